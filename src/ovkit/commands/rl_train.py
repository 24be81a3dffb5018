"""`ovkit rl-train`: GRPO with decoupled PPO, bounded-staleness asynchronous rollouts and mismatch corrections."""

from __future__ import annotations

import typer

from ovkit.commands._common import done, resolve, skipped, stage
from ovkit.config import check_inputs


@stage(
    "ovkit.rl.config:RLTrainConfig",
    required=("data", "model", "out"),
    example="ovkit rl-train runs/tiny/rl-data/stage1 --model runs/tiny/models/sft --out runs/tiny/models/rl1 "
    "--config examples/tiny/rl-stage1.yaml",
)
def rl_train(ctx: typer.Context) -> None:
    """GRPO on verifiable rewards (LLaVA-OneVision-1.5-RL): decoupled PPO, async rollouts with bounded staleness,
    sampler/learner mismatch corrections. Stage 1 answer-only, stage 2 chain-of-thought."""
    from ovkit.launch import processes

    cfg = resolve(ctx)  # before the loop's import (torch): an input error appears at once
    check_inputs(cfg)
    from ovkit.rl.loop import train_rl
    from ovkit.runtime.log import held_out_note

    m = train_rl(cfg)
    if m is None:
        return skipped(cfg.out)
    if processes()[0] != 0:  # under a launcher: the main process, which wrote OUT, prints the one summary line
        return
    reward = " -> ".join("-" if r is None else f"{r:.3f}" for r in (m["first_reward"], m["final_reward"]))
    done(
        f"rl-train stage {cfg.stage}: {m['steps']} steps, reward {reward}, "
        f"{m['samples_per_s']:.1f} samples/s, max staleness {m['max_staleness_seen']}, {m['elapsed_s']:.0f}s -> "
        f"{cfg.out}" + held_out_note(m)
    )
    from ovkit.rl.metrics import cut_or_masked

    line = cut_or_masked(cfg.out / "metrics.jsonl", cfg.max_new_tokens)
    if line:  # what the run cut or masked (#34): one line after the summary, none when nothing was
        done(f"rl-train: {line}")
