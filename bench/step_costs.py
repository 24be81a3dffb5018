"""The CPU proxies of one optimiser step's GPU overheads, measured on this checkout (or another, via PYTHONPATH):

  syncs      device-to-host reads per optimiser step on the training thread (bench/_syncs.py's SyncCounter:
             `.item()`/`float()`/`.tolist()`/`.cpu()`, nonzero, boolean-mask indexing, ...): each one stalls a GPU's
             queue. The profiler's `aten::_local_scalar_dense` count (profiler, every thread) is printed beside it.
  aten ops   aten ops per optimiser step on the training thread (torch.profiler; each top-level one is about a kernel
             launch on a GPU), with the dtype casts (`aten::_to_copy`) and per-tensor norms among them.
  host time  the share of a step spent outside the model's forward, backward, gradient clipping and optimiser step
             (waiting for data, collating, moving inputs, logging), from timers around those four (on a CPU the
             device work is synchronous, so the timers measure it exactly).

Inputs: the tiny default (synth at --scale 0.25 + init-model) for `ovkit sft --batch-size 8 --precision bf16-mixed`
on its instruct split, and a table of 448x448-pixel images (256 visual tokens each, ~120-word
captions) for the host-time share (a realistic image and text size).

    python bench/step_costs.py                                   # this checkout
    PYTHONPATH=/other/src python bench/step_costs.py --work /tmp/costs   # another checkout, same inputs
                      # (the counter is this checkout's bench/_syncs.py, whatever checkout is measured)
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _result  # noqa: E402
from _workers import tiny_default  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from _syncs import OptimizerSteps  # noqa: E402 (after the thread count is set: it imports torch)


def prepare(work: Path, image_rows: int) -> None:
    tiny_default(work, "data", "tiny")
    if not (work / "img448").exists():
        from gpu_train import make_data

        make_data(argparse.Namespace(rows=image_rows, image_size=448, text_tokens=120), work / "img448")


def sft_config(work: Path, data: Path, out: str, batch_size: int, steps: int, precision: str):
    from ovkit.train import SFTConfig

    return SFTConfig(
        data=data,
        model=work / "tiny",
        out=work / out,
        batch_size=batch_size,
        max_steps=steps,
        precision=precision,
        quiet=True,
        overwrite=True,
        max_len=1 << 20,
    )


# Ops that only make a view (no kernel runs on a GPU for them).
VIEWS = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::as_strided",
    "aten::t",
    "aten::transpose",
    "aten::expand",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::slice",
    "aten::select",
    "aten::reshape",
    "aten::permute",
    "aten::detach",
    "aten::alias",
    "aten::split",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::narrow",
    "aten::chunk",
    "aten::_reshape_alias",
    "aten::view_as",
    "aten::expand_as",
    "aten::flatten",
    "aten::unflatten",
    "aten::lift_fresh",
}


def op_counts(cfg) -> dict:
    """aten ops per optimiser step as the training thread dispatches them (a TorchDispatchMode sees each op after
    composite ops are decomposed: about one kernel launch each on a GPU, views aside), forward, backward and
    optimiser alike; the profiler's count (every thread, nested ops too) beside it."""
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils._python_dispatch import TorchDispatchMode

    from ovkit.train import train

    periods: list[collections.Counter] = [collections.Counter()]

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            periods[-1][func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=2, warmup=0, active=1, repeat=1))

    def step():
        periods.append(collections.Counter())
        prof.step()

    hooks = OptimizerSteps(step)
    prof.start()
    try:
        with Ops():
            train(cfg)
    finally:
        prof.stop()
        hooks.remove()
    ops = periods[3]  # the period from the end of step 2 to the end of step 3
    profiled = collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    return {
        "dispatched_ops": sum(ops.values()),
        "dispatched_kernels": sum(n for name, n in ops.items() if name not in VIEWS),
        "casts": ops["aten::_to_copy"],
        "per_tensor_norms": ops["aten::linalg_vector_norm"],
        "profiler_aten_ops": sum(profiled.values()),
        "profiler_local_scalar_dense": profiled["aten::_local_scalar_dense"],
    }


