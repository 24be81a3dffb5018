from pathlib import Path

import typer

from ovkit.commands._common import (
    ATTN_IMPLEMENTATION,
    CONFIG,
    IO,
    ON_ERROR,
    OUT,
    OVERWRITE,
    PRECISION,
    QUIET,
    RUN,
    RUNTIME,
    SEED,
    SHARD,
    done,
    resolve,
    skipped,
    stage,
)

_O = typer.Option


CAPTIONING, FILTER = "Captioning", "Caption filter"


@stage(
    "ovkit.caption.run:CaptionConfig",
    required=("data", "model", "out"),
    example="ovkit caption runs/tiny/data/pretrain-balanced --model runs/tiny/models/stage0 --shard 0/8 --out runs/tiny/data/pretrain-captioned --config examples/tiny/caption.yaml",
)
def caption(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="Sample table to recaption (parquet file or directory of shards)."),
    model: Path = _O(
        None, "--model", help="Captioner: any VLM directory (save_pretrained) or hub id.", rich_help_panel=IO
    ),
    out: Path = OUT,
    lang: str = _O(
        None,
        "--lang",
        help="Caption languages; each image gets one, drawn by --lang-ratio.",
        rich_help_panel=CAPTIONING,
    ),
    lang_ratio: str = _O(
        None,
        "--lang-ratio",
        help="Shares of the --lang languages, e.g. 0.75,0.25 (default for en,zh; else equal).",
        rich_help_panel=CAPTIONING,
    ),
    prompt: list[str] = _O(
        None,
        "--prompt",
        help="LANG=TEXT: the prompt of a language (repeatable; en and zh have defaults).",
        rich_help_panel=CAPTIONING,
    ),
    max_new_tokens: int = _O(None, "--max-new-tokens", help="Tokens per caption.", rich_help_panel=CAPTIONING),
    temperature: float = _O(None, "--temperature", help="0 = greedy.", rich_help_panel=CAPTIONING),
    top_p: float = _O(
        None, "--top-p", help="Nucleus sampling mass (with --temperature > 0).", rich_help_panel=CAPTIONING
    ),
    min_chars: int = _O(
        None, "--min-chars", help="Filter: captions shorter than this are rejected.", rich_help_panel=FILTER
    ),
    max_chars: int = _O(
        None, "--max-chars", help="Filter: captions longer than this are rejected.", rich_help_panel=FILTER
    ),
    repeat_limit: int = _O(
        None,
        "--repeat-limit",
        help="Filter: this many identical consecutive words reject a caption.",
        rich_help_panel=FILTER,
    ),
    keep_original_on_reject: bool = _O(
        None,
        "--keep-original-on-reject",
        help="A rejected recaption keeps its row with the original caption instead of moving it to rejects.",
        rich_help_panel=FILTER,
    ),
    replace_if_better: bool = _O(
        None,
        "--replace-if-better/--no-replace-if-better",
        help="With a `concepts` column: replace the targets only if recaption concept recall >= the originals'.",
        rich_help_panel=FILTER,
    ),
    engine: str = _O(None, "--engine", help="hf (transformers, any device) or vllm (GPU).", rich_help_panel=RUNTIME),
    batch_size: int = _O(None, "--batch-size", help="Sequences per generate call, hf engine.", rich_help_panel=RUNTIME),
    precision: str = PRECISION,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    trust_remote_code: bool = _O(
        None, "--trust-remote-code", help="Allow model code from the model directory / hub.", rich_help_panel=RUNTIME
    ),
    chunk_rows: int = _O(
        None,
        "--chunk-rows",
        help="Rows per saved chunk of generations (a rerun resumes after the last one).",
        rich_help_panel=RUN,
    ),
    shard: str = SHARD,
    on_error: str = ON_ERROR,
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Recaption every image with a VLM: one caption per image in a language drawn per row, the released caption filter, originals kept beside."""
    from ovkit.caption.run import remove_work, run, work_dir
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
        f"caption: {m['rows_in']} rows in, {m['rows_out']} out, {m['rejects']} rejected; filter pass rate {m['pass_rate']}, "
        f"mean length {m['mean_chars']['recaption']} chars (original {m['mean_chars']['original']}){measured}; {m['decision']} -> {stage.out}"
    )
