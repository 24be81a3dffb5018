"""`ovkit rl-curate`: N rollouts per prompt, pass@1 / pass@N, keep medium-difficulty prompts, split into stages."""

from __future__ import annotations

import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage


@stage(
    "ovkit.rl.curate:CurateConfig",
    required=("data", "model", "out"),
    example="ovkit rl-curate runs/tiny/data/rl --model runs/tiny/models/sft --out runs/tiny/rl-data --n 8 --limit "
    "24 --max-new-tokens 64 --no-system-prompt",
)
def rl_curate(ctx: typer.Context) -> None:
    """Sample N rollouts per RL prompt, score them, keep medium-difficulty prompts and split them into the stage-1
    (answer-only) and stage-2 (thinking) sets, with stats and a difficulty histogram."""
    from ovkit.data import parse_shard, shard_out
    from ovkit.rl.curate import curate
    from ovkit.runs import Stage

    cfg = resolve(ctx)
    part = parse_shard(cfg.shard)
    stage = Stage(
        "rl-curate",
        cfg,
        shard_out(cfg.out, part),
        inputs=[cfg.data],
        overwrite=cfg.overwrite,
        seed=cfg.seed,
        parent=cfg.model,
    )
    if stage.skipped:
        return skipped(stage.out)
    with stage:
        stage.metrics.update(curate(cfg, stage.path, part))
    m = stage.metrics
    done(
        f"rl-curate: {m['prompts']} prompts, pass@1 {m['pass_at_1']:.3f}, pass@{cfg.n} {m['pass_at_n']:.3f}, "
        f"kept {m['kept']} (stage 1: {m['stage1']}, stage 2: {m['stage2']}) -> {stage.out}"
    )
    dropped(
        "rl-curate",
        "left out",
        {f"prompt(s) of excluded category {c}": n for c, n in (m.get("excluded") or {}).items()},
        f"--exclude-category; counted in {stage.out}/stats.json (excluded)",
    )
