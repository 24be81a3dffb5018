"""`ovkit eval`: generate on held-out rows, score with the rewards library, aggregate, write lmms-eval results."""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ovkit import options as O
from ovkit.errors import OvkitError, where
from ovkit.evaluate.results import PAIRED_BY
from ovkit.files import write_json
from ovkit.generate import ENGINES, close_engine
from ovkit.options import option
from ovkit.progress import honours_quiet
from ovkit.prompts import ALIASES, INSTRUCTIONS
from ovkit.rollouts.prompts import UNCATEGORIZED  # the task of rows without a `category` (light: no torch)

MIN_NEW_TOKENS = 32  # the smallest per-category token budget when --max-new-tokens is not given
THINK_EXTRA_TOKENS = 256  # room for the reasoning with --prompt think


# --help panels of this config's own options (ovkit.options holds the shared ones)
GENERATION = "Generation"


@dataclass
class EvalMultiTurn(O.MultiTurnOptions):
    """Multi-turn rollouts, with eval's wording."""

    env: str | None = O.env(
        doc=(
            "evaluate under an environment's loop: `zoom`, `verifier` or `package.module:factory` "
            "([docs/environments.md](../docs/environments.md))"
        )
    )
    env_arg: Any = O.env_arg(
        doc=(
            "environment argument, value parsed as YAML (repeatable); in a config file a mapping `env-arg: {key: "
            "value}`"
        )
    )


@dataclass(frozen=True)
class Scoring:
    """How rows are asked, sampled and scored (score_rows, generate_rows): `ovkit eval`'s options
    (EvalConfig.scoring), or evaluation while training's (ovkit.evaluate.during: greedy, one completion, single-turn,
    as `ovkit eval --prompt PROMPT --seed SEED` would)."""

    prompt: str
    seed: int
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    multi_turn: O.MultiTurnOptions = field(default_factory=O.MultiTurnOptions)  # no --env: single-turn
    progress: bool = False
    reward_funcs: tuple[str, ...] = ()  # the user's reward functions, scored beside (ovkit.rewards.custom)


