"""Off-policy weights: the behaviour weight of decoupled PPO and the sampler/learner mismatch corrections.

Every trajectory was sampled by the sampler (`behave_logprobs`), which may be several versions old and may compute
probabilities differently from the learner (bf16/int8 kernels, vLLM). The learner recomputes `prox_logprobs` at the
start of the step, and one log-ratio per token, `prox - behave`, carries both gaps. What to do with it:

* the behaviour weight of AReaL's decoupled PPO, w = exp(prox - behave), capped (5.0 in LLaVA-OV-1.5-RL) with
  action `mask` (tokens above the cap train nothing) or `clamp` (w = min(w, cap)), at `token` or `sequence` level
  (a sequence's weight is the geometric mean of its token ratios, AReaL's `agg: mean`);
* one of the mismatch corrections, which replace that weight (they treat the same ratio; multiplying both would
  count it twice), while the behaviour cap stays as the outer guard:
  - `token-tis`: w_t = min(rho_t, C)                                     (TIS, Yao et al. 2025)
  - `seq-tis`:   w = min(prod_t rho_t, C) for every token of the sequence (Liu, Li et al. 2025)
  - `token-mis`: w_t = rho_t, tokens with rho_t outside [lower, C] masked (MIS, token level)
  - `seq-mis`:   w = prod_t rho_t, sequences outside [lower, C] masked     (Seq-MIS; verl preset 0.5_2.0)
  - `geo-rs`:    sequences whose geometric mean ratio is outside [geo_lower, geo_upper] masked; the behaviour weight
                 is kept (Geo-RS; verl preset seq_mean_k1 in 0.999_1.001)
* a veto (verl `rollout_token_veto_threshold`): a sequence with any token ratio below it is masked entirely.

Log-ratios are clamped to +-20 right before exp (verl's SAFETY_BOUND): a token's own, a sequence's sum, a sequence's
mean; never per token before summing, which would give a sequence whose large per-token gaps cancel the wrong weight. A
batch in which every token is masked gives zero
weights and `all_masked` in the stats; the loss is then exactly zero and the step is logged, not a crash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ovkit.choices import CORRECTIONS as MODES  # noqa: F401 (re-exported: one definition, torch-free)
from ovkit.choices import canonical_correction as canonical_mode  # noqa: F401

SAFETY_BOUND = 20.0


@dataclass
class Correction:
    """How the off-policy ratio prox/behave becomes a per-token weight (see the module docstring)."""

    mode: str = "none"
    upper: float = 2.0  # C: truncation (TIS) or rejection (MIS) threshold
    lower: float | None = None  # MIS: mask below; TIS: clamp below; None = no lower bound
    geo_lower: float = 0.999
    geo_upper: float = 1.001
    veto: float | None = None  # mask a sequence if any token ratio is below this
    behave_cap: float | None = 5.0  # None: no cap
    behave_action: str = "mask"  # mask | clamp
    behave_level: str = "token"  # token | sequence

    def __post_init__(self) -> None:
        self.mode = canonical_mode(self.mode)
        if self.behave_action not in ("mask", "clamp"):
            raise ValueError(f"behaviour-weight action must be mask or clamp, got {self.behave_action!r}")
        if self.behave_level not in ("token", "sequence"):
            raise ValueError(f"behaviour-weight level must be token or sequence, got {self.behave_level!r}")
        if self.upper <= 0 or (self.lower is not None and self.lower > self.upper):
            raise ValueError(
                f"correction thresholds need 0 <= lower <= upper, got lower={self.lower} upper={self.upper}"
            )
        if self.geo_lower > self.geo_upper:
            raise ValueError(f"geometric bounds need lower <= upper, got {self.geo_lower} > {self.geo_upper}")


@dataclass
class OffPolicyWeights:
    weights: torch.Tensor  # [N, T] float, 0 where a token trains nothing
    keep: torch.Tensor  # [N, T] bool: response tokens that still train
    stat_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # 0-dim, on the weights' device

    @property
    def stats(self) -> dict[str, float]:
        """The statistics as numbers (one device-to-host read; the learner reads `stat_tensors` with its others)."""
        return read(self.stat_tensors)


def read(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim tensors as floats, in one device-to-host read."""
    if not tensors:
        return {}
    return dict(zip(tensors, torch.stack([t.double() for t in tensors.values()]).tolist()))


def _safe_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


def _seq_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1, keepdim=True)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq.expand_as(mask).to(torch.float32)


