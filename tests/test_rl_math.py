"""Hand-computed values for the GRPO math: advantages, each clip branch, the behaviour-weight cap, every mismatch
correction, loss aggregation, KL estimators, and the staleness admission control."""

import math
import queue
import random
import threading

import pytest
import torch

from ovkit.rl.advantages import group_advantages, transform_rewards, zero_std_fraction
from ovkit.rl.correction import Correction, canonical_mode, off_policy_weights
from ovkit.rl.loss import aggregation_weights, decoupled_ppo_loss, kl_estimate, ppo_token_loss
from ovkit.rl.staleness import StalenessController, staleness_histogram


def t(*x):
    return torch.tensor(x, dtype=torch.float32)


# ---------------------------------------------------------------- advantages


def test_group_advantages_match_the_released_example():
    # rewards 1, 1, 1, 0.5, 0: mean 0.7, population std sqrt(0.8 / 5) = 0.4
    adv = group_advantages(t(1, 1, 1, 0.5, 0), torch.zeros(5, dtype=torch.long), eps=0.0)
    assert torch.allclose(adv, t(0.75, 0.75, 0.75, -0.5, -1.75), atol=1e-6)


def test_tied_group_and_singleton_give_exactly_zero():
    rewards = t(0.3, 0.3, 0.3, 1.0, 0.0, 0.7)
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups)
    assert adv[:3].eq(0).all() and adv[5] == 0  # tied group, group of one
    assert torch.allclose(adv[3:5], t(1.0, -1.0), atol=1e-5)  # mean 0.5, std 0.5
    assert zero_std_fraction(rewards, groups) == pytest.approx(2 / 3)


def test_reward_transform_and_its_effect_on_advantages():
    r = t(1.0, 0.0, 0.25)
    assert torch.allclose(transform_rewards(r), t(5.0, -5.0, -2.5))  # (r - 0.5) * 10
    g = torch.zeros(3, dtype=torch.long)
    # whitening removes the affine transform (up to eps): the transform matters for Dr. GRPO (std=False) and KL balance
    assert torch.allclose(group_advantages(transform_rewards(r), g), group_advantages(r, g), atol=1e-4)
    assert torch.allclose(
        group_advantages(transform_rewards(r), g, std=False), t(5.0, -5.0, -2.5) - (-2.5 / 3), atol=1e-5
    )


# ---------------------------------------------------------------- clip branches


@pytest.mark.parametrize(
    "adv, ratio, loss, low, high, grad",
    [
        (1.0, 1.5, -1.28, False, True, 0.0),  # A > 0, ratio above 1 + 0.28: clipped, no gradient
        (1.0, 1.1, -1.1, False, False, -1.1),  # A > 0 inside the window
        (1.0, 0.5, -0.5, False, False, -0.5),  # A > 0 below the window: unclipped (min picks the ratio)
        (-1.0, 0.5, 0.8, True, False, 0.0),  # A < 0, ratio below 1 - 0.2: clipped, no gradient
        (-1.0, 1.5, 1.5, False, False, 1.5),  # A < 0 above the window: unclipped
        (-1.0, 0.9, 0.9, False, False, 0.9),  # A < 0 inside
    ],
)
def test_each_clip_branch(adv, ratio, loss, low, high, grad):
    logp = torch.tensor([math.log(ratio)], requires_grad=True)
    out, clipped_low, clipped_high = ppo_token_loss(logp, torch.zeros(1), torch.tensor([adv]), 0.2, 0.28)
    out.sum().backward()
    assert float(out.detach()) == pytest.approx(loss, abs=1e-6)
    assert bool(clipped_low) == low and bool(clipped_high) == high
    assert float(logp.grad) == pytest.approx(grad, abs=1e-6)  # d(-A * ratio)/dlogp = -A * ratio


def test_symmetric_clip_when_eps_high_is_none():
    out, _, high = ppo_token_loss(torch.tensor([math.log(1.25)]), torch.zeros(1), torch.ones(1), 0.2, None)
    assert float(out) == pytest.approx(-1.2) and bool(high)


# ---------------------------------------------------------------- behaviour weight


def _ratios(*rs):
    """prox/behave log-probs whose token ratios are `rs` (one sequence)."""
    behave = torch.full((1, len(rs)), -1.0)
    return behave + torch.log(torch.tensor([rs])), behave, torch.ones(1, len(rs), dtype=torch.bool)