@dataclass(init=False)
class EvalConfig(O.StageConfig):
    """Options of `ovkit eval` (evaluate a model) and `ovkit eval --compare` (tabulate finished evals)."""

    launcher: ClassVar[str] = O.ROW_SHARED  # what it does under torchrun / accelerate launch (ovkit.launch)
    loading: O.GeneratorLoading = O.group(O.GeneratorLoading, after=True)  # listed after the command's own options

    # eval datasets; with --compare: eval outputs (summary.json dirs), LABEL=PATH allowed
    data: list[Path] | None = option(
        None,
        help=("Eval datasets (parquet file or directory); with --compare: eval outputs (DIR or LABEL=DIR)."),
        argument=True,
    )
    model: Path | None = option(
        None,
        help="Model directory (save_pretrained) or hub id.",
        panel=O.IO,
        default_doc="required (not with --compare)",
    )
    out: Path | None = O.out(
        help="Output directory (written atomically); with --compare: a markdown file for the table.",
        default_doc="required (with --compare: none)",
    )
    compare: bool = option(
        False,
        help="Tabulate finished evals (the DATA arguments) instead of running one.",
        panel="Compare finished evals",
    )
    metric: str = option(
        "reward",
        help="--compare: reward, accuracy, pass@K or truncated.",
        panel="Compare finished evals",
        doc=("with `--compare`: `reward`, `accuracy`, `pass@K` (runs with `--n` >= K) or `truncated`"),
    )
    # a stage can cost one category while overall rises: the paired change per category says so, the cells cannot
    paired_by: str = option(
        "overall",
        help="--compare: paired change vs the run to the left for overall only, or per category too (a second table).",
        panel="Compare finished evals",
        doc=(
            "with `--compare`: `overall` (the `change vs left` row), or `category`: also a second table of each "
            "run's change against the run to its left in every category, paired over the rows both scored"
        ),
        choices=PAIRED_BY,
    )
    prompt: str = option(
        "answer",
        help=(
            "Instruction added to each prompt: answer, think, none, or auto (each row in the mode of its RL "
            "stage: think for rl-curate's stage-2 categories); the released data's normal = answer, default = think."
        ),
        panel=GENERATION,
        doc=(
            'instruction appended to each prompt: `answer` (RL stage 1, "Put ONLY your final answer within '
            '<answer></answer>."), `think` (RL stage 2), `none`, or `auto`: each row in the mode of the RL stage '
            "it belongs to (rl-curate's split: its `prompt_type`, else think for the stage-2 categories math, "
            "chart, science, diagram, svg, code, stem, coding); `normal`/`default` are accepted as in the "
            "released data"
        ),
        choices=(*INSTRUCTIONS, "auto", *ALIASES),
    )
    engine: str = O.engine(choices=ENGINES)
    batch_size: int = option(
        64,
        help="Sequences per generate call (rows x n), hf engine.",
        panel=O.RUNTIME,
        min=1,
        doc=("sequences (rows x `--n`) per `generate` call of the hf engine; lower it when memory runs out"),
    )
    max_new_tokens: int | None = O.max_new_tokens(
        help=(
            "Tokens per completion at most (default: per category, 1.25 x its longest gold answer, at least 32; "
            "+256 with --prompt think)."
        ),
        panel=GENERATION,
        doc='token budget of every completion (default: see "Token budget")',
        default_doc="per category",
    )
    n: int = O.n(1, panel=GENERATION, doc="completions per row; more than 1 reports pass@k")
    temperature: float | None = O.temperature(
        help="Sampling temperature (0 = greedy; default: 0 for --n 1, 1.0 for --n > 1).",
        panel=GENERATION,
        default_doc="0 for `--n 1`, 1.0 otherwise",
        min=0,
    )
    top_p: float = O.top_p(panel=GENERATION)
    limit: int | None = O.limit(
        panel=GENERATION, doc="the first N rows of each category (lmms-eval's `--limit` is per task too)"
    )
    # each row gets another row's images (same category): how much the score needs the image
    shuffle_images: bool = option(
        False,
        help=(
            "Give each row another row's images (same category, seeded): the drop from the plain eval is what"
            " the model reads from the image."
        ),
        panel=GENERATION,
    )
    reward_funcs: list[str] = O.reward_funcs(panel=GENERATION)
    save_logprobs: bool = option(
        False,
        help="Also write OUT/rollouts.parquet (token ids, sampler log-probs, rewards).",
        panel=O.IO,
    )
    multi_turn: EvalMultiTurn = O.group(EvalMultiTurn)
    seed: int = O.seed()
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        from ovkit.rollouts.episodes import check_env_options

        O.validate(self)  # each option's declared range and choices; the checks across options follow
        check_env_options(self.multi_turn)
        if self.reward_funcs:  # the files and functions, before any model loads (user code: imported only if given)
            from ovkit.rewards.custom import parse_all

            parse_all(self.reward_funcs)

        if not self.data:
            raise OvkitError(
                "give the eval outputs to compare (ovkit eval --compare RUN...)"
                if self.compare
                else "give at least one eval dataset (ovkit eval --model DIR DATA... --out DIR)"
            )
        self.data = [Path(p) if not isinstance(p, Path) else p for p in self.data]
        if self.compare:
            return
        if self.model is None:
            raise OvkitError("--model is required")
        if self.out is None:
            raise OvkitError("--out is required")
        self.prompt = ALIASES.get(self.prompt, self.prompt)
        if self.prompt == "auto" and self.env:
            raise OvkitError(
                "--prompt auto asks rows in different modes; with --env give one: --prompt answer or think"
            )
        if self.temperature is None:
            self.temperature = 0.0 if self.n == 1 else 1.0
        if self.n > 1 and self.temperature == 0:
            raise OvkitError("--n > 1 needs --temperature > 0 (greedy completions are all the same)")

    def scoring(self) -> Scoring:
        """How this eval asks, samples and scores its rows (score_rows)."""
        return Scoring(
            prompt=self.prompt,
            seed=self.seed,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            multi_turn=self.multi_turn,
            progress=not self.quiet,
            reward_funcs=tuple(self.reward_funcs),
        )


