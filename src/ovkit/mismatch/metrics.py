"""Sampler/learner mismatch metrics over the compared tokens of a set of rollouts.

Notation (per sampled response token t, i.e. loss_mask 1): `logp_s` = the sampler's log-prob (`behave_logprobs`),
`logp_l` = the learner's, recomputed by a teacher-forced forward pass; r = logp_l - logp_s; w = exp(r) the token
importance weight pi_learner / pi_sampler. Averages over "tokens" pool every compared token of every response; PPLs
are per response, then averaged over responses (verl's `rollout_corr/` metrics, "When speed kills stability"):

| name | definition |
|---|---|
| `k3_kl` | mean_t exp(r) - r - 1: the K3 estimator of KL(sampler || learner) (004's `vllm-kl`, rl-train's
`mismatch/vllm_kl`) |
| `kl` | mean_t logp_s - logp_l: the k1 estimator of the same KL (can go negative under mismatch, Yao et al. 2025) |
| `training_ppl`, `rollout_ppl` | mean over responses of exp(-mean_t logp) for the learner / the sampler |
| `training_log_ppl`, `rollout_log_ppl` | mean over responses of -mean_t logp |
| `log_ppl_diff` | mean over responses of (mean_t logp_s - mean_t logp_l) = log(learner PPL / sampler PPL); also abs,
max, min |
| `ppl_ratio` | mean over responses of learner PPL / sampler PPL |
| `chi2_token` | mean_t w^2 - 1 = chi^2(learner || sampler) estimated on sampler draws (verl's direction) |
| `chi2_seq` | mean over responses of (prod_t w)^2 - 1 |
| `rollout_probs_diff_*` | max / mean / std over tokens of abs(p_s - p_l) (verl's `training/` debug metrics) |
| `rollout_actor_probs_pearson_corr` | Pearson correlation of p_s and p_l over tokens |
| `max_mismatch_*`, `mean_mismatch_*` | per response max_t / mean_t abs(p_s - p_l) (Yao et al. 2025), summarised over
responses |
| `token_is_*`, `seq_is_*` | the raw importance weights w (token) and prod_t w (sequence): mean, std, min, max,
quantiles, ESS |

ESS = (sum w)^2 / (n sum w^2), in (0, 1]: 1 when every weight is equal. Log-ratios are clamped to +-20 before exp
(verl's SAFETY_BOUND); k1 and the PPLs use the raw log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ovkit.errors import OvkitError

SAFETY_BOUND = 20.0  # verl / ovkit.rl.correction: |log ratio| is clamped to this before exp
HIGH_MISMATCH = (
    0.5  # a response whose max abs(p_s - p_l) exceeds this is "high max mismatch" (Yao et al. 2025, fig. 7-8)
)
QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)
EMPTY_MESSAGE = "no sampled response tokens to compare: the rollouts are empty or every loss_mask is 0"


@dataclass
class Scores:
    """The compared tokens of N rollouts, flat: one entry per sampled response token (loss_mask 1)."""

    learner: np.ndarray  # [M] float64, logp_l
    sampler: np.ndarray  # [M] float64, logp_s
    response: np.ndarray  # [M] int64, index of the rollout (0..N-1)
    turn: np.ndarray  # [M] int64, assistant turn of the token (0 = first turn)
    n: int  # rollouts (every one has at least one compared token)
    meta: dict[str, list[Any]] = field(default_factory=dict)  # per rollout: category, source, reward, ...

    @classmethod
    def from_lists(
        cls,
        learner: Sequence[Sequence[float]],
        sampler: Sequence[Sequence[float]],
        mask: Sequence[Sequence[int]] | None = None,
        turns: Sequence[Sequence[int]] | None = None,
        meta: dict[str, Sequence[Any]] | None = None,
    ) -> Scores:
        """Per-rollout lists aligned with the response tokens; `mask` (default all ones) picks the compared
        tokens, `turns` gives each token's assistant turn (default 0). Rollouts without a compared token drop out."""
        lp, sp, resp, turn = [], [], [], []
        kept: list[int] = []
        for i, (l_row, s_row) in enumerate(zip(learner, sampler)):
            m_row = mask[i] if mask is not None else [1] * len(l_row)
            t_row = turns[i] if turns is not None else [0] * len(l_row)
            if not (len(l_row) == len(s_row) == len(m_row) == len(t_row)):
                raise ValueError(f"rollout {i}: learner, sampler, mask and turns have different lengths")
            picked = [j for j, m in enumerate(m_row) if m]
            if not picked:
                continue
            k = len(kept)
            kept.append(i)
            lp.extend(l_row[j] for j in picked)
            sp.extend(s_row[j] for j in picked)
            turn.extend(t_row[j] for j in picked)
            resp.extend([k] * len(picked))
        kept_meta = {key: [list(values)[i] for i in kept] for key, values in (meta or {}).items()}
        return cls(
            learner=np.asarray(lp, dtype=np.float64),
            sampler=np.asarray(sp, dtype=np.float64),
            response=np.asarray(resp, dtype=np.int64),
            turn=np.asarray(turn, dtype=np.int64),
            n=len(kept),
            meta=kept_meta,
        )

    @property
    def tokens(self) -> int:
        return int(self.learner.size)

    def select(self, tokens: np.ndarray) -> Scores:
        """The compared tokens where `tokens` (bool [M]) is true; rollouts left without a token drop out."""
        tokens = np.asarray(tokens, dtype=bool)
        kept = np.unique(self.response[tokens])
        new_index = np.full(self.n, -1, dtype=np.int64)
        new_index[kept] = np.arange(kept.size)
        return Scores(
            learner=self.learner[tokens],
            sampler=self.sampler[tokens],
            response=new_index[self.response[tokens]],
            turn=self.turn[tokens],
            n=int(kept.size),
            meta={key: [values[i] for i in kept] for key, values in self.meta.items()},
        )

    def select_responses(self, responses: np.ndarray) -> Scores:
        """The rollouts where `responses` (bool [N]) is true."""
        return self.select(np.asarray(responses, dtype=bool)[self.response])

    def padded(self) -> tuple[Any, Any, Any]:
        """[N, T] torch tensors (learner, sampler, mask) with each rollout's compared tokens left-aligned: the layout
        of ovkit.rl.correction."""
        # heavy: torch loads on first use, not at CLI start or in config checks
        import torch

        counts = np.bincount(self.response, minlength=self.n)
        width = int(counts.max()) if self.n else 0
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if self.n else np.zeros(0, dtype=np.int64)
        order = np.argsort(self.response, kind="stable")
        cols = np.arange(self.tokens) - starts[self.response[order]]
        learner = torch.zeros((self.n, width), dtype=torch.float64)
        sampler = torch.zeros((self.n, width), dtype=torch.float64)
        mask = torch.zeros((self.n, width), dtype=torch.bool)
        rows = torch.as_tensor(self.response[order])
        cols_t = torch.as_tensor(cols)
        learner[rows, cols_t] = torch.as_tensor(self.learner[order])
        sampler[rows, cols_t] = torch.as_tensor(self.sampler[order])
        mask[rows, cols_t] = True
        return learner, sampler, mask