def test_behaviour_weight_cap_mask_and_clamp():
    prox, behave, mask = _ratios(6.0, 2.0, 0.5)
    masked = off_policy_weights(prox, behave, mask, Correction(behave_cap=5.0, behave_action="mask"))
    assert torch.allclose(masked.weights, t(0.0, 2.0, 0.5)[None], atol=1e-5)
    assert masked.keep.tolist() == [[False, True, True]]
    assert masked.stats["masked/behave_frac"] == pytest.approx(1 / 3)
    clamped = off_policy_weights(prox, behave, mask, Correction(behave_cap=5.0, behave_action="clamp"))
    assert torch.allclose(clamped.weights, t(5.0, 2.0, 0.5)[None], atol=1e-5)
    uncapped = off_policy_weights(prox, behave, mask, Correction(behave_cap=None))
    assert torch.allclose(uncapped.weights, t(6.0, 2.0, 0.5)[None], atol=1e-5)


def test_behaviour_weight_at_sequence_level_uses_the_geometric_mean():
    prox, behave, mask = _ratios(8.0, 8.0, 1 / 8)  # geometric mean 2
    w = off_policy_weights(prox, behave, mask, Correction(behave_level="sequence"))
    assert torch.allclose(w.weights, torch.full((1, 3), 2.0), atol=1e-5)
    prox, behave, mask = _ratios(8.0, 8.0, 1.0)  # geometric mean 4: above a cap of 3 -> the whole sequence goes
    w = off_policy_weights(prox, behave, mask, Correction(behave_cap=3.0, behave_level="sequence"))
    assert not w.keep.any() and w.stats["masked/seq_frac"] == 1.0


# ---------------------------------------------------------------- corrections


def test_token_tis_truncates_each_token():
    prox, behave, mask = _ratios(3.0, 1.5, 0.2)
    w = off_policy_weights(prox, behave, mask, Correction("token-tis", upper=2.0))
    assert torch.allclose(w.weights, t(2.0, 1.5, 0.2)[None], atol=1e-5)
    w = off_policy_weights(prox, behave, mask, Correction("token-tis", upper=2.0, lower=0.5))
    assert torch.allclose(w.weights, t(2.0, 1.5, 0.5)[None], atol=1e-5)


def test_seq_tis_truncates_the_sequence_product():
    prox, behave, mask = _ratios(3.0, 1.5, 0.2)  # product 0.9
    w = off_policy_weights(prox, behave, mask, Correction("seq-tis", upper=2.0))
    assert torch.allclose(w.weights, torch.full((1, 3), 0.9), atol=1e-5)
    prox, behave, mask = _ratios(3.0, 1.5, 1.0)  # product 4.5 -> 2
    w = off_policy_weights(prox, behave, mask, Correction("seq-tis", upper=2.0))
    assert torch.allclose(w.weights, torch.full((1, 3), 2.0), atol=1e-5)


def test_sequence_weights_sum_the_unclamped_log_ratios():
    """Per-token gaps of +30 and -29.5 cancel to a sequence log-ratio of 0.5: seq-IS weight e^0.5, geometric mean
    e^0.25 and the sequence-level behaviour weight follow the true sum (clamping each token to +-20 first gave e^0)."""
    prox, behave, mask = t(-1.0, -30.5)[None], t(-31.0, -1.0)[None], torch.ones(1, 2, dtype=torch.bool)
    seq = off_policy_weights(prox, behave, mask, Correction("seq-tis", upper=10.0, behave_cap=None))
    assert torch.allclose(seq.weights, torch.full((1, 2), math.exp(0.5)), rtol=1e-5)
    geo = off_policy_weights(prox, behave, mask, Correction("none", behave_level="sequence", behave_cap=None))
    assert torch.allclose(geo.weights, torch.full((1, 2), math.exp(0.25)), rtol=1e-5)
    token = off_policy_weights(prox, behave, mask, Correction("token-tis", upper=1e12, behave_cap=None))
    assert token.weights[0, 0] == pytest.approx(math.exp(20), rel=1e-5)  # one token's exp is still bounded


def test_mismatch_metrics_clamp_only_the_exponential():
    from ovkit.rl.metrics import mismatch_stats

    stats = mismatch_stats(t(-0.2, -50.0)[None], t(-0.2, -0.2)[None], torch.ones(1, 2, dtype=torch.bool))
    assert stats["mismatch/delta_logp_max"] == pytest.approx(49.8) and stats["mismatch/k1"] == pytest.approx(24.9)
    assert math.isfinite(stats["mismatch/vllm_kl"]) and stats["mismatch/vllm_kl"] == pytest.approx(
        (math.exp(-20) + 20 - 1) / 2
    )