# -- the eval set ---------------------------------------------------------------------------------------------------


def load_rows(paths: Sequence[Path], limit: int | None = None) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Rows of every eval dataset in order (at most `limit` per category), and each category's row count before the
    limit. Every row needs an `answer` to score against."""
    from ovkit.data.io import read_samples

    rows: list[dict[str, Any]] = []
    for path in paths:
        table = read_samples(path, answers=True).table
        if "answer" not in table.column_names:
            raise OvkitError(
                f"{where(path, column='answer')}: eval rows need a gold answer (this looks like a training split)"
            )
        for i, row in enumerate(table.to_pylist()):
            if row.get("answer") is None:
                rid = row["id"]
                raise OvkitError(f"{where(path, f'{rid!r} (index {i})', 'answer')}: the gold answer is null")
            row["category"] = row.get("category") or UNCATEGORIZED
            rows.append(row)
    original: dict[str, int] = {}
    kept = []
    for row in rows:
        seen = original.get(row["category"], 0)
        original[row["category"]] = seen + 1
        if limit is None or seen < limit:
            kept.append(row)
    return kept, original


def shuffle_images(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The rows with each one's images taken from another row of its category (a seeded random cycle, so no row keeps
    its own; a category of one row keeps it). Scored against the row's own answer, the drop from the plain eval is
    what the model reads from the image rather than from the question (a "blind" baseline)."""
    import random

    rng = random.Random(seed)
    by_category: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_category.setdefault(row["category"], []).append(i)
    out = [dict(row) for row in rows]
    for members in by_category.values():
        order = rng.sample(members, len(members))
        for k, i in enumerate(order):
            out[i]["images"] = rows[order[(k + 1) % len(order)]].get("images")
    return out


# -- the run --------------------------------------------------------------------------------------------------------


@honours_quiet
def run_eval(
    cfg: EvalConfig, out_dir: Path | None, *, engine: Any = None, processor: Any = None
) -> dict[str, Any] | None:
    """Evaluate `cfg.model` on `cfg.data`, writing the results into `out_dir`. Returns headline metrics.

    `engine`/`processor` may be given (tests, or a caller that already holds the model); otherwise they are built
    from `cfg.model` with `cfg.engine`. Under a launcher each process generates and scores its share of the rows
    (ovkit.launch.share; every row sampled from the seed of its id, so the share changes no draw) and the main process,
    given `out_dir`, writes what one process would; the others pass None and get None."""
    from ovkit.launch import gather, share

    clock = {"start": time.perf_counter()}
    timestamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    rows, n_original = load_rows(cfg.data, cfg.limit)
    if cfg.shuffle_images:
        rows = shuffle_images(rows, cfg.seed)
    built = engine is None
    if built:
        engine, processor = build_engine(cfg)
    clock["load"] = time.perf_counter()
    mine = share(len(rows))
    budgets = token_budgets(rows, processor, cfg.prompt, cfg.max_new_tokens)  # from every row: the same on each process
    try:
        done = score_rows(cfg.scoring(), engine, processor, [rows[i] for i in mine], budgets, clock)
        every = dict(zip((i for part in gather([mine]) for i in part), (r for part in gather([done]) for r in part)))
    finally:
        if built:  # after the last collective: vLLM's shutdown also ends the process group it joined
            close_engine(engine)
    if out_dir is None:
        return None
    tokenizer = getattr(processor, "tokenizer", processor)
    return _write(
        cfg, out_dir, rows, n_original, [every[i] for i in range(len(rows))], budgets, tokenizer, clock, timestamp
    )