def require_tokens(scores: Scores) -> None:
    if scores.tokens == 0:
        raise OvkitError(EMPTY_MESSAGE)


# ------------------------------------------------------------------------------------------------ per response


def per_response(scores: Scores) -> dict[str, np.ndarray]:
    """[N] arrays: compared tokens, mean logp (learner, sampler), sum of log-ratios, max and mean abs(p_s - p_l)."""
    n, resp = scores.n, scores.response
    count = np.bincount(resp, minlength=n).astype(np.float64)
    diff = np.abs(np.exp(scores.sampler) - np.exp(scores.learner))
    max_diff = np.zeros(n)
    np.maximum.at(max_diff, resp, diff)
    return {
        "tokens": count,
        "mean_logp_learner": np.bincount(resp, scores.learner, minlength=n) / count,
        "mean_logp_sampler": np.bincount(resp, scores.sampler, minlength=n) / count,
        "sum_log_ratio": np.bincount(resp, scores.learner - scores.sampler, minlength=n),
        "max_mismatch": max_diff,
        "mean_mismatch": np.bincount(resp, diff, minlength=n) / count,
    }


# ------------------------------------------------------------------------------------------------ the metrics


def _log_ratio(scores: Scores) -> np.ndarray:
    return np.clip(scores.learner - scores.sampler, -SAFETY_BOUND, SAFETY_BOUND)


