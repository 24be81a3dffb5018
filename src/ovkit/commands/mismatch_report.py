"""`ovkit mismatch-report`: recompute the learner's log-probs of rollouts and report the sampler/learner gap."""

from __future__ import annotations

import typer

from ovkit.commands._common import done, resolve, skipped, stage


@stage(
    "ovkit.mismatch.run:MismatchConfig",
    required=("model", "out"),
    example="ovkit mismatch-report --model runs/tiny/models/sft --generate runs/tiny/data/rl --limit 4 --n 4 "
    "--max-new-tokens 32 --sampler fp32 --sampler bf16 --sampler int8 --out runs/tiny/mismatch-demo",
)
def mismatch_report(ctx: typer.Context) -> None:
    """Recompute the learner's log-probs of saved (or freshly sampled) rollouts and report the sampler/learner
    mismatch: vllm-kl (K3), k1, PPLs, chi-square, max/mean |dp|, importance weights, what each rl-train correction
    would clip or mask, and where the gap sits (sampler probability, turn, length, category, source)."""
    from ovkit.mismatch import run_mismatch
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    inputs = [p for p in (cfg.rollouts, cfg.generate, cfg.data) if p is not None]
    stage = Stage(
        "mismatch-report", cfg, cfg.out, inputs=inputs, overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model
    )
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.metrics.update(run_mismatch(cfg, stage.path))
    runs = ", ".join(f"{name} {m['k3_kl']:.3e}" for name, m in stage.metrics.items())
    tokens = sum(m["tokens"] for m in stage.metrics.values())
    done(f"mismatch-report: vllm-kl (K3) {runs} over {tokens:,} tokens -> {cfg.out}/report.html")
