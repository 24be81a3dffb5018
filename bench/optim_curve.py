"""`--optim` x `--precision` on the tiny default: the loss curve of the same `ovkit sft` run per combination, side by
side, and the bytes per trainable parameter each one measured (ovkit.json `runtime.bytes_per_param`).

    OMP_NUM_THREADS=1 python bench/optim_curve.py --work /tmp/optim-curve            # 160 steps at lr 1e-4 (~5 min on 2
                                                                                       cores)
    OMP_NUM_THREADS=1 python bench/optim_curve.py --work /tmp/optim-curve --lr 1e-5  # the recipe's SFT lr

The runs share the data order (same seed) and start from the same fp32 weights, so a column differs from fp32's only
by what the precision and the optimiser do: bf16-mixed keeps fp32 masters, adamw_bf16 keeps bf16 weights with
Kahan-compensated updates, bf16-true + adamw_torch is plain bf16 AdamW (updates smaller than half a bf16 ulp of the
weight are lost). The adamw_8bit combinations run a few steps only, for their bytes per parameter.
Each run is `ovkit sft` in a child process of its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _result  # noqa: E402 (bench/ is on sys.path when this script runs)
from _workers import tiny_default  # noqa: E402
from runtime_proxies import ovkit  # bench/ is on sys.path when this script runs: `ovkit ...` in a child process

CURVES = {  # column name -> sft options
    "fp32": ("--precision", "fp32", "--optim", "adamw_torch_fused"),
    "bf16-mixed": ("--precision", "bf16-mixed", "--optim", "adamw_torch_fused"),
    "bf16-true adamw_bf16": ("--precision", "bf16-true", "--optim", "adamw_bf16"),
    "bf16-true adamw_torch": ("--precision", "bf16-true", "--optim", "adamw_torch"),
}
BYTES_ONLY = {
    "fp32 adamw_8bit": ("--precision", "fp32", "--optim", "adamw_8bit"),
    "bf16-mixed adamw_8bit": ("--precision", "bf16-mixed", "--optim", "adamw_8bit"),
    "bf16-true adamw_8bit": ("--precision", "bf16-true", "--optim", "adamw_8bit"),
}


def run(
    work: Path, name: str, opts: tuple[str, ...], steps: int, lr: float, batch: int
) -> tuple[list[float], dict, float]:
    """(losses per step, bytes_per_param, elapsed s) of one `ovkit sft` run."""
    out = work / "runs" / f"{name.replace(' ', '-')}-lr{lr:g}-{steps}"
    ovkit(
        "sft",
        work / "data" / "instruct",
        "--model",
        work / "tiny",
        "--out",
        out,
        "--max-steps",
        steps,
        "--batch-size",
        batch,
        "--lr",
        lr,
        "--min-lr",
        lr / 10,
        "--warmup-ratio",
        0.02,
        "--seed",
        0,
        "--overwrite",
        *opts,
    )
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    meta = json.loads((out / "ovkit.json").read_text())
    return losses, meta["runtime"]["bytes_per_param"], meta["metrics"]["elapsed_s"]


def window_means(losses: list[float], every: int) -> list[tuple[int, float]]:
    """(last step of the window, mean loss over the window): one noisy batch does not decide a row."""
    return [
        (min(i + every, len(losses)), sum(losses[i : i + every]) / len(losses[i : i + every]))
        for i in range(0, len(losses), every)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/optim-curve"))
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--every", type=int, default=20, help="print the mean loss of every this many steps")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    tiny_default(args.work, "data", "tiny")

    curves, sizes, times = {}, {}, {}
    for name, opts in CURVES.items():
        curves[name], sizes[name], times[name] = run(args.work, name, opts, args.steps, args.lr, args.batch_size)
    for name, opts in BYTES_ONLY.items():
        _, sizes[name], _ = run(args.work, name, opts, 2, args.lr, args.batch_size)

    names = list(CURVES)
    means = {n: window_means(curves[n], args.every) for n in names}
    rows = [{"steps": step, **{n: means[n][i][1] for n in names}} for i, (step, _) in enumerate(means["fp32"])]
    last = {n: sum(curves[n][-args.every :]) / args.every for n in names}
    gap = {n: max(abs(a - b) for a, b in zip(curves[n], curves["fp32"])) for n in names}
    rows.append({"steps": "last-window mean - fp32's", **{n: last[n] - last["fp32"] for n in names}})
    rows.append({"steps": "max per-step gap to fp32", **{n: gap[n] for n in names}})
    rows.append({"steps": "seconds", **{n: f"{times[n]:.0f}" for n in names}})
    _result.table(
        "optim_curve",
        f"loss, mean of every {args.every} steps (sft on the tiny default, batch {args.batch_size}, lr "
        f"{args.lr:g} cosine to {args.lr / 10:g})",
        rows,
        formats=dict.fromkeys(names, ".4f"),
    )
    _result.table(
        "optim_curve",
        f"bytes per trainable parameter after the first step (ovkit.json runtime.bytes_per_param; "
        f"{next(iter(sizes.values()))['trainable_params']:,} trainable parameters)",
        [
            {
                "combination": name,
                "weights": b["weights"],
                "master weights": b["master_weights"],
                "grads": b["grads"],
                "optimiser state": b["optimizer_state"],
                "total": b["total"],
            }
            for name, b in sizes.items()
        ],
        formats=dict.fromkeys(("weights", "master weights", "grads", "optimiser state", "total"), ".2f"),
    )


if __name__ == "__main__":
    main()
