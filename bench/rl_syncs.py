"""Device-to-host syncs of the RL learner's step (each stalls a GPU's queue), counted on CPU by SyncCounter
(bench/_syncs.py).

What is counted, one count per rl-train step: everything `ovkit.rl.update.train_step` does on the training thread
(`step`: trajectories -> advantages -> micro-batch plans -> proximal log-probs -> corrections -> decoupled-PPO
micro-batches, backward, clipping, optimiser step(s) -> metrics), and its device side alone (`learner`:
`ovkit.rl.update.learn`, from the move of the step's tensors to the device to the metrics read). The host side
(`prepare_step`) takes the model's config, never the model: its reads are of host tensors, which on a GPU cost no
stall, but the CPU proxy cannot tell them apart. Generation is left out: with the HF engine it runs on the same
thread between optimiser steps (and its reads are the sampler's, not the learner's), so the counter is entered
around each call only. Synchronous rollouts (--max-staleness 0) make the steps' groups depend on the seed alone.

    PYTHONPATH=src python bench/rl_syncs.py                 # the tiny default, 4 prompts x group 4 and 8
    PYTHONPATH=src python bench/rl_syncs.py --where         # and where the syncs of the last step come from
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _result  # noqa: E402
from _workers import tiny_default  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def learner_syncs(cfg, part: str = "step") -> tuple[list[int], list]:
    """Syncs of each train_step (`part` "step") or of its device side ("learner") in an rl-train run, and where each
    step's came from."""
    from _syncs import SyncCounter

    from ovkit.rl import loop, update

    counts, where = [], []
    owner, name = (loop, "train_step") if part == "step" else (update, "learn")
    original = getattr(owner, name, None)
    if original is None:  # a checkout from before the host/device split: the whole step
        owner, name = loop, "train_step"
        original = getattr(owner, name)

    def counted(*a, **k):
        with SyncCounter() as syncs:
            out = original(*a, **k)
        counts.append(syncs.total)
        where.append(syncs.where)
        return out

    setattr(owner, name, counted)
    try:
        loop.train_rl(cfg)
    finally:
        setattr(owner, name, original)
    return counts, where


def rl_config(work: Path, out: str, group_size: int, **kw):
    from ovkit.rl.config import RLTrainConfig

    base = dict(
        data=[work / "D" / "rl"],
        model=work / "M",
        out=work / out,
        prompts_per_step=4,
        group_size=group_size,
        max_new_tokens=16,
        max_steps=4,
        reward_workers=1,
        max_staleness=0,
        overwrite=True,
        quiet=True,
        seed=0,
    )
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
        tiny_default(work, "D", "M")
        result = {}
        for group in (4, 8):
            for part in ("step", "learner"):
                counts, where = learner_syncs(rl_config(work, f"rl-g{group}", group), part)
                result[f"syncs_per_{part}_4x{group}"] = counts
                if args.where:
                    result[f"where_{part}_4x{group}"] = dict(where[-1].most_common())
        # one micro-batch per step whatever the batch: the learner's count no longer depends on the batch
        for group in (4, 8):
            result[f"syncs_per_learner_4x{group}_one_micro_batch"] = learner_syncs(
                rl_config(work, f"rl-g{group}", group, micro_batch_size=4 * group), "learner"
            )[0]
        if args.where:
            print(json.dumps({k: v for k, v in result.items() if k.startswith("where")}, indent=2))
        _result.table(
            "rl_syncs",
            "device-to-host syncs of rl-train's step, one count per step (4 prompts x group)",
            [
                {"count": k.removeprefix("syncs_per_"), "per step": v}
                for k, v in result.items()
                if k.startswith("syncs")
            ],
        )


if __name__ == "__main__":
    main()
