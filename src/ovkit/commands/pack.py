from pathlib import Path

import typer

from ovkit.commands._common import (
    CONFIG,
    IO,
    ON_ERROR,
    OUT,
    OVERWRITE,
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


PACKING = "Packing"


@stage(
    "ovkit.pack.plan:PackConfig",
    required=("data", "model", "out"),
    example="ovkit pack runs/tiny/data/pretrain-balanced --model runs/tiny/models/stage0 --max-len 1024 --out runs/tiny/plans/pretrain --cache runs/tiny/cache",
)
def pack(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="Sample table to pack (a parquet file or a directory of shards)."),
    model: Path = _O(None, "--model", help="Model directory whose processor measures each sample.", rich_help_panel=IO),
    max_len: int = _O(
        None, "--max-len", help="Pack capacity L in tokens; longer samples go to rejects.", rich_help_panel=PACKING
    ),
    out: Path = OUT,
    workers: int = _O(None, "--workers", help="Processes measuring lengths.", rich_help_panel=RUNTIME),
    exact_lengths: bool = _O(
        None,
        "--exact-lengths",
        help="Encode every image with the processor instead of counting from image sizes.",
        rich_help_panel=PACKING,
    ),
    cache: Path = _O(
        None, "--cache", help="Lengths cache directory (default $OVKIT_CACHE or ~/.cache/ovkit).", rich_help_panel=IO
    ),
    baseline_batch: int = _O(
        None, "--baseline-batch", help="B of the 'pad to longest in random batches' baseline.", rich_help_panel=PACKING
    ),
    shard: str = SHARD,
    on_error: str = ON_ERROR,
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Measure every sample with the model's processor and pack them globally (best-fit-decreasing) into a plan."""
    from ovkit.pack.plan import build_plan
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    stage = Stage("pack", cfg, cfg.target, inputs=[cfg.data, cfg.model], overwrite=cfg.overwrite, seed=cfg.seed)
    if stage.skipped:
        return skipped(cfg.target)
    with stage:
        stats = build_plan(cfg, stage.path)
        stage.metrics.update({k: stats[k] for k in ("samples", "packs", "lower_bound", "efficiency", "tokens")})
    rejected = sum(stats["rejects"].values())
    done(
        f"pack: {stats['samples']} samples -> {stats['packs']} packs of {cfg.max_len} (lower bound {stats['lower_bound']}, "
        f"efficiency {stats['efficiency'] or 0:.4f}, {rejected} rejected) -> {cfg.target}"
    )