def profiled_ops(cfg) -> dict:
    """aten ops of the fifth optimiser step by torch.profiler alone (a dispatch mode would keep torch.compile from
    running): every op, and the top-level ones (not nested in another aten op). Compiled code runs inductor's fused
    kernels, which the profiler shows as compiled regions, not aten ops."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from ovkit.train import train

    prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=4, warmup=0, active=1, repeat=1))
    hooks = OptimizerSteps(prof.step)
    prof.start()
    try:
        train(cfg)
    finally:
        prof.stop()
        hooks.remove()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"profiler_aten_ops": len(aten), "profiler_top_level_aten_ops": len(top)}


def sync_counts(cfg) -> list[int]:
    from _syncs import SyncCounter

    from ovkit.train import train

    with SyncCounter(steps=True) as syncs:
        train(cfg)
    return syncs.step_counts()


def host_share(cfg, warmup: int) -> dict:
    """Per step: wall time, and the time inside forward, backward, clipping and optimizer.step."""
    from ovkit.runtime import Runtime
    from ovkit.runtime.loss import TokenScorer
    from ovkit.train import train

    inside = [0.0]
    steps: list[tuple[float, float]] = []
    last = [time.perf_counter()]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                inside[0] += time.perf_counter() - t

        return wrapper

    saved = TokenScorer.forward, Runtime.backward, Runtime.clip
    TokenScorer.forward, Runtime.backward, Runtime.clip = (timed(f) for f in saved)
    opt_start = [0.0]

    def step_end():
        inside[0] += time.perf_counter() - opt_start[0]
        now = time.perf_counter()
        steps.append((now - last[0], inside[0]))
        last[0], inside[0] = now, 0.0

    hooks = OptimizerSteps(step_end, on_start=lambda: opt_start.__setitem__(0, time.perf_counter()))
    try:
        train(cfg)
    finally:
        TokenScorer.forward, Runtime.backward, Runtime.clip = saved
        hooks.remove()
    measured = steps[warmup:]
    wall = statistics.median(w for w, _ in measured)
    host = statistics.median(w - i for w, i in measured)
    return {
        "step_s": round(wall, 4),
        "host_s": round(host, 4),
        "host_share": round(host / wall, 4),
        "steps": len(measured),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, help="keep inputs here (reused by a run on another checkout)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--image-rows", type=int, default=96)
    args = p.parse_args()
    import torch

    import ovkit

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare(work, args.image_rows)
        instruct = work / "data" / "instruct"
        result = {
            "ovkit": str(Path(ovkit.__file__).parent),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        result["sft_b8_bf16_mixed"] = op_counts(sft_config(work, instruct, "ops", 8, 4, "bf16-mixed"))
        for compiled in (False, True):
            cfg = sft_config(work, instruct, "ops-profiled", 8, 6, "bf16-mixed")
            cfg.compile = compiled
            result[f"sft_b8_bf16_mixed_profiled{'_compile' if compiled else ''}"] = profiled_ops(cfg)
        for batch in (2, 8):
            result[f"syncs_per_step_b{batch}_bf16_mixed"] = sync_counts(
                sft_config(work, instruct, "syncs", batch, 5, "bf16-mixed")
            )
        for precision in ("fp32", "bf16-mixed"):
            result[f"host_448px_b8_{precision}"] = host_share(
                sft_config(work, work / "img448", "host", 8, args.steps, precision), warmup=2
            )
        rows = []
        for key, value in result.items():
            if key in ("ovkit", "torch", "threads"):
                continue
            items = value.items() if isinstance(value, dict) else [("", value)]
            rows.extend({"measure": f"{key}.{sub}" if sub else key, "value": v} for sub, v in items)
        _result.table(
            "step_costs",
            f"CPU proxies of one optimiser step's GPU overheads (ovkit {result['ovkit']}, torch {result['torch']}, "
            f"{result['threads']} threads)",
            rows,
        )


if __name__ == "__main__":
    main()
