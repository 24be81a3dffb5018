"""ovkit.train: the engine behind align / midtrain / sft, on a very small Qwen2.5-VL-architecture model.

Invariants: frozen parameters stay bit-identical and trainable ones move; batch 1 x accumulation 4 == batch 4 x
accumulation 1; a run killed with SIGKILL and resumed logs the same losses as an uninterrupted one; 2 processes
give the same losses as 1 with the same global batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import ENV, config, losses, torchrun, weights

from ovkit.errors import OvkitError

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------- groups


def test_groups_follow_module_names_of_qwen_and_llava():
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2Config

    from ovkit.models.groups import param_groups, trainable_names

    qwen_cfg = __import__("transformers").Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
    )
    qwen = __import__("transformers").Qwen2_5_VLForConditionalGeneration(qwen_cfg)
    g = param_groups(qwen)
    assert g["projector"] and all(n.startswith("model.visual.merger.") for n in g["projector"])
    assert "model.visual.patch_embed.proj.weight" in g["vision"] and not any("merger" in n for n in g["vision"])
    assert "model.language_model.embed_tokens.weight" in g["llm"] and g["other"] == []
    assert trainable_names(qwen, "align") == g["projector"]
    assert set(trainable_names(qwen, "midtrain", freeze_vision=True)) == set(g["llm"] + g["projector"])

    llava_cfg = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ).to_dict(),
        text_config=Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        ).to_dict(),
        image_token_index=63,
    )
    llava = LlavaForConditionalGeneration(llava_cfg)
    g = param_groups(llava)
    assert g["projector"] and all(n.startswith("model.multi_modal_projector.") for n in g["projector"])
    assert g["vision"] and all(n.startswith("model.vision_tower.") for n in g["vision"])
    assert "lm_head.weight" in g["llm"] and g["other"] == []
    assert trainable_names(llava, ["vision_tower\\.encoder"]) and all(
        "vision_tower.encoder" in n for n in trainable_names(llava, ["vision_tower\\.encoder"])
    )
    with pytest.raises(OvkitError, match="matches no parameter"):
        trainable_names(llava, ["visual\\.merger"])


def test_lr_schedule_warms_up_then_decays_to_min_lr(assets, tmp_path):
    from ovkit.train.loop import lr_factor

    cfg = config("SFTConfig", assets, tmp_path / "o", lr=1e-3, min_lr=1e-5, warmup_ratio=0.1)
    f = [lr_factor(s, 100, cfg) * cfg.lr for s in range(100)]
    assert f[0] == pytest.approx(1e-4) and f[9] == pytest.approx(1e-3)  # 10 warmup steps, linear
    assert f[10] == pytest.approx(1e-3) and f[-1] == pytest.approx(1e-5)  # cosine from peak to the floor
    assert all(a >= b for a, b in zip(f[10:], f[11:]))


def test_config_presets_and_checks(assets, tmp_path):
    a = config("AlignConfig", assets, tmp_path / "a")
    m = config("MidtrainConfig", assets, tmp_path / "m")
    s = config("SFTConfig", assets, tmp_path / "s", lr=3e-4)
    assert (a.lr, a.weight_decay, a.trainable) == (1e-4, 0.0, ["projector"])
    assert (m.lr, m.weight_decay, m.trainable) == (1e-5, 0.01, ["llm", "projector", "vision"])
    assert (s.lr, s.weight_decay, s.trainable) == (3e-4, 0.0, ["all"])
    with pytest.raises(OvkitError, match="--max-steps or --epochs"):
        config("SFTConfig", assets, tmp_path / "x", epochs=1)
    with pytest.raises(OvkitError, match="--out is required"):
        config("SFTConfig", assets, None)


# ---------------------------------------------------------------------------------------------------- end to end


def test_align_trains_only_the_projector_and_writes_a_loadable_model(assets, tmp_path, cli):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path / "align"
    code, stdout, err = cli(
        "align",
        assets / "data",
        "--model",
        assets / "model",
        "--out",
        out,
        "--max-steps",
        "3",
        "--batch-size",
        "4",
        "--save-every",
        "2",
        "--precision",
        "fp32",
        "--lr",
        "1e-2",
        "--quiet",
    )
    assert code == 0, err
    assert stdout.startswith("align: 3 steps") and str(out) in stdout
    before, after = weights(assets / "model"), weights(out)
    assert before.keys() == after.keys()
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same != name.startswith("visual.merger."), name  # merger moved, everything else bit-identical
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    prov = json.loads((out / "ovkit.json").read_text())
    assert (
        prov["command"] == "align" and prov["metrics"]["steps"] == 3 and prov["parent"]["path"] == str(assets / "model")
    )
    assert (out / "config.yaml").is_file() and (out / "checkpoints" / "step-000002" / "state").is_dir()
    assert not (tmp_path / "align.partial").exists()
    AutoModelForImageTextToText.from_pretrained(out)  # a plain HF checkpoint
    AutoProcessor.from_pretrained(out)
    AutoModelForImageTextToText.from_pretrained(out / "checkpoints" / "step-000002")

    code, stdout, _ = cli("align", assets / "data", "--model", assets / "model", "--out", out, "--quiet")
    assert code == 0 and "skipped" in stdout


def test_midtrain_freeze_vision_keeps_the_vit_and_moves_llm_and_projector(assets, tmp_path):
    from ovkit.train import train

    out = tmp_path / "mid"
    res = train(config("MidtrainConfig", assets, out, max_steps=2, freeze_vision=True, lr=1e-2))
    assert res.status == "done" and res.metrics["first_loss"] > 0
    before, after = weights(assets / "model"), weights(out)
    for name in before:
        frozen = name.startswith("visual.") and not name.startswith("visual.merger.")
        assert torch.equal(before[name], after[name]) == frozen, name


def test_sft_loss_goes_down(assets, tmp_path):
    from ovkit.train import train

    res = train(config("SFTConfig", assets, tmp_path / "sft", max_steps=12, lr=1e-2, warmup_ratio=0.1))
    lines = losses(tmp_path / "sft")
    assert len(lines) == 12 and lines[-1] < lines[0] * 0.8, lines
    assert res.metrics["trainable_params"] == res.metrics["total_params"]


# ---------------------------------------------------------------------------------------------------- invariants


def test_batch_1_accum_4_equals_batch_4_accum_1(assets, tmp_path):
    """Same samples per step, loss normalised by the target tokens of the whole accumulated batch."""
    from ovkit.train import train

    train(config("SFTConfig", assets, tmp_path / "b4", batch_size=4, grad_accum=1, max_steps=2, lr=1e-2))
    train(config("SFTConfig", assets, tmp_path / "b1", batch_size=1, grad_accum=4, max_steps=2, lr=1e-2))
    assert losses(tmp_path / "b4") == pytest.approx(losses(tmp_path / "b1"), rel=1e-5)
    w4, w1 = weights(tmp_path / "b4"), weights(tmp_path / "b1")
    for name in w4:
        torch.testing.assert_close(w4[name], w1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_resume_after_sigkill_logs_the_same_losses(assets, tmp_path):
    """Kill a run (SIGKILL, no chance to clean up) after its second checkpoint, resume it, and compare with a run
    that was never interrupted: same losses at every step, same final weights."""
    from ovkit.train import train

    ref, out = tmp_path / "ref", tmp_path / "run"
    opts = dict(batch_size=2, max_steps=12, lr=1e-2, save_every=2)
    train(config("SFTConfig", assets, ref, **opts))

    cmd = [
        sys.executable,
        "-m",
        "ovkit",
        "sft",
        str(assets / "data"),
        "--model",
        str(assets / "model"),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--max-steps",
        "12",
        "--lr",
        "1e-2",
        "--save-every",
        "2",
        "--precision",
        "fp32",
        "--quiet",
    ]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "run.partial" / "checkpoints" / "step-000004"
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert ckpt.exists() and not out.exists(), "the run must be killed between its checkpoints and its end"

    with pytest.raises(OvkitError, match="--resume"):  # an unfinished run is not silently restarted
        train(config("SFTConfig", assets, out, **opts))
    res = train(config("SFTConfig", assets, out, resume=True, **opts))
    assert res.metrics["resumed_from"] is not None and int(res.metrics["resumed_from"][-6:]) >= 4
    assert losses(out) == losses(ref)  # the same trajectory, every step logged once
    w_ref, w_out = weights(ref), weights(out)
    assert all(torch.equal(w_ref[k], w_out[k]) for k in w_ref)


def test_resume_with_changed_options_is_refused(assets, tmp_path):
    from ovkit.train import train

    out = tmp_path / "r"
    cfg = config("SFTConfig", assets, out, max_steps=2, save_every=1)
    train(cfg)
    # make it look unfinished: move the finished output back to OUT.partial
    os.replace(out, tmp_path / "r.partial")
    with pytest.raises(OvkitError, match="--lr"):
        train(config("SFTConfig", assets, out, max_steps=2, save_every=1, resume=True, lr=1e-3))


def test_several_tables_are_read_as_one(assets, tmp_path):
    from ovkit.train import train

    res = train(config("SFTConfig", assets, tmp_path / "two", data=[assets / "data", assets / "data"], max_steps=1))
    assert res.metrics["items"] == 32
    with pytest.raises(OvkitError, match="exactly one DATA"):
        config("SFTConfig", assets, tmp_path / "x", data=[assets / "data", assets / "data"], plan=tmp_path)


def test_bf16_autocast_runs_on_cpu(assets, tmp_path):
    from ovkit.train import train

    res = train(config("SFTConfig", assets, tmp_path / "bf16", max_steps=2, precision="bf16", lr=1e-2))
    assert 0 < res.metrics["final_loss"] < 20
    assert all(v.dtype == torch.float32 for v in weights(tmp_path / "bf16").values())  # fp32 master weights


def test_trackers_through_accelerate(assets, tmp_path):
    """--report-to tensorboard (and mlflow / wandb where installed, offline): accelerate's trackers get the step's
    scalars under metrics.jsonl's names; an uninstalled or unknown tracker is refused before anything runs."""
    import importlib.util

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ovkit.train import train

    train(config("SFTConfig", assets, tmp_path / "tb", max_steps=2, report_to=["tensorboard"]))
    run = tmp_path / "tb" / "trackers" / "ovkit-sft"  # the scalars; the hyper-parameters sit in a sub-directory
    assert list(run.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(run))
    acc.Reload()
    logged = [e.value for e in acc.Scalars("train/loss")]  # the Trainer's train/ prefix, as TRL's runs show it
    assert logged == pytest.approx(losses(tmp_path / "tb"), rel=1e-6)
    assert {"train/learning_rate", "train/num_tokens", "train/epoch", "train/ovkit/tok_per_s"} <= set(
        acc.Tags()["scalars"]
    )  # TRL's names, ovkit's under ovkit/
    rows = [json.loads(line) for line in (tmp_path / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [0.25, 0.5]  # epochs done, fractional (16 rows, batch 4): the Trainer's
    with pytest.raises(OvkitError, match="--report-to must be one of"):
        config("SFTConfig", assets, tmp_path / "x", report_to=["neptune"])
    for name in ("mlflow", "wandb", "trackio"):
        if importlib.util.find_spec(name) is None:
            with pytest.raises(OvkitError, match=f"pip install {name}"):
                config("SFTConfig", assets, tmp_path / "x", report_to=[name])


def test_step_line_format():
    from ovkit.train.loop import step_line

    line = step_line(42, {"loss": 2.31, "lr": 1e-5, "tok_per_s": 5400.2, "pad_frac": 0.031, "elapsed_s": 186})
    assert line == "step 00042 | loss 2.3100 | lr 1.00e-05 | tok/s 5400 | pad 3% | 3.1m"


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(assets, tmp_path):
    """torchrun with 2 CPU processes (gloo) x batch 2 == 1 process x batch 4: same samples per step, same loss."""
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
        "--save-every",
        "1",
    ]
    subprocess.run(
        [sys.executable, "-m", "ovkit", *base, "--out", str(one), "--batch-size", "4"],
        check=True,
        env=ENV,
        capture_output=True,
    )
    run = torchrun(2, "-m", "ovkit", *base, "--out", str(two), "--batch-size", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((two / "ovkit.json").read_text())["metrics"]["processes"] == 2
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    state = {p.name for p in (two / "checkpoints" / "step-000001" / "state").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= state  # RNG of both processes
    w1, w2 = weights(one), weights(two)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_rows_give_the_same_loss_and_update_as_padded_batches(assets, tmp_path, cli):
    """One step over the whole table: padded (16 samples) and packed (every pack) see the same target tokens, so
    the token-normalised loss and the update agree."""
    from ovkit.train import train

    plan = tmp_path / "plan"
    code, _, err = cli(
        "pack", assets / "data", "--model", assets / "model", "--max-len", "160", "--out", plan, "--quiet"
    )
    assert code == 0, err
    import pyarrow.parquet as pq

    n_packs = len(set(pq.read_table(plan / "plan.parquet").column("pack").to_pylist()))
    assert 2 < n_packs < 16
    padded = train(config("SFTConfig", assets, tmp_path / "padded", batch_size=16, max_steps=1, lr=1e-2))
    packed = train(
        config("SFTConfig", assets, tmp_path / "packed", plan=plan, batch_size=n_packs, max_steps=1, lr=1e-2)
    )
    assert packed.metrics["inputs"] == "packed" and packed.metrics["items"] == n_packs
    assert packed.metrics["first_loss"] == pytest.approx(padded.metrics["first_loss"], rel=1e-5)
    w_pad, w_pack = weights(tmp_path / "padded"), weights(tmp_path / "packed")
    for name in w_pad:
        torch.testing.assert_close(w_pad[name], w_pack[name], rtol=1e-4, atol=1e-6, msg=name)
    meta = [json.loads(x) for x in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    assert (
        meta[0]["ovkit/target_tokens"]
        == json.loads((tmp_path / "padded" / "metrics.jsonl").read_text())["ovkit/target_tokens"]
    )


def test_vision_lr_gives_the_vision_encoder_its_own_learning_rate(tmp_path):
    import torch

    from ovkit.models.groups import group_of
    from ovkit.runtime.optim import adamw
    from ovkit.train.loop import vision_lrs

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.visual = torch.nn.Linear(4, 4)  # Qwen-VL names: model.visual.* is the vision encoder
            self.language_model = torch.nn.Linear(4, 4)

    model = Tiny()
    assert group_of("visual.weight") == "vision"
    assert vision_lrs(model, None) == {}
    lrs = vision_lrs(model, 1e-4)
    assert set(lrs) == {id(model.visual.weight), id(model.visual.bias)}
    opt = adamw(model.parameters(), lr=1e-3, weight_decay=0.1, fused=False, lrs=lrs)
    by_param = {id(p): (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]}
    assert by_param[id(model.visual.weight)] == (1e-4, 0.1) and by_param[id(model.visual.bias)] == (1e-4, 0.0)
    assert by_param[id(model.language_model.weight)] == (1e-3, 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    assert sorted(sched.get_last_lr()) == [5e-5, 5e-5, 5e-4, 5e-4]  # one schedule scales both rates
