"""Evaluation while training (--eval-data / --eval-every, ovkit.evaluate.during): the held-out metrics land in
metrics.jsonl at the right steps, equal an independent computation on the saved model (and `ovkit eval`'s numbers),
and leave the training trajectory bit-identical."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ENV, config, losses, make_rows, rl_cfg, torchrun, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def eval_data(tmp_path_factory):
    """8 held-out rows of the train table's kind (other seed), with the gold answer and category `ovkit eval` reads."""
    from ovkit.data.parts import write_samples
    from ovkit.data.schema import samples_table

    rows = make_rows(8, seed=1)
    for r in rows:
        answer = r["messages"][-1]["content"].split("<answer>")[1].split("</answer>")[0]
        colour = not answer.isdigit()
        r.update(
            answer=answer, answer_type="string" if colour else "number", category="colour" if colour else "counting"
        )
    path = tmp_path_factory.mktemp("eval-data") / "eval"
    write_samples(samples_table(rows), path, None)
    return path


def _held_out_nll(model_dir: Path, data: Path) -> float:
    """The token-mean NLL of every row's last assistant turn under the saved model, one row at a time."""
    from ovkit.data.io import read_samples
    from ovkit.models import load
    from ovkit.models.encode import decode_images, encode_sample
    from ovkit.pack.batches import collate_padded, target_tokens
    from ovkit.pack.packed import PackLayout
    from ovkit.train.loop import token_nll_sum

    model, processor = load(model_dir, dtype=torch.float32)
    model.eval()
    layout = PackLayout.for_model(model)
    nll, n = 0.0, 0
    with torch.no_grad():
        for row in read_samples(data).table.to_pylist():
            batch = collate_padded([encode_sample(processor, row["messages"], decode_images(row["images"]))], 0, layout)
            nll += float(token_nll_sum(model, batch, torch.device("cpu")))
            n += target_tokens(batch)
    return nll / n


def test_supervised_eval_is_logged_at_its_steps_and_leaves_the_trajectory_alone(assets, eval_data, tmp_path):
    from ovkit.train import train

    plain, with_eval = tmp_path / "plain", tmp_path / "eval"
    train(config("SFTConfig", assets, plain, max_steps=3, lr=1e-2))
    train(
        config(
            "SFTConfig",
            assets,
            with_eval,
            max_steps=3,
            lr=1e-2,
            eval_data=[eval_data],
            eval_every=2,
            eval_max_new_tokens=4,
        )
    )

    rows = _metrics(with_eval)
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 3]  # every 2 steps and after the last
    for r in rows[1:]:
        assert {
            "eval/reward",
            "eval/accuracy",
            "eval/reward/colour",
            "eval/reward/counting",
            "eval/accuracy/counting",
        } <= set(r)
        assert 0 <= r["eval/reward"] <= 1 and r["eval/loss"] > 0
    assert not any(k.startswith("eval/") for k in rows[0])
    assert losses(with_eval) == losses(plain)  # bit-identical: the eval restores every RNG and mode
    w0, w1 = weights(plain), weights(with_eval)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert rows[-1]["eval/loss"] == pytest.approx(_held_out_nll(with_eval, eval_data), rel=1e-5)
    assert rows[1]["eval/loss"] != rows[-1]["eval/loss"]  # the model of step 2, not the final one


def test_held_out_results_reach_the_console_the_summary_and_the_card(assets, eval_data, tmp_path, cli):
    """sft --eval-data: each step that evaluated prints an `eval  step N | reward ...` line under its step line, and
    the last evaluation is in ovkit.json's metrics, the summary line on stdout and the model card."""
    out = tmp_path / "sft"
    code, stdout, err = cli(
        "sft", assets / "data", "--model", assets / "model", "--out", out, "--max-steps", "3", "--batch-size", "4",
        "--precision", "fp32", "--eval-data", eval_data, "--eval-every", "2", "--eval-max-new-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    last = _metrics(out)[-1]
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("eval  step")]
    assert [line.split(" | ")[0] for line in lines] == ["eval  step 00002", "eval  step 00003"]
    assert f"reward {last['eval/reward']:.3f}" in lines[-1] and f"loss {last['eval/loss']:.4f}" in lines[-1]
    held = json.loads((out / "ovkit.json").read_text())["metrics"]["eval"]
    assert held["step"] == 3 and held["reward"] == last["eval/reward"] and held["loss"] == last["eval/loss"]
    assert held["reward/colour"] == last["eval/reward/colour"]
    assert f"; held-out at step 3: reward {last['eval/reward']:.3f}" in stdout
    card = (out / "README.md").read_text()
    assert "## Held-out evaluation" in card and f"| loss | {last['eval/loss']:.4g} |" in card


def test_eval_options_are_checked(assets, tmp_path):
    from ovkit.errors import OvkitError

    with pytest.raises(OvkitError, match="--eval-every needs --eval-data"):
        config("SFTConfig", assets, tmp_path / "x", eval_every=2)
    with pytest.raises(OvkitError, match="--eval-every must be >= 0"):
        config("SFTConfig", assets, tmp_path / "x", eval_data=[assets / "data"], eval_every=-1)
    with pytest.raises(OvkitError, match="--eval-limit"):
        config("SFTConfig", assets, tmp_path / "x", eval_data=[assets / "data"], eval_limit=0)


