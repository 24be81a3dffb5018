"""`ovkit align | midtrain | sft`: the three supervised stages of the recipe, one definition. Their options are the
fields of ovkit.train.config.TrainConfig; the stage (AlignConfig, MidtrainConfig, SFTConfig) picks the presets."""

from __future__ import annotations

import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage
from ovkit.config import check_inputs

REQUIRED = ("data", "model", "out")


@stage(
    "ovkit.train.config:AlignConfig",
    required=REQUIRED,
    example="ovkit align runs/tiny/data/pretrain-balanced --plan runs/tiny/plans/pretrain --model "
    "runs/tiny/models/stage0 --out runs/tiny/models/align --config examples/tiny/align.yaml",
)
def align(ctx: typer.Context) -> None:
    """Stage 1 (alignment): train the projector only (lr 1e-4, no weight decay) on caption data."""
    run(ctx)


@stage(
    "ovkit.train.config:MidtrainConfig",
    required=REQUIRED,
    example="ovkit midtrain runs/tiny/data/pretrain-balanced --plan runs/tiny/plans/pretrain --model "
    "runs/tiny/models/align --out runs/tiny/models/midtrain --config examples/tiny/midtrain.yaml",
)
def midtrain(ctx: typer.Context) -> None:
    """Stage 1.5 (mid-training): train LLM, projector and vision encoder (lr 1e-5, weight decay 0.01)."""
    run(ctx)


@stage(
    "ovkit.train.config:SFTConfig",
    required=REQUIRED,
    example="ovkit sft runs/tiny/data/instruct --model runs/tiny/models/midtrain --out runs/tiny/models/sft "
    "--config examples/tiny/sft.yaml",
)
def sft(ctx: typer.Context) -> None:
    """Stage 2 (instruction tuning): train every parameter (lr 1e-5) on instruction conversations."""
    run(ctx)


def run(ctx: typer.Context) -> None:
    """Resolve the stage's config, train, and print the one-line summary."""
    cfg = resolve(ctx)  # before the loop's import (torch): an input error appears at once
    check_inputs(cfg)
    from ovkit.runtime.log import held_out_note
    from ovkit.train import train

    result = train(cfg)
    if result.status == "skipped":
        return skipped(cfg.out)
    if result.status == "done":
        m = result.metrics
        done(
            f"{cfg.stage}: {m['steps']} steps, loss {m['first_loss']:.4f} -> {m['final_loss']:.4f}, "
            f"{m['trainable_params']:,}/{m['total_params']:,} params trained, {m['elapsed_s']:.0f}s -> {cfg.out}"
            + held_out_note(m)
        )
        dropped(
            cfg.stage,
            "skipped",
            {f"sample(s) longer than --max-len {cfg.max_len} tokens": m.get("skipped_too_long", 0)},
            f"not trained on; counted in {cfg.out}/ovkit.json (metrics.skipped_too_long); a larger --max-len keeps "
            f"them",
        )
