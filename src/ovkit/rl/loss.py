"""The decoupled PPO loss of AReaL as LLaVA-OneVision-1.5-RL uses it, its aggregation, and the optional KL term.

    ratio   = exp(logprobs - prox_logprobs)                          within-step leg, PPO clip [1-eps, 1+eps_high]
    pg_loss = max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps_high))   per token
    loss    = sum_t pg_loss_t * w_t * agg_t                          w: off-policy weight (ovkit.rl.correction)

`agg_t` are aggregation weights computed once per step from the ORIGINAL response mask, before any token is
masked by the behaviour cap or a correction, so masking never inflates the other tokens' gradients (AReaL:
"normalise by the original token count"), and summing micro-batch losses gives exactly the whole-batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ovkit.choices import AGGREGATIONS, KL_ESTIMATORS  # noqa: F401 (re-exported: one definition, torch-free)


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
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logprobs - prox_logprobs)
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_clip)
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    return loss, clipped_low, clipped_high


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
) -> LossParts:
    """The loss of one (micro-)batch. `weights` is 0 on masked tokens (and on padding); `agg_weights` from
    `aggregation_weights` over the whole step. Advantages are per token (a trajectory's advantage broadcast)."""
    pg, low, high = ppo_token_loss(logprobs, prox_logprobs, advantages, eps_clip, eps_clip_high)
    keep = weights > 0
    pg_loss = (pg * weights * agg_weights).sum()
    loss = pg_loss
    kl_value = pg_loss.new_zeros(())
    if kl_coef and ref_logprobs is not None:
        kl_value = (kl_estimate(logprobs, ref_logprobs, kl_estimator) * keep * agg_weights).sum()
        loss = loss + kl_coef * kl_value
    return LossParts(
        loss=loss,
        pg_loss=pg_loss.detach(),
        kl=kl_value.detach(),
        clipped_low=(low & keep).sum(),
        clipped_high=(high & keep).sum(),
        tokens=keep.sum(),
    )
