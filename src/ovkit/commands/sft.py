"""`ovkit sft`: stage 2 of the recipe, instruction tuning."""

from __future__ import annotations

from pathlib import Path

import typer

from ovkit.commands import _train_options as T
from ovkit.commands._common import CONFIG, OUT, OVERWRITE, QUIET, SEED, stage


@stage(
    "ovkit.train.config:SFTConfig",
    required=T.REQUIRED,
    example="ovkit sft runs/tiny/data/instruct --model runs/tiny/models/midtrain --out runs/tiny/models/sft --config examples/tiny/sft.yaml",
)
def sft(
    ctx: typer.Context,
    data: list[Path] = T.DATA,
    model: Path = T.MODEL,
    out: Path = OUT,
    plan: Path = T.PLAN,
    trainable: list[str] = T.TRAINABLE,
    freeze_vision: bool = T.FREEZE_VISION,
    lr: float = T.LR,
    vision_lr: float = T.VISION_LR,
    min_lr: float = T.MIN_LR,
    warmup_ratio: float = T.WARMUP_RATIO,
    weight_decay: float = T.WEIGHT_DECAY,
    max_grad_norm: float = T.MAX_GRAD_NORM,
    batch_size: int = T.BATCH_SIZE,
    grad_accum: int = T.GRAD_ACCUM,
    max_steps: int = T.MAX_STEPS,
    epochs: float = T.EPOCHS,
    max_len: int = T.MAX_LEN,
    precision: str = T.PRECISION,
    optim: str = T.OPTIM,
    attn_implementation: str = T.ATTN_IMPLEMENTATION,
    lora_r: int = T.LORA_R,
    lora_alpha: float = T.LORA_ALPHA,
    lora_dropout: float = T.LORA_DROPOUT,
    lora_targets: list[str] = T.LORA_TARGETS,
    load_in_4bit: bool = T.LOAD_IN_4BIT,
    activation_checkpointing: str = T.ACTIVATION_CHECKPOINTING,
    gradient_checkpointing: bool = T.GRADIENT_CHECKPOINTING,
    compile: bool = T.COMPILE,
    kernels: str = T.KERNELS,
    use_liger_kernel: bool = T.USE_LIGER_KERNEL,
    save_every: int = T.SAVE_EVERY,
    keep_checkpoints: int = T.KEEP_CHECKPOINTS,
    resume: bool = T.RESUME,
    report_to: list[str] = T.REPORT_TO,
    eval_data: list[Path] = T.EVAL_DATA,
    eval_every: int = T.EVAL_EVERY,
    eval_limit: int = T.EVAL_LIMIT,
    eval_max_new_tokens: int = T.EVAL_MAX_NEW_TOKENS,
    trust_remote_code: bool = T.TRUST_REMOTE_CODE,
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Stage 2 (instruction tuning): train every parameter (lr 1e-5) on instruction conversations."""
    T.run(ctx)