def test_token_mis_masks_tokens_outside_the_bounds():
    prox, behave, mask = _ratios(3.0, 1.5, 0.2)
    w = off_policy_weights(prox, behave, mask, Correction("token-mis", upper=2.0, lower=0.5))
    assert torch.allclose(w.weights, t(0.0, 1.5, 0.0)[None], atol=1e-5)
    assert w.stats["masked/correction_frac"] == pytest.approx(2 / 3)


def test_seq_mis_keeps_or_masks_whole_sequences():
    prox_a, behave_a, _ = _ratios(1.2, 1.5, 1.0)  # product 1.8: kept, weight 1.8
    prox_b, behave_b, _ = _ratios(3.0, 1.5, 1.0)  # product 4.5: masked
    prox_c, behave_c, _ = _ratios(0.5, 0.5, 1.0)  # product 0.25 < lower 0.5: masked
    prox, behave = torch.cat([prox_a, prox_b, prox_c]), torch.cat([behave_a, behave_b, behave_c])
    w = off_policy_weights(
        prox, behave, torch.ones(3, 3, dtype=torch.bool), Correction("seq_sum_k1", upper=2.0, lower=0.5)
    )
    assert torch.allclose(w.weights[0], torch.full((3,), 1.8), atol=1e-5)
    assert not w.keep[1:].any()
    assert w.stats["masked/seq_frac"] == pytest.approx(2 / 3)


def test_geo_rs_masks_by_the_geometric_mean_and_keeps_the_behaviour_weight():
    prox_a, behave_a, _ = _ratios(1.0005, 0.9999, 1.0)  # geometric mean ~1.0001: kept
    prox_b, behave_b, _ = _ratios(1.01, 1.0, 1.0)  # ~1.0033: rejected
    prox, behave = torch.cat([prox_a, prox_b]), torch.cat([behave_a, behave_b])
    w = off_policy_weights(
        prox, behave, torch.ones(2, 3, dtype=torch.bool), Correction("geo-rs", geo_lower=0.999, geo_upper=1.001)
    )
    assert w.keep[0].all() and not w.keep[1].any()
    assert torch.allclose(w.weights[0], t(1.0005, 0.9999, 1.0), atol=1e-5)


def test_veto_rejects_a_sequence_with_one_catastrophic_token():
    prox_a, behave_a, _ = _ratios(1.0, 1e-5, 1.0)
    prox_b, behave_b, _ = _ratios(1.0, 0.5, 1.0)
    w = off_policy_weights(
        torch.cat([prox_a, prox_b]),
        torch.cat([behave_a, behave_b]),
        torch.ones(2, 3, dtype=torch.bool),
        Correction(veto=1e-4),
    )
    assert not w.keep[0].any() and w.keep[1].all()
    assert w.stats["masked/veto_frac"] == pytest.approx(0.5)


def test_padding_never_counts():
    prox, behave, _ = _ratios(100.0, 2.0, 1.0)
    mask = torch.tensor([[False, True, True]])  # the huge ratio sits on padding
    for mode in ("none", "seq-tis", "seq-mis", "geo-rs"):
        w = off_policy_weights(prox, behave, mask, Correction(mode, geo_upper=2.0))
        assert w.weights[0, 0] == 0 and w.keep[0, 1], mode
    assert off_policy_weights(prox, behave, mask, Correction("seq-tis", upper=10)).weights[0, 1] == pytest.approx(2.0)


def test_verl_aliases():
    assert canonical_mode("token") == "token-tis" and canonical_mode("sequence") == "seq-tis"
    assert canonical_mode("seq_mean_k1") == "geo-rs" and canonical_mode("seq_sum_k1") == "seq-mis"
    assert canonical_mode("token_mis") == "token-mis"
    with pytest.raises(ValueError):
        canonical_mode("seq_max_k9")


def test_all_masked_batch_trains_nothing_and_does_not_crash():
    prox, behave, mask = _ratios(9.0, 9.0)
    w = off_policy_weights(prox, behave, mask, Correction("token-mis", upper=2.0))
    assert w.stats["all_masked"] == 1.0 and not w.keep.any()
    logp = prox.clone().requires_grad_(True)
    parts = decoupled_ppo_loss(logp, prox, torch.ones_like(prox), w.weights, aggregation_weights(mask))
    parts.loss.backward()
    assert float(parts.loss.detach()) == 0.0 and torch.isfinite(logp.grad).all() and logp.grad.eq(0).all()


# ---------------------------------------------------------------- aggregation, loss, KL


