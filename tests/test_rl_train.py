"""`ovkit rl-train` on the tiny model: a training step moves the weights only with a learning signal, an all-masked
batch is logged and trains nothing, both curriculum stages run end to end, an asynchronous run with ETA = 2 never
consumes a sample staler than 2, and a run killed with SIGKILL resumes onto the same trajectory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, TINY, rl_cfg, rl_groups, rl_rows, torchrun

from ovkit.data import samples_table, write_samples


def _step(model_dir, data, tmp_path, rewards, **kw):
    from ovkit.models import load
    from ovkit.rl.loop import trainable
    from ovkit.rl.update import train_step
    from ovkit.runtime.optim import adamw

    cfg = rl_cfg(model_dir, data, tmp_path / "unused", **kw)
    model, processor = load(model_dir)
    model.eval()
    groups = rl_groups(model, processor, data, cfg, rewards)
    params = trainable(model, cfg)
    optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(
        model,
        optimizer,
        params,
        groups,
        0,
        processor.tokenizer.pad_token_id,
        cfg.correction_config(),
        None,
        cfg.update_options(),
    )
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    return metrics, changed


def test_a_step_trains_only_with_a_learning_signal(rl_assets, tmp_path, one_thread):
    model_dir, data = rl_assets
    metrics, changed = _step(model_dir, data, tmp_path, [[1, 0, 1, 0], [0.5, 0.5, 0.5, 0.5]])
    assert changed, "a group with different rewards must move the weights"
    assert metrics["frac_reward_zero_std"] == 0.5
    assert metrics["mismatch/delta_logp_max"] < 1e-3  # fp32 sampler and learner agree on the same weights
    assert metrics["staleness/hist"] == {"0": 8}
    metrics, changed = _step(model_dir, data, tmp_path, [[1, 1, 1, 1], [0, 0, 0, 0]])
    assert not changed and metrics["advantage/abs_mean"] == 0  # tied groups: zero advantage, no update


def test_an_all_masked_batch_is_logged_and_trains_nothing(rl_assets, tmp_path, one_thread):
    model_dir, data = rl_assets
    # token-MIS with the window [0.5, 0.6]: every ratio is ~1, so every token is rejected
    metrics, changed = _step(
        model_dir,
        data,
        tmp_path,
        [[1, 0, 1, 0], [1, 0, 0, 0]],
        correction="token-mis",
        correction_threshold=0.6,
        correction_lower=0.5,
    )
    assert metrics["all_masked"] == 1.0 and metrics["masked/token_frac"] == 1.0
    assert metrics["skipped_updates"] == 1 and metrics["grad_norm"] == 0.0
    assert not changed


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


REQUIRED = [  # metrics.jsonl's names: TRL's where TRL logs the same quantity, ovkit's own under ovkit/
    "reward",
    "reward_std",
    "ovkit/accuracy",
    "completions/mean_length",
    "clip_ratio/region_mean",
    "entropy",
    "grad_norm",
    "loss",
    "learning_rate",
    "ovkit/mismatch/learner_ppl",
    "ovkit/mismatch/sampler_ppl",
    "ovkit/mismatch/vllm_kl",
    "sampling/sampling_logp_difference/max",
    "sampling/sampling_logp_difference/mean",
    "ovkit/behave_weight/mean",
    "sampling/importance_sampling_ratio/mean",
    "ovkit/masked/token_frac",
    "ovkit/staleness/hist",
    "ovkit/time/rollout",
    "ovkit/time/train",
    "ovkit/time/sync",
    "ovkit/samples_per_s",
    "num_tokens",
    "epoch",
    "completions/min_length",
    "completions/mean_terminated_length",
    "rewards/task/mean",
    "rewards/task/std",
]


def test_stage1_then_stage2_end_to_end(rl_assets, tmp_path, cli, one_thread):
    model_dir, data = rl_assets
    out1, out2 = tmp_path / "rl1", tmp_path / "rl2"
    code, stdout, err = cli(
        "rl-train",
        data,
        "--model",
        model_dir,
        "--out",
        out1,
        "--stage",
        "1",
        "--max-steps",
        "2",
        "--max-staleness",
        "0",
        "--save-rollouts",
        "--quiet",
        *TINY,
    )
    assert code == 0, err
    assert "rl-train stage 1: 2 steps" in stdout
    rows = _metrics(out1)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(k in r for r in rows for k in REQUIRED)
    first, second = rows
    # TRL's meanings: tokens cumulative (prompt + completion), epoch = prompts seen / prompts in DATA (2 per step of 6)
    assert 0 < first["num_tokens"] < second["num_tokens"] and second["num_tokens"] - first["num_tokens"] >= 2 * 4
    assert first["epoch"] == pytest.approx(2 / 6) and second["epoch"] == pytest.approx(4 / 6)
    assert first["rewards/task/mean"] == first["reward"]  # stage 1: the task reward is all that is optimised
    assert first["completions/min_length"] <= first["completions/mean_length"] <= first["completions/max_length"]
    assert (
        (out1 / "model.safetensors").is_file() and (out1 / "ovkit.json").is_file() and (out1 / "config.yaml").is_file()
    )
    assert not (tmp_path / "rl1.partial").exists()
    from ovkit.rollouts.table import read_rollouts

    rollouts = read_rollouts(out1 / "rollouts")
    assert rollouts.num_rows == 2 * 2 * 4 and set(rollouts.column("version").to_pylist()) == {0, 1}

    code, stdout, err = cli(
        "rl-train",
        data,
        "--model",
        out1,
        "--out",
        out2,
        "--stage",
        "2",
        "--max-steps",
        "1",
        "--max-staleness",
        "0",
        "--quiet",
        *TINY,
    )
    assert code == 0, err
    prov = json.loads((out2 / "ovkit.json").read_text())
    assert (
        prov["parent"]["command"] == "rl-train"
        and prov["config"]["stage"] == 2
        and prov["config"]["format-weight"] == 0.1
    )
    assert "rewards/format/mean" in _metrics(out2)[0]
    # TRL's names for the clip-ratio extremes over processes (one process here: the means) and each reward's spread
    for row in rows + _metrics(out2):
        assert row["clip_ratio/low_min"] == row["clip_ratio/low_mean"]
        assert row["clip_ratio/high_max"] == row["clip_ratio/high_mean"]
        assert 0 <= row["rewards/format/std"] <= 0.5 and row["rewards/task/std"] >= 0
    from ovkit.models import load

    load(out2)  # the curriculum's output is an ordinary HF model directory

    code, stdout, _ = cli("rl-train", data, "--model", model_dir, "--out", out1, "--max-steps", "2", *TINY)
    assert code == 0 and "skipped" in stdout


def test_fewer_prompts_than_a_step_needs_warns(rl_assets, tmp_path, capfd, one_thread):
    from ovkit.rl.loop import train_rl, warn_few_prompts

    model_dir, _ = rl_assets
    one = tmp_path / "one"
    write_samples(samples_table(rl_rows()[:1]), one)
    train_rl(rl_cfg(model_dir, one, tmp_path / "out", max_steps=1, group_size=2))  # --prompts-per-step 2, one prompt
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("warning: DATA has"))
    assert "1 prompt(s), fewer than --prompts-per-step 2" in line and "prompts repeat within a step" in line
    warn_few_prompts(rl_cfg(model_dir, one, tmp_path / "o2"), 6)  # enough prompts: silent
    assert "warning" not in capfd.readouterr().err


def test_async_eta2_never_consumes_a_sample_staler_than_2(rl_assets, tmp_path, one_thread):
    from ovkit.rl.loop import train_rl
    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    out = tmp_path / "async"
    summary = train_rl(rl_cfg(model_dir, data, out, max_staleness=2, max_steps=5, save_rollouts=True, quiet=True))
    rows = _metrics(out)
    assert max(r["ovkit/staleness/max"] for r in rows) <= 2
    assert summary["max_staleness_seen"] >= 1  # the rollout thread did run ahead of the learner
    # every sample's version tag, checked against the step that consumed it
    for path in sorted((out / "rollouts").glob("step-*.parquet")):
        consumed_at = int(path.stem.split("-")[1]) - 1
        versions = read_rollouts(path).column("version").to_pylist()
        assert all(0 <= consumed_at - v <= 2 for v in versions), (path.name, versions)


def test_interrupted_run_resumes_on_the_same_trajectory(rl_assets, tmp_path, monkeypatch, one_thread):
    """In-process: the run dies right after its step-2 checkpoint; --resume finishes it exactly as a straight run."""
    from safetensors.torch import load_file

    from ovkit.errors import OvkitError
    from ovkit.rl import loop as trainer
    from ovkit.runtime import Runtime

    model_dir, data = rl_assets
    kw = dict(max_steps=4, save_every=1, keep_checkpoints=1, quiet=True)
    trainer.train_rl(rl_cfg(model_dir, data, tmp_path / "straight", **kw))

    save = Runtime.save_checkpoint

    def save_then_die(*args, **kwargs):
        path = save(*args, **kwargs)
        if path.name == "step-000002":
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(Runtime, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_rl(rl_cfg(model_dir, data, tmp_path / "cut", **kw))
    monkeypatch.setattr(Runtime, "save_checkpoint", save)
    with pytest.raises(OvkitError, match="--resume"):
        trainer.train_rl(rl_cfg(model_dir, data, tmp_path / "cut", **kw))
    summary = trainer.train_rl(rl_cfg(model_dir, data, tmp_path / "cut", resume=True, **kw))
    assert summary["resumed_from"].endswith("step-000002")
    assert [r["step"] for r in _metrics(tmp_path / "cut")] == [1, 2, 3, 4]
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_killed_run_resumes_on_the_same_trajectory(rl_assets, tmp_path):
    """kill -9 after the step-2 checkpoint, --resume, and the result equals an uninterrupted run (sync mode)."""
    from safetensors.torch import load_file

    model_dir, data = rl_assets
    args = [
        sys.executable,
        "-m",
        "ovkit",
        "rl-train",
        str(data),
        "--model",
        str(model_dir),
        "--max-steps",
        "4",
        "--max-staleness",
        "0",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "1",
        "--quiet",
        *TINY,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*args, "--out", str(tmp_path / "straight")], check=True, env=env, capture_output=True)

    out = tmp_path / "killed"
    proc = subprocess.Popen([*args, "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "killed.partial" / "checkpoints" / "step-000002" / "ovkit.json"
    deadline = time.time() + 300
    while not ckpt.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ckpt.is_file() and not out.exists()

    again = subprocess.run([*args, "--out", str(out)], env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "--resume" in again.stderr  # an unfinished run is never silently discarded
    subprocess.run([*args, "--out", str(out), "--resume"], check=True, env=env, capture_output=True)
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    assert json.loads((out / "ovkit.json").read_text())["metrics"]["resumed_from"].endswith("step-000002")
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.parametrize("sampler", [{"sampler_quant": "int8"}, {"sampler_precision": "bf16"}], ids=["int8", "bf16"])
def test_low_precision_sampler_shows_up_as_mismatch(rl_assets, tmp_path, sampler, one_thread):
    """The INT8 / bf16 rollout ablation on CPU: the sampler's log-probs differ from the fp32 learner's, and the
    mismatch metrics see it (an fp32 sampler agrees to ~1e-6, test_a_step_trains_only_with_a_learning_signal)."""
    from ovkit.rl.loop import train_rl

    model_dir, data = rl_assets
    train_rl(rl_cfg(model_dir, data, tmp_path / "out", max_steps=2, correction="token-tis", quiet=True, **sampler))
    rows = _metrics(tmp_path / "out")
    assert all(r["sampling/sampling_logp_difference/max"] > 1e-3 and r["ovkit/mismatch/vllm_kl"] > 0 for r in rows)
    assert all(r["sampling/importance_sampling_ratio/max"] <= 2.0 + 1e-6 for r in rows)  # token-TIS truncates at C = 2


def test_config_validation_names_the_flag(tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.rl.config import RLTrainConfig

    ok = dict(data=[tmp_path], model=tmp_path, out=tmp_path / "o")
    for bad, flag in [
        ({"stage": 3}, "--stage"),
        ({"correction": "nope"}, "--correction"),
        ({"loss_agg": "x"}, "--loss-agg"),
        ({"max_staleness": -1}, "--max-staleness"),
        ({"max_steps": 2, "epochs": 1.0}, "--epochs"),
    ]:
        with pytest.raises(OvkitError, match=flag):
            RLTrainConfig(**ok, **bad)
    assert RLTrainConfig(**ok, correction="seq_mean_k1").correction == "geo-rs"
    assert RLTrainConfig(**ok, stage=2).format_weight == 0.1


@pytest.mark.parametrize(
    "path", sorted((ROOT / "examples").glob("*/rl-stage*.yaml")), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_shipped_configs_validate(path, tmp_path):
    from ovkit.config import load_yaml, merge
    from ovkit.rl.config import RLTrainConfig

    values = load_yaml(path)
    cfg = merge(
        RLTrainConfig,
        {"data": [tmp_path], "model": tmp_path, "out": tmp_path / "o"},
        {"data", "model", "out"},
        values,
        path,
    )
    assert cfg.stage == (1 if "stage1" in path.name else 2)
    assert yaml.safe_load(path.read_text())


def test_help_options_are_documented(cli):
    import re

    code, out, _ = cli("rl-train", "--help")
    assert code == 0
    page = (ROOT / "commands" / "rl-train.md").read_text()
    missing = sorted({o for o in re.findall(r"--[a-z][a-z0-9-]+", out) if o not in page})
    assert not missing, missing


def _torchrun(n: int, *args) -> subprocess.CompletedProcess:
    runner = ROOT / "tests" / "rl_ddp_runner.py"
    return torchrun(n, str(runner), *args)


def test_two_processes_take_the_single_process_step_over_the_same_groups(rl_assets, tmp_path):
    """torchrun (gloo, CPU) with 2 processes against 1, a scripted policy so a step's groups are the same: each process
    samples half of them, the loss is normalised by the global token count, and the weights, the metrics, the
    rollout table and the checkpoints (each process's RNG state) come out as one process's; the output is written
    once, complete. Both runs share each group's prompt in the learner (--shared-prefix, the default; micro-batches
    of 3 split the groups of 4), and move the weights as one process with one row per trajectory does."""
    from safetensors.torch import load_file

    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    for n, name, *plain in ((1, "p1"), (2, "p2"), (1, "plain", "--plain")):
        run = _torchrun(n, model_dir, data, tmp_path / name, *plain)
        assert run.returncode == 0, run.stderr[-3000:]
    one, two = tmp_path / "p1", tmp_path / "p2"
    assert json.loads((two / "ovkit.json").read_text())["runtime"]["processes"] == 2
    assert not (tmp_path / "p2.partial").exists()
    m1, m2 = _metrics(one), _metrics(two)
    assert [r["step"] for r in m2] == [1, 2]
    for a, b in zip(m1, m2):
        assert b["reward"] == pytest.approx(a["reward"]) and b["ovkit/samples"] == a["ovkit/samples"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # the global gradient, not a process's half
    r1, r2 = (read_rollouts(d / "rollouts" / "step-000002.parquet") for d in (one, two))
    key = lambda t: sorted(zip(t.column("group").to_pylist(), t.column("prompt_id").to_pylist()))  # noqa: E731
    assert key(r1) == key(r2) and r2.num_rows == 16
    state = {p.name for p in (two / "checkpoints" / "step-000001" / "state").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= state
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    start = load_file(model_dir / "model.safetensors")
    assert any(not torch.equal(w1[k], start[k]) for k in w1)  # the run trained
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    for k in w1:  # two Adam steps at lr 1e-2: float-order differences of the gradient move weights by ~1e-6
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=2e-5, msg=k)
        torch.testing.assert_close(plain[k], w2[k], rtol=1e-4, atol=2e-5, msg=k)


def test_two_processes_sample_and_learn_what_one_process_does(rl_assets, tmp_path):
    """End to end with the real sampler (`ovkit rl-train` under torchrun, 2 processes against 1, same seed and global
    batch): every group is seeded by its stream position and every completion draws from its own stream, so the two
    processes' rollouts together are the one process's (tokens and rewards), the step metrics agree and the weights
    agree within the learner's float tolerance; one summary line."""
    from safetensors.torch import load_file

    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    args = [
        "rl-train",
        data,
        "--model",
        model_dir,
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--max-new-tokens",
        "8",
        "--temperature",
        "1.0",
        "--lr",
        "1e-2",
        "--warmup-ratio",
        "0",
        "--max-steps",
        "2",
        "--micro-batch-size",
        "3",
        "--reward-workers",
        "1",
        "--precision",
        "fp32",
        "--save-rollouts",
        "--quiet",
    ]
    for n in (1, 2):
        run = torchrun(n, "-m", "ovkit", *args, "--out", str(tmp_path / f"p{n}"))
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.count("rl-train stage") == 1, run.stdout
    one, two = tmp_path / "p1", tmp_path / "p2"
    for step in (1, 2):
        r1, r2 = (read_rollouts(d / "rollouts" / f"step-{step:06d}.parquet").to_pylist() for d in (one, two))
        key = lambda rows: sorted((r["group"], r["response_ids"], r["reward"]) for r in rows)  # noqa: E731
        assert key(r1) == key(r2) and len(r1) == 16
    m1, m2 = _metrics(one), _metrics(two)
    assert (
        len({r["reward"] for r in m1}) + len({tuple(x["response_ids"]) for x in r1}) > 2
    )  # real sampling, not one answer
    for a, b in zip(m1, m2):
        assert b["reward"] == pytest.approx(a["reward"]) and b["ovkit/samples"] == a["ovkit/samples"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    w1, w2 = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=2e-5, msg=k)