def test_rl_eval_equals_ovkit_eval_on_the_saved_model(rl_assets, tmp_path, one_thread, monkeypatch):
    """Rollouts from a scripted policy (right and wrong answers in every group: real updates), the eval greedy from
    the learner's weights: after 4 steps at lr 1e-2 the tiny model answers some held-out counts right."""
    from rl_ddp_runner import answer
    from scripted_policy import ScriptedEngine

    from ovkit.evaluate.run import EvalConfig, run_eval
    from ovkit.rl import loop

    monkeypatch.setattr(loop, "make_sampler", lambda cfg, m, processor: ScriptedEngine(m, processor, answer))
    model_dir, data = rl_assets
    plain, with_eval = tmp_path / "plain", tmp_path / "eval"
    opts = dict(max_steps=4, lr=1e-2, precision="fp32", quiet=True)
    loop.train_rl(rl_cfg(model_dir, data, plain, **opts))
    loop.train_rl(rl_cfg(model_dir, data, with_eval, **opts, eval_data=[data], eval_every=2, eval_max_new_tokens=8))

    rows = _metrics(with_eval)
    assert [r["step"] for r in rows if "eval/reward" in r] == [2, 4]
    drop = ("eval/", "ovkit/time/", "ovkit/samples_per_s", "ovkit/elapsed_s")
    assert [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows] == [
        {k: v for k, v in r.items() if not k.startswith(drop)} for r in _metrics(plain)
    ]  # every training metric bit-identical
    w0, w1 = weights(plain), weights(with_eval)
    assert all(torch.equal(w0[k], w1[k]) for k in w0)

    summary = run_eval(
        EvalConfig(
            data=[data], model=with_eval, out=tmp_path / "ev", prompt="answer", max_new_tokens=8, seed=0, quiet=True
        ),
        tmp_path / "ev",
    )
    last = rows[-1]
    assert summary["overall"] > 0  # not an all-zero comparison
    assert last["eval/reward"] == pytest.approx(summary["overall"], abs=1e-9)
    assert last["eval/accuracy"] == pytest.approx(summary["accuracy"], abs=1e-9)
    for category, reward in summary["categories"].items():
        assert last[f"eval/reward/{category}"] == pytest.approx(reward, abs=1e-9)


@pytest.mark.slow
def test_two_processes_log_the_eval_of_one(assets, eval_data, tmp_path):
    """torchrun, 2 CPU processes (gloo): each evaluates its share of the held-out rows; gathered, the same numbers."""
    one, two = tmp_path / "one", tmp_path / "two"
    base = [
        "sft",
        str(assets / "data"),
        "--model",
        str(assets / "model"),
        "--max-steps",
        "2",
        "--lr",
        "1e-2",
        "--precision",
        "fp32",
        "--quiet",
        "--eval-data",
        str(eval_data),
        "--eval-every",
        "1",
        "--eval-max-new-tokens",
        "4",
    ]
    subprocess.run(
        [sys.executable, "-m", "ovkit", *base, "--out", str(one), "--batch-size", "4"],
        check=True,
        env=ENV,
        capture_output=True,
    )
    run = torchrun(2, "-m", "ovkit", *base, "--out", str(two), "--batch-size", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    for a, b in zip(_metrics(one), _metrics(two)):
        assert b["eval/loss"] == pytest.approx(a["eval/loss"], rel=1e-5)
        assert b["eval/reward"] == pytest.approx(a["eval/reward"], abs=1e-6)


def test_prompt_only_eval_rows_give_a_loss_on_their_gold_answer(assets, rl_assets, tmp_path):
    """synth's val/ and eval/ rows hold the prompt only: the target is the answer in the form sft trains on."""
    from ovkit.train import train

    out = tmp_path / "sft"
    train(config("SFTConfig", assets, out, max_steps=1, eval_data=[rl_assets[1]], eval_limit=2, eval_max_new_tokens=4))
    last = _metrics(out)[-1]
    assert last["eval/loss"] > 0 and set(last) >= {"eval/reward/counting", "eval/reward/math"}


@pytest.mark.parametrize("engine", ["FSDP", "DEEPSPEED"])
def test_sharded_runs_refuse_what_reads_the_learners_weights_directly(
    rl_assets, tmp_path, one_thread, monkeypatch, engine
):
    """Under FSDP/DeepSpeed each process holds a shard of the weights: eval-while-training's generate and the HF
    sampler would read shard-shaped tensors and run another number of collectives per process (a hang). Both are
    refused before the run directory exists, naming what works instead; vLLM engines gather (generate.full_tensor).
    (FSDP cannot run on this CPU box through accelerate, so the runtime is told it is sharded.)"""
    from ovkit.errors import OvkitError
    from ovkit.evaluate.during import evaluator
    from ovkit.rl import loop
    from ovkit.runtime.core import Runtime

    monkeypatch.setattr(Runtime, "distributed", property(lambda self: engine))
    model_dir, data = rl_assets
    out = tmp_path / "hf"
    with pytest.raises(OvkitError, match=f"--engine hf under {engine}: .* use --engine vllm"):
        loop.train_rl(rl_cfg(model_dir, data, out, max_steps=1, quiet=True))
    assert not (tmp_path / "hf.partial").exists()
    rt = type("Rt", (), {"sharded": True, "distributed": engine})()
    cfg = rl_cfg(model_dir, data, tmp_path / "eval", eval_data=[data])
    with pytest.raises(OvkitError, match=f"--eval-data under {engine}: .* DDP"):
        evaluator(cfg.eval_during, cfg.seed, rt, None, 1, prompt="answer", loss=False, batch_size=1)


def test_full_tensor_gathers_an_fsdp2_shard_and_passes_a_tensor_through():
    """The vLLM engines receive whole tensors from an FSDP2 learner (a one-process gloo group, in a subprocess)."""
    script = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from ovkit.generate import full_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
m = torch.nn.Linear(4, 3)
fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
w = full_tensor(m.weight.detach())
assert type(m.weight).__name__ == "DTensor" and type(w) is torch.Tensor and w.shape == (3, 4), (type(w), w.shape)
t = torch.ones(2)
assert full_tensor(t) is t
dist.destroy_process_group()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