def test_aggregation_modes():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    values = t(1, 2, 3, 100, 10, 100, 100, 100).view(2, 4)
    agg = lambda mode, **kw: float((values * aggregation_weights(mask, mode, **kw)).sum())  # noqa: E731
    assert agg("token-mean") == pytest.approx(16 / 4)
    assert agg("seq-mean-token-mean") == pytest.approx((2 + 10) / 2)
    assert agg("seq-mean-token-sum") == pytest.approx((6 + 10) / 2)
    assert agg("seq-mean-token-sum-norm", constant=8) == pytest.approx(16 / (2 * 8))


def test_masking_normalises_by_the_original_token_count():
    """A masked token must not raise the other tokens' weight in the loss (AReaL)."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    logp = torch.zeros(1, 4, requires_grad=True)
    weights = t(1, 1, 1, 0)[None]  # last token masked by a correction
    parts = decoupled_ppo_loss(logp, torch.zeros(1, 4), torch.ones(1, 4), weights, aggregation_weights(mask))
    parts.loss.backward()
    assert torch.allclose(logp.grad, t(-0.25, -0.25, -0.25, 0.0)[None])  # 1/4 each, not 1/3
    assert float(parts.loss.detach()) == pytest.approx(-0.75)


def test_micro_batches_sum_to_the_whole_batch_loss():
    torch.manual_seed(0)
    mask = torch.rand(6, 5) > 0.3
    logp, prox, adv = torch.randn(6, 5) * 0.1 - 1, torch.randn(6, 5) * 0.1 - 1, torch.randn(6, 1).expand(6, 5)
    agg = aggregation_weights(mask, "seq-mean-token-mean")
    w = mask.float()
    whole = decoupled_ppo_loss(logp, prox, adv, w, agg).loss
    parts = sum(
        decoupled_ppo_loss(logp[i : i + 2], prox[i : i + 2], adv[i : i + 2], w[i : i + 2], agg[i : i + 2]).loss
        for i in (0, 2, 4)
    )
    assert float(whole) == pytest.approx(float(parts), abs=1e-6)


def test_behaviour_weight_multiplies_the_surrogate():
    logp = torch.tensor([[0.0]], requires_grad=True)
    parts = decoupled_ppo_loss(logp, torch.zeros(1, 1), torch.tensor([[2.0]]), torch.tensor([[3.0]]), torch.ones(1, 1))
    assert float(parts.loss.detach()) == pytest.approx(-6.0)  # w * max(-A r, -A clip(r)) = 3 * -2


def test_kl_estimators_hand_values():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)  # r - log r - 1, r = 0.5
    parts = decoupled_ppo_loss(
        logp[None],
        logp[None],
        torch.zeros(1, 1),
        torch.ones(1, 1),
        torch.ones(1, 1),
        ref_logprobs=ref[None],
        kl_coef=0.1,
        kl_estimator="k1",
    )
    assert float(parts.loss) == pytest.approx(0.1 * math.log(2))


# ---------------------------------------------------------------- staleness


def test_admission_control_capacity():
    c = StalenessController(max_staleness=2, groups_per_step=2)
    assert c.capacity() == 6  # versions 0, 1, 2 may each be consumed 2 groups at a time
    assert c.acquire(4) == 4 and c.acquire(4) == 2
    assert c.acquire(1, timeout=0.01) == 0  # full: would be staler than 2 when consumed
    c.set_version(1)
    assert c.acquire(5) == 2
    resumed = StalenessController(0, 3, version=5)
    assert resumed.capacity() == 3


def test_async_producer_never_exceeds_max_staleness():
    """A fast producer and a slow consumer: staleness reaches ETA but never passes it."""
    eta, per_step, steps = 2, 3, 12
    ctrl = StalenessController(eta, per_step)
    buffer: queue.Queue = queue.Queue()
    sampler_version = [0]
    lock = threading.Lock()

    def produce():
        while True:
            n = ctrl.acquire(2)
            if n == 0:
                return
            with lock:
                v = sampler_version[0]
            for _ in range(n):
                buffer.put(v)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    seen = []
    rng = random.Random(0)
    for step in range(steps):
        versions = [buffer.get(timeout=5) for _ in range(per_step)]
        seen.extend(step - v for v in versions)
        threading.Event().wait(rng.random() * 0.01)  # "training"
        with lock:
            sampler_version[0] = step + 1
        ctrl.set_version(step + 1)
    ctrl.close()
    thread.join(timeout=5)
    assert max(seen) <= eta and min(seen) >= 0
    assert max(seen) == eta  # the producer ran ahead as far as it was allowed
    assert staleness_histogram(3, [3, 2, 2, 1]) == {"0": 1, "1": 2, "2": 1}


def test_synchronous_controller_is_on_policy():
    ctrl = StalenessController(0, 2)
    assert ctrl.acquire(5) == 2 and ctrl.acquire(1, timeout=0.01) == 0
