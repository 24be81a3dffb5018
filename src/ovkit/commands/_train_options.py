"""Options shared by `ovkit align`, `ovkit midtrain` and `ovkit sft` (declared once so the three spell them alike),
and the one function the three commands call. Defaults live in ovkit.train.config.TrainConfig only."""

from __future__ import annotations

import typer

# Re-exported: the three supervised commands read every shared option from this module.
from ovkit.commands._common import (  # noqa: F401
    ACTIVATION_CHECKPOINTING,
    ATTN_IMPLEMENTATION,
    CHECKPOINTS,
    COMPILE,
    EVAL_DATA,
    EVAL_EVERY,
    EVAL_LIMIT,
    EVAL_MAX_NEW_TOKENS,
    GRADIENT_CHECKPOINTING,
    IO,
    KERNELS,
    LOAD_IN_4BIT,
    LORA_ALPHA,
    LORA_DROPOUT,
    LORA_R,
    LORA_TARGETS,
    OPTIM,
    PRECISION,
    RUNTIME,
    USE_LIGER_KERNEL,
    done,
    resolve,
    skipped,
)
from ovkit.config import check_inputs

OPTIMISER = "Optimiser & schedule"
BATCHING = "Batches & length"

DATA = typer.Argument(
    None,
    help="Sample table(s) (parquet file or directory of shards), read as one; the last assistant turn is the target.",
    show_default=False,
)
MODEL = typer.Option(
    None,
    "--model",
    help="Model directory to start from (save_pretrained layout, e.g. from `ovkit init-model` or the previous stage).",
    rich_help_panel=IO,
)
PLAN = typer.Option(
    None,
    "--plan",
    help="Pack plan of DATA (`ovkit pack`): train on packed rows instead of length-bucketed padded batches.",
    rich_help_panel=IO,
)
TRAINABLE = typer.Option(
    None,
    "--trainable",
    help="Group (projector, vision, llm, all) or parameter-name regex to train; repeat for several. Default: the stage's preset.",
    rich_help_panel=OPTIMISER,
)
FREEZE_VISION = typer.Option(
    None,
    "--freeze-vision",
    help="Keep the vision encoder frozen whatever --trainable selects.",
    rich_help_panel=OPTIMISER,
)
LR = typer.Option(
    None,
    "--lr",
    "--learning-rate",
    help="Peak learning rate. Default: the stage's preset (align 1e-4, midtrain 1e-5, sft 1e-5). Also --learning-rate (HF/TRL).",
    rich_help_panel=OPTIMISER,
)
VISION_LR = typer.Option(
    None,
    "--vision-lr",
    help="Peak learning rate of the vision encoder (LLaVA-OneVision's mm_vision_tower_lr). Default: --lr.",
    rich_help_panel=OPTIMISER,
)
MIN_LR = typer.Option(
    None, "--min-lr", help="Learning rate at the end of the cosine schedule.", rich_help_panel=OPTIMISER
)
WARMUP_RATIO = typer.Option(
    None, "--warmup-ratio", help="Fraction of the steps with linear warmup from 0.", rich_help_panel=OPTIMISER
)
WEIGHT_DECAY = typer.Option(
    None,
    "--weight-decay",
    help="AdamW weight decay on weight matrices. Default: the stage's preset (midtrain 0.01, else 0).",
    rich_help_panel=OPTIMISER,
)
MAX_GRAD_NORM = typer.Option(
    None, "--max-grad-norm", help="Clip the global gradient norm to this (0: no clipping).", rich_help_panel=OPTIMISER
)
BATCH_SIZE = typer.Option(
    None,
    "--batch-size",
    "--per-device-train-batch-size",
    help="Samples (or packed rows with --plan) per micro-batch per process. Also --per-device-train-batch-size (HF/TRL).",
    rich_help_panel=BATCHING,
)
GRAD_ACCUM = typer.Option(
    None,
    "--grad-accum",
    "--gradient-accumulation-steps",
    help="Micro-batches per optimiser step; global batch = batch size x this x processes. Also --gradient-accumulation-steps (HF/TRL).",
    rich_help_panel=BATCHING,
)
MAX_STEPS = typer.Option(
    None, "--max-steps", help="Optimiser steps to run (instead of --epochs).", rich_help_panel=BATCHING
)
EPOCHS = typer.Option(
    None,
    "--epochs",
    "--num-train-epochs",
    help="Passes over the data (default 1 when --max-steps is not given). Also --num-train-epochs (HF/TRL).",
    rich_help_panel=BATCHING,
)
MAX_LEN = typer.Option(
    None, "--max-len", help="Skip samples longer than this many tokens (text + image tokens).", rich_help_panel=BATCHING
)
SAVE_EVERY = typer.Option(
    None,
    "--save-every",
    help="Write a resumable checkpoint every N steps into OUT.partial/checkpoints (0: only the final model).",
    rich_help_panel=CHECKPOINTS,
)
KEEP_CHECKPOINTS = typer.Option(
    None, "--keep-checkpoints", help="Keep the newest N intermediate checkpoints.", rich_help_panel=CHECKPOINTS
)
RESUME = typer.Option(
    None,
    "--resume",
    help="Continue the unfinished run in OUT.partial/ from its last checkpoint (starts fresh if there is none).",
    rich_help_panel=CHECKPOINTS,
)
REPORT_TO = typer.Option(
    None,
    "--report-to",
    help="Experiment tracker through accelerate: tensorboard, wandb, mlflow or trackio; repeatable (metrics.jsonl is always written).",
    rich_help_panel=CHECKPOINTS,
)
TRUST_REMOTE_CODE = typer.Option(
    None,
    "--trust-remote-code",
    help="Allow model code from the model directory (e.g. LLaVA-OneVision-1.5).",
    rich_help_panel=RUNTIME,
)

REQUIRED = ("data", "model", "out")


def run(ctx: typer.Context) -> None:
    """Resolve the stage's config, train, and print the one-line summary."""
    cfg = resolve(ctx)  # before the loop's import (torch): an input error appears at once (#29)
    check_inputs(cfg)
    from ovkit.train import train

    result = train(cfg)
    if result.status == "skipped":
        return skipped(cfg.out)
    if result.status == "done":
        m = result.metrics
        done(
            f"{cfg.stage}: {m['steps']} steps, loss {m['first_loss']:.4f} -> {m['final_loss']:.4f}, "
            f"{m['trainable_params']:,}/{m['total_params']:,} params trained, {m['elapsed_s']:.0f}s -> {cfg.out}"
        )
