from pathlib import Path

import typer

from ovkit.commands._common import CONFIG, ON_ERROR, OUT, OVERWRITE, QUIET, SEED, SHARD, done, resolve, skipped


def pack(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="Sample table to pack (a parquet file or a directory of shards)."),
    model: Path = typer.Option(None, "--model", help="Model directory whose processor measures each sample."),
    max_len: int = typer.Option(8192, "--max-len", help="Pack capacity L in tokens; longer samples go to rejects."),
    out: Path = OUT,
    shard: str = SHARD,
    workers: int = typer.Option(1, "--workers", help="Processes measuring lengths."),
    exact_lengths: bool = typer.Option(
        False, "--exact-lengths", help="Encode every image with the processor instead of counting from image sizes."
    ),
    cache: Path = typer.Option(None, "--cache", help="Lengths cache directory (default $OVKIT_CACHE or ~/.cache/ovkit)."),
    baseline_batch: int = typer.Option(8, "--baseline-batch", help="B of the 'pad to longest in random batches' baseline."),
    on_error: str = ON_ERROR,
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Measure every sample with the model's processor and pack them globally (best-fit-decreasing) into a plan."""
    from ovkit.pack.plan import PackConfig, build_plan
    from ovkit.runs import Stage

    cfg = resolve(ctx, PackConfig)
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
