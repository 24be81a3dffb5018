"""`ovkit rl-train`: GRPO with decoupled PPO, bounded-staleness asynchronous rollouts and mismatch corrections."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import ATTN_IMPLEMENTATION, LORA_ALPHA, LORA_DROPOUT, LORA_R, LORA_TARGETS, PRECISION, CONFIG, ENV, ENV_ARG, ENV_RETRIES, ENV_TIMEOUT, MAX_RESPONSE_TOKENS, MAX_TURNS, OUT, OVERWRITE, QUIET, SEED, done, resolve, skipped

_O = typer.Option


def rl_train(
    ctx: typer.Context,
    data: list[Path] = typer.Argument(None, help="RL sample tables with answer/answer_type (e.g. rl-curate's OUT/stage1, or OUT/part-*/stage1 of a sharded curate).", show_default=False),
    model: Path = _O(None, "--model", help="Model directory: the SFT model for stage 1, the stage-1 output for stage 2."),
    out: Path = OUT,
    stage: int = _O(1, "--stage", help="1: answer-only prompts; 2: think prompts + format reward (the curriculum)."),
    engine: str = _O("hf", "--engine", help="Rollout engine: hf (transformers, CPU or GPU) or vllm (GPU)."),
    precision: str = PRECISION,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    sampler_precision: str = _O(None, "--sampler-precision", help="Sample from a copy in another precision than the learner: fp32, bf16, fp16."),
    sampler_quant: str = _O(None, "--sampler-quant", help="int8: sample from a dynamically quantised copy (hf engine, CPU); int4: from a copy with 4-bit weights."),
    prompts_per_step: int = _O(32, "--prompts-per-step", help="GRPO groups (prompts) per step."),
    group_size: int = _O(16, "--group-size", "--n-samples", help="Completions per prompt (G)."),
    max_new_tokens: int = _O(4096, "--max-new-tokens", help="Completion length limit."),
    temperature: float = _O(1.0, "--temperature", help="Sampling temperature (the learner divides its logits by it too)."),
    top_p: float = _O(1.0, "--top-p", help="Nucleus sampling (the learner does not truncate: top-p < 1 shows up as mismatch)."),
    max_steps: int = _O(None, "--max-steps", help="GRPO steps to run (instead of --epochs)."),
    epochs: float = _O(None, "--epochs", help="Passes over the prompts (default 30 when --max-steps is not given)."),
    lr: float = _O(2e-6, "--lr", help="Constant learning rate after warmup (AdamW)."),
    weight_decay: float = _O(0.01, "--weight-decay", help="AdamW weight decay on weight matrices."),
    warmup_ratio: float = _O(0.001, "--warmup-ratio", help="Fraction of the steps with linear warmup."),
    max_grad_norm: float = _O(1.0, "--max-grad-norm", help="Clip the global gradient norm (0: no clipping)."),
    eps_clip: float = _O(0.2, "--eps-clip", help="PPO clip: ratio lower bound 1 - eps."),
    eps_clip_high: float = _O(0.28, "--eps-clip-high", "--eps-clip-higher", help="PPO clip: ratio upper bound 1 + eps_high."),
    reward_bias: float = _O(-0.5, "--reward-bias", help="r' = (r + bias) * scale."),
    reward_scale: float = _O(10.0, "--reward-scale", "--reward-scaling", help="r' = (r + bias) * scale."),
    adv_eps: float = _O(1e-6, "--adv-eps", help="A = (r' - group mean) / (group std + eps)."),
    adv_std: bool = _O(True, "--adv-std/--no-adv-std", help="Divide advantages by the group std (--no-adv-std: centre only, Dr. GRPO)."),
    loss_agg: str = _O("token-mean", "--loss-agg", help="token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (constant normaliser = --max-new-tokens)."),
    kl_coef: float = _O(0.0, "--kl-coef", help="KL penalty to the initial model (0: none, as released)."),
    kl_estimator: str = _O("k3", "--kl-estimator", help="k1 | k2 | k3."),
    behave_cap: float = _O(5.0, "--behave-cap", "--behav-imp-weight-cap", help="Cap of the behaviour weight exp(prox - behave) (0: no cap)."),
    behave_action: str = _O("mask", "--behave-action", help="Above the cap: mask (train nothing) or clamp (weight = cap)."),
    behave_level: str = _O("token", "--behave-level", help="token, or sequence (geometric mean of the sequence's ratios)."),
    correction: str = _O("none", "--correction", help="Mismatch correction: none | token-tis | seq-tis | token-mis | seq-mis | geo-rs (verl names accepted, e.g. token, sequence, seq_mean_k1)."),
    correction_threshold: float = _O(2.0, "--correction-threshold", "--rollout-is-threshold", help="C: upper truncation (TIS) or rejection (MIS) bound."),
    correction_lower: float = _O(None, "--correction-lower", help="Lower bound (MIS masks below it, TIS clamps to it)."),
    geo_lower: float = _O(0.999, "--geo-lower", help="geo-rs: lower bound on the geometric-mean ratio."),
    geo_upper: float = _O(1.001, "--geo-upper", help="geo-rs: upper bound on the geometric-mean ratio."),
    veto_threshold: float = _O(None, "--veto-threshold", "--rollout-token-veto-threshold", help="Mask a whole sequence if any token ratio is below this."),
    max_staleness: int = _O(4, "--max-staleness", "--max-head-offpolicyness", help="ETA: rollouts run ahead of training by at most this many versions (0: synchronous on-policy)."),
    ppo_minibatches: int = _O(1, "--ppo-minibatches", help="Optimizer steps per batch (each on a slice of it)."),
    micro_batch_size: int = _O(8, "--micro-batch-size", help="Trajectories per learner forward pass (memory)."),
    rollout_batch_size: int = _O(64, "--rollout-batch-size", help="Sequences per generate call of the hf engine."),
    vllm_gpu_memory_utilization: float = _O(0.3, "--vllm-gpu-memory-utilization", help="--engine vllm: the GPU memory share the colocated vLLM takes."),
    format_weight: float = _O(None, "--format-weight", help="Weight of the format reward (default: 0 in stage 1, 0.1 in stage 2)."),
    system_prompt: bool = _O(True, "--system-prompt/--no-system-prompt", help="Prepend 'You are a helpful AI assistant.' (the recipe's system prompt)."),
    max_pixels: int = _O(262144, "--max-pixels", help="Downscale images to at most this many pixels (512x512 in the recipe)."),
    freeze_vision: bool = _O(False, "--freeze-vision", help="Keep the vision encoder frozen."),
    lora_r: int = LORA_R,
    lora_alpha: float = LORA_ALPHA,
    lora_dropout: float = LORA_DROPOUT,
    lora_targets: list[str] = LORA_TARGETS,
    save_every: int = _O(250, "--save-every", help="Resumable checkpoint every N steps in OUT.partial/checkpoints (0: only the final model)."),
    keep_checkpoints: int = _O(2, "--keep-checkpoints", help="Keep the newest N intermediate checkpoints."),
    save_rollouts: bool = _O(False, "--save-rollouts", help="Write every step's trajectories to OUT/rollouts/step-N.parquet."),
    resume: bool = _O(False, "--resume", help="Continue the unfinished run in OUT.partial/ from its last checkpoint."),
    report_to: list[str] = _O(None, "--report-to", help="Experiment tracker through accelerate: tensorboard, wandb, mlflow or trackio; repeatable (metrics.jsonl is always written)."),
    reward_workers: int = _O(2, "--reward-workers", help="Processes for the sandboxed scorers (math, svg, code)."),
    env: str = ENV,
    env_arg: list[str] = ENV_ARG,
    max_turns: int = MAX_TURNS,
    max_response_tokens: int = MAX_RESPONSE_TOKENS,
    env_retries: int = ENV_RETRIES,
    env_timeout: float = ENV_TIMEOUT,
    trust_remote_code: bool = _O(False, "--trust-remote-code", help="Allow model code from the model directory."),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """GRPO on verifiable rewards (LLaVA-OneVision-1.5-RL): decoupled PPO, async rollouts with bounded staleness,
    sampler/learner mismatch corrections. Stage 1 answer-only, stage 2 chain-of-thought."""
    from ovkit.rl.config import RLTrainConfig
    from ovkit.rl.loop import train_rl

    cfg = resolve(ctx, RLTrainConfig)
    m = train_rl(cfg)
    if m is None:
        return skipped(cfg.out)
    reward = " -> ".join("-" if r is None else f"{r:.3f}" for r in (m["first_reward"], m["final_reward"]))
    done(
        f"rl-train stage {cfg.stage}: {m['steps']} steps, reward {reward}, "
        f"{m['samples_per_s']:.1f} samples/s, max staleness {m['max_staleness_seen']}, {m['elapsed_s']:.0f}s -> {cfg.out}"
    )
