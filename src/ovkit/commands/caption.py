import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage


@stage(
    "ovkit.caption.run:CaptionConfig",
    required=("data", "model", "out"),
    example="ovkit caption runs/tiny/data/pretrain-balanced --model runs/tiny/models/stage0 --shard 0/8 --out "
    "runs/tiny/data/pretrain-captioned --config examples/tiny/caption.yaml",
)
def caption(ctx: typer.Context) -> None:
    """Recaption every image with a VLM: one caption per image in a language drawn per row, the released caption filter,
    originals kept beside."""
    from ovkit.caption.run import check_work, remove_work, run, work_dir
    from ovkit.data import parse_shard, shard_out
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    part = parse_shard(cfg.shard)
    stage = Stage(
        "caption",
        cfg,
        shard_out(cfg.out, part),
        inputs=[cfg.data, cfg.model],
        overwrite=cfg.overwrite,
        seed=cfg.seed,
        parent=cfg.model,
    )
    if stage.skipped:
        return skipped(stage.out)
    work = work_dir(stage.out)
    check_work(work)  # before the model loads
    with stage:
        stage.metrics.update(run(cfg, stage.path, part, work=work))
    remove_work(work)
    m = stage.metrics
    recall = m["concept_recall"]
    measured = (
        f", concept recall {recall['recaption']} vs {recall['original']} (original)"
        if recall["recaption"] is not None and recall["original"] is not None
        else ""
    )
    done(
        f"caption: {m['rows_in']} rows in, {m['rows_out']} out, {m['rejects']} rejected; filter pass rate "
        f"{m['pass_rate']}, "
        f"mean length {m['mean_chars']['recaption']} chars (original {m['mean_chars']['original']}){measured}; "
        f"{m['decision']} -> {stage.out}"
    )
    dropped(
        "caption",
        "moved to rejects",
        {
            "invalid input rows (--on-error skip)": m["input_rejects"],
            "recaptions that failed the filter": m["rejects"] - m["input_rejects"],
        },
        f"listed with their reason in {stage.out}/rejects.parquet",
    )
