import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage


@stage(
    "ovkit.balance.run:BalanceConfig",
    required=("concepts", "out"),
    example="ovkit balance runs/tiny/data/pretrain --concepts runs/tiny/data/concepts.txt --encoder "
    'runs/tiny/models/clip --concept-template "a {}" --top-k 2 --out runs/tiny/data/pretrain-balanced',
)
def balance(ctx: typer.Context) -> None:
    """Concept-balanced resampling: top-K concepts per image, inverse-frequency weights, a resampled dataset and a
    report."""
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
        f"balance ({cfg.method}, phase {'merge' if cfg.merge else cfg.phase}): {m.get('rows_in', m.get('rows'))} "
        f"rows in, {m.get('rows_out', '-')} out{extra} -> {stage.out}"
    )
    where = [f"invalid rows are listed with their reason in {stage.out}/rejects.parquet"] if m.get("rejects") else []
    if m.get("unmatched_rows"):
        where.append(
            f"rows that match no concept have weight 0 in {stage.out}/plan.parquet (report.json: unmatched_rows)"
        )
    dropped(
        "balance",
        "dropped",
        {
            "invalid rows (--on-error skip)": m.get("rejects", 0),
            "rows that match no concept": m.get("unmatched_rows", 0),
        },
        "; ".join(where),
    )
