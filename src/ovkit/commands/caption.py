from pathlib import Path

import typer

from ovkit.commands._common import ATTN_IMPLEMENTATION, PRECISION, CONFIG, ON_ERROR, OUT, OVERWRITE, QUIET, SEED, SHARD, done, resolve, skipped


def caption(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="Sample table to recaption (parquet file or directory of shards)."),
    model: Path = typer.Option(None, "--model", help="Captioner: any VLM directory (save_pretrained) or hub id."),
    out: Path = OUT,
    lang: str = typer.Option("en,zh", "--lang", help="Caption languages; each image gets one, drawn by --lang-ratio."),
    lang_ratio: str = typer.Option(None, "--lang-ratio", help="Shares of the --lang languages, e.g. 0.75,0.25 (default for en,zh; else equal)."),
    prompt: list[str] = typer.Option(None, "--prompt", help="LANG=TEXT: the prompt of a language (repeatable; en and zh have defaults)."),
    engine: str = typer.Option("hf", "--engine", help="hf (transformers, any device) or vllm (GPU)."),
    batch_size: int = typer.Option(32, "--batch-size", help="Sequences per generate call, hf engine."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Tokens per caption."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (with --temperature > 0)."),
    min_chars: int = typer.Option(50, "--min-chars", help="Filter: captions shorter than this are rejected."),
    max_chars: int = typer.Option(3500, "--max-chars", help="Filter: captions longer than this are rejected."),
    repeat_limit: int = typer.Option(8, "--repeat-limit", help="Filter: this many identical consecutive words reject a caption."),
    keep_original_on_reject: bool = typer.Option(False, "--keep-original-on-reject", help="A rejected recaption keeps its row with the original caption instead of moving it to rejects."),
    replace_if_better: bool = typer.Option(True, "--replace-if-better/--no-replace-if-better", help="With a `concepts` column: replace the targets only if recaption concept recall >= the originals'."),
    chunk_rows: int = typer.Option(256, "--chunk-rows", help="Rows per saved chunk of generations (a rerun resumes after the last one)."),
    shard: str = SHARD,
    on_error: str = ON_ERROR,
    precision: str = PRECISION,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Allow model code from the model directory / hub."),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Recaption every image with a VLM: one caption per image in a language drawn per row, the released caption filter, originals kept beside."""
    from ovkit.caption.run import CaptionConfig, remove_work, run, work_dir
    from ovkit.data import parse_shard, shard_out
    from ovkit.runs import Stage

    cfg = resolve(ctx, CaptionConfig)
    part = parse_shard(cfg.shard)
    stage = Stage("caption", cfg, shard_out(cfg.out, part), inputs=[cfg.data, cfg.model], overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model)
    if stage.skipped:
        return skipped(stage.out)
    work = work_dir(stage.out)
    with stage:
        stage.metrics.update(run(cfg, stage.path, part, work=work))
    remove_work(work)
    m = stage.metrics
    recall = m["concept_recall"]
    measured = f", concept recall {recall['recaption']} vs {recall['original']} (original)" if recall["recaption"] is not None and recall["original"] is not None else ""
    done(
        f"caption: {m['rows_in']} rows in, {m['rows_out']} out, {m['rejects']} rejected; filter pass rate {m['pass_rate']}, "
        f"mean length {m['mean_chars']['recaption']} chars (original {m['mean_chars']['original']}){measured}; {m['decision']} -> {stage.out}"
    )