def test_rl_train_with_the_vllm_engine_colocated(rl_assets, tmp_path, monkeypatch, one_thread):
    """--engine vllm through a stand-in with vLLM's shapes (tests/fake_vllm.py): rollouts come back on-policy (the
    behaviour log-probs are the sampled distribution's, the learner agrees), vLLM sleeps during every update and its
    weights are the learner's after every step."""
    import fake_vllm
    from safetensors.torch import load_file

    from ovkit.rl.loop import train_rl

    fake_vllm.install(monkeypatch)
    model_dir, data = rl_assets
    train_rl(rl_cfg(model_dir, data, tmp_path / "out", engine="vllm", max_steps=2, temperature=0.9, quiet=True))
    rows = _metrics(tmp_path / "out")
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows)
    # vLLM samples in the learner's compute dtype (fp32 here), not its own choice (bf16 for an fp32 checkpoint)
    assert fake_vllm.LLM.calls[0][0] == "init" and fake_vllm.LLM.calls[0][1]["dtype"] == "float32"
    names = [c[0] for c in fake_vllm.LLM.calls[1:]]
    assert (
        names
        == ["load_weights", "reset_prefix_cache"]
        + ["generate", "sleep", "wake_up", "load_weights", "reset_prefix_cache"] * 2
    )
    final = load_file(tmp_path / "out" / "model.safetensors")
    loaded = [c for c in fake_vllm.LLM.calls if c[0] == "load_weights"]
    assert all(c[1] == len(final) for c in loaded)  # every checkpoint tensor, every time
    llm = fake_vllm.LLM.instance
    served = dict(llm.hf.named_parameters())
    to_runtime = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.to_runtime
    assert all(torch.equal(served[to_runtime[k]], v) for k, v in final.items())  # vLLM holds the trained weights