def score_rows(
    scoring: Scoring,
    engine: Any,
    processor: Any,
    rows: Sequence[dict[str, Any]],
    budgets: dict[str, int],
    clock: dict[str, float] | None = None,
) -> list[tuple]:
    """(prompt text, prompt token ids, completions, rewards) per row: encoded, generated (each row from the streams
    of its id and the run seed) and scored. The part of an eval that the processes share; `clock` gets each phase's
    end."""
    from ovkit.rewards.custom import parse_all
    from ovkit.rollouts.episodes import env_instruction, env_tools
    from ovkit.rollouts.prompts import encode_prompts

    clock = {} if clock is None else clock
    prompts = encode_prompts(
        rows,
        processor,
        mode=[row_mode(r, scoring.prompt) for r in rows],
        system=False,
        extra=env_instruction(scoring.multi_turn),
        tools=env_tools(scoring.multi_turn),
        progress=scoring.progress,
    )
    clock["encode"] = time.perf_counter()
    completions = generate_rows(engine, scoring, prompts, budgets, processor)
    clock["generate"] = time.perf_counter()
    funcs = parse_all(scoring.reward_funcs) if scoring.reward_funcs else ()
    rewards = score(rows, completions, scoring.prompt, funcs, [p.messages for p in prompts])
    clock["score"] = time.perf_counter()
    return [
        (prompt_text(p.messages), [int(t) for t in p.encoded.input_ids], c, r)
        for p, c, r in zip(prompts, completions, rewards)
    ]


def _write(
    cfg: EvalConfig, out_dir: Path, rows, n_original, scored: Sequence[tuple], budgets, tokenizer, clock, timestamp
) -> dict[str, Any]:
    """The results files, summary.json and (--save-logprobs) the rollouts of every row (`scored`: score_rows' tuple
    per row); the headline metrics."""
    from ovkit import __version__
    from ovkit.evaluate.metrics import summarize
    from ovkit.evaluate.results import write_results

    inputs, prompt_ids, completions, rewards = ([x[k] for x in scored] for k in range(4))
    records = make_records(rows, inputs, completions, rewards)
    summary = summarize(records)
    seconds = time.perf_counter() - clock["start"]
    results_path = write_results(
        out_dir,
        model=str(cfg.model),
        timestamp=timestamp,
        summary=summary,
        records=records,
        task_configs=_task_configs(cfg, budgets),
        n_original=n_original,
        run_config=_run_config(cfg),
        version=__version__,
        seconds=seconds,
    )
    doc = _summary_doc(cfg, summary, budgets, results_path.relative_to(out_dir))
    if cfg.env:
        from ovkit.rollouts.episodes import turn_stats

        flat = [(c, r.reward) for outs, rs in zip(completions, rewards) for c, r in zip(outs, rs)]
        doc["multiturn"] = turn_stats([c for c, _ in flat], [r for _, r in flat])
    write_json(out_dir / "summary.json", doc)
    if cfg.save_logprobs:
        write_eval_rollouts(out_dir / "rollouts.parquet", rows, prompt_ids, completions, rewards, tokenizer)
    return {
        "overall": doc["overall"],
        "accuracy": doc["accuracy"]["overall"],
        "categories": doc["categories"],
        "rows": len(rows),
        "rows_beyond_limit": sum(n_original.values()) - len(rows),  # left out by --limit (N per category)
        "completions": len(rows) * cfg.n,
        "new_tokens": sum(len(c.token_ids) for outs in completions for c in outs),
        "truncated": summary["overall"].get("truncated", 0.0),
        "seconds": {
            "load": round(clock["load"] - clock["start"], 2),
            "encode": round(clock["encode"] - clock["load"], 2),
            "generate": round(clock["generate"] - clock["encode"], 2),
            "score": round(clock["score"] - clock["generate"], 2),
            "total": round(seconds, 2),
        },
    }


def row_mode(row: dict[str, Any], prompt: str) -> str:
    """The instruction a row is asked with: `prompt`, or with `auto` the mode of the RL stage the row belongs to
    (rl-curate's split: its `prompt_type` column, else its category; think for stage 2, answer for stage 1)."""
    if prompt != "auto":
        return prompt
    from ovkit.prompts import STAGE2_CATEGORIES, mode_of, stage_of

    return mode_of(stage_of(row, STAGE2_CATEGORIES), "auto")


