"""`ovkit rl-train`: GRPO with decoupled PPO, bounded-staleness asynchronous rollouts and mismatch corrections."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands._common import (
    ACTIVATION_CHECKPOINTING,
    ATTN_IMPLEMENTATION,
    CHECKPOINTS,
    COMPILE,
    CONFIG,
    ENV,
    ENV_ARG,
    ENV_RETRIES,
    ENV_TIMEOUT,
    EVAL_DATA,
    EVAL_EVERY,
    EVAL_LIMIT,
    EVAL_MAX_NEW_TOKENS,
    GRADIENT_CHECKPOINTING,
    IO,
    KERNELS,
    LORA_ALPHA,
    LORA_DROPOUT,
    LORA_R,
    LORA_TARGETS,
    MAX_RESPONSE_TOKENS,
    MAX_TURNS,
    OPTIM,
    OUT,
    OVERWRITE,
    PRECISION,
    QUIET,
    RUNTIME,
    SEED,
    USE_LIGER_KERNEL,
    done,
    resolve,
    skipped,
    stage,
)
from ovkit.config import check_inputs

_O = typer.Option
SAMPLING, OPTIMISER, LOSS, CORRECTIONS = "Sampling", "Optimiser", "GRPO loss", "Mismatch corrections"


@stage(
    "ovkit.rl.config:RLTrainConfig",
    required=("data", "model", "out"),
    example="ovkit rl-train runs/tiny/rl-data/stage1 --model runs/tiny/models/sft --out runs/tiny/models/rl1 --config examples/tiny/rl-stage1.yaml",
)
def rl_train(
    ctx: typer.Context,
    data: list[Path] = typer.Argument(
        None,
        help="RL sample tables with answer/answer_type (e.g. rl-curate's OUT/stage1, or OUT/part-*/stage1 of a sharded curate).",
        show_default=False,
    ),
    model: Path = _O(
        None,
        "--model",
        help="Model directory: the SFT model for stage 1, the stage-1 output for stage 2.",
        rich_help_panel=IO,
    ),
    out: Path = OUT,
    stage: int = _O(
        None,
        "--stage",
        help="1: answer-only prompts; 2: think prompts + format reward (the curriculum).",
        rich_help_panel=IO,
    ),
    config: Path = CONFIG,
    engine: str = _O(
        None,
        "--engine",
        help="Rollout engine: hf (transformers, CPU or GPU), vllm (colocated, GPU) or vllm-server (a running `vllm serve`, see --vllm-server-url).",
        rich_help_panel=SAMPLING,
    ),
    sampler_precision: str = _O(
        None,
        "--sampler-precision",
        help="Sample from a copy in another precision than the learner: fp32, bf16, fp16.",
        rich_help_panel=SAMPLING,
    ),
    sampler_quant: str = _O(
        None,
        "--sampler-quant",
        help="int8, fp8 or int4: sample from a quantised copy (hf engine: int8 is dynamic W8A8 on CPU, weight-only on GPU; fp8 weight-only; int4 group-wise 4-bit weights; vllm: fp8).",
        rich_help_panel=SAMPLING,
    ),
    prompts_per_step: int = _O(
        None, "--prompts-per-step", help="GRPO groups (prompts) per step.", rich_help_panel=SAMPLING
    ),
    group_size: int = _O(
        None, "--group-size", "--n-samples", help="Completions per prompt (G).", rich_help_panel=SAMPLING
    ),
    max_new_tokens: int = _O(None, "--max-new-tokens", help="Completion length limit.", rich_help_panel=SAMPLING),
    temperature: float = _O(
        None,
        "--temperature",
        help="Sampling temperature (the learner divides its logits by it too).",
        rich_help_panel=SAMPLING,
    ),
    top_p: float = _O(
        None,
        "--top-p",
        help="Nucleus sampling (the learner does not truncate: top-p < 1 shows up as mismatch).",
        rich_help_panel=SAMPLING,
    ),
    max_staleness: int = _O(
        None,
        "--max-staleness",
        "--max-head-offpolicyness",
        help="ETA: rollouts run ahead of training by at most this many versions (0: synchronous on-policy).",
        rich_help_panel=SAMPLING,
    ),
    system_prompt: bool = _O(
        None,
        "--system-prompt/--no-system-prompt",
        help="Prepend 'You are a helpful AI assistant.' (the recipe's system prompt).",
        rich_help_panel=SAMPLING,
    ),
    max_pixels: int = _O(
        None,
        "--max-pixels",
        help="Downscale images to at most this many pixels (512x512 in the recipe).",
        rich_help_panel=SAMPLING,
    ),
    max_steps: int = _O(
        None, "--max-steps", help="GRPO steps to run (instead of --epochs).", rich_help_panel=OPTIMISER
    ),
    epochs: float = _O(
        None,
        "--epochs",
        "--num-train-epochs",
        help="Passes over the prompts (default 30 when --max-steps is not given). Also --num-train-epochs (HF/TRL).",
        rich_help_panel=OPTIMISER,
    ),
    lr: float = _O(
        None,
        "--lr",
        "--learning-rate",
        help="Constant learning rate after warmup (AdamW). Also --learning-rate (HF/TRL).",
        rich_help_panel=OPTIMISER,
    ),
    weight_decay: float = _O(
        None, "--weight-decay", help="AdamW weight decay on weight matrices.", rich_help_panel=OPTIMISER
    ),
    warmup_ratio: float = _O(
        None, "--warmup-ratio", help="Fraction of the steps with linear warmup.", rich_help_panel=OPTIMISER
    ),
    max_grad_norm: float = _O(
        None, "--max-grad-norm", help="Clip the global gradient norm (0: no clipping).", rich_help_panel=OPTIMISER
    ),
    ppo_minibatches: int = _O(
        None, "--ppo-minibatches", help="Optimizer steps per batch (each on a slice of it).", rich_help_panel=OPTIMISER
    ),
    freeze_vision: bool = _O(
        None, "--freeze-vision", help="Keep the vision encoder frozen.", rich_help_panel=OPTIMISER
    ),
    eps_clip: float = _O(None, "--eps-clip", help="PPO clip: ratio lower bound 1 - eps.", rich_help_panel=LOSS),
    eps_clip_high: float = _O(
        None,
        "--eps-clip-high",
        "--eps-clip-higher",
        help="PPO clip: ratio upper bound 1 + eps_high.",
        rich_help_panel=LOSS,
    ),
    reward_bias: float = _O(None, "--reward-bias", help="r' = (r + bias) * scale.", rich_help_panel=LOSS),
    reward_scale: float = _O(
        None, "--reward-scale", "--reward-scaling", help="r' = (r + bias) * scale.", rich_help_panel=LOSS
    ),
    adv_eps: float = _O(None, "--adv-eps", help="A = (r' - group mean) / (group std + eps).", rich_help_panel=LOSS),
    adv_std: bool = _O(
        None,
        "--adv-std/--no-adv-std",
        help="Divide advantages by the group std (--no-adv-std: centre only, Dr. GRPO).",
        rich_help_panel=LOSS,
    ),
    loss_agg: str = _O(
        None,
        "--loss-agg",
        help="token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (constant normaliser = --max-new-tokens).",
        rich_help_panel=LOSS,
    ),
    kl_coef: float = _O(
        None, "--kl-coef", help="KL penalty to the initial model (0: none, as released).", rich_help_panel=LOSS
    ),
    kl_estimator: str = _O(None, "--kl-estimator", help="k1 | k2 | k3.", rich_help_panel=LOSS),
    format_weight: float = _O(
        None,
        "--format-weight",
        help="Weight of the format reward (default: 0 in stage 1, 0.1 in stage 2).",
        rich_help_panel=LOSS,
    ),
    behave_cap: float = _O(
        None,
        "--behave-cap",
        "--behav-imp-weight-cap",
        help="Cap of the behaviour weight exp(prox - behave) (0: no cap).",
        rich_help_panel=CORRECTIONS,
    ),
    behave_action: str = _O(
        None,
        "--behave-action",
        help="Above the cap: mask (train nothing) or clamp (weight = cap).",
        rich_help_panel=CORRECTIONS,
    ),
    behave_level: str = _O(
        None,
        "--behave-level",
        help="token, or sequence (geometric mean of the sequence's ratios).",
        rich_help_panel=CORRECTIONS,
    ),
    correction: str = _O(
        None,
        "--correction",
        help="Mismatch correction: none | token-tis | seq-tis | token-mis | seq-mis | geo-rs (verl names accepted, e.g. token, sequence, seq_mean_k1).",
        rich_help_panel=CORRECTIONS,
    ),
    correction_threshold: float = _O(
        None,
        "--correction-threshold",
        "--rollout-is-threshold",
        help="C: upper truncation (TIS) or rejection (MIS) bound.",
        rich_help_panel=CORRECTIONS,
    ),
    correction_lower: float = _O(
        None,
        "--correction-lower",
        help="Lower bound (MIS masks below it, TIS clamps to it).",
        rich_help_panel=CORRECTIONS,
    ),
    geo_lower: float = _O(
        None, "--geo-lower", help="geo-rs: lower bound on the geometric-mean ratio.", rich_help_panel=CORRECTIONS
    ),
    geo_upper: float = _O(
        None, "--geo-upper", help="geo-rs: upper bound on the geometric-mean ratio.", rich_help_panel=CORRECTIONS
    ),
    veto_threshold: float = _O(
        None,
        "--veto-threshold",
        "--rollout-token-veto-threshold",
        help="Mask a whole sequence if any token ratio is below this.",
        rich_help_panel=CORRECTIONS,
    ),
    env: str = ENV,
    env_arg: list[str] = ENV_ARG,
    max_turns: int = MAX_TURNS,
    max_response_tokens: int = MAX_RESPONSE_TOKENS,
    env_retries: int = ENV_RETRIES,
    env_timeout: float = ENV_TIMEOUT,
    lora_r: int = LORA_R,
    lora_alpha: float = LORA_ALPHA,
    lora_dropout: float = LORA_DROPOUT,
    lora_targets: list[str] = LORA_TARGETS,
    precision: str = PRECISION,
    optim: str = OPTIM,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    activation_checkpointing: str = ACTIVATION_CHECKPOINTING,
    gradient_checkpointing: bool = GRADIENT_CHECKPOINTING,
    compile: bool = COMPILE,
    kernels: str = KERNELS,
    use_liger_kernel: bool = USE_LIGER_KERNEL,
    micro_batch_size: int = _O(
        None, "--micro-batch-size", help="Trajectories per learner forward pass (memory).", rich_help_panel=RUNTIME
    ),
    rollout_batch_size: int = _O(
        None, "--rollout-batch-size", help="Sequences per generate call of the hf engine.", rich_help_panel=RUNTIME
    ),
    vllm_gpu_memory_utilization: float = _O(
        None,
        "--vllm-gpu-memory-utilization",
        help="--engine vllm: the GPU memory share the colocated vLLM takes.",
        rich_help_panel=RUNTIME,
    ),
    vllm_server_url: str = _O(
        None,
        "--vllm-server-url",
        help="--engine vllm-server: the server's address (default http://localhost:8000).",
        rich_help_panel=RUNTIME,
    ),
    vllm_server_timeout: float = _O(
        None,
        "--vllm-server-timeout",
        help="--engine vllm-server: seconds to wait for the server at start.",
        rich_help_panel=RUNTIME,
    ),
    reward_workers: int = _O(
        None, "--reward-workers", help="Processes for the sandboxed scorers (math, svg, code).", rich_help_panel=RUNTIME
    ),
    trust_remote_code: bool = _O(
        None, "--trust-remote-code", help="Allow model code from the model directory.", rich_help_panel=RUNTIME
    ),
    save_every: int = _O(
        None,
        "--save-every",
        help="Resumable checkpoint every N steps in OUT.partial/checkpoints (0: only the final model).",
        rich_help_panel=CHECKPOINTS,
    ),
    keep_checkpoints: int = _O(
        None, "--keep-checkpoints", help="Keep the newest N intermediate checkpoints.", rich_help_panel=CHECKPOINTS
    ),
    save_rollouts: bool = _O(
        None,
        "--save-rollouts",
        help="Write every step's trajectories to OUT/rollouts/step-N.parquet.",
        rich_help_panel=CHECKPOINTS,
    ),
    resume: bool = _O(
        None,
        "--resume",
        help="Continue the unfinished run in OUT.partial/ from its last checkpoint.",
        rich_help_panel=CHECKPOINTS,
    ),
    report_to: list[str] = _O(
        None,
        "--report-to",
        help="Experiment tracker through accelerate: tensorboard, wandb, mlflow or trackio; repeatable (metrics.jsonl is always written).",
        rich_help_panel=CHECKPOINTS,
    ),
    eval_data: list[Path] = EVAL_DATA,
    eval_every: int = EVAL_EVERY,
    eval_limit: int = EVAL_LIMIT,
    eval_max_new_tokens: int = EVAL_MAX_NEW_TOKENS,
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
) -> None:
    """GRPO on verifiable rewards (LLaVA-OneVision-1.5-RL): decoupled PPO, async rollouts with bounded staleness,
    sampler/learner mismatch corrections. Stage 1 answer-only, stage 2 chain-of-thought."""
    from ovkit.launch import processes

    cfg = resolve(ctx)  # before the loop's import (torch): an input error appears at once (#29)
    check_inputs(cfg)
    from ovkit.rl.loop import train_rl

    m = train_rl(cfg)
    if m is None:
        return skipped(cfg.out)
    if processes()[0] != 0:  # under a launcher: the main process, which wrote OUT, prints the one summary line
        return
    reward = " -> ".join("-" if r is None else f"{r:.3f}" for r in (m["first_reward"], m["final_reward"]))
    done(
        f"rl-train stage {cfg.stage}: {m['steps']} steps, reward {reward}, "
        f"{m['samples_per_s']:.1f} samples/s, max staleness {m['max_staleness_seen']}, {m['elapsed_s']:.0f}s -> {cfg.out}"
    )
