from pathlib import Path

import typer

from ovkit.commands._common import CONFIG, ON_ERROR, OUT, OVERWRITE, QUIET, SEED, SHARD, done, resolve, skipped


def balance(
    ctx: typer.Context,
    data: Path = typer.Argument(None, help="Sample table (parquet file or directory of shards)."),
    concepts: Path = typer.Option(None, "--concepts", help="Concept vocabulary: a text file, one concept per line."),
    out: Path = OUT,
    method: str = typer.Option("embed", "--method", help="embed (top-K by encoder similarity), text (concepts in captions) or metaclip."),
    encoder: Path = typer.Option(None, "--encoder", help="CLIP / SigLIP / MetaCLIP directory for --method embed."),
    top_k: int = typer.Option(3, "--top-k", help="Concepts per image (embed)."),
    combine: str = typer.Option("mean", "--combine", help="How an image's per-concept inverse frequencies combine: mean, max or sum."),
    target: int = typer.Option(None, "--target", help="Rows after resampling (default: as many as the input)."),
    threshold: float = typer.Option(20.0, "--threshold", help="MetaCLIP t: keep a concept's matches with probability min(1, t/count)."),
    concept_template: str = typer.Option("{}", "--concept-template", help="Text embedded per concept, e.g. 'a photo of {}.'"),
    chunk: int = typer.Option(65536, "--chunk", help="Concepts per similarity chunk (memory = batch x chunk)."),
    batch_size: int = typer.Option(64, "--batch-size", help="Images per encoder batch."),
    phase: str = typer.Option("all", "--phase", help="all, or for sharded runs: assign (per shard), then --merge, then sample (per shard)."),
    merge: list[Path] = typer.Option(None, "--merge", help="Assignment outputs (of --phase assign) to reduce into a plan."),
    plan: Path = typer.Option(None, "--plan", help="The output of --merge, for --phase sample."),
    shard: str = SHARD,
    on_error: str = ON_ERROR,
    device: str = typer.Option("cpu", "--device", help="Device for the encoder (cpu, cuda)."),
    seed: int = SEED,
    overwrite: bool = OVERWRITE,
    quiet: bool = QUIET,
    config: Path = CONFIG,
) -> None:
    """Concept-balanced resampling: top-K concepts per image, inverse-frequency weights, a resampled dataset and a report."""
    from ovkit.balance.run import BalanceConfig, run
    from ovkit.data import parse_shard, shard_out
    from ovkit.runs import Stage

    cfg = resolve(ctx, BalanceConfig)
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
    done(f"balance ({cfg.method}, phase {'merge' if cfg.merge else cfg.phase}): {m.get('rows_in', m.get('rows'))} rows in, {m.get('rows_out', '-')} out{extra} -> {stage.out}")
