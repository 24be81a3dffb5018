"""The decoupled PPO loss of AReaL as LLaVA-OneVision-1.5-RL uses it, its aggregation, and the optional KL term.

    ratio   = exp(logprobs - prox_logprobs)                          within-step leg, PPO clip [1-eps, 1+eps_high]
    pg_loss = max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps_high))   per token
    loss    = sum_t pg_loss_t * w_t * agg_t                          w: off-policy weight (ovkit.rl.correction)

`agg_t` are aggregation weights computed once per step from the ORIGINAL response mask, before any token is
masked by the behaviour cap or a correction, so masking never inflates the other tokens' gradients (AReaL:
"normalise by the original token count"), and summing micro-batch losses gives exactly the whole-batch loss.

The surrogate and the ratio have a menu, under TRL's names (`loss_type`, `importance_sampling_level`); the defaults,
grpo at token level, are the loss above, bit for bit:
    grpo, dr_grpo, dapo   the clipped surrogate above; dr_grpo and dapo differ only in aggregation (PRESCRIBED)
    cispo                 -sg(min(ratio, 1 + eps_high)) * A * logprobs: the weight is clipped, never the gradient
    sapo                  -A * 4/tau * sigmoid(tau * (ratio - 1)): a soft gate instead of the clip
    level sequence        GSPO: one ratio per trajectory, exp(mean over its response tokens of logprobs - prox)
    level sequence-token  GSPO-token: that ratio's value, with each token's own gradient
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ovkit.choices import (  # noqa: F401 (re-exported: one definition, torch-free)
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    PRESCRIBED,
)


def aggregation_weights(
    mask: torch.Tensor, mode: str = "token-mean", constant: float | None = None, totals: Sequence[float] | None = None
) -> torch.Tensor:
    """Per-token weights whose masked sum of a per-token loss is the aggregated loss (verl's `loss_agg_mode`).

    token-mean: every response token of the batch counts once (AReaL, DAPO).
    seq-mean-token-mean: mean over sequences of each sequence's token mean (original GRPO).
    seq-mean-token-sum: mean over sequences of token sums.
    seq-mean-token-sum-norm: token sums over N * constant (constant normaliser, Dr. GRPO; default = longest).

    `totals` = (response tokens, sequences) of the whole batch, host values: the counts of the whole step when
    `mask` is one process's share of it (several processes normalise by the same global counts), and in any case
    what spares the learner reading them back from the device (rl-train knows them from the trajectories' lists).
    """
    m = mask.to(torch.float32)
    n_tok, n_seq = totals if totals is not None else (float(m.sum()), float(m.any(-1).sum()))
    n_seq = max(n_seq, 1.0)
    if mode == "token-mean":
        return m / max(n_tok, 1.0)
    if mode == "seq-mean-token-mean":
        return m / (m.sum(-1, keepdim=True).clamp(min=1) * n_seq)
    if mode == "seq-mean-token-sum":
        return m / n_seq
    if mode == "seq-mean-token-sum-norm":
        c = float(constant) if constant else float(m.shape[-1])
        return m / (n_seq * c)
    raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, got {mode!r}")


def ppo_token_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = 0.28,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (asymmetric clip, DAPO's clip-higher) -> (loss, clipped_low, clipped_high).

    clipped_low: A < 0 and ratio < 1 - eps (the clipped branch is active, no gradient);
    clipped_high: A > 0 and ratio > 1 + eps_high.
    """
    return clipped_surrogate(torch.exp(logprobs - prox_logprobs), advantages, eps_clip, eps_clip_high)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ppo_token_loss` on a given ratio (token- or sequence-level)."""
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_clip)
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    return loss, clipped_low, clipped_high


def importance_ratio(
    logprobs: torch.Tensor, prox_logprobs: torch.Tensor, mask: torch.Tensor | None, level: str = "token"
) -> torch.Tensor:
    """pi_theta / pi_prox for every token [B, T], at the given level.

    token: exp(logprobs - prox_logprobs).
    sequence (GSPO, Zheng et al. 2025, as TRL's importance_sampling_level="sequence"): each row's
        s_i = exp(mean over its response tokens of logprobs - prox_logprobs), on every token of the row; its gradient
        is s_i / |y_i| times each token's log-prob gradient, so a row's tokens together carry s_i * A_i.
    sequence-token (GSPO-token, verl's loss_mode=gspo): sg[s_i] * exp(logprobs - sg[logprobs]): the value s_i, the
        gradient s_i on each token's own log-prob, so per-token advantages keep their own weight.

    A row is one trajectory, right-padded (every assistant turn of a multi-turn one): the learner's layout
    (ovkit.rollouts.trajectories), in which a micro-batch never splits a row. `mask` marks the response tokens, so
    padding and observation tokens never enter the mean (the token level needs none).
    """
    log_ratio = logprobs - prox_logprobs
    if level == "token":
        return torch.exp(log_ratio)
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance sampling level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, got {level!r}"
        )
    m = mask.to(log_ratio.dtype)
    seq = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    if level == "sequence":
        return torch.exp(seq).expand_as(log_ratio)
    return torch.exp(seq.detach() + logprobs - logprobs.detach())


def cispo_token_loss(
    ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025): -sg(min(ratio, 1 + eps_high)) * A * logprobs -> (loss, low, high).

    The importance weight is truncated and detached, so every token keeps the gradient -w * A of its log-prob
    (PPO's clip zeroes it). Upper bound only, as the paper (eps_low^IS "set large") and TRL; verl also clips below
    at 1 - eps. `high` marks the truncated weights, whatever the advantage's sign; `low` is empty.
    """
    cap = 1.0 + eps_clip_high
    loss = -ratio.clamp(max=cap).detach() * advantages * logprobs
    high = ratio.detach() > cap
    return loss, torch.zeros_like(high), high


def sapo_token_loss(
    ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAPO (Gao et al. 2025, as TRL and verl): -A * f(ratio), f(r) = 4/tau * sigmoid(tau * (r - 1)), tau = tau_pos
    where A > 0, else tau_neg -> (loss, low, high); nothing is clipped, so `low` and `high` are empty.

    df/dlog r = 4 * s * (1 - s) * r with s = sigmoid(tau * (r - 1)): 1 on-policy (r = 1), the unclipped gradient,
    and smoothly smaller the farther r moves, faster for a larger tau (the paper: tau_neg > tau_pos).
    """
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    loss = -advantages * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return loss, none, none


def policy_token_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    eps_clip: float = 0.2,
    eps_clip_high: float | None = 0.28,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token surrogate of `loss_type` on the ratio of `importance_sampling_level` -> (loss, low, high)."""
    ratio = importance_ratio(logprobs, prox_logprobs, mask, importance_sampling_level)
    if loss_type == "cispo":
        return cispo_token_loss(ratio, logprobs, advantages, eps_clip if eps_clip_high is None else eps_clip_high)
    if loss_type == "sapo":
        return sapo_token_loss(ratio, advantages, sapo_tau_pos, sapo_tau_neg)
    if loss_type in LOSS_TYPES:
        return clipped_surrogate(ratio, advantages, eps_clip, eps_clip_high)
    raise ValueError(f"loss type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimators on samples (Schulman's k1, k2, k3; k3 is unbiased and >= 0)."""
    log_ratio = ref_logprobs - logprobs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        log_ratio = log_ratio.clamp(-20, 20)
        return log_ratio.exp() - log_ratio - 1
    raise ValueError(f"KL estimator must be one of {', '.join(KL_ESTIMATORS)}, got {kind!r}")


@dataclass
class LossParts:
    """The loss and its parts. The parts are detached 0-dim tensors on the loss's device: the learner sums them over
    micro-batches there and reads them once, with the step's other metrics (a read per part would stall a GPU)."""

    loss: torch.Tensor  # scalar to backpropagate
    pg_loss: torch.Tensor
    kl: torch.Tensor
    clipped_low: torch.Tensor  # token counts (not fractions): summed over micro-batches, divided by tokens at the end
    clipped_high: torch.Tensor
    tokens: torch.Tensor


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    agg_weights: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    mask: torch.Tensor | None = None,
    pg_mask: torch.Tensor | None = None,
) -> LossParts:
    """The loss of one (micro-)batch. `weights` is 0 on masked tokens (and on padding); `agg_weights` from
    `aggregation_weights` over the whole step. Advantages are per token (a trajectory's advantage broadcast).

    `mask`: the response tokens, for a sequence-level ratio (default: where `agg_weights` is nonzero, which
    `aggregation_weights` makes exactly the response mask). `pg_mask`: the tokens the policy-gradient term trains
    (ovkit.rl.shaping.high_entropy_mask); as TRL, the KL term still covers every kept token. `tokens` and the clip
    counts are over the tokens the policy-gradient term trains.
    """
    if mask is None and importance_sampling_level != "token":
        mask = agg_weights > 0
    pg, low, high = policy_token_loss(
        logprobs,
        prox_logprobs,
        advantages,
        mask,
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        eps_clip=eps_clip,
        eps_clip_high=eps_clip_high,
        sapo_tau_pos=sapo_tau_pos,
        sapo_tau_neg=sapo_tau_neg,
    )
    keep = weights > 0
    trained, pg_weights = (keep, weights) if pg_mask is None else (keep & pg_mask, weights * pg_mask)
    pg_loss = (pg * pg_weights * agg_weights).sum()
    loss = pg_loss
    kl_value = pg_loss.new_zeros(())
    if kl_coef and ref_logprobs is not None:
        kl_value = (kl_estimate(logprobs, ref_logprobs, kl_estimator) * keep * agg_weights).sum()
        loss = loss + kl_coef * kl_value
    return LossParts(
        loss=loss,
        pg_loss=pg_loss.detach(),
        kl=kl_value.detach(),
        clipped_low=(low & trained).sum(),
        clipped_high=(high & trained).sum(),
        tokens=trained.sum(),
    )
