"""The loss menu against each paper's formula on hand-made tensors: GSPO (sequence and sequence-token ratio), CISPO,
SAPO, the top-entropy tokens, Dr. GRPO / DAPO aggregation, batch-scaled advantages, dynamic sampling's signal test and
the overlong shaping. Values are checked against hand computations, gradients where a method is defined by its
gradient, and each degenerate case against GRPO where the paper says they coincide."""

import math

import pytest
import torch

from ovkit.choices import AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS
from ovkit.rl.advantages import group_advantages, groups_with_signal, zero_std_fraction
from ovkit.rl.loss import (
    PRESCRIBED,
    aggregation_weights,
    decoupled_ppo_loss,
    importance_ratio,
    policy_token_loss,
    ppo_token_loss,
    sapo_token_loss,
)
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


def _batch(seed: int, rows: int = 6, width: int = 7):
    """Random right-padded rows (every row has at least one response token), per-row advantages broadcast,
    off-policy weights with some masked tokens, and entropies."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    logp = -torch.rand(rows, width, generator=g, dtype=D) * 2
    prox = logp + torch.randn(rows, width, generator=g, dtype=D) * 0.3
    adv = torch.randn(rows, 1, generator=g, dtype=D).expand(rows, width)
    weights = (
        mask
        * (torch.rand(rows, width, generator=g, dtype=D) > 0.15)
        * (0.5 + torch.rand(rows, width, generator=g, dtype=D))
    )
    ref = logp + torch.randn(rows, width, generator=g, dtype=D) * 0.1
    entropy = torch.rand(rows, width, generator=g, dtype=D) * 3
    return logp * mask, prox * mask, adv, weights, mask, ref, entropy


def _today(logp, prox, adv, weights, agg, eps=0.2, eps_high=0.28, ref=None, kl_coef=0.0):
    """rl-train's loss before the menu existed, written out: PPO's asymmetric clip on the token ratio to pi_prox,
    times the off-policy weights and the aggregation weights, plus k3 KL on the kept tokens."""
    ratio = torch.exp(logp - prox)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps, 1.0 + eps_high))
    loss = (pg * weights * agg).sum()
    if kl_coef:
        log_ratio = (ref - logp).clamp(-20, 20)
        loss = loss + kl_coef * ((log_ratio.exp() - log_ratio - 1) * (weights > 0) * agg).sum()
    return loss


# ---------------------------------------------------------------- defaults are today's loss


@pytest.mark.parametrize("agg_mode", AGGREGATIONS)
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_defaults_are_todays_loss_bit_for_bit(agg_mode, kl_coef, dtype):
    logp, prox, adv, weights, mask, ref, _ = (x.to(dtype) if x.is_floating_point() else x for x in _batch(1))
    agg = aggregation_weights(mask, agg_mode, constant=9)
    leaf = logp.clone().requires_grad_(True)
    new = decoupled_ppo_loss(leaf, prox, adv, weights, agg, ref_logprobs=ref, kl_coef=kl_coef).loss
    (new_grad,) = torch.autograd.grad(new, leaf)
    old_leaf = logp.clone().requires_grad_(True)
    old = _today(old_leaf, prox, adv, weights, agg, ref=ref, kl_coef=kl_coef)
    (old_grad,) = torch.autograd.grad(old, old_leaf)
    assert torch.equal(new, old) and torch.equal(new_grad, old_grad)
    assert torch.equal(policy_token_loss(logp, prox, adv, mask)[0], ppo_token_loss(logp, prox, adv)[0])


def test_unknown_loss_type_or_level_is_refused_with_the_choices():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="grpo, dr_grpo, dapo, cispo, sapo"):
        policy_token_loss(x, x, x, x > -1, loss_type="ppo")
    with pytest.raises(ValueError, match="token, sequence, sequence-token"):
        importance_ratio(x, x, x > -1, "seq")


# ---------------------------------------------------------------- GSPO


def test_sequence_ratio_is_the_geometric_mean_over_the_row_response_tokens():
    logp = t(-1.0, -2.0, -3.0, 0.0)[None]
    prox = t(-1.2, -2.4, -9.0, 0.0)[None]  # log-ratios 0.2, 0.4, 6.0 (padding), 0 (padding)
    mask = torch.tensor([[True, True, False, False]])
    for level in ("sequence", "sequence-token"):
        ratio = importance_ratio(logp, prox, mask, level)
        assert torch.allclose(ratio, torch.full((1, 4), math.exp(0.3), dtype=D)), level
        # a micro-batch trimmed to its longest row (rl.update: columns up to the plan's width) gives the same ratio
        assert torch.equal(importance_ratio(logp[:, :2], prox[:, :2], mask[:, :2], level), ratio[:, :2]), level
    assert torch.allclose(importance_ratio(logp, prox, mask)[0, :2], t(math.exp(0.2), math.exp(0.4)))


def _grad(logp, *args, **kwargs):
    """decoupled_ppo_loss(logp, *args, **kwargs).loss and its gradient w.r.t. `logp`."""
    leaf = logp.clone().requires_grad_(True)
    out = decoupled_ppo_loss(leaf, *args, **kwargs).loss
    (g,) = torch.autograd.grad(out, leaf)
    return out.detach(), g


def _token_grad(logp, *args, **kwargs):
    """The sum of policy_token_loss(logp, *args, **kwargs) and its gradient w.r.t. `logp`."""
    leaf = logp.clone().requires_grad_(True)
    out = policy_token_loss(leaf, *args, **kwargs)[0].sum()
    (g,) = torch.autograd.grad(out, leaf)
    return out.detach(), g


def test_gspo_gradient_is_the_papers():
    """GSPO (Zheng et al. 2025): grad = -(1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_i,t) on the unclipped
    sequences, 0 on a clipped one; the objective is (1/G) sum_i min(s_i A_i, clip(s_i) A_i)."""
    logp = t(-1.0, -2.0, -0.5, -1.5, -0.7, -3.0).view(2, 3)
    prox = logp - t(0.1, 0.2, 9.9, 0.3, 0.3, 0.3).view(2, 3)  # row 0: s = e^0.15 (2 tokens); row 1: s = e^0.3
    mask = torch.tensor([[True, True, False], [True, True, True]])
    adv = t(2.0, 1.0)[:, None].expand(2, 3)
    agg = aggregation_weights(mask, "seq-mean-token-mean")
    s0, s1 = math.exp(0.15), math.exp(0.3)
    for eps_high, clipped in ((0.5, False), (0.2, True)):  # 1 + 0.2 < e^0.3 = 1.35: row 1 is clipped (A > 0)
        loss, grad = _grad(
            logp, prox, adv, mask.to(D), agg, eps_clip_high=eps_high, importance_sampling_level="sequence"
        )
        row1 = min(s1, 1 + eps_high) * 1.0
        assert float(loss) == pytest.approx(-(s0 * 2.0 + row1) / 2)
        expected = torch.zeros(2, 3, dtype=D)
        expected[0, :2] = -s0 * 2.0 / 2 / 2
        expected[1] = 0.0 if clipped else -s1 * 1.0 / 2 / 3
        assert torch.allclose(grad, expected), eps_high


def test_gspo_token_routes_the_sequence_ratio_to_each_tokens_advantage():
    """GSPO-token: the value s_i, and grad log pi(y_i,t) weighted by s_i * A_i,t; with a per-row advantage it is
    GSPO's loss and gradient."""
    logp = t(-1.0, -2.0, -0.5).view(1, 3)
    prox = logp - t(0.1, 0.2, 0.3).view(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    agg = aggregation_weights(mask, "token-mean")
    s = math.exp(0.2)
    per_token = t(1.0, -2.0, 4.0)[None]
    _, grad = _grad(
        logp, prox, per_token, mask.to(D), agg, eps_clip_high=1.0, importance_sampling_level="sequence-token"
    )
    assert torch.allclose(grad, -s * per_token / 3)
    row = torch.full((1, 3), 1.5, dtype=D)
    seq, seq_grad = _grad(logp, prox, row, mask.to(D), agg, importance_sampling_level="sequence")
    tok, tok_grad = _grad(logp, prox, row, mask.to(D), agg, importance_sampling_level="sequence-token")
    assert torch.allclose(seq, tok) and torch.allclose(seq_grad, tok_grad)


@pytest.mark.parametrize("level", ["sequence", "sequence-token"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_on_one_token_responses_is_the_token_loss(level, loss_type):
    """One response token per row: the sequence ratio is the token ratio, so every loss is its token-level self."""
    logp, prox, adv, weights, mask, _, _ = _batch(2, rows=5, width=1)
    agg = aggregation_weights(mask)
    token, token_grad = _grad(logp, prox, adv, weights, agg, loss_type=loss_type)
    seq, seq_grad = _grad(logp, prox, adv, weights, agg, loss_type=loss_type, importance_sampling_level=level)
    assert torch.equal(seq, token) and torch.allclose(seq_grad, token_grad, rtol=1e-12, atol=0)


def test_gspo_with_equal_token_ratios_is_grpo():
    """Every token of a row with the same ratio: s_i equals each token ratio, and GSPO's gradient (s_i / |y_i| on
    each of |y_i| tokens' sum) equals GRPO's, clipped or not (GSPO paper, the relation to GRPO)."""
    mask = torch.tensor([[True, True, True], [True, True, False]])
    prox = -torch.ones(2, 3, dtype=D)
    logp = prox + t(0.1, 0.1, 0.1, 0.5, 0.5, 0.0).view(2, 3)  # row 1 above 1 + 0.28
    adv = t(-1.0, 2.0)[:, None].expand(2, 3)
    agg = aggregation_weights(mask)
    grpo, grpo_grad = _grad(logp, prox, adv, mask.to(D), agg)
    gspo, gspo_grad = _grad(logp, prox, adv, mask.to(D), agg, importance_sampling_level="sequence")
    assert torch.allclose(gspo, grpo) and torch.allclose(gspo_grad, grpo_grad)


# ---------------------------------------------------------------- CISPO


def test_cispo_clips_the_weight_and_every_token_keeps_its_gradient():
    """CISPO (MiniMax-M1): loss -sg(min(r, 1 + eps_high)) A log pi, gradient -w A with w held constant."""
    ratios = t(1.1, 2.0, 0.5, 0.5)
    adv = t(1.0, 1.0, -1.0, 1.0)
    prox = -torch.ones(4, dtype=D)
    logp = prox + ratios.log()
    w = t(1.1, 1.28, 0.5, 0.5)  # 2.0 truncated to 1 + 0.28; no lower bound
    loss, grad = _token_grad(logp, prox, adv, torch.ones(4), loss_type="cispo")
    assert torch.allclose(loss, (-w * adv * logp).sum())
    assert torch.allclose(grad, -w * adv)
    _, low, high = policy_token_loss(logp, prox, adv, torch.ones(4), loss_type="cispo")
    assert high.tolist() == [False, True, False, False] and not low.any()
    # PPO's clip gives no gradient to the 2.0 (A > 0) and 0.5 (A < 0) tokens; CISPO keeps both
    _, ppo_grad = _token_grad(logp, prox, adv, torch.ones(4))
    assert ppo_grad[1] == 0 and ppo_grad[2] == 0 and grad[1] != 0 and grad[2] != 0


def test_cispo_inside_the_clip_has_reinforces_ratio_gradient():
    """Where the weight is not truncated, CISPO's gradient is -r A (grad of -A r w.r.t. log pi), PPO's unclipped one."""
    logp, prox, adv, weights, mask, _, _ = _batch(3)
    prox = logp - torch.rand_like(logp) * 0.1 * mask  # ratios in [1, 1.1]: inside 1 + 0.28
    agg = aggregation_weights(mask)
    _, cispo = _grad(logp, prox, adv, weights, agg, loss_type="cispo")
    leaf = logp.clone().requires_grad_(True)
    (reinforce,) = torch.autograd.grad((-adv * torch.exp(leaf - prox) * weights * agg).sum(), leaf)
    assert torch.allclose(cispo, reinforce)


# ---------------------------------------------------------------- SAPO


def test_sapo_gate_values_and_its_temperatures():
    """SAPO: loss -A * 4/tau * sigmoid(tau (r - 1)), tau_pos where A > 0 and tau_neg elsewhere."""
    ratio = t(1.0, 1.5, 0.7, 1.2)
    adv = t(2.0, 1.0, -1.0, 0.0)
    loss, low, high = sapo_token_loss(ratio, adv, tau_pos=1.0, tau_neg=2.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = t(-2.0 * 4 * sig(0.0), -1.0 * 4 * sig(0.5), 1.0 * 2 * sig(2 * -0.3), 0.0)
    assert torch.allclose(loss, expected)
    assert not low.any() and not high.any()


def test_sapo_gradient_is_the_gate_derivative_and_grpos_on_policy():
    """d/dlog pi of the gate is 4 s (1 - s) r, s = sigmoid(tau (r - 1)): at r = 1 it is 1 whatever tau (SAPO: the
    on-policy gradient is the unclipped one, GRPO's), and it decays away from r = 1, faster for a larger tau."""
    prox = -torch.ones(5, dtype=D)
    ratios = t(1.0, 1.0, 1.3, 0.6, 1.3)
    logp = prox + ratios.log()
    adv = t(1.0, -2.0, 1.0, -1.0, 1.0)
    ones = torch.ones(5)
    for tau in (0.5, 1.0, 8.0):
        _, grad = _token_grad(logp, prox, adv, ones, loss_type="sapo", sapo_tau_pos=tau, sapo_tau_neg=tau)
        s = torch.sigmoid(tau * (ratios - 1))
        assert torch.allclose(grad, -adv * 4 * s * (1 - s) * ratios)
        _, grpo = _token_grad(logp, prox, adv, ones)
        assert torch.allclose(grad[:2], grpo[:2])  # on-policy tokens
    weight = lambda tau, r: 4 * torch.sigmoid(t(tau * (r - 1))) * (1 - torch.sigmoid(t(tau * (r - 1))))  # noqa: E731
    assert float(weight(2.0, 1.3)) < float(weight(1.0, 1.3)) < 1.0


# ---------------------------------------------------------------- micro-batches, top-entropy tokens


@pytest.mark.parametrize("level", IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_the_whole_batch_for_every_loss(loss_type, level):
    """Rows are never split, aggregation weights and the entropy threshold are the step's: micro-batch losses and
    gradients sum to the whole batch's."""
    logp, prox, adv, weights, mask, ref, entropy = _batch(4, rows=8)
    agg = aggregation_weights(mask, "seq-mean-token-mean")
    keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 0.4))
    kw = dict(loss_type=loss_type, importance_sampling_level=level, kl_coef=0.05, eps_clip_high=0.1)

    def loss(lp, rows):
        return decoupled_ppo_loss(
            lp[rows], prox[rows], adv[rows], weights[rows], agg[rows], ref_logprobs=ref[rows], pg_mask=keep[rows], **kw
        )

    leaf = logp.clone().requires_grad_(True)
    whole = loss(leaf, slice(0, 8))
    whole.loss.backward()
    whole_grad, leaf.grad = leaf.grad.clone(), None
    parts = [loss(leaf, slice(i, i + 3)) for i in (0, 3, 6)]
    sum(p.loss for p in parts).backward()
    assert torch.allclose(sum(p.loss for p in parts), whole.loss) and torch.allclose(leaf.grad, whole_grad)
    for name in ("clipped_low", "clipped_high", "tokens"):
        assert sum(getattr(p, name) for p in parts) == getattr(whole, name), name


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


def test_top_entropy_quantile_one_keeps_every_token():
    logp, prox, adv, weights, mask, ref, entropy = _batch(6)
    agg = aggregation_weights(mask)
    keep = high_entropy_mask(entropy, mask, entropy_threshold(entropy[mask], 1.0))
    assert torch.equal(keep, mask)
    plain = decoupled_ppo_loss(logp, prox, adv, weights, agg)
    masked = decoupled_ppo_loss(logp, prox, adv, weights, agg, pg_mask=keep)
    assert torch.equal(plain.loss, masked.loss) and torch.equal(plain.tokens, masked.tokens)


def test_top_entropy_mask_trains_the_policy_term_on_its_tokens_only():
    """The masked tokens get no policy gradient and leave the counts; the KL term still covers them (TRL)."""
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp = torch.zeros(1, 3, dtype=D)
    keep = torch.tensor([[True, False, True]])
    agg = aggregation_weights(mask)
    ref = t(-0.5, -0.5, -0.5)[None]
    parts = decoupled_ppo_loss(logp, logp, torch.ones(1, 3, dtype=D), mask.to(D), agg, pg_mask=keep)
    _, grad = _grad(logp, logp, torch.ones(1, 3, dtype=D), mask.to(D), agg, pg_mask=keep)
    assert float(parts.pg_loss) == pytest.approx(-2 / 3) and int(parts.tokens) == 2
    assert grad[0].tolist() == pytest.approx([-1 / 3, 0.0, -1 / 3])
    zero = torch.zeros(1, 3, dtype=D)
    with_kl = decoupled_ppo_loss(
        logp, logp, zero, mask.to(D), agg, pg_mask=keep, ref_logprobs=ref, kl_coef=1.0, kl_estimator="k1"
    )
    assert float(with_kl.kl) == pytest.approx(0.5)  # k1 = logp - ref = 0.5 on all three tokens, mean 0.5


# ---------------------------------------------------------------- Dr. GRPO, DAPO: aggregation and advantages


def test_prescribed_aggregations_are_trls_dr_grpo_and_dapo():
    """TRL: dr_grpo = sum(loss * mask) / (B * max_completion_length); dapo = sum(loss * mask) / tokens of the step."""
    assert set(PRESCRIBED) <= set(LOSS_TYPES)
    assert {p["loss_agg"] for p in PRESCRIBED.values()} <= set(AGGREGATIONS)
    assert PRESCRIBED["dr_grpo"]["scale_rewards"] in SCALE_REWARDS
    _, _, _, _, mask, _, values = _batch(7)
    dr = aggregation_weights(mask, PRESCRIBED["dr_grpo"]["loss_agg"], constant=16)
    assert torch.allclose((values * dr).sum(), (values * mask).sum() / (mask.shape[0] * 16))
    dapo = aggregation_weights(mask, PRESCRIBED["dapo"]["loss_agg"])
    assert torch.allclose((values * dapo).sum(), (values * mask).sum() / mask.sum())


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


# ---------------------------------------------------------------- dynamic sampling, overlong


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
