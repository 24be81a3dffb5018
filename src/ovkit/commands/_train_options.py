"""Options shared by `ovkit align`, `ovkit midtrain` and `ovkit sft` (declared once so the three spell them alike),
and the one function the three commands call."""

from __future__ import annotations

import typer

from ovkit.commands._common import ATTN_IMPLEMENTATION, LORA_ALPHA, LORA_DROPOUT, LORA_R, LORA_TARGETS, PRECISION, done, resolve, skipped  # noqa: F401 (re-exported)

DATA = typer.Argument(None, help="Sample table(s) (parquet file or directory of shards), read as one; the last assistant turn is the target.", show_default=False)
MODEL = typer.Option(None, "--model", help="Model directory to start from (save_pretrained layout, e.g. from `ovkit init-model` or the previous stage).")
PLAN = typer.Option(None, "--plan", help="Pack plan of DATA (`ovkit pack`): train on packed rows instead of length-bucketed padded batches.")
TRAINABLE = typer.Option(None, "--trainable", help="Group (projector, vision, llm, all) or parameter-name regex to train; repeat for several. Default: the stage's preset.")
FREEZE_VISION = typer.Option(False, "--freeze-vision", help="Keep the vision encoder frozen whatever --trainable selects.")
LR = typer.Option(None, "--lr", help="Peak learning rate. Default: the stage's preset (align 1e-4, midtrain 1e-5, sft 1e-5).")
VISION_LR = typer.Option(None, "--vision-lr", help="Peak learning rate of the vision encoder (LLaVA-OneVision's mm_vision_tower_lr). Default: --lr.")
MIN_LR = typer.Option(1e-6, "--min-lr", help="Learning rate at the end of the cosine schedule.")
WARMUP_RATIO = typer.Option(0.002, "--warmup-ratio", help="Fraction of the steps with linear warmup from 0.")
WEIGHT_DECAY = typer.Option(None, "--weight-decay", help="AdamW weight decay on weight matrices. Default: the stage's preset (midtrain 0.01, else 0).")
MAX_GRAD_NORM = typer.Option(1.0, "--max-grad-norm", help="Clip the global gradient norm to this (0: no clipping).")
BATCH_SIZE = typer.Option(8, "--batch-size", help="Samples (or packed rows with --plan) per micro-batch per process.")
GRAD_ACCUM = typer.Option(1, "--grad-accum", help="Micro-batches per optimiser step; global batch = batch size x this x processes.")
MAX_STEPS = typer.Option(None, "--max-steps", help="Optimiser steps to run (instead of --epochs).")
EPOCHS = typer.Option(None, "--epochs", help="Passes over the data (default 1 when --max-steps is not given).")
MAX_LEN = typer.Option(8192, "--max-len", help="Skip samples longer than this many tokens (text + image tokens).")
GRADIENT_CHECKPOINTING = typer.Option(False, "--gradient-checkpointing", help="Recompute activations in the backward pass (less memory, slower).")
SAVE_EVERY = typer.Option(0, "--save-every", help="Write a resumable checkpoint every N steps into OUT.partial/checkpoints (0: only the final model).")
KEEP_CHECKPOINTS = typer.Option(2, "--keep-checkpoints", help="Keep the newest N intermediate checkpoints.")
RESUME = typer.Option(False, "--resume", help="Continue the unfinished run in OUT.partial/ from its last checkpoint (starts fresh if there is none).")
REPORT_TO = typer.Option(None, "--report-to", help="Experiment tracker through accelerate: tensorboard, wandb, mlflow or trackio; repeatable (metrics.jsonl is always written).")
TRUST_REMOTE_CODE = typer.Option(False, "--trust-remote-code", help="Allow model code from the model directory (e.g. LLaVA-OneVision-1.5).")


def run(ctx: typer.Context, cls) -> None:
    """Resolve the stage's config, train, and print the one-line summary."""
    from ovkit.train import train

    cfg = resolve(ctx, cls)
    result = train(cfg)
    if result.status == "skipped":
        return skipped(cfg.out)
    if result.status == "done":
        m = result.metrics
        done(
            f"{cfg.stage}: {m['steps']} steps, loss {m['first_loss']:.4f} -> {m['final_loss']:.4f}, "
            f"{m['trainable_params']:,}/{m['total_params']:,} params trained, {m['elapsed_s']:.0f}s -> {cfg.out}"
        )
