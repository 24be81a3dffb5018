"""rl-train's algorithm menu as options: what the options refuse together, DAPO's overlong penalty in the optimised
reward and the metrics, and a real step on the tiny model for every loss type, ratio level, reward scaling,
top-entropy share and the truncated-completion mask."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import ROOT, TINY, rl_cfg, rl_groups, torchrun

from ovkit.errors import OvkitError
from ovkit.generate import Completion
from ovkit.rl.metrics import rollout_metrics
from ovkit.rl.shaping import score_with_overlong
from ovkit.rollouts.groups import Group


def _cfg(**kw):
    return rl_cfg("model", "data", "out", **kw)


def test_a_loss_type_sets_what_it_prescribes_when_left_at_its_default():
    cfg = _cfg(loss_type="dr_grpo")
    assert (cfg.loss_agg, cfg.scale_rewards) == ("seq-mean-token-sum-norm", "none")
    assert _cfg(loss_type="dapo").loss_agg == "token-mean"
    assert _cfg(loss_type="dr_grpo", loss_agg="seq-mean-token-sum-norm").loss_agg == "seq-mean-token-sum-norm"
    assert (_cfg().loss_type, _cfg().scale_rewards, _cfg().importance_sampling_level) == ("grpo", "group", "token")


@pytest.mark.parametrize(
    "kw, names",
    [
        ({"loss_type": "dr_grpo", "loss_agg": "seq-mean-token-mean"}, ("--loss-type dr_grpo", "--loss-agg")),
        ({"loss_type": "dr_grpo", "scale_rewards": "batch"}, ("--loss-type dr_grpo", "--scale-rewards")),
        ({"loss_type": "dapo", "loss_agg": "seq-mean-token-sum"}, ("--loss-type dapo", "--loss-agg")),
        ({"adv_std": False, "scale_rewards": "batch"}, ("--no-adv-std", "--scale-rewards batch")),
        ({"sapo_temperature_neg": 2.0}, ("--sapo-temperature", "grpo")),
        ({"loss_type": "sapo", "eps_clip_high": 0.3}, ("--loss-type sapo", "--eps-clip-high")),
        ({"loss_type": "cispo", "eps_clip": 0.1}, ("--loss-type cispo", "--eps-clip")),
        ({"overlong_buffer_len": 7}, ("--overlong-buffer-len", "--max-new-tokens")),
        ({"overlong_buffer_len": 2, "env": "verifier"}, ("--overlong-buffer-len", "--env")),
    ],
)
def test_combinations_without_meaning_are_refused_naming_both_options(kw, names):
    with pytest.raises(OvkitError) as e:
        _cfg(**kw)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_no_adv_std_reads_as_scale_rewards_none():
    assert _cfg(adv_std=False).scale_rewards == "none"


def _group(lengths, rewards):
    completions = [Completion(token_ids=[5] * n, text="x", logprobs=[0.0] * n) for n in lengths]
    return Group(prompt=None, index=0, version=0, completions=completions)


def test_the_overlong_penalty_enters_the_optimised_reward_and_the_metrics():
    def score(groups):
        for g in groups:
            n = len(g.completions)
            g.task_rewards, g.format_rewards, g.rewards = [1.0] * n, [0.0] * n, [1.0] * n
            g.parts = [{"accuracy": 1.0} for _ in range(n)]

    groups = [_group([2, 6, 8, 10], [1.0] * 4)]
    groups[0].prompt = type("P", (), {"category": "math"})()
    score_with_overlong(groups, score, max_len=10, buffer_len=4, factor=0.5)
    # start of the buffer = 6: lengths 2 and 6 free, 8 half-way (-0.25), 10 at the end (-0.5)
    assert groups[0].rewards == [1.0, 1.0, 0.75, 0.5]
    assert groups[0].task_rewards == [1.0] * 4  # the answer's score is left as scored
    m = rollout_metrics(groups)
    assert m["overlong/penalty_mean"] == pytest.approx(-0.1875) and m["overlong/frac"] == 0.5
    assert m["reward/optimised"] == pytest.approx(0.8125)


def _step(rl_assets, tmp_path, rewards, groups_hook=None, **kw):
    from ovkit.models import load
    from ovkit.rl.loop import trainable
    from ovkit.rl.update import train_step
    from ovkit.runtime.optim import adamw

    model_dir, data = rl_assets
    cfg = rl_cfg(model_dir, data, tmp_path / "unused", **kw)
    torch.manual_seed(0)
    model, processor = load(model_dir)
    model.eval()
    groups = rl_groups(model, processor, data, cfg, rewards)
    if groups_hook is not None:
        groups_hook(groups)
    params = trainable(model, cfg)
    optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    pad = processor.tokenizer.pad_token_id
    metrics = train_step(model, optimizer, params, groups, 0, pad, cfg.correction_config(), None, cfg.update_options())
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


REWARDS = [[1, 0, 1, 0], [1, 0, 0, 0.5]]


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "dr_grpo"},
        {"loss_type": "cispo"},
        {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05},
        {"importance_sampling_level": "sequence"},
        # on-policy GSPO-token is GRPO (value 1, each token's own gradient): its second minibatch is off-policy
        {"importance_sampling_level": "sequence-token", "ppo_minibatches": 2},
        {"scale_rewards": "batch"},
        {"top_entropy_quantile": 0.5},
    ],
    ids=lambda kw: "-".join(str(v) for v in kw.values()),
)
def test_every_menu_entry_trains_a_step_and_differs_from_grpo(rl_assets, tmp_path, one_thread, kw):
    base, base_weights = _step(rl_assets, tmp_path, REWARDS, ppo_minibatches=kw.get("ppo_minibatches", 1))
    metrics, weights = _step(rl_assets, tmp_path, REWARDS, **kw)
    assert metrics["skipped_updates"] == 0 and torch.isfinite(torch.tensor(metrics["pg_loss"]))
    assert metrics["grad_norm"] > 0
    # on-policy (ratio 1) CISPO's and SAPO's gradients are GRPO's: their losses differ (-A log p, -2A / tau), and the
    # others move the weights differently
    moved = any(not torch.equal(weights[n], base_weights[n]) for n in weights)
    assert moved or metrics["pg_loss"] != base["pg_loss"], f"{kw} trained what grpo does"


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "grpo", "importance_sampling_level": "token", "scale_rewards": "group"},
        {"top_entropy_quantile": 1.0, "mask_truncated_completions": False, "overlong_buffer_len": 0},
        {"loss_type": "dapo"},  # DAPO's surrogate is GRPO's clip-higher one, with today's default token-mean
    ],
    ids=["defaults", "off", "dapo"],
)
def test_what_today_trains_is_trained_bit_for_bit(rl_assets, tmp_path, one_thread, kw):
    m0, w0 = _step(rl_assets, tmp_path, REWARDS)
    m1, w1 = _step(rl_assets, tmp_path, REWARDS, **kw)
    assert all(torch.equal(w0[n], w1[n]) for n in w0) and m0["pg_loss"] == m1["pg_loss"]


def test_masked_truncated_completions_train_nothing(rl_assets, tmp_path, one_thread):
    def cut_all(groups):
        for g in groups:
            for c in g.completions:
                c.finish_reason = "length"

    metrics, _ = _step(rl_assets, tmp_path, REWARDS, groups_hook=cut_all, mask_truncated_completions=True)
    assert metrics["masked_truncated_frac"] == 1.0
    assert metrics["skipped_updates"] == 1 and metrics["grad_norm"] == 0.0
    metrics, _ = _step(rl_assets, tmp_path, REWARDS, groups_hook=cut_all)
    assert metrics["skipped_updates"] == 0 and "masked_truncated_frac" not in metrics


def test_the_top_entropy_tokens_are_the_steps_whatever_the_micro_batches(rl_assets, tmp_path, one_thread):
    # a threshold per micro-batch would pick other tokens in each of 4 micro-batches than in one
    _, whole = _step(rl_assets, tmp_path, REWARDS, top_entropy_quantile=0.3, micro_batch_size=8)
    _, split = _step(rl_assets, tmp_path, REWARDS, top_entropy_quantile=0.3, micro_batch_size=2)
    _, every = _step(rl_assets, tmp_path, REWARDS, micro_batch_size=2)
    assert all(torch.allclose(whole[n], split[n], atol=1e-6) for n in whole)
    assert not all(torch.allclose(every[n], split[n], atol=1e-6) for n in whole)


ALGORITHMS = sorted((ROOT / "examples" / "rl").glob("*.yaml"))


def test_every_algorithm_of_the_page_has_its_example():
    page = (ROOT / "commands" / "rl-train.md").read_text()
    assert {p.stem for p in ALGORITHMS} == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "top-entropy"}
    assert all(f"examples/rl/{p.name}" in page for p in ALGORITHMS)


@pytest.mark.parametrize("path", ALGORITHMS, ids=[p.stem for p in ALGORITHMS])
def test_each_algorithm_example_trains_on_the_tiny_model(rl_assets, tmp_path, cli, one_thread, path):
    import json

    model_dir, data = rl_assets
    small = [*TINY[:4], "--max-new-tokens", "40", *TINY[6:]]  # 40: room for the DAPO example's 32-token buffer
    out = tmp_path / "o"
    run = ["--model", model_dir, "--out", out, "--config", path, "--max-steps", "2", "--quiet"]
    code, _, err = cli("rl-train", data, *run, *small)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # a step trains unless no group had a signal (2 groups of 4 on the tiny model can tie)
    assert len(rows) == 2 and all(r["ovkit/skipped_updates"] == 0 or r["frac_reward_zero_std"] == 1 for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)
    if path.stem == "dapo":
        assert all(-1.0 <= r["ovkit/overlong/penalty_mean"] <= 0.0 for r in rows)
        assert all(1 <= r["ovkit/dynamic_sampling/gen_batches_max"] <= 3 for r in rows)


# -- dynamic sampling ------------------------------------------------------------------------------------------------


def _fake(tied: set[int], calls: list):
    """generate/score stand-ins: the group at stream position i has rewards [0, 0] when i is in `tied`, else [0, 1]."""

    def generate(indices):
        calls.append(list(indices))
        return [Group(prompt=None, index=i, version=0, completions=[]) for i in indices]

    def score(groups):
        for g in groups:
            g.rewards = [0.0, 0.0] if g.index in tied else [0.0, 1.0]

    return generate, score


def test_a_tied_groups_place_draws_again_at_its_own_stream_positions_up_to_the_bound():
    from ovkit.rl.rollout import draw_groups, redraw_index

    always = {3, *(redraw_index(3, d) for d in range(1, 5))}
    tied = {1, redraw_index(1, 1), *always}  # place 1 finds a signal at its 2nd redraw, place 3 never
    calls: list = []
    groups = draw_groups(*_fake(tied, calls), [0, 1, 2, 3], max_draws=4)
    assert [g.index for g in groups] == [0, redraw_index(1, 2), 2, redraw_index(3, 3)]
    assert [g.draws for g in groups] == [1, 3, 1, 4]
    assert calls == [
        [0, 1, 2, 3],
        [redraw_index(1, 1), redraw_index(3, 1)],
        [redraw_index(1, 2), redraw_index(3, 2)],
    ] + [[redraw_index(3, 3)]]
    assert len(calls) == 4  # the bound: at most max_draws generate calls, and a place draws at most max_draws groups


def test_which_groups_a_step_trains_does_not_depend_on_how_places_are_split_over_processes():
    from ovkit.rl.rollout import draw_groups, redraw_index

    tied = {0, 2, 5, redraw_index(2, 1), redraw_index(5, 1), redraw_index(5, 2)}
    one = draw_groups(*_fake(tied, []), list(range(8)), max_draws=3)
    shares = [draw_groups(*_fake(tied, []), list(range(r, 8, 2)), max_draws=3) for r in (0, 1)]
    assert [g.index for g in one] == [g.index for pair in zip(*shares) for g in pair]


def test_without_dynamic_sampling_a_place_draws_once():
    from ovkit.rl.rollout import draw_groups

    calls: list = []
    groups = draw_groups(*_fake({0, 1}, calls), [0, 1], max_draws=1)
    assert [g.index for g in groups] == [0, 1] and calls == [[0, 1]]


@pytest.mark.parametrize(
    "staleness, turns",
    [(0, {}), (1, {}), (0, {"env": "verifier", "max_turns": 2})],
    ids=["sync", "async", "multi-turn"],
)
def test_dynamic_sampling_trains_no_tied_group_but_at_the_bound_and_counts_it(rl_assets, tmp_path, staleness, turns):
    import json

    from ovkit.rl.loop import train_rl

    model_dir, data = rl_assets
    out = tmp_path / "o"
    cfg = rl_cfg(model_dir, data, out, max_steps=3, max_staleness=staleness, quiet=True, max_new_tokens=40, **turns)
    train_rl(dataclasses.replace(cfg, dynamic_sampling=True, max_num_gen_batches=8))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    filtered = sum(r["ovkit/dynamic_sampling/groups_filtered"] for r in rows)
    assert filtered > 0  # the tiny model ties groups: the filter ran
    if not staleness and not turns:  # and a redraw found a signal (a synchronous run is a function of its seed)
        assert any(r["ovkit/dynamic_sampling/groups_filtered"] > 7 * r["ovkit/dynamic_sampling/unfilled"] for r in rows)
    for r in rows:
        assert r["frac_reward_zero_std"] * cfg.prompts_per_step == r["ovkit/dynamic_sampling/unfilled"]
        assert 1 <= r["ovkit/dynamic_sampling/gen_batches_max"] <= 8
        if staleness:
            assert max(int(v) for v in r["ovkit/staleness/hist"]) <= staleness
        if turns:
            assert r["ovkit/turns/max"] <= 2


@pytest.mark.parametrize(
    "extra",
    [
        ["--dynamic-sampling", "--max-num-gen-batches", "4"],
        ["--scale-rewards", "batch", "--top-entropy-quantile", "0.5"],
    ],
    ids=["dynamic-sampling", "batch-std-top-entropy"],
)
def test_two_processes_train_what_one_process_does(rl_assets, tmp_path, extra):
    """As tests/test_rl_train.py's 2-process test: with --dynamic-sampling each place of a step redraws alone, so
    the 2 processes' trained groups, their rewards and the filter's counts are the one process's; the batch std and
    the top-entropy threshold are the step's over both processes, so the weights are the one process's."""
    import json

    from safetensors.torch import load_file

    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    args = ["rl-train", data, "--model", model_dir, "--prompts-per-step", "4", "--group-size", "4"]
    args += ["--max-new-tokens", "8", "--lr", "1e-2", "--warmup-ratio", "0", "--max-steps", "2"]
    args += ["--micro-batch-size", "3", "--reward-workers", "1", "--precision", "fp32", "--save-rollouts", "--quiet"]
    args += extra
    for n in (1, 2):
        run = torchrun(n, "-m", "ovkit", *args, "--out", str(tmp_path / f"p{n}"))
        assert run.returncode == 0, run.stderr[-3000:]
    one, two = tmp_path / "p1", tmp_path / "p2"
    for step in (1, 2):
        r1, r2 = (read_rollouts(d / "rollouts" / f"step-{step:06d}.parquet").to_pylist() for d in (one, two))
        key = lambda rows: sorted((r["group"], r["response_ids"], r["reward"]) for r in rows)  # noqa: E731
        assert key(r1) == key(r2) and len(r1) == 16
    m1, m2 = ([json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two))
    names = ("groups_filtered", "unfilled", "gen_batches_max") if "--dynamic-sampling" in extra else ()
    assert not names or sum(r["ovkit/dynamic_sampling/groups_filtered"] for r in m1) > 0
    for a, b in zip(m1, m2):
        assert all(a[f"ovkit/dynamic_sampling/{k}"] == b[f"ovkit/dynamic_sampling/{k}"] for k in names)
        assert b["reward"] == pytest.approx(a["reward"]) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=2e-5, msg=k)


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "cispo", "importance_sampling_level": "sequence"},
        {"loss_type": "sapo", "scale_rewards": "batch", "mask_truncated_completions": True},
        {"top_entropy_quantile": 0.2},
    ],
    ids=["cispo-sequence", "sapo-batch-masked", "top-entropy"],
)
def test_the_menu_keeps_one_device_read_per_step_on_one_process(rl_assets, tmp_path, kw):
    """tests/test_rl_syncs.py's count: the threshold of the top-entropy tokens is taken without a host read."""
    from test_rl_syncs import _learner_syncs, _ours

    model, data = rl_assets
    cfg = rl_cfg(model, data, tmp_path / "s", group_size=4, micro_batch_size=3, max_steps=1, quiet=True, **kw)
    (where,) = _learner_syncs(cfg)
    assert list(_ours(where).values()) == [1], dict(where)


@pytest.mark.parametrize("stage", [1, 2], ids=["answer", "think"])
def test_overlong_penalty_and_truncation_mask_at_both_stages(rl_assets, tmp_path, cli, one_thread, stage):
    """DAPO's overlong shaping end to end in each curriculum stage's prompt mode: with an 8-token budget that is all
    buffer, every completion (at least one token) is penalised, a cut one by exactly -1; the truncation mask's
    fraction is the fraction of completions cut at --max-new-tokens, both in the step's metrics."""
    import json

    model_dir, data = rl_assets
    small = [*TINY[:4], "--max-new-tokens", "8", *TINY[6:]]
    out = tmp_path / "o"
    shaping = ["--overlong-buffer-len", "8", "--mask-truncated-completions", "--stage", str(stage)]
    code, _, err = cli("rl-train", data, "--model", model_dir, "--out", out, "--max-steps", "1", *small, *shaping)
    assert code == 0, err
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cut = row["completions/clipped_ratio"]
    assert row["ovkit/masked_truncated_frac"] == pytest.approx(cut)
    assert -1.0 <= row["ovkit/overlong/penalty_mean"] < 0.0
    assert row["ovkit/overlong/penalty_mean"] <= -cut  # each cut completion contributes -1