def k3(scores: Scores) -> float:
    r = _log_ratio(scores)
    return float(np.mean(np.expm1(r) - r))  # expm1 keeps exp(r) - 1 - r accurate for tiny r


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson correlation; None when either side is constant (undefined, not NaN)."""
    if x.size < 2:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    if denom == 0:
        return None
    return float(np.sum(dx * dy) / denom)


def weight_stats(w: np.ndarray, prefix: str) -> dict[str, float]:
    """mean/std/min/max/quantiles and ESS = (sum w)^2 / (n sum w^2) of importance weights."""
    out = {
        f"{prefix}_mean": float(w.mean()),
        f"{prefix}_std": float(w.std()),
        f"{prefix}_min": float(w.min()),
        f"{prefix}_max": float(w.max()),
        f"{prefix}_eff_sample_size": float(w.sum() ** 2 / (w.size * np.sum(w * w))),
    }
    for q in QUANTILES:
        out[f"{prefix}_p{round(q * 100):02d}"] = float(np.quantile(w, q))
    return out


def mismatch_metrics(scores: Scores) -> dict[str, Any]:
    """Every metric of the module docstring for `scores` (which must hold at least one token)."""
    require_tokens(scores)
    r = _log_ratio(scores)
    per = per_response(scores)
    log_ppl_learner = -per["mean_logp_learner"]
    log_ppl_sampler = -per["mean_logp_sampler"]
    log_ppl_diff = per["mean_logp_sampler"] - per["mean_logp_learner"]
    p_s, p_l = np.exp(scores.sampler), np.exp(scores.learner)
    diff = np.abs(p_s - p_l)
    seq_log_w = np.clip(per["sum_log_ratio"], -SAFETY_BOUND, SAFETY_BOUND)
    max_mm, mean_mm = per["max_mismatch"], per["mean_mismatch"]
    out: dict[str, Any] = {
        "responses": scores.n,
        "tokens": scores.tokens,
        "k3_kl": k3(scores),
        "kl": float(np.mean(scores.sampler - scores.learner)),
        "training_ppl": float(np.mean(np.exp(log_ppl_learner))),
        "rollout_ppl": float(np.mean(np.exp(log_ppl_sampler))),
        "training_log_ppl": float(np.mean(log_ppl_learner)),
        "rollout_log_ppl": float(np.mean(log_ppl_sampler)),
        "log_ppl_diff": float(np.mean(log_ppl_diff)),
        "log_ppl_abs_diff": float(np.mean(np.abs(log_ppl_diff))),
        "log_ppl_diff_max": float(np.max(log_ppl_diff)),
        "log_ppl_diff_min": float(np.min(log_ppl_diff)),
        "ppl_ratio": float(np.mean(np.exp(log_ppl_diff))),
        "chi2_token": float(np.mean(np.exp(2 * r)) - 1.0),
        "chi2_seq": float(np.mean(np.exp(2 * seq_log_w)) - 1.0),
        "rollout_probs_diff_max": float(diff.max()),
        "rollout_probs_diff_mean": float(diff.mean()),
        "rollout_probs_diff_std": float(diff.std(ddof=1)) if diff.size > 1 else 0.0,
        "rollout_actor_probs_pearson_corr": pearson(p_s, p_l),
        "max_mismatch_mean": float(max_mm.mean()),
        "max_mismatch_p50": float(np.quantile(max_mm, 0.5)),
        "max_mismatch_p90": float(np.quantile(max_mm, 0.9)),
        "max_mismatch_max": float(max_mm.max()),
        "max_mismatch_frac_high": float(np.mean(max_mm > HIGH_MISMATCH)),
        "mean_mismatch_mean": float(mean_mm.mean()),
        "mean_mismatch_p90": float(np.quantile(mean_mm, 0.9)),
    }
    out.update(weight_stats(np.exp(r), "token_is"))
    out.update(weight_stats(np.exp(seq_log_w), "seq_is"))
    return out


# ------------------------------------------------------------------------------------------------ corrections


@dataclass
class Thresholds:
    """rl-train's correction options (same names and defaults as `ovkit rl-train`)."""

    correction_threshold: float = 2.0
    correction_lower: float | None = None
    geo_lower: float = 0.999
    geo_upper: float = 1.001
    behave_cap: float | None = 5.0
    veto_threshold: float | None = None


