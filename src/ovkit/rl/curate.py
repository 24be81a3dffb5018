"""`ovkit rl-curate`: keep the RL prompts a model can learn from, split into the two curriculum stages.

LLaVA-OneVision-1.5-RL's curation: sample N rollouts per prompt with the starting model, score them with the rule
rewards, and keep medium-difficulty prompts. Per prompt, pass@1 is the mean reward of the N rollouts and pass@N the
best one (for 0/1 rewards: whether any rollout is right). Two selection rules:

* `mean` (the released code): keep iff min_reward < pass@1 < max_reward (defaults 0 and 0.6): drop what the model
  never solves and what it already solves;
* `gap` (the write-up's "discrepancy-driven" version): keep iff pass@N - pass@1 >= min_gap: the model can solve the
  prompt but does not do so reliably ("latent capability").

Sources listed in `keep_sources` are kept whatever their difficulty (the release keeps some sources whole).
Categories listed in `exclude_categories` are not sampled and never reach RL: for a category whose rollouts at the
sampling temperature are mostly malformed, RL follows noise and can erase what greedy decoding had (on the embedded
default, SVG: sampled reward ~0.1 against 0.73 greedy, and stage 2 took held-out SVG from 73 to 13-26; BENCHMARKS.md).

The stage split. The release trains stage 1 (answer-only, 19.9K) mostly on perception (grounding, counting, OCR,
spatial) and stage 2 (chain-of-thought, 49.2K) on reasoning (STEM, charts, diagrams, code); the write-up shows the
thinking mode winning on code/SVG and the fast mode on grounding/counting. ovkit's rule: a row with the released
`prompt_type` column goes where it says (normal -> stage 1, default -> stage 2); otherwise a row whose `category`
is in `stage2_categories` (default: math, chart, science, diagram, svg, code, stem, coding) goes to stage 2 and every
other row to stage 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ovkit import options as O
from ovkit.errors import OvkitError
from ovkit.generate import ENGINES, owned
from ovkit.options import option
from ovkit.prompts import ALIASES, STAGE2_CATEGORIES, mode_of, stage_of

SELECT_RULES = ("mean", "gap")


# --help panels of this config's own options (ovkit.options holds the shared ones)
SAMPLING = O.SAMPLING
SELECTION = "Selection"


@dataclass
class CurateLoading(O.ModelLoading):
    """Model loading, with rl-curate's default or wording for --precision."""

    precision: str = O.precision(
        doc=(
            "the sampler's compute precision: `auto` (bf16 on a GPU with bf16, else fp32), `fp32`, `bf16-true` / "
            "`bf16-mixed` (bf16 weights); `bf16` = bf16-mixed, `32` = fp32"
        )
    )


