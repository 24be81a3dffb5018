"""`ovkit mismatch-report`: the options, and the run that ties sampling, re-scoring, analyses and the report
together."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from ovkit import options as O
from ovkit.errors import OvkitError
from ovkit.files import read_provenance, write_json
from ovkit.generate import owned
from ovkit.mismatch.analyses import analyse
from ovkit.mismatch.metrics import EMPTY_MESSAGE, Scores, Thresholds
from ovkit.mismatch.report import html_page, markdown
from ovkit.mismatch.sample import generate_rollouts, make_sampler
from ovkit.mismatch.score import data_images, rescore
from ovkit.models import vocab_size
from ovkit.options import option
from ovkit.rollouts.prompts import encode_prompts, limit_per_category

PROMPT_MODES = ("answer", "think", "none")


# --help panels of this config's own options (ovkit.options holds the shared ones)
FRESH_ROLLOUTS = "Fresh rollouts (--generate)"
LEARNER = "Learner"
RL_TRAIN_CORRECTIONS = "rl-train corrections reported"


@dataclass
class MismatchLoading(O.ModelLoading):
    """Model loading, with mismatch-report's default or wording for --precision."""

    precision: str = O.precision(
        "fp32",
        help=(
            "The learner's precision: fp32 (the default, the reference), bf16-true or bf16-mixed (both "
            "compute in bf16), or auto (bf16-mixed on a bf16 GPU, else fp32). Aliases: bf16 = bf16-mixed, 32 = fp32."
        ),
        panel=LEARNER,
        doc=None,  # the help says it all; the shared page text describes a learner whose default is auto
    )


@dataclass
class MismatchMultiTurn(O.MultiTurnOptions):
    """Multi-turn rollouts, with mismatch-report's wording."""

    env: str | None = O.env(
        doc=(
            "with `--generate`: multi-turn rollouts with an environment: `zoom`, `verifier` or `package.module:factory`"
        )
    )


