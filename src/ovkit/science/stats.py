"""The numbers of the science report, as small functions over plain inputs (tested on hand-made values).

- `gini`, `head_tail_ratio`: how flat a concept-frequency distribution is (balancing's long tail).
- `seed_band`: mean and spread of per-step curves across seeds.
- `seed_interval`: the 95% interval of a mean over a few seeds (Student's t: three seeds are not a normal sample).
- `spikes`: gradient-norm spikes of one run (a step whose norm exceeds `factor` x the run's median).
- `matched_positions`: first-turn vs later-turn mismatch restricted to context positions both cover, so turn and
  position are not confounded (004 compares turns; later turns also sit deeper in the context).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def gini(counts: Sequence[float]) -> float:
    """Gini coefficient of non-negative counts: 0 when every concept is equally frequent, -> 1 when one dominates."""
    x = np.sort(np.asarray(counts, dtype=np.float64))
    if x.size == 0 or x.sum() <= 0:
        return 0.0
    n = x.size
    ranks = np.arange(1, n + 1)
    return float((2 * (ranks * x).sum()) / (n * x.sum()) - (n + 1) / n)


def head_tail_ratio(counts: Sequence[float], share: float = 0.2) -> float:
    """Mean count of the most frequent `share` of concepts over the mean count of the least frequent `share`."""
    x = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    if x.size == 0:
        return float("nan")
    k = max(1, int(round(share * x.size)))
    tail = x[-k:].mean()
    return float(x[:k].mean() / tail) if tail > 0 else float("inf")


def seed_band(curves: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """Per step: mean, min and max over seeds (curves cut to the shortest), and the std over seeds."""
    if not curves:
        return {"mean": [], "min": [], "max": [], "std": []}
    steps = min(len(c) for c in curves)
    a = np.asarray([list(c)[:steps] for c in curves], dtype=np.float64)
    return {
        "mean": a.mean(0).tolist(),
        "min": a.min(0).tolist(),
        "max": a.max(0).tolist(),
        "std": a.std(0).tolist(),
    }


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    v = [float(x) for x in values]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, sd


# Two-sided 95% quantiles of Student's t by degrees of freedom (any statistics table); past 30 the normal's 1.96 is
# within 2% of them, and the science runs use 3 seeds (2 degrees of freedom: 4.30, where the normal says 1.96).
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
T975.update({11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042})


def seed_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% Student-t interval, t(n - 1) x sd / sqrt(n), over per-seed values (the
    spread of training runs, not of rows); the half-width is inf for one value, nan for none."""
    m, sd = mean_sd(values)
    n = len(values)
    if n < 2:
        return m, float("nan") if n == 0 else float("inf")
    df = n - 1
    t = T975[max(k for k in T975 if k <= df)] if df <= 30 else 1.959964
    return m, t * sd / math.sqrt(n)


def spikes(grad_norms: Sequence[float], factor: float = 3.0) -> dict[str, float]:
    """Steps whose gradient norm is above `factor` x the run's median norm, and the largest norm over the median."""
    g = np.asarray([x for x in grad_norms if x is not None and math.isfinite(x)], dtype=np.float64)
    if g.size == 0:
        return {"steps": 0, "spikes": 0, "max_over_median": float("nan")}
    med = float(np.median(g)) or 1e-12
    return {"steps": int(g.size), "spikes": int((g > factor * med).sum()), "max_over_median": float(g.max() / med)}


def k3(learner: np.ndarray, sampler: np.ndarray) -> float:
    """mean exp(r) - r - 1, r = logp_l - logp_s clamped to +-20 (004's vllm-kl)."""
    r = np.clip(np.asarray(learner, np.float64) - np.asarray(sampler, np.float64), -20, 20)
    return float(np.mean(np.expm1(r) - r)) if r.size else float("nan")


def matched_positions(tokens: Mapping[str, np.ndarray], band: int = 40) -> dict[str, Any]:
    """First-turn vs later-turn K3 at matched context positions.

    `tokens`: flat arrays `position` (the token's index in the whole context), `turn` (0 = first assistant turn),
    `learner`, `sampler` (log-probs). Positions are cut into bands of `band`; only bands holding both first-turn and
    later-turn tokens count, and each side's K3 is the mean over those bands weighted by the smaller token count of
    the band, so both sides are averaged over the same position mix. Returns the two K3 values, their ratio, the
    token counts that entered, the bands, and the unmatched (pooled) K3 of each side for comparison."""
    pos = np.asarray(tokens["position"], dtype=np.int64)
    turn = np.asarray(tokens["turn"], dtype=np.int64)
    lrn = np.asarray(tokens["learner"], dtype=np.float64)
    smp = np.asarray(tokens["sampler"], dtype=np.float64)
    first, later = turn == 0, turn > 0
    bands = pos // band
    rows, w_sum, acc_first, acc_later = [], 0.0, 0.0, 0.0
    n_first = n_later = 0
    for b in np.unique(bands):
        f, l_ = first & (bands == b), later & (bands == b)
        nf, nl = int(f.sum()), int(l_.sum())
        if nf == 0 or nl == 0:
            continue
        kf, kl = k3(lrn[f], smp[f]), k3(lrn[l_], smp[l_])
        w = float(min(nf, nl))
        w_sum += w
        acc_first += w * kf
        acc_later += w * kl
        n_first += nf
        n_later += nl
        rows.append(
            {
                "band": f"{int(b) * band}-{int(b + 1) * band - 1}",
                "first_tokens": nf,
                "later_tokens": nl,
                "first_k3": kf,
                "later_k3": kl,
            }
        )
    first_k3 = acc_first / w_sum if w_sum else float("nan")
    later_k3 = acc_later / w_sum if w_sum else float("nan")
    return {
        "first_k3": first_k3,
        "later_k3": later_k3,
        "ratio": later_k3 / first_k3 if w_sum and first_k3 > 0 else float("nan"),
        "first_tokens": n_first,
        "later_tokens": n_later,
        "bands": rows,
        "pooled_first_k3": k3(lrn[first], smp[first]),
        "pooled_later_k3": k3(lrn[later], smp[later]),
    }
