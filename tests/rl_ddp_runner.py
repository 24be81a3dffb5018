"""Run by tests/test_rl_train.py under torchrun (not a test module): rl-train with a scripted policy, so the groups
of a step are the same whatever the number of processes (tests/scripted_policy.py).

    torchrun --nproc_per_node N tests/rl_ddp_runner.py MODEL DATA OUT [--resume] [--plain] [--sft-data SFT]

--plain: the learner forwards one row per trajectory (--shared-prefix off).
--sft-data SFT: the SFT mix at coefficient 0.5, 4 rows per step (tests/test_rl_sft_mix.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scripted_policy import ScriptedEngine  # noqa: E402


def answer(turn: int, k: int, prompt) -> str:
    """Sample k of a group answers k % 4 + 1: each group holds right and wrong answers (counts are 1 to 4). Lengths
    vary with the image, so the processes of a step hold different token counts (the loss normalisation matters)."""
    extra = int(float(prompt.mm["pixel_values"].abs().sum()) * 1000) % 3 + k % 2
    return f"<answer>{k % 4 + 1}</answer>" + " ok" * extra


def main() -> None:
    import torch

    from ovkit.rl import loop
    from ovkit.rl.config import RLTrainConfig

    torch.set_num_threads(1)
    model, data, out = (Path(a) for a in sys.argv[1:4])
    loop.make_sampler = lambda cfg, m, processor: ScriptedEngine(m, processor, answer)
    sft = sys.argv[sys.argv.index("--sft-data") + 1] if "--sft-data" in sys.argv else None
    mix = dict(sft_data=[sft], sft_coef=0.5, sft_rows_per_step=4) if sft else {}
    cfg = RLTrainConfig(
        data=[data],
        model=model,
        out=out,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=12,
        lr=1e-2,
        warmup_ratio=0.0,
        weight_decay=0.0,
        system_prompt=False,
        max_staleness=0,
        micro_batch_size=3,
        reward_workers=1,
        max_steps=2,
        save_every=1,
        keep_checkpoints=2,
        quiet=True,
        precision="fp32",
        resume="--resume" in sys.argv,
        shared_prefix="off" if "--plain" in sys.argv else "on",
        save_rollouts=True,
        **mix,
    )
    loop.train_rl(cfg)


if __name__ == "__main__":
    main()