@dataclass(init=False)
class MismatchConfig(O.StageConfig):
    """Options of `ovkit mismatch-report`."""

    launcher: ClassVar[str] = O.ONE_PROCESS  # what it does under torchrun / accelerate launch (ovkit.launch)
    loading: MismatchLoading = O.group(MismatchLoading, after=True)  # listed after the command's own options

    rollouts: Path | None = option(
        None,
        help=(
            "Rollout table: eval --save-logprobs OUT, rl-curate OUT/rollouts, rl-train OUT/rollouts, or one "
            "parquet file."
        ),
        argument=True,
        doc=(
            "rollout table (file, directory, or run directory holding `rollouts.parquet`); exclusive with `--generate`"
        ),
    )
    model: Path | None = option(None, help="The learner: a model directory (save_pretrained).", panel=O.IO)
    out: Path | None = O.out()
    generate: Path | None = option(
        None,
        help="Sample fresh rollouts from these prompt rows (RL/eval table) instead of reading ROLLOUTS.",
        panel=FRESH_ROLLOUTS,
    )
    sampler: list[str] = option(
        [],
        help=(
            "With --generate: fp32, bf16, fp16, int8, fp8, int4 (4-bit weights), or vLLM's kernels: vllm (the "
            "checkpoint's dtype), vllm-fp32, vllm-bf16; repeat to compare (default bf16)."
        ),
        panel=FRESH_ROLLOUTS,
        doc=(
            "with `--generate`: `fp32`, `bf16`, `fp16`, `int8`, `fp8`, `int4`, or vLLM's kernels: `vllm` (the "
            "checkpoint's dtype), `vllm-fp32`, `vllm-bf16`; repeat to compare several (one run each)"
        ),
        default_doc="`bf16`",
    )
    data: Path | None = option(
        None,
        help=("Prompt rows (matched by prompt_id) for the images of rollout tables that store none (rl-train)."),
        panel=O.IO,
    )
    # default: the rollouts' producer's (its config.yaml), else 1.0
    temperature: float | None = O.temperature(
        help=(
            "Sampling temperature (0 = greedy); the learner divides its logits by it (default: the rollouts' "
            "producer's, else 1.0)."
        ),
        panel=LEARNER,
        default_doc="producer's, else 1.0",
        min=0,
    )
    # --generate: nucleus mass (default 1.0); ROLLOUTS: read from the producer for the note
    top_p: float | None = O.top_p(
        None,
        help="Nucleus sampling mass (with --temperature > 0; default 1.0).",
        panel=FRESH_ROLLOUTS,
        doc="with `--generate`: nucleus sampling mass of the samplers",
        default_doc="1.0",
        gt=0,
        max=1,
    )
    n: int = O.n(4, panel=FRESH_ROLLOUTS, doc="with `--generate`: completions per prompt")
    limit: int | None = O.limit(
        panel=FRESH_ROLLOUTS, doc="with `--generate`: at most N prompt rows per category (the first ones)"
    )
    max_new_tokens: int = O.max_new_tokens(
        64, panel=FRESH_ROLLOUTS, doc="with `--generate`: tokens per completion at most"
    )
    prompt: str = option(
        "answer",
        help="With --generate: stage instruction added to prompts: answer, think or none.",
        panel=FRESH_ROLLOUTS,
        choices=PROMPT_MODES,
    )
    system_prompt: bool = O.system_prompt(
        panel=FRESH_ROLLOUTS, doc="with `--generate`: prepend the recipe's system prompt, as rl-train does"
    )
    # images downscaled to at most this many pixels, as rl-curate / rl-train do (0: never)
    max_pixels: int = O.max_pixels(
        panel=LEARNER,
        min=0,
        doc=(
            "downscale images to at most N pixels as the sampler did (rl-curate / rl-train: 262144; eval does not"
            " downscale: 0)"
        ),
    )
    batch_size: int = option(
        16, help="Rollouts per learner forward pass (and sequences per generate call).", panel=LEARNER, min=1
    )
    # rl-train's correction bounds (ovkit.options), reported as what each correction would clip or mask
    correction_threshold: float = O.correction_threshold(panel=RL_TRAIN_CORRECTIONS)
    correction_lower: float | None = O.correction_lower(panel=RL_TRAIN_CORRECTIONS)
    geo_lower: float = O.geo_lower(panel=RL_TRAIN_CORRECTIONS)
    geo_upper: float = O.geo_upper(panel=RL_TRAIN_CORRECTIONS)
    behave_cap: float = O.behave_cap(
        help="rl-train's behaviour-weight cap, reported as a mask rate (0: not reported).",
        panel=RL_TRAIN_CORRECTIONS,
        doc=(
            "rl-train's cap of the behaviour weight `exp(prox - behave)`: what it masks (action `mask`, token level) is"
            " reported as `corrections.behave-cap` (0: not reported)"
        ),
    )
    veto_threshold: float | None = O.veto_threshold(
        help="Also report the veto: sequences with any token ratio below this.",
        panel=RL_TRAIN_CORRECTIONS,
        doc="also report rl-train's per-token veto as `corrections.veto`: responses with any token ratio below it",
    )
    max_points: int = option(
        20000,
        help="Tokens drawn in the scatter plots (a seeded sample beyond that).",
        panel=O.IO,
        min=1,
    )
    multi_turn: MismatchMultiTurn = O.group(MismatchMultiTurn)
    seed: int = O.seed(doc="sampling seed with `--generate`; scatter-plot sample")
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        from ovkit.mismatch.sample import canonical_sampler
        from ovkit.rollouts.episodes import check_env_options

        O.validate(self)  # each option's declared range and choices; the checks across options follow
        check_env_options(self.multi_turn)
        if self.env and self.generate is None:
            raise OvkitError("--env goes with --generate (ROLLOUTS were already sampled)")

        if self.model is None:
            raise OvkitError("--model is required (the learner)")
        if self.out is None:
            raise OvkitError("--out is required")
        if (self.rollouts is None) == (self.generate is None):
            raise OvkitError(
                "give either ROLLOUTS (a saved rollout table) or --generate DATA, not both"
                if self.rollouts
                else "give ROLLOUTS (a saved rollout table) or --generate DATA --sampler ..."
            )
        for name in ("rollouts", "model", "out", "generate", "data"):
            if getattr(self, name) is not None:
                setattr(self, name, Path(getattr(self, name)))
        if self.sampler and self.generate is None:
            raise OvkitError("--sampler goes with --generate (ROLLOUTS were already sampled)")
        self.sampler = list(
            dict.fromkeys(canonical_sampler(s) for s in (self.sampler or (["bf16"] if self.generate else [])))
        )
        O.check_corrections(self)
        if self.generate is not None and self.temperature == 0 and self.n > 1:
            raise OvkitError("--n > 1 needs --temperature > 0")

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(
            self.correction_threshold,
            self.correction_lower,
            self.geo_lower,
            self.geo_upper,
            self.behave_cap or None,
            self.veto_threshold,
        )


# ------------------------------------------------------------------------------------------------ inputs


