from pathlib import Path

import typer

from ovkit.commands._common import CONFIG, IO, ON_ERROR, OUT, OVERWRITE, QUIET, SHARD, done, resolve, skipped, stage

_O = typer.Option


RECORDS = "Records"


@stage(
    "ovkit.data.convert:ConvertConfig",
    required=("input", "out"),
    example="ovkit convert runs/tiny/data@instruct --to trl --out data/instruct-trl",
)
def convert(
    ctx: typer.Context,
    # text, not Path: Path('./org/name') would lose the './' that keeps a missing local path away from the Hub
    input: str = typer.Argument(
        None,
        help="A JSON / JSON-lines / parquet file, a directory of parquet files, a directory with a dataset card or saved by `datasets` (DIR[:CONFIG]\\[@SPLIT]), or a Hub dataset id (ORG/NAME[:CONFIG]\\[@SPLIT]).",
    ),
    from_format: str = _O(
        None,
        "--from",
        "--from-format",
        help="auto (detect from the keys/columns) | llava | sharegpt | onevision | ov-midtrain | ov-rl | verl (= roll) | trl | ovkit.",
        rich_help_panel=IO,
    ),
    to_format: str = _O(
        None,
        "--to",
        "--to-format",
        help="ovkit (the sample table) | trl (TRL's conversational VLM format: images + messages with content parts).",
        rich_help_panel=IO,
    ),
    out: Path = OUT,
    image_root: Path = _O(
        None,
        "--image-root",
        help="Folder that relative image paths start from (default: the input's folder).",
        rich_help_panel=IO,
    ),
    source: str = _O(
        None,
        "--source",
        help="`source` of rows whose input names none (default: the input's file name).",
        rich_help_panel=RECORDS,
    ),
    caption_prompt: str = _O(
        None, "--caption-prompt", help="ov-midtrain: the user turn after '<image>\\n'.", rich_help_panel=RECORDS
    ),
    rows_per_file: int = _O(None, "--rows-per-file", help="Rows per output part file.", rich_help_panel=RECORDS),
    shard: str = SHARD,
    on_error: str = ON_ERROR,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Convert LLaVA / ShareGPT / LLaVA-OneVision / LLaVA-OV-1.5 / ROLL-verl / TRL data into the sample table, or the sample table into TRL's format."""
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
        f"convert: {m['format']}{' (detected)' if m['detected'] else ''}{' -> trl' if m['to'] == 'trl' else ''}: {m['rows_in']} records -> {m['rows_out']} rows"
        f" in {m['files']} file(s) + {m['rejects']} rejects -> {cfg.out_dir}"
    )
