"""`ovkit rl-curate`: N rollouts per prompt, pass@1 / pass@N, keep medium-difficulty prompts, split into stages."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import ATTN_IMPLEMENTATION, PRECISION, CONFIG, ENV, ENV_ARG, ENV_RETRIES, ENV_TIMEOUT, MAX_RESPONSE_TOKENS, MAX_TURNS, OUT, OVERWRITE, QUIET, SEED, SHARD, done, resolve, skipped

_O = typer.Option


def rl_curate(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="RL prompts (sample table with answer/answer_type).", show_default=False),
    model: Path = _O(None, "--model", help="The model RL will start from (e.g. the SFT output)."),
    out: Path = OUT,
    n: int = _O(16, "--n", help="Rollouts per prompt."),
    limit: int = _O(None, "--limit", help="At most this many prompts per category (the first ones), to fit a time budget."),
    select: str = _O("mean", "--select", help="mean: keep min-reward < pass@1 < max-reward (released code); gap: keep pass@N - pass@1 >= min-gap (the write-up)."),
    min_reward: float = _O(0.0, "--min-reward", help="mean rule: drop prompts whose pass@1 is <= this (never solved)."),
    max_reward: float = _O(0.6, "--max-reward", help="mean rule: drop prompts whose pass@1 is >= this (already solved)."),
    min_gap: float = _O(0.25, "--min-gap", help="gap rule: keep prompts with pass@N - pass@1 >= this."),
    keep_sources: list[str] = _O(None, "--keep-source", help="Keep every prompt whose source contains this tag, whatever its difficulty; repeatable."),
    stage2_categories: list[str] = _O(None, "--stage2-category", help="Categories that go to the stage-2 (thinking) set; repeatable (default: math chart science diagram svg code stem coding)."),
    prompt: str = _O("auto", "--prompt", help="Instruction the rollouts are sampled with: auto (the row's stage: 1 answer-only, 2 think), answer or think."),
    engine: str = _O("hf", "--engine", help="hf (transformers, CPU or GPU) or vllm (GPU)."),
    precision: str = PRECISION,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    batch_size: int = _O(64, "--batch-size", help="Sequences per generate call (prompts x n)."),
    max_new_tokens: int = _O(1024, "--max-new-tokens", help="Completion length limit."),
    temperature: float = _O(1.0, "--temperature", help="Sampling temperature."),
    top_p: float = _O(1.0, "--top-p", help="Nucleus sampling."),
    max_pixels: int = _O(262144, "--max-pixels", help="Downscale images to at most this many pixels (512x512 in the recipe)."),
    system_prompt: bool = _O(True, "--system-prompt/--no-system-prompt", help="Prepend the recipe's system prompt."),
    rollout_images: bool = _O(True, "--rollout-images/--no-rollout-images", help="Store prompt images in OUT/rollouts (mismatch-report needs them for multimodal prompts)."),
    reward_workers: int = _O(2, "--reward-workers", help="Processes for the sandboxed scorers (math, svg, code)."),
    env: str = ENV,
    env_arg: list[str] = ENV_ARG,
    max_turns: int = MAX_TURNS,
    max_response_tokens: int = MAX_RESPONSE_TOKENS,
    env_retries: int = ENV_RETRIES,
    env_timeout: float = ENV_TIMEOUT,
    shard: str = SHARD,
    trust_remote_code: bool = _O(False, "--trust-remote-code", help="Allow model code from the model directory."),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Sample N rollouts per RL prompt, score them, keep medium-difficulty prompts and split them into the stage-1
    (answer-only) and stage-2 (thinking) sets, with stats and a difficulty histogram."""
    from ovkit.data import parse_shard, shard_out
    from ovkit.rl.curate import CurateConfig, curate
    from ovkit.runs import Stage

    cfg = resolve(ctx, CurateConfig)
    part = parse_shard(cfg.shard)
    stage = Stage("rl-curate", cfg, shard_out(cfg.out, part), inputs=[cfg.data], overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model)
    if stage.skipped:
        return skipped(stage.out)
    with stage:
        stage.metrics.update(curate(cfg, stage.path, part))
    m = stage.metrics
    done(
        f"rl-curate: {m['prompts']} prompts, pass@1 {m['pass_at_1']:.3f}, pass@{cfg.n} {m['pass_at_n']:.3f}, "
        f"kept {m['kept']} (stage 1: {m['stage1']}, stage 2: {m['stage2']}) -> {stage.out}"
    )
