"""`ovkit synth`: render the embedded synthetic corpus (the data of the CPU pipeline)."""

from __future__ import annotations

import typer

from ovkit.commands._common import done, resolve, skipped, stage


@stage("ovkit.data.synth:SynthConfig", required=("out",), example="ovkit synth --out runs/tiny/data")
def synth(ctx: typer.Context) -> None:
    """Render the embedded synthetic corpus: pretrain, instruct, rl, val (for tuning) and eval (held out) splits, and
    concepts.txt."""
    from ovkit.data.synth import build_corpus
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    stage = Stage("synth", cfg, cfg.out, overwrite=cfg.overwrite, seed=cfg.seed)
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.metrics.update(build_corpus(cfg, stage.path))
    splits = ", ".join(f"{name} {n}" for name, n in stage.metrics["splits"].items())
    done(f"synth: {stage.metrics['rows']} rows ({splits}) in {stage.metrics['seconds']}s -> {cfg.out}")
