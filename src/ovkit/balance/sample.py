"""From concept assignments to a resampled dataset: counts, per-image weights, copies per image, and the report.

Inverse-frequency resampling (LLaVA-OneVision-1.5): an image's weight comes from the inverse frequencies of its
concepts; images are drawn in proportion to weight. How the K per-concept weights combine was not published; ovkit
offers `mean` (default), `max` and `sum`. With `mean` every image spreads one unit over its K concepts, so each
concept's expected share of the resampled set is close to uniform over the concepts that occur (exactly uniform for
K=1). MetaCLIP's rule (MetaCLIP, Xu et al. 2023) keeps a concept's matches with probability `min(1, t / count)` and an
image with `1 - prod(1 - p)` over its concepts; images that match nothing are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

COMBINE = ("mean", "max", "sum")


def concept_counts(
    assignments: Sequence[Sequence[int]], n_concepts: int, copies: np.ndarray | None = None
) -> np.ndarray:
    """How many images carry each concept (an image counts once per concept), optionally weighted by copies."""
    counts = np.zeros(n_concepts, dtype=np.int64)
    for i, cs in enumerate(assignments):
        if len(cs):
            counts[np.unique(np.asarray(cs, dtype=np.int64))] += 1 if copies is None else int(copies[i])
    return counts


def image_weights(assignments: Sequence[Sequence[int]], counts: np.ndarray, combine: str = "mean") -> np.ndarray:
    if combine not in COMBINE:
        raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}")
    inv = np.where(counts > 0, 1.0 / np.maximum(counts, 1), 0.0)
    reduce = {"mean": np.mean, "max": np.max, "sum": np.sum}[combine]
    return np.array([float(reduce(inv[list(cs)])) if len(cs) else 0.0 for cs in assignments])


def inverse_frequency_copies(weights: np.ndarray, target: int, seed: int) -> np.ndarray:
    """Copies per image with expectation `target * w / sum(w)`: the integer part, plus one more with probability
    equal to the fraction (stochastic rounding with a seeded generator over the global row order)."""
    total = weights.sum()
    if total <= 0:
        return np.zeros(len(weights), dtype=np.int64)
    expected = target * weights / total
    base = np.floor(expected)
    u = np.random.default_rng(seed).random(len(weights))
    return (base + (u < expected - base)).astype(np.int64)


def metaclip_copies(
    assignments: Sequence[Sequence[int]], counts: np.ndarray, threshold: float, seed: int
) -> np.ndarray:
    p_concept = np.minimum(1.0, threshold / np.maximum(counts, 1))
    p_image = np.array([1.0 - float(np.prod(1.0 - p_concept[list(cs)])) if len(cs) else 0.0 for cs in assignments])
    u = np.random.default_rng(seed).random(len(assignments))
    return (u < p_image).astype(np.int64)


def distribution_stats(counts: np.ndarray, concepts: Sequence[str], top: int = 10) -> dict:
    """Coverage, entropy and effective number of concepts (exp of entropy) of a concept count vector."""
    total = counts.sum()
    p = counts[counts > 0] / total if total else np.array([])
    entropy = float(-(p * np.log(p)).sum()) if len(p) else 0.0
    order = np.argsort(-counts, kind="stable")[:top]
    return {
        "concepts_seen": int((counts > 0).sum()),
        "coverage": float((counts > 0).mean()),
        "entropy": entropy,
        "effective_concepts": math.exp(entropy),
        "max_over_median": float(counts.max() / max(np.median(counts[counts > 0]), 1)) if total else 0.0,
        "top": [{"concept": concepts[i], "count": int(counts[i])} for i in order if counts[i] > 0],
    }


def rare_gain(before: np.ndarray, after: np.ndarray) -> dict:
    """Rare = concepts that occur, in the bottom half by count before balancing. Gained = larger share after."""
    seen = before > 0
    if not seen.any() or after.sum() == 0:
        return {"rare_concepts": 0, "rare_gained_fraction": 0.0}
    rare = seen & (before <= np.median(before[seen]))
    share_before = before / before.sum()
    share_after = after / after.sum()
    gained = rare & (share_after > share_before)
    return {"rare_concepts": int(rare.sum()), "rare_gained_fraction": float(gained.sum() / max(rare.sum(), 1))}


def retrieval_precision(assignments: Sequence[Sequence[int]], truth: Sequence[set[int]], n_concepts: int) -> dict:
    """Precision@K of assigned concepts against ground-truth concepts, and what random assignment would score."""
    pairs = [(cs, t) for cs, t in zip(assignments, truth) if t and len(cs)]
    if not pairs:
        return {}
    k = max(len(cs) for cs, _ in pairs)
    precision = float(np.mean([len(set(cs) & t) / len(cs) for cs, t in pairs]))
    recall = float(np.mean([len(set(cs) & t) / len(t) for cs, t in pairs]))
    chance = float(np.mean([len(t) / n_concepts for _, t in pairs]))
    return {
        "images": len(pairs),
        "k": k,
        "precision_at_k": precision,
        "recall_at_k": recall,
        "chance_precision": chance,
    }


def plot_long_tail(before: np.ndarray, after: np.ndarray, path) -> None:
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib

    matplotlib.use("Agg")
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for counts, label in ((before, "before"), (after, "after")):
        c = np.sort(counts[counts > 0])[::-1]
        if len(c):
            ax.loglog(np.arange(1, len(c) + 1), c / c.sum(), label=f"{label} ({len(c)} concepts)")
    ax.set_xlabel("concept rank")
    ax.set_ylabel("share of images")
    ax.set_title("concept long tail")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
