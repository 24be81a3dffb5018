"""Eval metrics: mean reward, accuracy and pass@k per row, aggregated per category, per source and overall.

- `reward`: the mean reward of a row's completions (rewards are in [0, 1]; continuous ones such as IoU or ANLS too).
- `accuracy`: the share of a row's completions with reward >= 0.5 (`CORRECT`), so a continuous reward counts as
  right from 0.5 on; with one greedy completion it is 1 or 0 per row.
- `pass@k` (n > 1 samples per row): the probability that at least one of k completions drawn without replacement from
  the n is correct, with the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code", eq. 1): 1 - C(n - c, k) / C(n, k), c = correct completions among n.
Aggregates are means over rows (every row weighs the same, so `overall` is the mean over all rows, not over
categories), each with its standard error (sample std / sqrt(rows)), as lmms-eval reports `<metric>_stderr`.

Confidence intervals (`wilson_interval`, shown by `eval --compare`): the 95% Wilson score interval of a mean of
values in [0, 1] over n rows. For 0/1 values (accuracy, exact-match rewards) it is the usual binomial interval, and
it stays sensible at 0% and 100% where mean +- 1.96 stderr collapses to a point; for continuous rewards in [0, 1]
(IoU, edit similarity) it is conservative, since a variable in [0, 1] with mean p has variance at most p (1 - p).
Changes between two runs on the same rows (`paired_difference`) use the per-row differences, which is far tighter
than comparing two intervals when the runs agree on most rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CORRECT = 0.5  # a completion with reward >= CORRECT counts as correct (accuracy, pass@k)
Z95 = 1.959964  # two-sided 95% normal quantile


def wilson_interval(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a mean of n values in [0, 1] (Wilson 1927); (0, 1) when n is 0."""
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, max(0.0, mean))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(after: Sequence[float], before: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """(mean of after_i - before_i, half-width of its 95% normal interval) over rows scored by both runs."""
    if len(after) != len(before) or not after:
        raise ValueError("a paired difference needs two equally long, non-empty lists of per-row values")
    d = [a - b for a, b in zip(after, before)]
    mean = sum(d) / len(d)
    if len(d) == 1:
        return mean, float("inf")
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    return mean, z * sd / math.sqrt(len(d))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021), computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def ks_for(n: int) -> list[int]:
    """The k of pass@k reported for n samples: powers of two below n, and n."""
    if n < 2:
        return []
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def row_metrics(rewards: Sequence[float], finish_reasons: Sequence[str] = ()) -> dict[str, float]:
    """Metrics of one row from the rewards of its n completions."""
    n = len(rewards)
    if n == 0:
        raise ValueError("a row needs at least one completion")
    c = sum(1 for r in rewards if r >= CORRECT)
    out = {"reward": sum(rewards) / n, "accuracy": c / n}
    for k in ks_for(n):
        out[f"pass@{k}"] = pass_at_k(n, c, k)
    if finish_reasons:
        out["truncated"] = sum(1 for f in finish_reasons if f == "length") / len(finish_reasons)
    return out


def func_means(values: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A row's mean of each user reward function over its completions (`rewards/<name>`, aggregated like every
    metric); a function that returned None for all of them has no entry, so the row does not count for it."""
    out: dict[str, float] = {}
    for name in sorted({k for v in values for k in v if "/" not in k}):
        applied = [v[name] for v in values if name in v and v[name] == v[name]]
        if applied:
            out[f"rewards/{name}"] = sum(applied) / len(applied)
    return out


def aggregate(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Mean and standard error of every metric over rows, plus the row count (`rows`)."""
    values: dict[str, list[float]] = defaultdict(list)
    count = 0
    for r in rows:
        count += 1
        for k, v in r.items():
            values[k].append(float(v))
    out: dict[str, float] = {}
    for k, vs in values.items():
        mean = sum(vs) / len(vs)
        out[k] = mean
        out[f"{k}_stderr"] = (
            math.sqrt(sum((v - mean) ** 2 for v in vs) / (len(vs) - 1) / len(vs)) if len(vs) > 1 else 0.0
        )
    out["rows"] = count
    return out


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`records`: one per row with `category`, `source` and `metrics` (from `row_metrics`). Returns
    {"overall": {...}, "categories": {cat: {...}}, "sources": {src: {...}}} of `aggregate`d metrics."""
    by_cat: dict[str, list] = defaultdict(list)
    by_src: dict[str, list] = defaultdict(list)
    for r in records:
        by_cat[r["category"]].append(r["metrics"])
        by_src[r["source"]].append(r["metrics"])
    return {
        "overall": aggregate(r["metrics"] for r in records),
        "categories": {k: aggregate(v) for k, v in sorted(by_cat.items())},
        "sources": {k: aggregate(v) for k, v in sorted(by_src.items())},
    }