@dataclass(init=False)
class CurateConfig(O.StageConfig):
    """Options of `ovkit rl-curate`."""

    launcher: ClassVar[str] = O.RANK_SHARDED  # what it does under torchrun / accelerate launch (ovkit.launch)
    loading: CurateLoading = O.group(CurateLoading, after=True)  # listed after the command's own options

    data: Path | None = option(
        None,
        help="RL prompts (sample table with answer/answer_type).",
        argument=True,
        doc=(
            "RL prompts: sample table with `answer`, `answer_type`; also a Hub dataset id "
            "(`ORG/NAME[:CONFIG][@SPLIT]`), a directory with a dataset card (`DIR:CONFIG`, `DIR@SPLIT`) or a "
            '`save_to_disk` directory (README.md, "Datasets and other tools")'
        ),
    )
    # the model RL will start from (the SFT checkpoint)
    model: Path | None = option(None, help="The model RL will start from (e.g. the SFT output).", panel=O.IO)
    out: Path | None = O.out()
    n: int = O.n(16, doc="rollouts per prompt (pass@N of the selection)")
    limit: int | None = O.limit(
        doc="at most N prompt rows per category (the first ones in the data), to fit a time budget"
    )
    select: str = option(
        "mean",
        help=(
            "mean: keep min-reward < pass@1 < max-reward (released code); gap: keep pass@N - pass@1 >= "
            "min-gap (the write-up)."
        ),
        panel=SELECTION,
        choices=SELECT_RULES,
    )
    min_reward: float = option(
        0.0,
        help="mean rule: drop prompts whose pass@1 is <= this (never solved).",
        panel=SELECTION,
        doc="mean rule: lower bound (exclusive)",
    )
    max_reward: float = option(
        0.6,
        help="mean rule: drop prompts whose pass@1 is >= this (already solved).",
        panel=SELECTION,
        doc="mean rule: upper bound (exclusive)",
    )
    min_gap: float = option(
        0.25,
        help="gap rule: keep prompts with pass@N - pass@1 >= this.",
        panel=SELECTION,
        min=0,
        max=1,
    )
    # sources kept whatever their difficulty
    keep_sources: list[str] = option(
        [],
        help="Keep every prompt whose source contains this tag, whatever its difficulty; repeatable.",
        panel=SELECTION,
        flag="--keep-source",
    )
    stage2_categories: list[str] = option(
        list(STAGE2_CATEGORIES),
        help=(
            "Categories that go to the stage-2 (thinking) set; repeatable (default: math chart science "
            "diagram svg code stem coding)."
        ),
        panel=SELECTION,
        flag="--stage2-category",
    )
    # categories left out of RL (not sampled)
    exclude_categories: list[str] = option(
        [],
        help="Leave this category out of RL (its prompts are not sampled); repeatable.",
        panel=SELECTION,
        flag="--exclude-category",
        doc=(
            "leave a category out of RL: its prompts are not sampled, and `stats.json` counts them under "
            "`excluded` (repeatable). For a category whose rollouts at the sampling temperature are mostly "
            "malformed: on the embedded default, sampled SVGs score ~0.1 against 0.73 greedy, and RL stage 2 on "
            "them took held-out SVG from 73 to 13-26 (BENCHMARKS.md)"
        ),
    )
    prompt: str = option(
        "auto",
        help=(
            "Instruction the rollouts are sampled with: auto (the row's stage: 1 answer-only, 2 think), "
            "answer or think."
        ),
        panel=SAMPLING,
        choices=("auto", "answer", "think", *ALIASES),  # the released data's names too (ovkit.prompts)
        doc=(
            "instruction the rollouts are sampled with: auto (each row its stage's: stage 1 answer-only, stage 2 "
            "think, so difficulty is measured in the mode it will be trained in), answer or think"
        ),
    )
    engine: str = O.engine(choices=ENGINES)
    batch_size: int = option(64, help="Sequences per generate call (prompts x n).", panel=O.RUNTIME, min=1)
    max_new_tokens: int = O.max_new_tokens(1024)
    temperature: float = O.temperature(1.0)
    top_p: float = O.top_p()
    max_pixels: int = O.max_pixels()
    system_prompt: bool = O.system_prompt()
    # store the prompt images in the rollout table (mismatch-report re-runs the model)
    rollout_images: bool = option(
        True,
        help="Store prompt images in OUT/rollouts (mismatch-report needs them for multimodal prompts).",
        panel=O.IO,
        negatable=True,
        doc="store prompt images in the rollout table",
    )
    reward_workers: int = O.reward_workers()
    multi_turn: O.MultiTurnOptions = O.group(O.MultiTurnOptions)
    shard: str | None = O.shard(doc="process part I of N (`I/N`); writes `OUT/part-I-of-N/`")
    seed: int = O.seed()
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        from ovkit.rollouts.episodes import check_env_options

        O.validate(self)  # each option's declared range and choices; the checks across options follow
        check_env_options(self.multi_turn)
        for name in ("data", "model", "out"):
            if getattr(self, name) is None:
                raise OvkitError(f"{'DATA' if name == 'data' else '--' + name} is required")
            setattr(self, name, Path(getattr(self, name)))
        if self.min_reward >= self.max_reward:
            raise OvkitError("need --min-reward < --max-reward")
        self.keep_sources = list(self.keep_sources or [])
        self.stage2_categories = list(self.stage2_categories or [])
        self.exclude_categories = list(self.exclude_categories or [])


@dataclass
class PromptStats:
    id: str
    category: str
    source: str
    pass_at_1: float  # mean reward of the n rollouts
    pass_at_n: float  # best reward of the n rollouts
    accuracy: float  # share of fully correct rollouts
    kept: bool
    stage: int  # 1 or 2 (where it would go), whether kept or not


def select(pass1: float, passn: float, source: str, cfg: CurateConfig) -> bool:
    if any(s and s in source for s in cfg.keep_sources):
        return True
    if cfg.select == "gap":
        return passn - pass1 >= cfg.min_gap - 1e-12
    return cfg.min_reward < pass1 < cfg.max_reward


