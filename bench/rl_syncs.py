"""Device-to-host syncs of the RL learner's step (#25, #26), counted on CPU by ovkit.runtime.syncs.SyncCounter.

What is counted: everything `ovkit.rl.update.train_step` does on the training thread (trajectories -> advantages ->
proximal log-probs -> corrections -> decoupled-PPO micro-batches, backward, clipping, optimiser step(s) -> metrics),
one count per rl-train step. Generation is left out: with the HF engine it runs on the same thread between
optimiser steps (and its reads are the sampler's, not the learner's), so the counter is entered around each
train_step call only. Synchronous rollouts (--max-staleness 0) make the steps' groups depend on the seed alone.

    PYTHONPATH=src python bench/rl_syncs.py                 # the tiny default, 4 prompts x group 4 and 8
    PYTHONPATH=src python bench/rl_syncs.py --where         # and where the syncs of the last step come from
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def prepare(work: Path) -> None:
    def ovkit(*args):
        subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)

    if not (work / "D" / "ovkit.json").is_file():
        ovkit("synth", "--out", work / "D", "--scale", "0.25", "--seed", "0")
    if not (work / "M" / "ovkit.json").is_file():
        ovkit("init-model", "--preset", "tiny", "--corpus", work / "D", "--out", work / "M")


def learner_syncs(cfg) -> tuple[list[int], list]:
    """Syncs of each train_step of an rl-train run, and where each step's came from."""
    from ovkit.rl import loop
    from ovkit.runtime.syncs import SyncCounter

    counts, where = [], []
    step = loop.train_step

    def counted(*a, **k):
        with SyncCounter() as syncs:
            out = step(*a, **k)
        counts.append(syncs.total)
        where.append(syncs.where)
        return out

    loop.train_step = counted
    try:
        loop.train_rl(cfg)
    finally:
        loop.train_step = step
    return counts, where


def rl_config(work: Path, out: str, group_size: int, **kw):
    from ovkit.rl.config import RLTrainConfig

    base = dict(data=[work / "D" / "rl"], model=work / "M", out=work / out, prompts_per_step=4, group_size=group_size, max_new_tokens=16,
                max_steps=4, reward_workers=1, max_staleness=0, overwrite=True, quiet=True, seed=0)  # fmt: skip
    return RLTrainConfig(**{**base, **kw})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, help="keep inputs here")
    p.add_argument("--where", action="store_true", help="print where the last step's syncs come from")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare(work)
        result = {}
        for group in (4, 8):
            counts, where = learner_syncs(rl_config(work, f"rl-g{group}", group))
            result[f"syncs_per_learner_step_4x{group}"] = counts
            if args.where:
                result[f"where_4x{group}"] = dict(where[-1].most_common())
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
