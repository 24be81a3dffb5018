"""The table of `make science-caption-cost`: per variant, caption and overall after the RL chain, each seed, their mean
and range, and the change against the SFT model paired over the same rows with its 95% interval: what
`ovkit eval --compare --paired-by category` prints per category (the same `paired_change`), here on seed-averaged rows.

    python scripts/caption_cost.py CAPCOST [SEEDS]     (SEEDS: comma-separated, default 1,2,3)

Each row's value is its reward averaged over the seeds before pairing, so the interval is the rows' noise; the range
shows the seeds'.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from ovkit.evaluate.results import load_run, paired_change, row_values

VARIANTS = ("none", "kl", "sftmix")


def rows(path: Path) -> dict[str, tuple[str, float]]:
    return row_values(load_run(str(path))[1], "reward") or {}


def mean(values: dict, category: str | None) -> float:
    picked = [v for c, v in values.values() if category in (None, c)]
    return sum(picked) / len(picked)


def main(root: Path, seeds: list[int]) -> None:
    sft = rows(root / "eval" / "sft")
    columns = ("per seed", "mean (range)", "vs sft, paired")
    print("| variant | " + " | ".join(f"{what} {c}" for what in ("caption", "overall") for c in columns) + " |")
    print("|---|---|---|---|---|---|---|")
    print(f"| sft | {100 * mean(sft, 'caption'):.1f} | | | {100 * mean(sft, None):.1f} | | |")
    for variant in VARIANTS:
        runs = [rows(root / "eval" / variant / f"s{s}") for s in seeds]
        if not all(runs):
            continue
        averaged = {i: (c, statistics.mean(r[i][1] for r in runs)) for i, (c, _) in sft.items()}
        cells = []
        for category in ("caption", None):
            each = [mean(r, category) for r in runs]
            change, half = paired_change(sft, averaged, category)  # never None: averaged holds sft's own rows
            cells += [
                " / ".join(f"{100 * v:.1f}" for v in each),
                f"{100 * statistics.mean(each):.1f} ({100 * min(each):.1f}-{100 * max(each):.1f})",
                f"{100 * change:+.1f} ±{100 * half:.1f}",
            ]
        print(f"| {variant} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "1,2,3").split(",")])