def prompt_stats(groups, rows: Sequence[dict[str, Any]], cfg: CurateConfig) -> list[PromptStats]:
    out = []
    for g, row in zip(groups, rows):
        rewards = g.task_rewards
        pass1, passn = sum(rewards) / len(rewards), max(rewards)
        acc = sum(p.get("accuracy", 0.0) >= 1.0 for p in g.parts) / len(g.parts)
        kept = select(pass1, passn, g.prompt.source, cfg)
        out.append(
            PromptStats(
                g.prompt.id,
                g.prompt.category,
                g.prompt.source,
                pass1,
                passn,
                acc,
                kept,
                stage_of(row, cfg.stage2_categories),
            )
        )
    return out


def sample_groups(cfg: CurateConfig, engine, prompts, mode: str, bar, episodes=None) -> list:
    """N scored rollouts for every prompt, in sampler calls of about `batch_size` sequences (multi-turn rollouts
    with `episodes`, an ovkit.rollouts.episodes.EpisodeRunner). A prompt's rollouts are drawn from its id's streams
    (ovkit.rollouts.sample), so --shard, --limit and the stage split change no prompt's samples."""
    from ovkit.rollouts.groups import Group, score_groups
    from ovkit.rollouts.sample import sample

    per_call = max(1, cfg.batch_size // cfg.n)
    groups: list = []
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start : start + per_call]
        outs = sample(
            engine,
            chunk,
            n=cfg.n,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=cfg.seed,
            episodes=episodes,
        )
        batch = [Group(p, start + i, 0, list(cs)) for i, (p, cs) in enumerate(zip(chunk, outs))]
        score_groups(batch, mode=mode, format_weight=0.0, workers=cfg.reward_workers)
        groups.extend(batch)
        bar.update(len(chunk))
    return groups


def rollout_all(cfg: CurateConfig, engine, processor, table, stages: Sequence[int]) -> list:
    """One scored group per row, in row order; each row sampled with the instruction of `mode_of` its stage."""
    from tqdm.auto import tqdm

    from ovkit.rollouts.episodes import env_instruction, env_tools, make_runner
    from ovkit.rollouts.prompts import encode_prompts

    groups: list = [None] * table.num_rows
    bar = tqdm(total=table.num_rows, desc="rl-curate", unit="prompt", leave=False, disable=cfg.quiet)
    for mode in ("answer", "think"):
        rows = [i for i, st in enumerate(stages) if mode_of(st, cfg.prompt) == mode]
        if not rows:
            continue
        prompts = encode_prompts(
            table.take(rows),
            processor,
            mode=mode,
            system=cfg.system_prompt,
            max_pixels=cfg.max_pixels,
            extra=env_instruction(cfg.multi_turn),
            tools=env_tools(cfg.multi_turn),
        )
        episodes = make_runner(cfg.multi_turn, engine, processor, mode=mode, max_pixels=cfg.max_pixels)
        for i, g in zip(rows, sample_groups(cfg, engine, prompts, mode, bar, episodes)):
            g.index = i
            groups[i] = g
    bar.close()
    return groups


