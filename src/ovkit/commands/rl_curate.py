"""`ovkit rl-curate`: N rollouts per prompt, pass@1 / pass@N, keep medium-difficulty prompts, split into stages."""

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
    PRECISION,
    QUIET,
    RUNTIME,
    SEED,
    SHARD,
    done,
    resolve,
    skipped,
    stage,
)

_O = typer.Option


SAMPLING, SELECTION = "Sampling", "Selection"


@stage(
    "ovkit.rl.curate:CurateConfig",
    required=("data", "model", "out"),
    example="ovkit rl-curate runs/tiny/data/rl --model runs/tiny/models/sft --out runs/tiny/rl-data --n 8 --limit 24 --max-new-tokens 64 --no-system-prompt",
)
def rl_curate(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="RL prompts (sample table with answer/answer_type).", show_default=False),
    model: Path = _O(None, "--model", help="The model RL will start from (e.g. the SFT output).", rich_help_panel=IO),
    out: Path = OUT,
    n: int = _O(None, "--n", help="Rollouts per prompt.", rich_help_panel=SAMPLING),
    limit: int = _O(
        None,
        "--limit",
        help="At most this many prompts per category (the first ones), to fit a time budget.",
        rich_help_panel=SAMPLING,
    ),
    select: str = _O(
        None,
        "--select",
        help="mean: keep min-reward < pass@1 < max-reward (released code); gap: keep pass@N - pass@1 >= min-gap (the write-up).",
        rich_help_panel=SELECTION,
    ),
    min_reward: float = _O(
        None,
        "--min-reward",
        help="mean rule: drop prompts whose pass@1 is <= this (never solved).",
        rich_help_panel=SELECTION,
    ),
    max_reward: float = _O(
        None,
        "--max-reward",
        help="mean rule: drop prompts whose pass@1 is >= this (already solved).",
        rich_help_panel=SELECTION,
    ),
    min_gap: float = _O(
        None, "--min-gap", help="gap rule: keep prompts with pass@N - pass@1 >= this.", rich_help_panel=SELECTION
    ),
    keep_sources: list[str] = _O(
        None,
        "--keep-source",
        help="Keep every prompt whose source contains this tag, whatever its difficulty; repeatable.",
        rich_help_panel=SELECTION,
    ),
    stage2_categories: list[str] = _O(
        None,
        "--stage2-category",
        help="Categories that go to the stage-2 (thinking) set; repeatable (default: math chart science diagram svg code stem coding).",
        rich_help_panel=SELECTION,
    ),
    exclude_categories: list[str] = _O(
        None,
        "--exclude-category",
        help="Leave this category out of RL (its prompts are not sampled); repeatable.",
        rich_help_panel=SELECTION,
    ),
    prompt: str = _O(
        None,
        "--prompt",
        help="Instruction the rollouts are sampled with: auto (the row's stage: 1 answer-only, 2 think), answer or think.",
        rich_help_panel=SAMPLING,
    ),
    engine: str = _O(None, "--engine", help="hf (transformers, CPU or GPU) or vllm (GPU).", rich_help_panel=RUNTIME),
    precision: str = PRECISION,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    batch_size: int = _O(
        None, "--batch-size", help="Sequences per generate call (prompts x n).", rich_help_panel=RUNTIME
    ),
    max_new_tokens: int = _O(None, "--max-new-tokens", help="Completion length limit.", rich_help_panel=SAMPLING),
    temperature: float = _O(None, "--temperature", help="Sampling temperature.", rich_help_panel=SAMPLING),
    top_p: float = _O(None, "--top-p", help="Nucleus sampling.", rich_help_panel=SAMPLING),
    max_pixels: int = _O(
        None,
        "--max-pixels",
        help="Downscale images to at most this many pixels (512x512 in the recipe).",
        rich_help_panel=SAMPLING,
    ),
    system_prompt: bool = _O(
        None, "--system-prompt/--no-system-prompt", help="Prepend the recipe's system prompt.", rich_help_panel=SAMPLING
    ),
    rollout_images: bool = _O(
        None,
        "--rollout-images/--no-rollout-images",
        help="Store prompt images in OUT/rollouts (mismatch-report needs them for multimodal prompts).",
        rich_help_panel=IO,
    ),
    reward_workers: int = _O(
        None, "--reward-workers", help="Processes for the sandboxed scorers (math, svg, code).", rich_help_panel=RUNTIME
    ),
    env: str = ENV,
    env_arg: list[str] = ENV_ARG,
    max_turns: int = MAX_TURNS,
    max_response_tokens: int = MAX_RESPONSE_TOKENS,
    env_retries: int = ENV_RETRIES,
    env_timeout: float = ENV_TIMEOUT,
    shard: str = SHARD,
    trust_remote_code: bool = _O(
        None, "--trust-remote-code", help="Allow model code from the model directory.", rich_help_panel=RUNTIME
    ),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Sample N rollouts per RL prompt, score them, keep medium-difficulty prompts and split them into the stage-1
    (answer-only) and stage-2 (thinking) sets, with stats and a difficulty histogram."""
    from ovkit.data import parse_shard, shard_out
    from ovkit.rl.curate import curate
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    part = parse_shard(cfg.shard)
    stage = Stage(
        "rl-curate",
        cfg,
        shard_out(cfg.out, part),
        inputs=[cfg.data],
        overwrite=cfg.overwrite,
        seed=cfg.seed,
        parent=cfg.model,
    )
    if stage.skipped:
        return skipped(stage.out)
    with stage:
        stage.metrics.update(curate(cfg, stage.path, part))
    m = stage.metrics
    done(
        f"rl-curate: {m['prompts']} prompts, pass@1 {m['pass_at_1']:.3f}, pass@{cfg.n} {m['pass_at_n']:.3f}, "
        f"kept {m['kept']} (stage 1: {m['stage1']}, stage 2: {m['stage2']}) -> {stage.out}"
    )