def producer_sampling(rollouts: Path) -> dict[str, Any] | None:
    """Temperature and top-p from the config of the command that wrote `rollouts` (its OUT/ovkit.json, found at the
    rollout path or up to two directories above it: eval OUT/rollouts.parquet, rl-curate / rl-train OUT/rollouts/)."""

    start = rollouts if rollouts.is_dir() else rollouts.parent
    for d in [start, *list(start.parents)[:2]]:
        prov = read_provenance(d)
        config = (prov or {}).get("config") or {}
        if config.get("temperature") is not None:
            return {
                "temperature": config["temperature"],
                "top_p": config.get("top_p"),
                "from": f"{prov.get('command')} config in {d}",
            }
    return None


def first_per_category(table: Any, limit: int | None) -> Any:

    return limit_per_category(table, limit)


def check_not_empty(rows: Sequence[dict[str, Any]], source: str) -> None:
    if not any(any(r.get("loss_mask") or []) for r in rows):
        raise OvkitError(f"{source}: {EMPTY_MESSAGE}")


# ------------------------------------------------------------------------------------------------ the run


def run_mismatch(cfg: MismatchConfig, out_dir: Path) -> dict[str, Any]:
    """Write report.json, report.md, report.html, figures/, logprobs.parquet (and rollouts/ with --generate) into
    `out_dir`; return the headline metrics per run."""
    # Every input is read and checked before the model loads: rollouts (token ids inside the model's vocabulary,
    # finite log-probs, images), prompt rows (answers included) and --data.
    inputs: list[tuple[str, list[dict[str, Any]], str]] = []
    if cfg.rollouts is not None:
        # heavy: pyarrow loads on first use, not at CLI start or in config checks
        from ovkit.rollouts.table import read_rollouts

        rows = read_rollouts(cfg.rollouts, vocab_size=vocab_size(cfg.model)).to_pylist()
        check_not_empty(rows, str(cfg.rollouts))
        inputs.append(("rollouts", rows, str(cfg.rollouts)))
    prompt_rows = _prompt_rows(cfg) if cfg.generate is not None else None
    images_for = data_images(cfg.data)
    from ovkit.generate.engines import load_for_inference  # torch: after every input check

    model, processor = load_for_inference(
        cfg.model,
        precision=cfg.precision,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )
    device = str(next(model.parameters()).device)
    temperature, temperature_from, top_p = _sampling(cfg)
    if prompt_rows is not None:
        inputs += _generate_all(cfg, prompt_rows, model, processor, out_dir, temperature, top_p)
    runs: dict[str, dict[str, Any]] = {}
    figures: dict[str, dict[str, bytes]] = {}
    logprob_rows: list[dict[str, Any]] = []
    for name, rows, source in inputs:
        run, scores, table_rows = _one_run(cfg, model, processor, rows, source, name, temperature, images_for)
        runs[name] = run
        logprob_rows += table_rows
        figures[name] = _figures(cfg, scores, run)
    doc = {
        "model": str(cfg.model),
        "learner_precision": cfg.precision,
        "device": device,
        "temperature": temperature,
        "temperature_from": temperature_from,
        "top_p": top_p,
        "thresholds": asdict(cfg.thresholds),
        "runs": runs,
    }
    _write(out_dir, doc, figures, logprob_rows)
    return {
        name: {
            k: run["metrics"][k]
            for k in ("tokens", "k3_kl", "kl", "training_ppl", "rollout_ppl", "chi2_token", "max_mismatch_mean")
        }
        for name, run in runs.items()
    }


def _sampling(cfg: MismatchConfig) -> tuple[float, str, float | None]:
    """(temperature, where it came from, top-p): the options with --generate; for ROLLOUTS, --temperature or the
    producer's config."""
    if cfg.generate is not None:
        if cfg.temperature is None:
            return 1.0, "default", cfg.top_p or 1.0
        return cfg.temperature, "--temperature", cfg.top_p or 1.0
    found = producer_sampling(cfg.rollouts)
    if cfg.temperature is not None:
        return cfg.temperature, "--temperature", (found or {}).get("top_p")
    if found is not None:
        return float(found["temperature"]), found["from"], found.get("top_p")
    return 1.0, "default: the rollouts' producer is unknown", None


def _prompt_rows(cfg: MismatchConfig) -> Any:
    """The --generate rows to sample from (the first --limit per category), read and checked."""
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    from ovkit.data import read_samples

    return first_per_category(read_samples(cfg.generate, answers=True).table, cfg.limit)