CORRECTION_MODES = ("token-tis", "seq-tis", "token-mis", "seq-mis", "geo-rs")


def correction_fractions(scores: Scores, th: Thresholds) -> dict[str, dict[str, Any]]:
    """For each correction mode of rl-train, the share of compared tokens (and of responses) it would clip (TIS:
    weight != ratio) or mask (MIS, geo-rs: token dropped), computed with rl-train's own `off_policy_weights`; plus
    the decoupled-PPO behaviour cap (rl-train's default guard) and the veto when a threshold is given."""
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch

    from ovkit.rl.correction import SAFETY_BOUND as RL_BOUND
    from ovkit.rl.correction import Correction, off_policy_weights

    require_tokens(scores)
    learner, sampler, mask = scores.padded()
    d = torch.where(mask, (learner - sampler).float(), torch.zeros_like(learner, dtype=torch.float32))
    d = d.clamp(-RL_BOUND, RL_BOUND)  # the ratios exactly as off_policy_weights forms them
    ratios = {"token": d.exp(), "sequence": d.sum(-1, keepdim=True).clamp(-RL_BOUND, RL_BOUND).exp().expand_as(d)}
    rows: dict[str, dict[str, Any]] = {}
    for mode in CORRECTION_MODES:
        corr = Correction(
            mode=mode,
            upper=th.correction_threshold,
            lower=th.correction_lower,
            geo_lower=th.geo_lower,
            geo_upper=th.geo_upper,
            behave_cap=None,
        )
        opw = off_policy_weights(learner, sampler, mask, corr)
        if mode.endswith("tis"):
            ratio = ratios["token" if mode == "token-tis" else "sequence"]
            hit = mask & ~torch.isclose(opw.weights, ratio, rtol=1e-6, atol=0.0)
            action = "clip"
        else:
            hit = mask & ~opw.keep
            action = "mask"
        rows[mode] = _fractions(hit, mask, action, _bounds(mode, th))
    if th.behave_cap is not None:
        opw = off_policy_weights(
            learner, sampler, mask, Correction(mode="none", behave_cap=th.behave_cap, behave_action="mask")
        )
        rows["behave-cap"] = _fractions(mask & ~opw.keep, mask, "mask", f"token ratio > {th.behave_cap:g}")
    if th.veto_threshold is not None:
        corr = Correction(mode="none", behave_cap=None, veto=th.veto_threshold)
        opw = off_policy_weights(learner, sampler, mask, corr)
        rows["veto"] = _fractions(mask & ~opw.keep, mask, "mask", f"any token ratio < {th.veto_threshold:g}")
    return rows


def _bounds(mode: str, th: Thresholds) -> str:
    if mode == "geo-rs":
        return f"geometric-mean ratio outside [{th.geo_lower:g}, {th.geo_upper:g}]"
    level = "token ratio" if mode.startswith("token") else "sequence ratio"
    if th.correction_lower is None:
        return f"{level} > {th.correction_threshold:g}"
    return f"{level} outside [{th.correction_lower:g}, {th.correction_threshold:g}]"


def _fractions(hit, mask, action: str, rule: str) -> dict[str, Any]:
    n_tok = max(int(mask.sum()), 1)
    seqs = mask.any(-1)
    return {
        "action": action,
        "rule": rule,
        "token_frac": float(hit.sum()) / n_tok,
        "seq_frac": float((hit.any(-1) & seqs).sum()) / max(int(seqs.sum()), 1),
    }
