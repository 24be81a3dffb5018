"""A diverged run stops: a step whose loss or gradient norm is not finite is not applied (weights and optimiser
state as they were), a streak of --max-nonfinite-steps of them ends the run with exit 2 naming the step, the loss and
the usual causes, OUT is never written with non-finite weights, and the newest checkpoint from before the divergence
stays for --resume, which may lower --lr from there. One guard for every learner (ovkit.runtime.guard): sft and
rl-train are checked here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import TINY, config, rl_cfg, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def _poisoned_steps(monkeypatch, bad: set[int], seen: list | None = None):
    """ovkit.train.loop._step with the gradients and the loss of the steps in `bad` (1-based) made NaN, as an
    overflow would make them; `seen` gets (weights, AdamW step count) at the start of each step."""
    from ovkit.train import loop

    step = loop._step
    calls = [0]

    def poisoned(rt, scorer, batches):
        calls[0] += 1
        if seen is not None:
            params = [p for p in scorer.parameters() if p.requires_grad]
            state = rt._optimizer.state
            count = [float(state[p]["step"]) for p in params if "step" in state[p]]
            seen.append(([p.detach().clone() for p in params], count))
        nll, *rest = step(rt, scorer, batches)
        if calls[0] in bad:
            for p in scorer.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            nll = nll * float("nan")
        return (nll, *rest)

    monkeypatch.setattr(loop, "_step", poisoned)


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_one_non_finite_step_is_not_applied_and_the_run_goes_on(assets, tmp_path, monkeypatch, capsys):
    from ovkit.train import train

    seen: list = []
    _poisoned_steps(monkeypatch, {3}, seen)
    res = train(config("SFTConfig", assets, tmp_path / "out", max_steps=5))
    assert res.status == "done"
    (before_2, count_2), (before_3, count_3), (before_4, count_4) = seen[1], seen[2], seen[3]
    assert count_3 and count_4 == count_3 != count_2  # AdamW's step count did not move at step 3 ...
    assert all(torch.equal(b, c) for b, c in zip(before_3, before_4))  # ... nor did any weight
    assert any(not torch.equal(a, b) for a, b in zip(before_2, before_3))  # step 2 was applied
    assert any(not torch.equal(a, b) for a, b in zip(before_4, seen[4][0]))  # and step 4 again
    rows = _metrics(tmp_path / "out")
    assert [r["ovkit/skipped_updates"] for r in rows] == [0, 0, 1, 0, 0]
    assert math.isnan(rows[2]["loss"]) and math.isfinite(rows[-1]["loss"])
    summary = json.loads((tmp_path / "out" / "ovkit.json").read_text())["metrics"]
    assert summary["skipped_nonfinite"] == 1 and math.isfinite(summary["final_loss"])
    assert all(torch.isfinite(t).all() for t in weights(tmp_path / "out").values())
    assert "step 3: loss nan, grad norm nan: not applied (1 of --max-nonfinite-steps 3 in a row)" in (
        capsys.readouterr().err
    )


def test_a_streak_stops_the_run_and_resume_with_a_lower_lr_goes_on_from_before_it(
    assets, tmp_path, monkeypatch, capsys
):
    from ovkit.errors import OvkitError
    from ovkit.runtime import list_checkpoints
    from ovkit.train import train

    out, partial = tmp_path / "out", tmp_path / "out.partial"
    cfg = dict(max_steps=8, save_every=1, keep_checkpoints=3, lr=1e-3)
    _poisoned_steps(monkeypatch, {3, 4, 5, 6, 7, 8})
    with pytest.raises(OvkitError) as e:
        train(config("SFTConfig", assets, out, **cfg))
    message = str(e.value)
    assert "diverged at step 5: loss nan" in message and "steps 3-5, 3 in a row" in message
    assert "--lr 0.001" in message and "--precision fp32" in message
    assert f"--resume and a lower --lr to continue from {partial / 'checkpoints' / 'step-000001'}" in message
    assert not out.exists()  # never marked complete
    # step 2's weights are those steps 3-5 failed from: set aside, so --resume takes step 1's
    assert [p.name for p in list_checkpoints(partial)] == ["step-000001"]
    assert (partial / "checkpoints" / "step-000002.diverged").is_dir()
    assert json.loads((partial / "diverged.json").read_text())["step"] == 5
    monkeypatch.undo()
    # the same options but --lr are still refused; a lower --lr resumes from step 1 and finishes
    with pytest.raises(OvkitError, match="--batch-size 4 -> 2"):
        train(config("SFTConfig", assets, out, **{**cfg, "lr": 5e-4, "batch_size": 2}, resume=True))
    capsys.readouterr()
    res = train(config("SFTConfig", assets, out, **{**cfg, "lr": 5e-4}, resume=True))
    assert res.metrics["resumed_from"].endswith("step-000001")
    assert "note: --resume from step-000001, before the divergence: --lr 0.001 -> 0.0005" in capsys.readouterr().err
    provenance = json.loads((out / "ovkit.json").read_text())
    assert provenance["diverged_before"]["step"] == 5 and provenance["config"]["lr"] == 5e-4
    assert not (out / "diverged.json").exists()
    rows = _metrics(out)  # step 1 from the first run, steps 2-8 at the lower lr (the schedule replayed on it)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(0 < r["learning_rate"] <= 5e-4 for r in rows[1:]) and rows[0]["learning_rate"] > 5e-4
    assert all(torch.isfinite(t).all() for t in weights(out).values())


def test_without_a_divergence_resume_still_refuses_a_changed_lr(assets, tmp_path, monkeypatch):
    from helpers import dies_at_first_checkpoint

    from ovkit.errors import OvkitError
    from ovkit.train import train

    cfg = dict(max_steps=4, save_every=2)
    with dies_at_first_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):
        train(config("SFTConfig", assets, tmp_path / "out", **cfg))
    with pytest.raises(OvkitError, match="--lr"):
        train(config("SFTConfig", assets, tmp_path / "out", **cfg, lr=5e-4, resume=True))


def test_sft_at_a_huge_lr_exits_2_naming_the_step_and_lr_and_writes_no_output(assets, rl_assets, tmp_path, cli):
    """The issue's command: the tiny default's width (the micro model of `assets` only saturates at this lr)."""
    out = tmp_path / "out"
    code, stdout, err = cli(
        "sft",
        assets / "data",
        "--model",
        rl_assets[0],
        "--out",
        out,
        "--lr",
        "1e6",
        "--max-steps",
        "6",
        "--batch-size",
        "4",
        "--precision",
        "fp32",
        "--quiet",
    )
    assert code == 2, err
    assert "Traceback" not in err
    assert "sft: diverged at step" in err and "--lr 1e+06" in err and "OUT was not written" in err
    assert not out.exists() and (tmp_path / "out.partial").is_dir()


def test_weights_that_are_not_finite_are_never_saved(assets, tmp_path, monkeypatch):
    """The last line of defence: finite losses and norms, weights gone to inf (the guard cannot see it)."""
    from ovkit.errors import OvkitError
    from ovkit.runtime import Runtime
    from ovkit.train import train

    finish = Runtime.finish

    def blown(self, scorer, *a, **k):
        with torch.no_grad():
            next(p for p in scorer.parameters() if p.requires_grad).fill_(float("inf"))
        return finish(self, scorer, *a, **k)

    monkeypatch.setattr(Runtime, "finish", blown)
    with pytest.raises(OvkitError, match="the weights after step 3 are not finite"):
        train(config("SFTConfig", assets, tmp_path / "out", max_steps=3))
    assert not (tmp_path / "out").exists()


def _poisoned_rl_losses(monkeypatch, bad: set[int], seen: list):
    """rl-train's PPO loss made NaN (and so its gradients) at the optimiser steps in `bad` (1-based); `seen` gets the
    trainable weights before and after each train_step."""
    from ovkit.rl import loop, update

    loss_fn, step_fn = update.decoupled_ppo_loss, loop.train_step
    calls = [0]

    def loss(*a, **k):
        parts = loss_fn(*a, **k)
        if calls[0] in bad:
            parts.loss = parts.loss * float("nan")
        return parts

    def step(model, optimizer, params, *a, **k):
        calls[0] += 1
        count = lambda: [float(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state[p]]  # noqa: E731
        before = ([p.detach().clone() for p in params], count())
        metrics = step_fn(model, optimizer, params, *a, **k)
        seen.append((before, ([p.detach().clone() for p in params], count())))
        return metrics

    monkeypatch.setattr(update, "decoupled_ppo_loss", loss)
    monkeypatch.setattr(loop, "train_step", step)


def test_rl_train_skips_a_non_finite_step_through_the_same_guard(rl_assets, tmp_path, monkeypatch):
    from ovkit.rl.loop import train_rl

    model, data = rl_assets
    seen: list = []
    _poisoned_rl_losses(monkeypatch, {2}, seen)
    out = tmp_path / "out"
    train_rl(rl_cfg(model, data, out, max_steps=3, quiet=True, precision="fp32"))
    (before, after) = seen[1]
    assert before[1] == after[1] == [1.0] * len(after[1])  # step 2: no AdamW step ...
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))  # ... and no weight changed
    assert seen[2][1][1] == [2.0] * len(after[1])  # step 3 was applied again
    rows = _metrics(out)
    assert [r["ovkit/skipped_updates"] for r in rows] == [0, 1, 0]
    assert [r["ovkit/nonfinite_updates"] for r in rows] == [0, 1, 0]
    assert json.loads((out / "ovkit.json").read_text())["metrics"]["skipped_nonfinite"] == 1


def test_rl_train_stops_after_the_streak_with_exit_2(rl_assets, tmp_path, monkeypatch):
    from ovkit.errors import OvkitError
    from ovkit.rl.loop import train_rl

    model, data = rl_assets
    _poisoned_rl_losses(monkeypatch, {1, 2}, [])
    out = tmp_path / "out"
    with pytest.raises(OvkitError) as e:
        train_rl(rl_cfg(model, data, out, max_steps=4, max_nonfinite_steps=2, quiet=True, precision="fp32"))
    assert "rl-train: diverged at step 2" in str(e.value) and "--lr 0.001" in str(e.value)
    assert "no checkpoint from before it" in str(e.value)
    assert not out.exists() and (tmp_path / "out.partial").is_dir()


def test_rl_train_at_a_huge_lr_exits_2_without_output(rl_assets, tmp_path, cli):
    model, data = rl_assets
    out = tmp_path / "out"
    flags = [f if f != "1e-3" else "1e6" for f in TINY]
    code, _, err = cli(
        "rl-train", data, "--model", model, "--out", out, *flags, "--max-steps", "6", "--max-staleness", "0", "--quiet"
    )
    assert code == 2, err
    assert "rl-train: diverged at step" in err and "--lr 1e+06" in err and "Traceback" not in err
    assert not out.exists()