def off_policy_weights(
    prox_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor, corr: Correction, stats: bool = True
) -> OffPolicyWeights:
    """Weights for the policy-gradient loss, one per token of the [N, T] layout (`mask` = response tokens), and
    their statistics (`stats=False`: none, for a micro-batch of the gradient pass). No device-to-host read."""
    mask = mask.bool()
    m = mask.to(torch.float32)
    log_ratio = torch.where(mask, (prox_logprobs - behave_logprobs).float(), torch.zeros_like(m))
    n_tok = m.sum(-1, keepdim=True).clamp(min=1)
    token_ratio = _safe_exp(log_ratio)
    seq_ratio = _broadcast(_safe_exp(_seq_sum(log_ratio, m)), m)
    geo_ratio = _broadcast(_safe_exp(_seq_sum(log_ratio, m) / n_tok), m)

    behave_weight = token_ratio if corr.behave_level == "token" else geo_ratio
    keep = mask.clone()
    above_cap = torch.zeros_like(mask)
    if corr.behave_cap is not None:
        above_cap = mask & (behave_weight > corr.behave_cap)
        if corr.behave_action == "mask":
            keep &= ~above_cap
        else:
            behave_weight = behave_weight.clamp(max=corr.behave_cap)

    weight, rejected = _correct(corr, token_ratio, seq_ratio, geo_ratio, behave_weight, mask)
    keep &= ~rejected
    vetoed = torch.zeros_like(mask)
    if corr.veto is not None:
        vetoed = _broadcast((mask & (token_ratio < corr.veto)).any(-1, keepdim=True), m).bool() & mask
        keep &= ~vetoed
    weight = torch.where(keep, weight, torch.zeros_like(weight))
    parts = _stats(behave_weight, weight, above_cap, rejected, vetoed, keep, mask, corr) if stats else {}
    return OffPolicyWeights(weight, keep, parts)


def _correct(corr: Correction, token_ratio, seq_ratio, geo_ratio, behave_weight, mask):
    """(weight, rejected) for the chosen mode; `rejected` marks tokens the correction masks."""
    lo = corr.lower
    none = torch.zeros_like(mask)
    if corr.mode == "none":
        return behave_weight, none
    if corr.mode in ("token-tis", "seq-tis"):
        ratio = token_ratio if corr.mode == "token-tis" else seq_ratio
        return ratio.clamp(min=lo, max=corr.upper), none
    if corr.mode in ("token-mis", "seq-mis"):
        ratio = token_ratio if corr.mode == "token-mis" else seq_ratio
        outside = (ratio > corr.upper) | ((ratio < lo) if lo is not None else none)
        return ratio, outside & mask
    outside = (geo_ratio < corr.geo_lower) | (geo_ratio > corr.geo_upper)  # geo-rs
    return behave_weight, outside & mask


def _stats(behave_weight, weight, above_cap, rejected, vetoed, keep, mask, corr: Correction) -> dict[str, torch.Tensor]:
    """Masked reductions over the response tokens (`behave_weight[mask]`) and the kept ones (`weight[keep]`), on the
    device: a boolean-mask index would make the host read its size back. Empty selections give 0."""
    m, k = mask.double(), keep.double()
    n, n_kept = m.sum().clamp(min=1), k.sum()
    any_kept = keep.any()
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    bw, w = behave_weight.double(), weight.double()

    def extreme(x, where, fn, fill):  # max/min over the selection, 0 when it is empty
        return torch.where(where.any(), fn(torch.where(where, x, torch.full_like(x, fill))), zero)

    kept_mean = (w * k).sum() / n_kept.clamp(min=1)
    kept_sq = (w * w * k).sum()
    seqs = mask.any(-1)
    seq_dropped = seqs & ~keep.any(-1)
    frac = lambda x: x.sum().double() / n  # noqa: E731
    return {
        "behave_weight/mean": (bw * m).sum() / n,
        "behave_weight/max": extreme(bw, mask, torch.amax, -torch.inf),
        "behave_weight/min": extreme(bw, mask, torch.amin, torch.inf),
        "behave_weight/above_cap_frac": frac(above_cap),
        "masked/behave_frac": frac(above_cap) if corr.behave_action == "mask" else zero,
        "masked/correction_frac": frac(rejected),
        "masked/veto_frac": frac(vetoed),
        "masked/token_frac": 1.0 - frac(keep),
        "masked/seq_frac": seq_dropped.sum().double() / seqs.sum().clamp(min=1),
        "is_weight/mean": kept_mean,
        "is_weight/std": torch.where(any_kept, ((((w - kept_mean) * k) ** 2).sum() / n_kept.clamp(min=1)).sqrt(), zero),
        "is_weight/min": extreme(w, keep, torch.amin, torch.inf),
        "is_weight/max": extreme(w, keep, torch.amax, -torch.inf),
        "is_weight/ess": torch.where(kept_sq > 0, (w * k).sum() ** 2 / (n_kept * kept_sq).clamp(min=1e-300), zero),
        "all_masked": (~any_kept).double(),
    }
