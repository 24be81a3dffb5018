"""The loss menu's parts against each paper's formula on hand-made tensors: batch-scaled advantages and dynamic
sampling's signal test."""

import math

import pytest
import torch

from ovkit.rl.advantages import group_advantages, groups_with_signal, zero_std_fraction

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def test_scale_rewards_group_batch_none():
    rewards = t(1.0, 0.0, 0.5, 0.5)  # group 0: mean 0.5; group 1 tied
    groups = torch.tensor([0, 0, 1, 1])
    batch_std = math.sqrt((0.25 + 0.25) / 4)  # population std of the whole batch
    batch = group_advantages(rewards, groups, eps=0.0, std="batch")
    assert torch.allclose(batch, torch.tensor([0.5 / batch_std, -0.5 / batch_std, 0.0, 0.0]))
    assert torch.equal(group_advantages(rewards, groups, std="group"), group_advantages(rewards, groups))
    assert torch.equal(group_advantages(rewards, groups, std="none"), group_advantages(rewards, groups, std=False))
    assert torch.allclose(group_advantages(rewards, groups, std="none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    with pytest.raises(ValueError, match="group, batch, none"):
        group_advantages(rewards, groups, std="global")


def test_groups_with_signal_are_the_groups_with_nonzero_advantages():
    groups = [[1.0, 1.0, 1.0], [1.0, 0.0], [0.3], [0.1 + 0.2, 0.3], [0.0, 0.0, 0.5]]
    assert groups_with_signal(groups) == [False, True, False, False, True]  # 0.1 + 0.2 != 0.3 by float noise alone
    assert groups_with_signal([]) == []
    gen = torch.Generator().manual_seed(8)
    groups = [torch.randint(0, 2, (4,), generator=gen).double().tolist() for _ in range(40)]
    rewards = torch.tensor([r for g in groups for r in g])
    ids = torch.arange(40).repeat_interleave(4)
    adv = group_advantages(rewards, ids)
    assert groups_with_signal(groups) == [bool(adv[ids == g].ne(0).any()) for g in range(40)]
    assert zero_std_fraction(rewards, ids) == pytest.approx(1 - sum(groups_with_signal(groups)) / 40)
