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


METHOD, SHARDED = "Method", "Sharded runs"


@stage(
    "ovkit.balance.run:BalanceConfig",
    required=("concepts", "out"),
    example='ovkit balance runs/tiny/data/pretrain --concepts runs/tiny/data/concepts.txt --encoder runs/tiny/models/clip --concept-template "a {}" --top-k 2 --out runs/tiny/data/pretrain-balanced',
)
def balance(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="Sample table (parquet file or directory of shards)."),
    concepts: Path = _O(
        None, "--concepts", help="Concept vocabulary: a text file, one concept per line.", rich_help_panel=IO
    ),
    out: Path = OUT,
    method: str = _O(
        None,
        "--method",
        help="embed (top-K by encoder similarity), text (concepts in captions) or metaclip.",
        rich_help_panel=METHOD,
    ),
    encoder: Path = _O(
        None, "--encoder", help="CLIP / SigLIP / MetaCLIP directory for --method embed.", rich_help_panel=IO
    ),
    top_k: int = _O(None, "--top-k", help="Concepts per image (embed).", rich_help_panel=METHOD),
    combine: str = _O(
        None,
        "--combine",
        help="How an image's per-concept inverse frequencies combine: mean, max or sum.",
        rich_help_panel=METHOD,
    ),
    target: int = _O(
        None, "--target", help="Rows after resampling (default: as many as the input).", rich_help_panel=METHOD
    ),
    threshold: float = _O(
        None,
        "--threshold",
        help="MetaCLIP t: keep a concept's matches with probability min(1, t/count).",
        rich_help_panel=METHOD,
    ),
    concept_template: str = _O(
        None, "--concept-template", help="Text embedded per concept, e.g. 'a photo of {}.'", rich_help_panel=METHOD
    ),
    chunk: int = _O(
        None, "--chunk", help="Concepts per similarity chunk (memory = batch x chunk).", rich_help_panel=RUNTIME
    ),
    batch_size: int = _O(None, "--batch-size", help="Images per encoder batch.", rich_help_panel=RUNTIME),
    phase: str = _O(
        None,
        "--phase",
        help="all, or for sharded runs: assign (per shard), then --merge, then sample (per shard).",
        rich_help_panel=SHARDED,
    ),
    merge: list[Path] = _O(
        None, "--merge", help="Assignment outputs (of --phase assign) to reduce into a plan.", rich_help_panel=SHARDED
    ),
    plan: Path = _O(None, "--plan", help="The output of --merge, for --phase sample.", rich_help_panel=SHARDED),
    shard: str = SHARD,
    on_error: str = ON_ERROR,
    device: str = _O(None, "--device", help="Device for the encoder (cpu, cuda).", rich_help_panel=RUNTIME),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Concept-balanced resampling: top-K concepts per image, inverse-frequency weights, a resampled dataset and a report."""
    from ovkit.balance.run import run
    from ovkit.data import parse_shard, shard_out
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    part = parse_shard(cfg.shard)
    inputs = [p for p in [cfg.data, cfg.concepts, cfg.encoder, cfg.plan, *(cfg.merge or [])] if p is not None]
    stage = Stage("balance", cfg, shard_out(cfg.out, part), inputs=inputs, overwrite=cfg.overwrite, seed=cfg.seed)
    if stage.skipped:
        return skipped(stage.out)
    with stage:
        stage.metrics.update(run(cfg, stage.path, part))
    m = stage.metrics
    extra = ""
    if "effective_concepts_after" in m:
        extra = f", effective concepts {m['effective_concepts_before']} -> {m['effective_concepts_after']}"
    if "precision_at_k" in m:
        extra += f", concept precision@k {m['precision_at_k']} (chance {m['chance_precision']})"
    done(
        f"balance ({cfg.method}, phase {'merge' if cfg.merge else cfg.phase}): {m.get('rows_in', m.get('rows'))} rows in, {m.get('rows_out', '-')} out{extra} -> {stage.out}"
    )