def curate(cfg: CurateConfig, out_dir: Path, shard: tuple[int, int] | None = None) -> dict[str, Any]:
    """Write stage1/, stage2/, rollouts/, curation.parquet, stats.json and difficulty.png into `out_dir`."""
    import pyarrow as pa

    from ovkit.data import read_samples, write_samples, write_table
    from ovkit.rollouts.groups import groups_table
    from ovkit.rollouts.prompts import limit_per_category

    table = limit_per_category(read_samples(cfg.data, shard=shard, answers=True).table, cfg.limit)
    table, excluded = exclude_categories(table, cfg.exclude_categories, cfg.data)
    from ovkit.generate.engines import build_engine  # torch: once the data is read and checked (#29)

    engine = build_engine(
        cfg.engine,
        model_dir=cfg.model,
        precision=cfg.precision,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
    )
    processor = engine.processor
    rows = table.to_pylist()
    with owned(engine):  # vLLM's worker shuts down here, not at the interpreter's exit
        groups = rollout_all(cfg, engine, processor, table, [stage_of(r, cfg.stage2_categories) for r in rows])
    stats = prompt_stats(groups, rows, cfg)

    annotated = table.append_column("pass_at_1", pa.array([s.pass_at_1 for s in stats], pa.float64()))
    annotated = annotated.append_column("pass_at_n", pa.array([s.pass_at_n for s in stats], pa.float64()))
    for stage in (1, 2):
        keep = [i for i, s in enumerate(stats) if s.kept and s.stage == stage]
        write_samples(annotated.take(pa.array(keep, pa.int64())), out_dir / f"stage{stage}", shard)
    write_table(
        groups_table(groups, with_images=cfg.rollout_images, tokenizer=getattr(processor, "tokenizer", processor)),
        out_dir / "rollouts" / _part(shard),
    )
    write_table(pa.Table.from_pylist([vars(s) for s in stats]), out_dir / "curation.parquet")
    summary = {**summarise(stats, cfg), "excluded": excluded}
    (out_dir / "stats.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    plot_difficulty(stats, cfg, out_dir / "difficulty.png")
    return summary


def exclude_categories(table, categories: Sequence[str], data: Path):
    """(the table without rows of `categories`, rows dropped per category); an error if nothing is left."""
    from collections import Counter

    import pyarrow as pa

    from ovkit.rollouts.prompts import categories_of

    if not categories:
        return table, {}
    cats = categories_of(table)
    keep = [i for i, c in enumerate(cats) if c not in categories]
    if not keep:
        raise OvkitError(f"{data}: every prompt is in an excluded category (--exclude-category {' '.join(categories)})")
    dropped = Counter(c for c in cats if c in categories)
    return table.take(pa.array(keep, pa.int64())), dict(sorted(dropped.items()))


def _part(shard: tuple[int, int] | None) -> str:
    from ovkit.data import part_name

    return part_name(shard)


def summarise(stats: Sequence[PromptStats], cfg: CurateConfig) -> dict[str, Any]:
    """Counts and mean pass@1 / pass@N, overall and per category (deterministic: no timings)."""

    def block(items: Sequence[PromptStats]) -> dict[str, Any]:
        n = max(len(items), 1)
        return {
            "prompts": len(items),
            "kept": sum(s.kept for s in items),
            "stage1": sum(s.kept and s.stage == 1 for s in items),
            "stage2": sum(s.kept and s.stage == 2 for s in items),
            "pass_at_1": round(sum(s.pass_at_1 for s in items) / n, 6),
            "pass_at_n": round(sum(s.pass_at_n for s in items) / n, 6),
            "accuracy": round(sum(s.accuracy for s in items) / n, 6),
            "never_solved": sum(s.pass_at_n <= 0 for s in items),
            "always_solved": sum(s.pass_at_1 >= 1 for s in items),
        }

    cats = sorted({s.category for s in stats})
    return {
        "rule": cfg.select,
        "window": [cfg.min_reward, cfg.max_reward] if cfg.select == "mean" else None,
        "min_gap": cfg.min_gap if cfg.select == "gap" else None,
        "n": cfg.n,
        **block(stats),
        "categories": {c: block([s for s in stats if s.category == c]) for c in cats},
        "histogram": histogram([s.pass_at_1 for s in stats], bins=10),
    }


def histogram(values: Sequence[float], bins: int = 10) -> dict[str, int]:
    """Counts of pass@1 in [0, 0.1), ..., [0.9, 1.0]."""
    counts = [0] * bins
    for v in values:
        counts[min(int(v * bins), bins - 1)] += 1
    return {f"{i / bins:.1f}-{(i + 1) / bins:.1f}": c for i, c in enumerate(counts)}


def plot_difficulty(stats: Sequence[PromptStats], cfg: CurateConfig, path: Path) -> None:
    """Histogram of pass@1 (kept prompts stacked on the rest) and pass@N against pass@1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bins = [i / 20 for i in range(21)]
    left.hist(
        [[s.pass_at_1 for s in stats if s.kept], [s.pass_at_1 for s in stats if not s.kept]],
        bins=bins,
        stacked=True,
        label=["kept", "dropped"],
        color=["tab:green", "tab:gray"],
    )
    if cfg.select == "mean":
        left.axvspan(cfg.min_reward, cfg.max_reward, color="tab:green", alpha=0.08)
    left.set(
        xlabel="pass@1 (mean reward over rollouts)", ylabel="prompts", title=f"difficulty ({cfg.n} rollouts per prompt)"
    )
    left.legend()
    right.scatter(
        [s.pass_at_1 for s in stats],
        [s.pass_at_n for s in stats],
        c=["tab:green" if s.kept else "tab:gray" for s in stats],
        s=12,
    )
    right.plot([0, 1], [0, 1], color="black", lw=0.5)
    right.set(
        xlabel="pass@1",
        ylabel=f"pass@{cfg.n}",
        title="latent capability: pass@N - pass@1",
        xlim=(-0.02, 1.02),
        ylim=(-0.02, 1.02),
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
