"""Where the mismatch is: by the sampler's probability of the token, by assistant turn, by response length, and per
category and source. Each analysis is a list of table rows (dicts) that report.json, report.md and the figures share.

- Sampler probability bins: "When speed kills stability" (004, section 3.3, the low-probability-token trap) finds
  the learner/sampler gap concentrated on tokens the sampler itself gave a low probability.
- First turn vs later turns: 004 section 3.4.1 finds non-first-turn outputs of multi-turn rollouts more mismatched
  (larger log-PPL gap, lower Pearson correlation). A turn is one assistant turn; single-turn rollouts have only turn 0.
- Response length: Yao et al. 2025 (003) find the per-response max mismatch grows with response length while the mean
  mismatch barely moves.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ovkit.mismatch.metrics import (
    HIGH_MISMATCH,
    SAFETY_BOUND,
    Scores,
    Thresholds,
    correction_fractions,
    k3,
    mismatch_metrics,
    pearson,
    per_response,
    require_tokens,
)

PROB_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
GROUP_COLUMNS = ("k3_kl", "kl", "training_ppl", "rollout_ppl", "chi2_token", "max_mismatch_mean", "mean_mismatch_mean")


def by_sampler_prob(scores: Scores, edges: tuple[float, ...] = PROB_EDGES) -> list[dict[str, Any]]:
    """Tokens binned by the sampler's probability p_s: how far the learner's log-prob falls from the sampler's."""
    require_tokens(scores)
    p_s = np.exp(scores.sampler)
    r = np.clip(scores.learner - scores.sampler, -SAFETY_BOUND, SAFETY_BOUND)
    diff = np.abs(p_s - np.exp(scores.learner))
    bins = np.clip(np.searchsorted(np.asarray(edges[1:-1]), p_s, side="right"), 0, len(edges) - 2)
    rows = []
    for b in range(len(edges) - 1):
        sel = bins == b
        n = int(sel.sum())
        if n == 0:
            continue
        rb = r[sel]
        rows.append(
            {
                "bin": f"[{edges[b]:g}, {edges[b + 1]:g}{']' if b == len(edges) - 2 else ')'}",
                "lo": edges[b],
                "hi": edges[b + 1],
                "tokens": n,
                "share": n / scores.tokens,
                "mean_sampler_prob": float(p_s[sel].mean()),
                "mean_log_ratio": float(rb.mean()),
                "mean_abs_log_ratio": float(np.abs(rb).mean()),
                "k3_kl": float(np.mean(np.expm1(rb) - rb)),
                "mean_abs_prob_diff": float(diff[sel].mean()),
                "learner_lower_frac": float(np.mean(rb < 0)),
            }
        )
    return rows


def segment_ids(scores: Scores) -> np.ndarray:
    """Each compared token's segment: one segment per (response, assistant turn)."""
    key = scores.response * (int(scores.turn.max(initial=0)) + 1) + scores.turn
    return np.unique(key, return_inverse=True)[1]


def _turn_row(name: str, scores: Scores, tokens: np.ndarray, seg: np.ndarray) -> dict[str, Any]:
    sub = scores.select(tokens)
    seg_ids, seg_inv = np.unique(seg[tokens], return_inverse=True)
    count = np.bincount(seg_inv).astype(np.float64)
    log_ppl_l = -np.bincount(seg_inv, sub.learner) / count
    log_ppl_s = -np.bincount(seg_inv, sub.sampler) / count
    return {
        "turn": name,
        "segments": int(seg_ids.size),
        "tokens": sub.tokens,
        "k3_kl": k3(sub),
        "kl": float(np.mean(sub.sampler - sub.learner)),
        "rollout_log_ppl": float(log_ppl_s.mean()),
        "training_log_ppl": float(log_ppl_l.mean()),
        "log_ppl_abs_diff": float(np.abs(log_ppl_l - log_ppl_s).mean()),
        "mean_abs_prob_diff": float(np.abs(np.exp(sub.sampler) - np.exp(sub.learner)).mean()),
        "pearson": pearson(np.exp(sub.sampler), np.exp(sub.learner)),
    }


def by_turn(scores: Scores, max_listed: int = 8) -> list[dict[str, Any]]:
    """The first assistant turn against later ones (all later turns pooled, then each turn index up to
    `max_listed`). One row ("first") for single-turn rollouts."""
    require_tokens(scores)
    seg = segment_ids(scores)
    rows = [_turn_row("first", scores, scores.turn == 0, seg)] if np.any(scores.turn == 0) else []
    later = scores.turn > 0
    if later.any():
        rows.append(_turn_row("later", scores, later, seg))
        for t in range(1, min(int(scores.turn.max()), max_listed) + 1):
            if np.any(scores.turn == t):
                rows.append(_turn_row(str(t + 1), scores, scores.turn == t, seg))
        if scores.turn.max() > max_listed:
            rows.append(_turn_row(f">{max_listed + 1}", scores, scores.turn > max_listed, seg))
    return rows


def length_bucket(length: int) -> tuple[int, int]:
    """[2^k, 2^(k+1)) holding `length` (>= 1)."""
    lo = 2 ** int(math.floor(math.log2(max(length, 1))))
    return lo, 2 * lo


def by_length(scores: Scores) -> list[dict[str, Any]]:
    """Responses bucketed by their number of compared tokens (powers of two): max and mean mismatch per bucket."""
    require_tokens(scores)
    per = per_response(scores)
    lengths = per["tokens"].astype(np.int64)
    lows = np.array([length_bucket(int(n))[0] for n in lengths])
    rows = []
    for lo in sorted(set(lows.tolist())):
        sel = lows == lo
        sub = scores.select_responses(sel)
        mx, mean = per["max_mismatch"][sel], per["mean_mismatch"][sel]
        rows.append(
            {
                "bucket": f"[{lo}, {2 * lo})",
                "lo": lo,
                "hi": 2 * lo,
                "responses": int(sel.sum()),
                "mean_length": float(lengths[sel].mean()),
                "max_mismatch_mean": float(mx.mean()),
                "max_mismatch_p90": float(np.quantile(mx, 0.9)),
                "max_mismatch_frac_high": float(np.mean(mx > HIGH_MISMATCH)),
                "mean_mismatch_mean": float(mean.mean()),
                "k3_kl": k3(sub),
            }
        )
    return rows


def by_key(scores: Scores, key: str) -> list[dict[str, Any]]:
    """One row per value of the per-rollout `key` (category, source): the headline metrics on its rollouts."""
    require_tokens(scores)
    values = [str(v) if v not in (None, "") else "none" for v in scores.meta.get(key, ["none"] * scores.n)]
    rows = []
    for value in sorted(set(values)):
        sub = scores.select_responses(np.array([v == value for v in values]))
        m = mismatch_metrics(sub)
        row: dict[str, Any] = {key: value, "responses": sub.n, "tokens": sub.tokens, **{c: m[c] for c in GROUP_COLUMNS}}
        rewards = [r for r in sub.meta.get("reward", []) if r is not None]
        row["reward_mean"] = float(np.mean(rewards)) if rewards else None
        rows.append(row)
    return rows


def analyse(scores: Scores, thresholds: Thresholds) -> dict[str, Any]:
    """Everything report.json holds for one set of rollouts."""
    require_tokens(scores)
    return {
        "metrics": mismatch_metrics(scores),
        "corrections": correction_fractions(scores, thresholds),
        "by_sampler_prob": by_sampler_prob(scores),
        "by_turn": by_turn(scores),
        "by_length": by_length(scores),
        "by_category": by_key(scores, "category"),
        "by_source": by_key(scores, "source"),
    }
