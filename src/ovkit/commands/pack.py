import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage


@stage(
    "ovkit.pack.plan:PackConfig",
    required=("data", "model", "out"),
    example="ovkit pack runs/tiny/data/pretrain-balanced --model runs/tiny/models/stage0 --max-len 1024 --out "
    "runs/tiny/plans/pretrain --cache runs/tiny/cache",
)
def pack(ctx: typer.Context) -> None:
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
        f"pack: {stats['samples']} samples -> {stats['packs']} packs of {cfg.max_len} (lower bound "
        f"{stats['lower_bound']}, "
        f"efficiency {stats['efficiency'] or 0:.4f}, {rejected} rejected) -> {cfg.target}"
    )
    reasons = {
        "invalid_row": "invalid rows (--on-error skip)",
        "unencodable": "the processor could not encode",
        "longer_than_max_len": f"longer than --max-len {cfg.max_len} tokens",
    }
    dropped(
        "pack",
        "left out of the plan",
        {reasons.get(why, why): n for why, n in stats["rejects"].items()},
        f"listed with their reason in {cfg.target}/rejects.parquet",
    )
