"""`rl-train --prox-logp loglinear` (AReaL's approximated proximal log-probs, ovkit.rl.proximal): the formula and its
version arithmetic on hand-made tensors (AReaL's own test values among them), the options it is refused with, the
no-grad proximal pass it skips, its measured error against the exact pi_prox, and tiny end-to-end runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import TINY, rl_cfg, rl_groups

from ovkit.errors import OvkitError
from ovkit.rl.proximal import loglinear_alpha, loglinear_prox

pytestmark = pytest.mark.usefixtures("one_thread")

D = torch.float64


# ---------------------------------------------------------------- the formula


def test_alpha_is_areals_version_arithmetic():
    # at step 5 (v_theta 5, v_prox 4): a sample d versions old gets 0 for d <= 1, then (d - 1) / d
    alpha = loglinear_alpha([5, 4, 3, 2, 1, 0], 5)
    torch.testing.assert_close(alpha, torch.tensor([0.0, 0.0, 1 / 2, 2 / 3, 3 / 4, 4 / 5]))
    # AReaL's tests/test_prox_approx.py: versions 0 and 2 at current version 4 -> 0.75 and 0.5; at step 0 nothing
    torch.testing.assert_close(loglinear_alpha([0, 2], 4), torch.tensor([0.75, 0.5]))
    assert loglinear_alpha([0, 0], 0).tolist() == [0.0, 0.0]


def test_loglinear_prox_known_values_and_its_endpoints_bit_for_bit():
    behave = torch.tensor([[-1.0, -2.0, -3.0], [-2.0, -0.3, -0.7]], dtype=D)
    theta = torch.tensor([[-1.5, -2.5, -3.5], [-2.2, -0.1, -1.9]], dtype=D)
    # AReaL's test: alpha 0.5 on row 0 -> -1.25, -2.25, -3.25; row 1 at alpha 0.5: -2.1, -0.2, -1.3
    half = loglinear_prox(behave, theta, torch.full((2, 1), 0.5, dtype=D))
    torch.testing.assert_close(half, torch.tensor([[-1.25, -2.25, -3.25], [-2.1, -0.2, -1.3]], dtype=D))
    assert torch.equal(loglinear_prox(behave, theta, torch.zeros(2, 1, dtype=D)), behave)  # alpha 0: behave
    assert torch.equal(loglinear_prox(behave, theta, torch.ones(2, 1, dtype=D)), theta)  # alpha 1: current
    # per row: row 0 takes behave, row 1 the current log-probs; float32 theta is computed in behave's dtype
    rows = loglinear_prox(behave, theta.float(), torch.tensor([[0.0], [1.0]]))
    assert rows.dtype == D and torch.equal(rows[0], behave[0]) and torch.equal(rows[1], theta.float()[1].to(D))


# ---------------------------------------------------------------- options


def _cfg(**kw):
    return rl_cfg("model", "data", "out", **kw)


def test_recompute_is_the_default():
    assert _cfg().prox_logp == "recompute" and _cfg().update_options().ppo.prox_logp == "recompute"
    assert _cfg(prox_logp="loglinear", max_staleness=2).prox_logp == "loglinear"


@pytest.mark.parametrize(
    "kw, names",
    [
        ({"max_staleness": 0}, ("--prox-logp loglinear", "--max-staleness 0")),
        ({"max_staleness": 1}, ("--prox-logp loglinear", "--max-staleness 1")),
        ({"max_staleness": 2, "top_entropy_quantile": 0.2}, ("--prox-logp loglinear", "--top-entropy-quantile")),
    ],
    ids=["synchronous", "staleness-1", "top-entropy"],
)
def test_loglinear_without_meaning_is_refused_naming_both_options(kw, names):
    with pytest.raises(OvkitError) as e:
        _cfg(prox_logp="loglinear", **kw)
    assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("staleness", ["0", "1"])
def test_the_cli_refuses_loglinear_synchronous_with_exit_2(rl_assets, tmp_path, cli, staleness):
    model, data = rl_assets
    out = tmp_path / "o"
    args = ["--model", model, "--out", out, "--prox-logp", "loglinear", "--max-staleness", staleness, *TINY]
    code, _, err = cli("rl-train", data, *args)
    assert code == 2 and "--prox-logp loglinear" in err and f"--max-staleness {staleness}" in err, err
    assert not out.exists() and not (tmp_path / "o.partial").exists()


def test_a_bad_value_is_refused_with_the_choices(rl_assets, tmp_path, cli):
    model, data = rl_assets
    code, _, err = cli("rl-train", data, "--model", model, "--out", tmp_path / "o", "--prox-logp", "linear", *TINY)
    assert code == 2 and "recompute" in err and "loglinear" in err, err


# ---------------------------------------------------------------- one step on the tiny model

REWARDS = [[1, 0, 1, 0], [1, 0, 0, 0.5]]
STEP = 4
VERSIONS = [2, 4]  # the two groups, at step 4: 2 versions old (alpha 1/2) and fresh (alpha 0)


def _step(rl_assets, **kw):
    """One train_step at STEP on groups of VERSIONS: (metrics, forward passes of the model, the model before, the
    trajectories)."""
    from ovkit.models import load
    from ovkit.rl.loop import trainable
    from ovkit.rl.update import train_step
    from ovkit.runtime.optim import adamw

    model_dir, data = rl_assets
    cfg = rl_cfg(model_dir, data, "unused", max_staleness=2, **kw)
    torch.manual_seed(0)
    model, processor = load(model_dir)
    model.eval()
    groups = rl_groups(model, processor, data, cfg, REWARDS)
    for g, v in zip(groups, VERSIONS):
        g.version = v
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    passes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda *_: passes.append(torch.is_grad_enabled()))
    params = trainable(model, cfg)
    optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    pad = processor.tokenizer.pad_token_id
    try:
        metrics = train_step(
            model, optimizer, params, groups, STEP, pad, cfg.correction_config(), None, cfg.update_options()
        )
    finally:
        hook.remove()
    return metrics, passes, (model, processor, before, groups, cfg)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_loglinear_skips_the_no_grad_proximal_pass(rl_assets, minibatches):
    # micro-batch 8: the whole batch (8 rows) is one no-grad forward, each minibatch one gradient forward
    _, recompute, _ = _step(rl_assets, ppo_minibatches=minibatches)
    _, loglinear, _ = _step(rl_assets, ppo_minibatches=minibatches, prox_logp="loglinear")
    assert loglinear == [True] * minibatches  # gradient passes only
    assert recompute == ([False] if minibatches > 1 else []) + [True] * minibatches


def test_loglinear_measures_its_error_against_the_exact_proximal_policy(rl_assets):
    """`loglinear/abs_error` is |exact - approximated log pi_prox| over the first minibatch's response tokens, the
    exact one recomputed here from the weights before the step; `loglinear/alpha` the token mean of the row weights;
    and the mismatch metrics read the approximation."""
    from ovkit.rl.update import prepare_step
    from ovkit.rollouts.trajectories import forward_all

    metrics, _, (model, processor, before, groups, cfg) = _step(rl_assets, ppo_minibatches=2, prox_logp="loglinear")
    model.load_state_dict(before, strict=False)
    update = cfg.update_options()
    sb = prepare_step(groups, STEP, processor.tokenizer.pad_token_id, model.config, update)
    with torch.no_grad():
        exact, _ = forward_all(model, sb.traj, 8, update.temperature)
    behave, mask = sb.traj.behave_logprobs, sb.traj.mask
    alpha = loglinear_alpha(sb.traj.versions, STEP)
    assert sorted(set(alpha.tolist())) == [0.0, 0.5]
    approx = loglinear_prox(behave, exact, alpha[:, None])
    first = torch.zeros_like(mask)
    first[torch.cat([p.row_index for p in sb.minibatches[0]])] = True
    first &= mask
    expected = float((exact - approx).abs()[first].mean())
    assert expected > 0 and metrics["loglinear/abs_error"] == pytest.approx(expected, rel=1e-3, abs=1e-6)
    n = mask.sum(-1).double()
    assert metrics["loglinear/alpha"] == pytest.approx(float((alpha.double() * n).sum() / n.sum()))
    assert 0 < metrics["loglinear/alpha"] < 0.5
    # the fresh group's tokens have pi_prox = pi_behave: the mismatch metrics see only the stale group's gap
    fresh = mask & (alpha[:, None] == 0)
    d = (approx - behave)[mask]
    assert float((approx - behave)[fresh].abs().max()) == 0.0
    assert metrics["mismatch/delta_logp_max"] == pytest.approx(float(d.abs().max()), rel=1e-3, abs=1e-6)
    for name in ("approx_logp", "behave_imp_weight", "importance_weight"):
        assert math.isfinite(metrics[f"loglinear/{name}"])
    assert metrics["skipped_updates"] == 0 and metrics["grad_norm"] > 0


def test_recompute_logs_no_approximation(rl_assets):
    metrics, _, _ = _step(rl_assets, ppo_minibatches=2)
    assert not any(k.startswith("loglinear/") for k in metrics)


# ---------------------------------------------------------------- end to end


def test_rl_train_loglinear_runs_asynchronously_and_logs_the_approximation(rl_assets, tmp_path, cli):
    model, data = rl_assets
    out = tmp_path / "o"
    args = ["--model", model, "--out", out, "--max-steps", "3", "--quiet", *TINY]
    args += ["--prox-logp", "loglinear", "--max-staleness", "2", "--ppo-minibatches", "2"]
    code, _, err = cli("rl-train", data, *args)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert all(math.isfinite(r[f"ovkit/loglinear/{k}"]) for k in ("approx_logp", "abs_error", "importance_weight"))
        assert 0.0 <= r["ovkit/loglinear/alpha"] <= 0.5 + 1e-6  # ages <= 2: alpha 0 or 1/2
        if r["ovkit/staleness/max"] <= 1:  # every sample 0 or 1 versions old: pi_prox is pi_behave
            assert r["ovkit/loglinear/alpha"] == 0.0 and r["ovkit/loglinear/behave_imp_weight"] == 1.0
    assert json.loads((out / "ovkit.json").read_text())["config"]["prox-logp"] == "loglinear"


def test_loglinear_reads_the_device_once_per_optimiser_step(rl_assets, tmp_path):
    """tests/test_rl_syncs.py's count: the versions' weights go to the device, nothing comes back but the usual."""
    from test_rl_syncs import _learner_syncs, _ours

    model, data = rl_assets
    cfg = rl_cfg(
        model,
        data,
        tmp_path / "s",
        group_size=4,
        micro_batch_size=3,
        ppo_minibatches=2,
        max_steps=1,
        quiet=True,
        prox_logp="loglinear",
        max_staleness=2,
    )
    (where,) = _learner_syncs(cfg)
    assert sum(where.values()) == sum(_ours(where).values()) == 2, dict(where)
