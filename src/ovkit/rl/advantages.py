"""GRPO advantages: rewards are shifted and scaled, then whitened within each prompt's group.

LLaVA-OneVision-1.5-RL (AReaL): r' = (r + bias) * scale with bias -0.5 and scale 10, then
A_i = (r'_i - mean_group) / (std_group + eps). A group whose rewards are all equal carries no signal: its
advantages are exactly zero (not eps-amplified noise), so it trains nothing.
"""

from __future__ import annotations

import torch


def transform_rewards(rewards: torch.Tensor, bias: float = -0.5, scale: float = 10.0) -> torch.Tensor:
    """r' = (r + bias) * scale (the released `reward_bias` / `reward_scaling`)."""
    return (rewards + bias) * scale


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, std: bool = True
) -> torch.Tensor:
    """One advantage per trajectory: its reward minus the mean of its group, over the group's std (+ eps).

    `group_ids` labels each trajectory with its prompt's group (any integers; groups may differ in size). The std is
    the population std (divide by G), as in the released example (rewards 1, 1, 1, 0.5, 0 -> std 0.40). `std=False`
    only centres (Dr. GRPO). A group of one, or of equal rewards, gets zeros.
    """
    rewards = rewards.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, centred**2) / count
    group_std = var.sqrt()[inverse]
    tied = group_std <= 1e-12  # float noise in a tied group must not become a +-1/eps advantage
    adv = centred / (group_std + eps) if std else centred
    return torch.where(tied, torch.zeros_like(adv), adv).to(torch.float32)


def zero_std_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of groups whose rewards are all equal (TRL's `frac_reward_zero_std`): groups that train nothing."""
    groups = torch.unique(group_ids)
    if groups.numel() == 0:
        return 0.0
    tied = [bool((rewards[group_ids == g].max() - rewards[group_ids == g].min()).abs() <= 1e-12) for g in groups]
    return sum(tied) / len(tied)