def prompt_text(messages: Sequence[dict[str, Any]]) -> str:
    """A prompt as the results files show it (`input`): one `role: content` line per turn."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def token_budgets(rows: Sequence[dict[str, Any]], processor: Any, prompt: str, fixed: int | None) -> dict[str, int]:
    """max_new_tokens per category (lmms-eval sets generation length per task too). Without --max-new-tokens: room
    for the category's longest gold answer written as `<answer>X</answer>` plus the stop token, times 1.25, at least
    32; another 256 for the reasoning where the category is asked in think mode. A fixed 32 would cut every SVG and
    detection answer."""
    categories = list(dict.fromkeys(r["category"] for r in rows))
    if fixed is not None:
        return {c: fixed for c in categories}
    tokenizer = getattr(processor, "tokenizer", processor)
    longest: dict[str, int] = {}
    think: set[str] = set()
    for r in rows:
        n = len(tokenizer.encode(f"<answer>{r['answer']}</answer>", add_special_tokens=False)) + 1
        longest[r["category"]] = max(longest.get(r["category"], 0), n)
        if row_mode(r, prompt) == "think":
            think.add(r["category"])
    return {
        c: max(MIN_NEW_TOKENS, math.ceil(1.25 * longest[c])) + (THINK_EXTRA_TOKENS if c in think else 0)
        for c in categories
    }


def generate_rows(
    engine: Any, scoring: Scoring, prompts, budgets: dict[str, int], processor: Any = None
) -> list[list[Any]]:
    """Completions per row (ovkit.rollouts.sample: single-turn, or multi-turn with --env); rows that share a token
    budget are sampled together. A row draws from the streams of its id, whatever rows share its call or process."""
    from ovkit.rollouts.episodes import make_runner
    from ovkit.rollouts.sample import sample

    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(budgets[p.category], []).append(i)
    out: list[list[Any]] = [[] for _ in prompts]
    mode = "answer" if scoring.prompt == "none" else scoring.prompt
    turns = scoring.multi_turn
    episodes = make_runner(turns, engine, processor, mode=mode, max_pixels=None) if turns.env else None
    copies = scoring.n if scoring.temperature > 0 else 1
    with one_bar(engine, len(prompts) * copies, per_sequence=episodes is None) as bar:
        for budget, idx in sorted(groups.items()):
            done = sample(
                engine,
                [prompts[i] for i in idx],
                n=scoring.n,
                max_new_tokens=budget,
                temperature=scoring.temperature,
                top_p=scoring.top_p,
                seed=scoring.seed,
                episodes=episodes,
            )
            for i, completions in zip(idx, done):
                out[i] = completions
            if bar is not None:  # the engine did not advance it per sequence: a group at a time
                bar.update(len(idx) * copies)
    return out


@contextlib.contextmanager
def one_bar(engine: Any, total: int, *, per_sequence: bool) -> Iterator[Any]:
    """One progress bar with an ETA over every completion of the run, in place of the engine's bar per call (one per
    token-budget group). An engine with a `bar` slot (ovkit.generate.hf) advances it per batch of sequences (not with
    --env: its calls are turns); otherwise the bar is yielded to be advanced per group. Off where the engine's bars
    are (--quiet)."""
    if not getattr(engine, "progress", False):
        yield None
        return
    from tqdm.auto import tqdm  # imported on use, like the bar it draws

    shared = per_sequence and hasattr(engine, "bar")
    bar = tqdm(total=total, desc="eval", unit="seq", dynamic_ncols=True, file=sys.stderr)
    engine.progress = False
    if shared:
        engine.bar = bar
    try:
        yield None if shared else bar
    finally:
        engine.progress = True
        if shared:
            engine.bar = None
        bar.close()


def make_records(rows, inputs, completions, rewards) -> list[dict[str, Any]]:
    """One record per row: what the results files and the metrics need."""
    from ovkit.evaluate.metrics import func_means, row_metrics

    records = []
    doc_ids: dict[str, int] = {}
    for row, text, outs, rs in zip(rows, inputs, completions, rewards):
        doc_id = doc_ids.get(row["category"], 0)
        doc_ids[row["category"]] = doc_id + 1
        records.append(
            {
                "doc_id": doc_id,
                "id": row["id"],
                "category": row["category"],
                "source": row["source"],
                "answer": row["answer"],
                "input": text,
                "completions": [
                    {
                        "text": c.text,
                        "reward": r.reward,
                        "parts": r.parts,
                        "finish_reason": c.finish_reason,
                        **_turns(c),
                    }
                    for c, r in zip(outs, rs)
                ],
                "metrics": {
                    **row_metrics([r.reward for r in rs], [c.finish_reason for c in outs]),
                    **func_means([r.parts.get("funcs", {}) for r in rs]),
                },
            }
        )
    return records


def build_engine(cfg: EvalConfig) -> tuple[Any, Any]:
    """(engine, processor) for `cfg.model` (ovkit.generate.engines: one device rule, one precision vocabulary)."""
    from ovkit.generate.engines import build_engine as build

    engine = build(
        cfg.engine,
        model_dir=cfg.model,
        precision=cfg.precision,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        progress=not cfg.quiet,
        trust_remote_code=cfg.trust_remote_code,
        attn_implementation=cfg.attn_implementation,
    )
    return engine, engine.processor


def score(
    rows: Sequence[dict[str, Any]],
    completions: Sequence[Sequence[Any]],
    prompt: str,
    funcs: Sequence[Any] = (),
    asked: Sequence[list] = (),
) -> list[list[Any]]:
    """Rewards of every completion, grouped per row like `completions`; with the user's reward functions (`funcs`,
    ovkit.rewards.custom; `asked`: each row's prompt messages as the model was asked them) their values are in each
    reward's `parts["funcs"]` (reported beside the built-in score, which they do not change)."""
    from ovkit.rewards import Reward, custom, score_batch
    from ovkit.rollouts.episodes import episode_reward

    items = [
        {
            "id": row["id"],
            "completion": c.text,
            "answer": row["answer"],
            "answer_type": row.get("answer_type"),
            "source": row["source"],
            "reward_kwargs": row.get("reward_kwargs"),
            "prompt_type": "answer" if prompt == "none" else row_mode(row, prompt),
        }
        for row, outs in zip(rows, completions)
        for c in outs
    ]
    flat = score_batch(items)
    if funcs:
        per_row = [len(outs) for outs in completions]
        for item, row, messages in zip(items, _repeat(rows, per_row), _repeat(asked, per_row)):
            item.update(category=row.get("category"), messages=messages)
        for r, values in zip(flat, custom.score(funcs, items)):
            r.parts["funcs"] = values
    flat = [
        Reward(*episode_reward(r.reward, r.parts, c)) for r, c in zip(flat, (c for outs in completions for c in outs))
    ]
    grouped, i = [], 0
    for outs in completions:
        grouped.append(flat[i : i + len(outs)])
        i += len(outs)
    return grouped


