"""The report's figures, as PNG bytes (matplotlib's object API: no pyplot state, no display needed).

- `prob_vs_logratio`: sampler probability (log x) against log(p_learner / p_sampler) per token, with bin means: the
  low-probability-token trap of 004 section 3.3 is the fan opening towards the left.
- `prob_scatter`: p_sampler against p_learner per token (004's probability scatter); the diagonal is no mismatch.
- `max_mismatch_by_length`: histograms of the per-response max abs(p_s - p_l), one per length bucket (003, fig. 9).
- `turns`: per (response, turn) log-PPL of sampler vs learner, first turn vs later turns (004 section 3.4.1), and
  K3 per turn.
- `compare`: K3 and mean max-mismatch per run, when the report compares several samplers.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.ticker import NullFormatter

from ovkit.mismatch.analyses import length_bucket, segment_ids
from ovkit.mismatch.metrics import SAFETY_BOUND, Scores, per_response

FIRST, LATER = "#1f77b4", "#d62728"


def _figure(width: float = 6.4, height: float = 4.4):
    # optional: the package (or this name in it) may be missing; imported only where it is used
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _sample(n: int, max_points: int, seed: int) -> np.ndarray:
    if n <= max_points:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_points, replace=False))


def prob_vs_logratio(
    scores: Scores, bins: Sequence[dict[str, Any]], *, max_points: int = 20000, seed: int = 0
) -> bytes:
    idx = _sample(scores.tokens, max_points, seed)
    p_s = np.exp(scores.sampler[idx])
    r = np.clip(scores.learner[idx] - scores.sampler[idx], -SAFETY_BOUND, SAFETY_BOUND)
    fig = _figure()
    ax = fig.add_subplot()
    ax.scatter(np.maximum(p_s, 1e-8), r, s=4, alpha=0.35, color=FIRST, linewidths=0, label="token")
    ax.plot(
        [b["mean_sampler_prob"] for b in bins],
        [b["mean_log_ratio"] for b in bins],
        "o-",
        color="black",
        ms=4,
        label="bin mean",
    )
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor-tick labels of a narrow log range overlap
    ax.set(
        xlabel="sampler probability p_s",
        ylabel="log p_learner - log p_sampler",
        title=f"mismatch vs sampler probability ({scores.tokens} tokens)",
    )
    ax.legend(loc="lower right", fontsize=8)
    return _png(fig)


def prob_scatter(scores: Scores, *, max_points: int = 20000, seed: int = 0) -> bytes:
    idx = _sample(scores.tokens, max_points, seed)
    fig = _figure(5.0, 5.0)
    ax = fig.add_subplot()
    ax.scatter(np.exp(scores.sampler[idx]), np.exp(scores.learner[idx]), s=4, alpha=0.35, color=FIRST, linewidths=0)
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="p_sampler", ylabel="p_learner", title="token probabilities")
    return _png(fig)


def max_mismatch_by_length(scores: Scores) -> bytes:
    per = per_response(scores)
    lows = np.array([length_bucket(int(n))[0] for n in per["tokens"]])
    fig = _figure()
    ax = fig.add_subplot()
    # Log-spaced bins: a bf16 sampler's max mismatch is ~1e-4, an int8 or buggy one's can reach 1 (003, fig. 2).
    floor = 1e-12
    values_all = np.maximum(per["max_mismatch"], floor)
    lo_edge = max(float(values_all.min()) / 2, floor)
    edges = np.geomspace(lo_edge, max(1.0, float(values_all.max())), 41)
    for lo in sorted(set(lows.tolist())):
        values = values_all[lows == lo]
        ax.hist(values, bins=edges, histtype="step", lw=1.4, label=f"{lo}-{2 * lo - 1} tokens ({values.size})")
    ax.set_xscale("log")
    ax.set(
        xlabel="per-response max |p_sampler - p_learner| (log scale)",
        ylabel="responses",
        title="max mismatch by response length",
    )
    ax.legend(fontsize=8)
    return _png(fig)


def turns(scores: Scores, turn_rows: Sequence[dict[str, Any]]) -> bytes:
    seg = segment_ids(scores)
    count = np.bincount(seg).astype(np.float64)
    log_ppl_s = -np.bincount(seg, scores.sampler) / count
    log_ppl_l = -np.bincount(seg, scores.learner) / count
    seg_turn = np.zeros(count.size, dtype=np.int64)
    seg_turn[seg] = scores.turn
    fig = _figure(10.0, 4.4)
    left, right = fig.subplots(1, 2)
    for name, sel, colour in (("first turn", seg_turn == 0, FIRST), ("later turns", seg_turn > 0, LATER)):
        if sel.any():
            left.scatter(
                log_ppl_s[sel],
                log_ppl_l[sel],
                s=8,
                alpha=0.5,
                color=colour,
                linewidths=0,
                label=f"{name} ({int(sel.sum())})",
            )
    lo = float(min(log_ppl_s.min(), log_ppl_l.min()))
    hi = float(max(log_ppl_s.max(), log_ppl_l.max()))
    pad = max(hi - lo, 1e-3) * 0.05
    left.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", lw=0.8)
    left.set(xlim=(lo - pad, hi + pad), ylim=(lo - pad, hi + pad))
    left.set(xlabel="sampler log-PPL", ylabel="learner log-PPL", title="log-PPL per assistant turn")
    left.legend(fontsize=8)
    names = [row["turn"] for row in turn_rows]
    right.bar(names, [row["k3_kl"] for row in turn_rows], color=[FIRST if n == "first" else LATER for n in names])
    right.set(
        xlabel="assistant turn",
        ylabel="K3 (vllm-kl)",
        title="K3 by turn" + ("" if len(names) > 1 else " (single-turn rollouts)"),
    )
    return _png(fig)


def compare(runs: dict[str, dict[str, Any]]) -> bytes:
    names = list(runs)
    fig = _figure(9.0, 3.8)
    left, right = fig.subplots(1, 2)
    values = [runs[n]["metrics"]["k3_kl"] for n in names]
    left.bar(names, values, color=FIRST)
    if min(values) > 0:
        left.set_yscale("log")
    left.set(ylabel="K3 (vllm-kl)", title="K3 per sampler")
    right.bar(names, [runs[n]["metrics"]["max_mismatch_mean"] for n in names], color=LATER)
    right.set(ylabel="mean per-response max |dp|", title="max mismatch per sampler")
    return _png(fig)


def run_figures(scores: Scores, analysis: dict[str, Any], *, max_points: int, seed: int) -> dict[str, bytes]:
    """Every per-run figure, by file stem."""
    return {
        "prob_vs_logratio": prob_vs_logratio(scores, analysis["by_sampler_prob"], max_points=max_points, seed=seed),
        "prob_scatter": prob_scatter(scores, max_points=max_points, seed=seed),
        "max_mismatch_by_length": max_mismatch_by_length(scores),
        "turns": turns(scores, analysis["by_turn"]),
    }
