"""What a pack plan buys: packs against the lower bound, fill, and padding saved against two stated baselines.

Padding compression is `padding before / padding after` (the LLaVA-OneVision-1.5 "~11x" is this ratio; its code
never says what "before" is, so both baselines are reported):
- `pad_to_max_len`: every sample alone in a row of L tokens (before = samples * L - tokens);
- `pad_to_longest_in_random_batches`: samples shuffled (seeded) into batches of B, each padded to its longest
  sample (before = sum over batches of B_i * longest_i - tokens), the usual unpacked dataloader.
"After" is the padding left if every pack were padded to L (packs * L - tokens). The ratio is unstable near the
optimum (one pack more or less changes it a lot), so efficiency and packs / lower bound are reported with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def pack_stats(lengths, packs, capacity: int, *, batch: int = 8, seed: int = 0) -> dict[str, Any]:
    """Statistics of one plan: `lengths[i]` tokens of sample i, `packs[i]` its pack, `capacity` = --max-len."""
    lengths = np.asarray(lengths, dtype=np.int64)
    packs = np.asarray(packs, dtype=np.int64)
    n, tokens = int(lengths.size), int(lengths.sum())
    loads = np.bincount(packs, weights=lengths.astype(np.float64)).astype(np.int64) if n else np.zeros(0, np.int64)
    loads = loads[loads > 0]
    per_pack = np.bincount(packs)[np.bincount(packs) > 0] if n else np.zeros(0, np.int64)
    n_packs = int(loads.size)
    lower = -(-tokens // capacity)
    after = n_packs * capacity - tokens
    return {
        "samples": n,
        "packs": n_packs,
        "tokens": tokens,
        "capacity": capacity,
        "lower_bound": lower,
        "packs_over_lower_bound": n_packs / lower if lower else None,
        "efficiency": tokens / (n_packs * capacity) if n_packs else None,
        "samples_per_pack": _summary(per_pack),
        "fill": _summary(loads / capacity),
        "sample_length": _summary(lengths),
        "padding": {
            "after": after,
            "pad_to_max_len": _compression(n * capacity - tokens, after),
            "pad_to_longest_in_random_batches": {
                "batch": batch,
                "seed": seed,
                **_compression(random_batch_padding(lengths, batch, seed), after),
            },
        },
    }


def random_batch_padding(lengths: np.ndarray, batch: int, seed: int) -> int:
    """Padding tokens when the samples, shuffled with `seed`, go in batches of `batch` padded to their longest."""
    if lengths.size == 0:
        return 0
    shuffled = lengths[np.random.default_rng(seed).permutation(lengths.size)]
    n_full = shuffled.size // batch * batch
    longest = shuffled[:n_full].reshape(-1, batch).max(axis=1).sum() * batch
    tail = shuffled[n_full:]
    if tail.size:
        longest += tail.max() * tail.size
    return int(longest - shuffled.sum())


def _compression(before: int, after: int) -> dict[str, Any]:
    # after == 0 only when every pack is exactly full: the ratio is then unbounded, reported as null.
    return {"before": int(before), "compression": before / after if after else None}


def _summary(x: np.ndarray) -> dict[str, float | None]:
    if x.size == 0:
        return {"min": None, "mean": None, "median": None, "max": None}
    return {"min": _num(x.min()), "mean": float(x.mean()), "median": _num(np.median(x)), "max": _num(x.max())}


def _num(v) -> float | int:
    v = v.item() if hasattr(v, "item") else v
    return int(v) if float(v).is_integer() else float(v)


def merge_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Headline numbers of a plan written in --shard parts (each part is packed on its own)."""
    samples = sum(p["samples"] for p in parts)
    n_packs = sum(p["packs"] for p in parts)
    tokens = sum(p["tokens"] for p in parts)
    capacity = parts[0]["capacity"]
    lower = -(-tokens // capacity)
    return {
        "parts": len(parts),
        "samples": samples,
        "packs": n_packs,
        "tokens": tokens,
        "capacity": capacity,
        "lower_bound": lower,
        "packs_over_lower_bound": n_packs / lower if lower else None,
        "efficiency": tokens / (n_packs * capacity) if n_packs else None,
    }


def fill_histogram(loads, capacity: int, path: Path, title: str = "") -> Path:
    """A PNG histogram of pack fill (tokens / capacity). Written without a timestamp, so it is reproducible."""
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fill = np.asarray(loads, dtype=np.float64) / capacity
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.hist(fill, bins=np.linspace(0, 1, 51), color="#4477aa", edgecolor="white", linewidth=0.5)
    ax.set_yscale("log")
    ax.set_xlim(0, 1)
    ax.set_xlabel(f"pack fill (tokens / {capacity})")
    ax.set_ylabel("packs (log scale)")
    ax.set_title(title or f"{fill.size:,} packs, mean fill {fill.mean():.4f}" if fill.size else "no packs")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return Path(path)