def _repeat(values: Sequence[Any], counts: Sequence[int]) -> list[Any]:
    return [v for v, n in zip(values, counts) for _ in range(n)]


def _turns(c: Any) -> dict[str, Any]:
    """Multi-turn fields of a completion record (none for single-turn)."""
    return (
        {}
        if c.termination is None
        else {"turns": c.turns, "termination": c.termination, "turn_texts": list(c.turn_texts)}
    )


def write_eval_rollouts(path: Path, rows, prompts, completions, rewards, tokenizer: Any = None) -> None:
    """The eval's trajectories in the rollout schema (`ovkit.rollouts.table`), for mismatch-report (`prompts`: each
    row's prompt token ids, or its encoded prompt). The prompt
    rows' image cells are copied as they are (then any observation images), so the file is self-contained."""
    from ovkit.data import image_cell
    from ovkit.rollouts.episodes import transcript
    from ovkit.rollouts.table import write_rollouts

    out = []
    for group, (row, prompt_ids, outs, rs) in enumerate(zip(rows, prompts, completions, rewards)):
        cells = [{"bytes": c.get("bytes"), "path": c.get("path")} for c in row["images"] or []]
        for c, r in zip(outs, rs):
            out.append(
                {
                    "prompt_id": row["id"],
                    "group": group,
                    "version": 0,
                    "prompt_ids": list(getattr(prompt_ids, "input_ids", prompt_ids)),
                    "response_ids": list(c.token_ids),
                    "loss_mask": c.mask,
                    "behave_logprobs": list(c.logprobs),
                    "reward": float(r.reward),
                    "reward_parts": r.parts,
                    "finish_reason": c.finish_reason,
                    "turns": c.turns,
                    "category": row["category"],
                    "source": row["source"],
                    "answer": row["answer"],
                    "answer_type": row.get("answer_type"),
                    "completion": c.text,
                    "images": cells + [image_cell(im) for im in c.images],
                }
            )
            if c.termination is not None:
                out[-1].update(
                    turn_ids=list(c.turn_ids),
                    termination=c.termination,
                    completion=transcript(tokenizer, c.token_ids) if tokenizer else c.text,
                )
    write_rollouts(out, path)