def _generate_all(
    cfg: MismatchConfig, table: Any, model, processor, out_dir: Path, temperature: float, top_p: float
) -> list:
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    from ovkit.rollouts.episodes import env_instruction, env_tools, make_runner
    from ovkit.rollouts.table import write_rollouts

    prompts = encode_prompts(
        table,
        processor,
        mode=cfg.prompt,
        system=cfg.system_prompt,
        max_pixels=cfg.max_pixels or None,
        extra=env_instruction(cfg.multi_turn),
        tools=env_tools(cfg.multi_turn),
    )
    mode = "answer" if cfg.prompt == "none" else cfg.prompt
    out = []
    for name in cfg.sampler:
        engine = make_sampler(
            name, model, processor, model_dir=cfg.model, batch_size=cfg.batch_size, seed=cfg.seed, quiet=cfg.quiet
        )
        episodes = make_runner(
            cfg.multi_turn, engine, processor, mode=mode, max_pixels=cfg.max_pixels or None, model=model
        )
        with owned(engine):  # a vLLM sampler shuts down before the next sampler is built
            rollouts = generate_rollouts(
                engine,
                prompts,
                n=cfg.n,
                max_new_tokens=cfg.max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=cfg.seed,
                prompt_mode=mode,
                episodes=episodes,
            )
        del engine, episodes
        path = write_rollouts(rollouts, out_dir / "rollouts" / f"{name}.parquet")
        rows = rollouts.to_pylist()
        check_not_empty(rows, f"sampler {name}")
        out.append((name, rows, f"sampled with {name} from {cfg.generate} -> {path.relative_to(out_dir)}"))
    return out


def _one_run(cfg: MismatchConfig, model, processor, rows, source: str, name: str, temperature: float, images_for):

    res = rescore(
        model,
        processor,
        rows,
        temperature=temperature,
        batch_size=cfg.batch_size,
        max_pixels=cfg.max_pixels or None,
        images_for=images_for,
        progress=not cfg.quiet,
    )
    meta = {key: [r.get(key) for r in rows] for key in ("prompt_id", "category", "source", "reward")}
    scores = Scores.from_lists(res.learner, [r["behave_logprobs"] for r in rows], res.compared, res.turns, meta)
    if scores.tokens == 0:
        raise OvkitError(
            f"{source}: {EMPTY_MESSAGE}"
            + (" (every sampled token follows a multimodal placeholder)" if res.cut_tokens else "")
        )
    run = {
        "rollouts": source,
        "counts": {
            "rollouts": len(rows),
            "responses": scores.n,
            "compared_tokens": scores.tokens,
            "cut_tokens": res.cut_tokens,
        },
        **analyse(scores, cfg.thresholds),
    }
    table_rows = [
        {
            "run": name,
            "index": i,
            "prompt_id": r.get("prompt_id"),
            "group": r.get("group"),
            "learner_logprobs": res.learner[i],
            "behave_logprobs": r["behave_logprobs"],
            "compared": res.compared[i],
            "turn_ids": res.turns[i],
        }
        for i, r in enumerate(rows)
    ]
    return run, scores, table_rows


def _figures(cfg: MismatchConfig, scores: Scores, run: dict[str, Any]) -> dict[str, bytes]:
    # heavy: PIL loads on first use, not at CLI start or in config checks
    from ovkit.mismatch.figures import run_figures

    return run_figures(scores, run, max_points=cfg.max_points, seed=cfg.seed)


def _write(
    out_dir: Path, doc: dict[str, Any], figures: dict[str, dict[str, bytes]], logprob_rows: list[dict[str, Any]]
) -> None:
    # heavy: pyarrow, PIL load on first use, not at CLI start or in config checks
    import pyarrow as pa

    from ovkit.data.parts import write_table
    from ovkit.mismatch import figures as figs

    paths: dict[str, dict[str, str]] = {}
    for name, pngs in figures.items():
        (out_dir / "figures" / name).mkdir(parents=True, exist_ok=True)
        paths[name] = {}
        for stem, png in pngs.items():
            rel = f"figures/{name}/{stem}.png"
            (out_dir / rel).write_bytes(png)
            paths[name][stem] = rel
        doc["runs"][name]["figures"] = paths[name]
    compare_png = figs.compare(doc["runs"]) if len(doc["runs"]) > 1 else None
    if compare_png is not None:
        (out_dir / "figures" / "compare.png").write_bytes(compare_png)
    write_json(out_dir / "report.json", json.loads(json.dumps(doc, default=float)))
    (out_dir / "report.md").write_text(markdown(doc, paths))
    (out_dir / "report.html").write_text(html_page(doc, figures, compare_png))
    schema = pa.schema(
        [
            ("run", pa.string()),
            ("index", pa.int64()),
            ("prompt_id", pa.string()),
            ("group", pa.int64()),
            ("learner_logprobs", pa.list_(pa.float32())),
            ("behave_logprobs", pa.list_(pa.float32())),
            ("compared", pa.list_(pa.int8())),
            ("turn_ids", pa.list_(pa.int32())),
        ]
    )
    write_table(pa.Table.from_pylist(logprob_rows, schema=schema), out_dir / "logprobs.parquet")
