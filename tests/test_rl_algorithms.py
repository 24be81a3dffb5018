"""The loss menu's parts against each paper's formula on hand-made tensors: batch-scaled advantages, dynamic
sampling's signal test, the top-entropy tokens and the overlong shaping."""

import math

import pytest
import torch

from ovkit.rl.advantages import group_advantages, groups_with_signal, zero_std_fraction
from ovkit.rl.shaping import (
    entropy_threshold,
    high_entropy_mask,
    mask_truncated,
    overlong_penalty,
    truncated,
)

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def test_entropy_threshold_is_torch_quantile_and_picks_the_top_tokens():
    values = torch.rand(1000, generator=torch.Generator().manual_seed(5), dtype=D)
    for q in (0.0, 0.2, 0.5, 0.77, 1.0):
        assert torch.allclose(entropy_threshold(values, q), torch.quantile(values, 1 - q)), q
    entropy = t(0.1, 0.5, 0.9, 0.3, 7.0)[None]
    mask = torch.tensor([[True, True, True, True, False]])  # the 7.0 is padding
    threshold = entropy_threshold(entropy[mask], 0.5)  # median of 0.1, 0.3, 0.5, 0.9 = 0.4
    assert float(threshold) == pytest.approx(0.4)
    assert high_entropy_mask(entropy, mask, threshold).tolist() == [[False, True, True, False, False]]
    top = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 0.0))
    assert top.tolist() == [[False, False, True, False, False]]  # quantile 0: the highest-entropy token alone
    assert float(entropy_threshold(torch.zeros(0), 0.2)) == math.inf
    with pytest.raises(ValueError, match="quantile"):
        entropy_threshold(values, 1.5)


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


def test_overlong_penalty_is_dapos_and_matches_trl():
    from trl.rewards import get_soft_overlong_punishment

    lengths = [50, 80, 81, 90, 100, 101, 300]
    assert overlong_penalty(lengths, 100, 20) == pytest.approx([0, 0, -0.05, -0.5, -1.0, -1.0, -1.0])
    assert overlong_penalty(lengths, 100, 20) == pytest.approx(
        get_soft_overlong_punishment(100, 20)([[0] * n for n in lengths])
    )
    assert overlong_penalty([90, 120], 100, 20, penalty_factor=0.5) == pytest.approx([-0.25, -0.5])
    assert overlong_penalty([4], 4, 4) == pytest.approx([-1.0])  # the whole budget as buffer
    for bad in (0, 101):
        with pytest.raises(ValueError, match="overlong buffer"):
            overlong_penalty(lengths, 100, bad)


def test_truncated_completions_leave_the_mask():
    assert truncated("length") and not truncated("stop")
    assert truncated("stop", "truncated") and not truncated("length", "completed")
    assert not truncated("stop", "max_turns")
    mask = torch.ones(3, 4, dtype=torch.bool)
    kept = mask_truncated(mask, [False, True, False])
    assert kept.tolist() == [[True] * 4, [False] * 4, [True] * 4]