def _task_configs(cfg: EvalConfig, budgets: dict[str, int]) -> dict[str, Any]:
    from ovkit.prompts import instruction

    gen = {"temperature": cfg.temperature, "top_p": cfg.top_p, "do_sample": cfg.temperature > 0, "n": cfg.n}
    return {
        t: {
            "task": t,
            "dataset_path": [str(p) for p in cfg.data],
            "dataset_filter": {"category": t},
            "output_type": "generate_until",
            "instruction": instruction(row_mode({"category": t}, cfg.prompt)),
            "generation_kwargs": {"max_new_tokens": budgets[t], **gen},
            "metric_list": [
                {"metric": m, "higher_is_better": m != "truncated"} for m in ("reward", "accuracy", "truncated")
            ],
            "scorer": "ovkit.rewards (per-row answer_type)",
        }
        for t in sorted(budgets)
    }


def _run_config(cfg: EvalConfig) -> dict[str, Any]:
    args = f"pretrained={cfg.model}" + (f",precision={cfg.precision}" if cfg.precision != "auto" else "")
    return {
        "model": f"ovkit-{cfg.engine}",
        "model_args": args,
        "batch_size": cfg.batch_size,
        "limit": cfg.limit,
        "gen_kwargs": f"max_new_tokens={cfg.max_new_tokens or 'per task'},temperature={cfg.temperature},"
        f"top_p={cfg.top_p},n={cfg.n}",
        "random_seed": cfg.seed,
        "prompt": cfg.prompt,
    }


def _summary_doc(
    cfg: EvalConfig, summary: dict[str, Any], budgets: dict[str, int], results_file: Path
) -> dict[str, Any]:
    """summary.json: headline numbers the pipeline table reads (mean reward), accuracy, and every metric in detail."""
    return {
        "model": str(cfg.model),
        "metric": "reward",
        "overall": summary["overall"]["reward"],
        "categories": {k: v["reward"] for k, v in summary["categories"].items()},
        "sources": {k: v["reward"] for k, v in summary["sources"].items()},
        "accuracy": {
            "overall": summary["overall"]["accuracy"],
            "categories": {k: v["accuracy"] for k, v in summary["categories"].items()},
            "sources": {k: v["accuracy"] for k, v in summary["sources"].items()},
        },
        "n": cfg.n,
        "rows": int(summary["overall"]["rows"]),
        "prompt": cfg.prompt,
        "shuffled_images": cfg.shuffle_images,
        "temperature": cfg.temperature,
        "max_new_tokens": dict(sorted(budgets.items())),
        "data": [str(p) for p in cfg.data],
        "results": str(results_file),
        "detail": summary,
    }
