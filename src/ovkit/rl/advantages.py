"""GRPO advantages: rewards are shifted and scaled, then whitened within each prompt's group.

LLaVA-OneVision-1.5-RL (AReaL): r' = (r + bias) * scale with bias -0.5 and scale 10, then
A_i = (r'_i - mean_group) / (std_group + eps). A group whose rewards are all equal carries no signal: its
advantages are exactly zero (not eps-amplified noise), so it trains nothing, and DAPO's dynamic sampling
(`groups_with_signal`) leaves it out of the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ovkit.choices import SCALE_REWARDS

# A group's rewards are tied when their std is at most this: float noise in a tied group must not become a +-1/eps
# advantage, and such a group counts as one without signal.
TIE = 1e-12


def transform_rewards(rewards: torch.Tensor, bias: float = -0.5, scale: float = 10.0) -> torch.Tensor:
    """r' = (r + bias) * scale (the released `reward_bias` / `reward_scaling`)."""
    return (rewards + bias) * scale


def _centred(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each reward minus its group's mean, its group's population std), per trajectory, in float64."""
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / count
    return centred, var.sqrt()[inverse]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    eps: float = 1e-6,
    std: bool | str = True,
    batch_std: float | None = None,
) -> torch.Tensor:
    """One advantage per trajectory: its reward minus the mean of its group, over a std (+ eps).

    `group_ids` labels each trajectory with its prompt's group (any integers; groups may differ in size). `std` says
    which std divides, as TRL's `scale_rewards`: "group" (or True) the group's; "batch" the whole batch's (group
    mean, batch std: Liu et al. 2025, "Tricks or Traps"); "none" (or False) none, the centred reward (Dr. GRPO). Both
    stds are population stds (divide by G), as in the released example (rewards 1, 1, 1, 0.5, 0 -> std 0.40); TRL
    divides by G - 1. A group of one, or of equal rewards, gets zeros. `batch_std`: the batch's std when the batch
    is wider than `rewards` (the step's rewards over several processes).
    """
    scale = {True: "group", False: "none"}.get(std, std)
    if scale not in SCALE_REWARDS:
        raise ValueError(f"reward scaling must be one of {', '.join(SCALE_REWARDS)}, got {std!r}")
    centred, group_std = _centred(rewards, group_ids)
    tied = group_std <= TIE
    if scale == "group":
        adv = centred / (group_std + eps)
    elif scale == "batch":
        spread = rewards.to(torch.float64).std(correction=0) if batch_std is None else batch_std
        adv = centred / (spread + eps)
    else:
        adv = centred
    return torch.where(tied, torch.zeros_like(adv), adv).to(torch.float32)


def groups_with_signal(rewards: Sequence[Sequence[float]]) -> list[bool]:
    """For each group's rewards, whether it carries a learning signal: whether they are not all equal.

    DAPO's dynamic sampling (verl's `filter_groups` with its metric = the reward: a group is kept when the std of its
    values is > 0) drops the others and samples again. The test is `group_advantages`' own (float64 std, tie
    tolerance), so a kept group is exactly one with a nonzero advantage. A group of one carries none (verl keeps it:
    with one sample per prompt nothing could be trained otherwise; here its advantage is 0 whatever its reward).
    """
    flat = torch.tensor([r for group in rewards for r in group], dtype=torch.float64)
    ids = torch.tensor([g for g, group in enumerate(rewards) for _ in group], dtype=torch.long)
    _, group_std = _centred(flat, ids)
    std_of = dict(zip(ids.tolist(), group_std.tolist()))
    return [std_of.get(g, 0.0) > TIE for g in range(len(rewards))]


def zero_std_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of groups whose rewards are all equal (TRL's `frac_reward_zero_std`): groups that train nothing."""
    groups = [rewards[group_ids == g].tolist() for g in torch.unique(group_ids)]
    return (len(groups) - sum(groups_with_signal(groups))) / len(groups) if groups else 0.0
