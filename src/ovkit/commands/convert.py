import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage


@stage(
    "ovkit.data.convert:ConvertConfig",
    required=("input", "out"),
    example="ovkit convert runs/tiny/data@instruct --to trl --out data/instruct-trl",
)
def convert(ctx: typer.Context) -> None:
    """Convert LLaVA / ShareGPT / LLaVA-OneVision / LLaVA-OV-1.5 / ROLL-verl / TRL data into the sample table, or the
    sample table into TRL's format."""
    from ovkit.data.convert import convert as run_convert
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    stage = Stage("convert", cfg, cfg.out_dir, inputs=[cfg.input], overwrite=cfg.overwrite)
    if stage.skipped:
        return skipped(cfg.out_dir)
    with stage:
        stage.metrics.update(run_convert(cfg, stage.path))
    m = stage.metrics
    done(
        f"convert: {m['format']}{' (detected)' if m['detected'] else ''}{' -> trl' if m['to'] == 'trl' else ''}: "
        f"{m['rows_in']} records -> {m['rows_out']} rows"
        f" in {m['files']} file(s) + {m['rejects']} rejects -> {cfg.out_dir}"
    )
    dropped(
        "convert",
        "rejected",
        {f"bad in {field or 'the record'}": n for field, n in m["reject_fields"].items()},
        f"listed with their reason in {cfg.out_dir}/rejects.parquet",
    )
