"""`ovkit mismatch-report`: recompute the learner's log-probs of rollouts and report the sampler/learner gap."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import (
    ATTN_IMPLEMENTATION,
    CONFIG,
    ENV,
    ENV_ARG,
    ENV_RETRIES,
    ENV_TIMEOUT,
    IO,
    MAX_RESPONSE_TOKENS,
    MAX_TURNS,
    OUT,
    OVERWRITE,
    QUIET,
    RUNTIME,
    SEED,
    done,
    resolve,
    skipped,
    stage,
)

_O = typer.Option


FRESH, LEARNER, CORRECTIONS = "Fresh rollouts (--generate)", "Learner", "rl-train corrections reported"


@stage(
    "ovkit.mismatch.run:MismatchConfig",
    required=("model", "out"),
    example="ovkit mismatch-report --model runs/tiny/models/sft --generate runs/tiny/data/rl --limit 4 --n 4 --max-new-tokens 32 --sampler fp32 --sampler bf16 --sampler int8 --out runs/tiny/mismatch-demo",
)
def mismatch_report(
    ctx: typer.Context,
    rollouts: Path = typer.Argument(
        None,
        help="Rollout table: eval --save-logprobs OUT, rl-curate OUT/rollouts, rl-train OUT/rollouts, or one parquet file.",
        show_default=False,
    ),
    model: Path = _O(None, "--model", help="The learner: a model directory (save_pretrained).", rich_help_panel=IO),
    out: Path = OUT,
    generate: Path = _O(
        None,
        "--generate",
        help="Sample fresh rollouts from these prompt rows (RL/eval table) instead of reading ROLLOUTS.",
        rich_help_panel=FRESH,
    ),
    sampler: list[str] = _O(
        None,
        "--sampler",
        help="With --generate: fp32, bf16, fp16, int8, fp8, int4 (4-bit weights) or vllm (GPU); repeat to compare (default bf16).",
        rich_help_panel=FRESH,
    ),
    data: Path = _O(
        None,
        "--data",
        help="Prompt rows (matched by prompt_id) for the images of rollout tables that store none (rl-train).",
        rich_help_panel=IO,
    ),
    temperature: float = _O(
        None,
        "--temperature",
        help="Sampling temperature; the learner divides its logits by it (default: the rollouts' producer's, else 1.0).",
        rich_help_panel=LEARNER,
    ),
    top_p: float = _O(
        None, "--top-p", help="With --generate: nucleus sampling mass (default 1.0).", rich_help_panel=FRESH
    ),
    n: int = _O(None, "--n", help="With --generate: completions per prompt.", rich_help_panel=FRESH),
    limit: int = _O(
        None,
        "--limit",
        help="With --generate: at most this many prompt rows per category (the first ones).",
        rich_help_panel=FRESH,
    ),
    max_new_tokens: int = _O(
        None, "--max-new-tokens", help="With --generate: tokens per completion.", rich_help_panel=FRESH
    ),
    prompt: str = _O(
        None,
        "--prompt",
        help="With --generate: stage instruction added to prompts: answer, think or none.",
        rich_help_panel=FRESH,
    ),
    system_prompt: bool = _O(
        None,
        "--system-prompt/--no-system-prompt",
        help="With --generate: prepend the recipe's system prompt (as rl-train).",
        rich_help_panel=FRESH,
    ),
    max_pixels: int = _O(
        None,
        "--max-pixels",
        help="Downscale images to at most this many pixels, as the sampler did (0: never; eval does not downscale).",
        rich_help_panel=LEARNER,
    ),
    batch_size: int = _O(
        None,
        "--batch-size",
        help="Rollouts per learner forward pass (and sequences per generate call).",
        rich_help_panel=LEARNER,
    ),
    precision: str = _O(
        None,
        "--precision",
        help="The learner's precision: fp32 (the default, the reference), bf16-true or bf16-mixed (both compute in bf16).",
        rich_help_panel=LEARNER,
    ),
    attn_implementation: str = ATTN_IMPLEMENTATION,
    correction_threshold: float = _O(
        None,
        "--correction-threshold",
        "--rollout-is-threshold",
        help="rl-train's C: TIS truncation / MIS rejection bound.",
        rich_help_panel=CORRECTIONS,
    ),
    correction_lower: float = _O(
        None,
        "--correction-lower",
        help="rl-train's lower bound (MIS masks below it, TIS clamps to it).",
        rich_help_panel=CORRECTIONS,
    ),
    geo_lower: float = _O(
        None, "--geo-lower", help="geo-rs: lower bound on the geometric-mean ratio.", rich_help_panel=CORRECTIONS
    ),
    geo_upper: float = _O(
        None, "--geo-upper", help="geo-rs: upper bound on the geometric-mean ratio.", rich_help_panel=CORRECTIONS
    ),
    behave_cap: float = _O(
        None,
        "--behave-cap",
        help="rl-train's behaviour-weight cap, reported as a mask rate (0: not reported).",
        rich_help_panel=CORRECTIONS,
    ),
    veto_threshold: float = _O(
        None,
        "--veto-threshold",
        "--rollout-token-veto-threshold",
        help="Also report the veto: sequences with any token ratio below this.",
        rich_help_panel=CORRECTIONS,
    ),
    max_points: int = _O(
        None,
        "--max-points",
        help="Tokens drawn in the scatter plots (a seeded sample beyond that).",
        rich_help_panel=IO,
    ),
    env: str = ENV,
    env_arg: list[str] = ENV_ARG,
    max_turns: int = MAX_TURNS,
    max_response_tokens: int = MAX_RESPONSE_TOKENS,
    env_retries: int = ENV_RETRIES,
    env_timeout: float = ENV_TIMEOUT,
    trust_remote_code: bool = _O(
        None, "--trust-remote-code", help="Allow model code from the model directory.", rich_help_panel=RUNTIME
    ),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Recompute the learner's log-probs of saved (or freshly sampled) rollouts and report the sampler/learner
    mismatch: vllm-kl (K3), k1, PPLs, chi-square, max/mean |dp|, importance weights, what each rl-train correction
    would clip or mask, and where the gap sits (sampler probability, turn, length, category, source)."""
    from ovkit.mismatch import run_mismatch
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    inputs = [p for p in (cfg.rollouts, cfg.generate, cfg.data) if p is not None]
    stage = Stage(
        "mismatch-report", cfg, cfg.out, inputs=inputs, overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model
    )
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.metrics.update(run_mismatch(cfg, stage.path))
    runs = ", ".join(f"{name} {m['k3_kl']:.3e}" for name, m in stage.metrics.items())
    tokens = sum(m["tokens"] for m in stage.metrics.values())
    done(f"mismatch-report: vllm-kl (K3) {runs} over {tokens:,} tokens -> {cfg.out}/report.html")
