"""Resume is exact or refused (#26): every option of a learner shapes the trajectory unless it is declared run
control, so an option added later can never be forgotten; a resumed run with a changed trajectory option stops with
exit 2 naming it, and a checkpoint written before an option existed counts as having run at its default. The data
too (#34): every checkpoint records its inputs' fingerprints, and --resume refuses an input whose contents changed at
the same path."""

from __future__ import annotations

import json
import os

import pytest
from helpers import config, dies_at_first_checkpoint, make_rows, rl_cfg, rl_rows

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("module", ["ovkit.train.config", "ovkit.rl.config"])
def test_every_option_is_trajectory_or_run_control(module):
    import importlib

    from ovkit.options import flatten

    mod = importlib.import_module(module)
    cls = mod.TrainConfig if module.endswith("train.config") else mod.RLTrainConfig
    names = set(flatten(cls))  # every option, those held in groups included
    assert set(mod.TRAJECTORY) == names - mod.RUN_CONTROL
    assert not set(mod.TRAJECTORY) & mod.RUN_CONTROL


def test_the_rl_options_the_hand_kept_list_forgot_are_kept():
    from ovkit.rl.config import TRAJECTORY

    forgotten = {
        "correction_threshold",
        "correction_lower",
        "behave_cap",
        "behave_action",
        "behave_level",
        "adv_std",
        "adv_eps",
        "kl_estimator",
        "max_pixels",
        "freeze_vision",
        "geo_lower",
        "geo_upper",
        "veto_threshold",
    }
    assert forgotten <= set(TRAJECTORY)


def test_a_run_control_name_that_is_no_option_fails_at_import():
    from ovkit.config import trajectory_options
    from ovkit.train.config import RUN_CONTROL, TrainConfig

    with pytest.raises(TypeError, match="save_evry"):
        trajectory_options(TrainConfig, RUN_CONTROL | {"save_evry"})


def _unfinish(out):
    """Make a finished run look interrupted: its output back to OUT.partial (it keeps its checkpoints)."""
    os.replace(out, out.parent / f"{out.name}.partial")


def test_sft_resume_refuses_a_changed_option_it_did_not_list_before_and_allows_run_control(assets, tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.train import train

    out = tmp_path / "r"
    train(config("SFTConfig", assets, out, max_steps=2, save_every=1))
    _unfinish(out)
    with pytest.raises(OvkitError, match="--attn-implementation 'auto' -> 'eager'"):
        train(config("SFTConfig", assets, out, max_steps=2, save_every=1, resume=True, attn_implementation="eager"))
    done = train(config("SFTConfig", assets, out, max_steps=2, save_every=2, keep_checkpoints=3, resume=True))
    assert done.status == "done" and done.metrics["resumed_from"]


def test_a_checkpoint_from_before_an_option_existed_ran_at_its_default(assets, tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.train import train

    out = tmp_path / "old"
    train(config("SFTConfig", assets, out, max_steps=2, save_every=1))
    _unfinish(out)
    ckpt = tmp_path / "old.partial" / "checkpoints" / "step-000001" / "ovkit.json"
    meta = json.loads(ckpt.read_text())
    del meta["config"]["optim"]  # as written before --optim existed
    ckpt.write_text(json.dumps(meta))
    with pytest.raises(OvkitError, match="--optim 'adamw_torch_fused' -> 'adamw_torch'"):
        train(config("SFTConfig", assets, out, max_steps=2, save_every=1, resume=True, optim="adamw_torch"))
    assert train(config("SFTConfig", assets, out, max_steps=2, save_every=1, resume=True)).status == "done"


def test_rl_resume_with_a_changed_behaviour_cap_exits_2_naming_it(rl_assets, tmp_path, cli):
    from ovkit.rl.loop import train_rl

    model, data = rl_assets
    out = tmp_path / "rl"
    train_rl(rl_cfg(model, data, out, max_steps=2, save_every=1))
    _unfinish(out)
    code, _, err = cli(
        "rl-train",
        str(data),
        "--model",
        str(model),
        "--out",
        str(out),
        "--resume",
        "--behave-cap",
        "3",
        "--prompts-per-step",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "6",
        "--lr",
        "1e-3",
        "--warmup-ratio",
        "0",
        "--weight-decay",
        "0",
        "--no-system-prompt",
        "--max-staleness",
        "0",
        "--max-steps",
        "2",
        "--save-every",
        "1",
        "--reward-workers",
        "1",
        "--quiet",
    )
    assert code == 2, err
    assert "--behave-cap 5.0 -> 3.0" in err and "Traceback" not in err


def _replace_table(path, rows):
    """Another dataset at the same path: the directory's contents replaced, its name kept."""
    import shutil

    from ovkit.data import samples_table, write_samples

    shutil.rmtree(path)
    write_samples(samples_table(rows), path)


def test_sft_resume_refuses_data_replaced_at_the_same_path_and_resumes_on_the_data_put_back(
    assets, tmp_path, monkeypatch, cli
):
    import shutil

    from ovkit.train import train

    data, out = tmp_path / "data", tmp_path / "run"
    shutil.copytree(assets / "data", data)
    flags = dict(data=[data], max_steps=4, save_every=2)
    with dies_at_first_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):
        train(config("SFTConfig", assets, out, **flags))
    ckpt = tmp_path / "run.partial" / "checkpoints" / "step-000002"
    recorded = json.loads((ckpt / "ovkit.json").read_text())["inputs"]
    assert [i["path"] for i in recorded] == [str(data), str(assets / "model")]

    _replace_table(data, make_rows(16, seed=1))
    args = ["--model", assets / "model", "--out", out, "--batch-size", "4", "--max-steps", "4", "--save-every", "2"]
    code, _, err = cli("sft", data, *args, "--precision", "fp32", "--quiet", "--resume")
    assert code == 2 and "Traceback" not in err, err
    assert f"DATA {data} changed since {ckpt}" in err and "--overwrite" in err, err
    assert (ckpt / "ovkit.json").is_file()  # refused before anything was touched

    shutil.rmtree(data)
    shutil.copytree(assets / "data", data)  # the data it trained on, back: the same fingerprint
    done = train(config("SFTConfig", assets, out, **flags, resume=True))
    assert done.status == "done" and done.metrics["resumed_from"].endswith("step-000002")


def test_a_checkpoint_without_input_fingerprints_resumes_with_a_warning(assets, tmp_path, capsys):
    from ovkit.train import train

    out = tmp_path / "old"
    train(config("SFTConfig", assets, out, max_steps=2, save_every=1))
    _unfinish(out)
    ckpt = tmp_path / "old.partial" / "checkpoints" / "step-000001" / "ovkit.json"
    meta = json.loads(ckpt.read_text())
    del meta["inputs"]  # as written before checkpoints recorded them
    ckpt.write_text(json.dumps(meta))
    assert train(config("SFTConfig", assets, out, max_steps=2, save_every=1, resume=True)).status == "done"
    assert "records no input fingerprints" in capsys.readouterr().err


def test_rl_resume_refuses_prompts_replaced_at_the_same_path(rl_assets, tmp_path, monkeypatch):
    import shutil

    from ovkit.errors import OvkitError
    from ovkit.rl.loop import train_rl

    model, assets_data = rl_assets
    data, out = tmp_path / "prompts", tmp_path / "rl"
    shutil.copytree(assets_data, data)
    with dies_at_first_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):
        train_rl(rl_cfg(model, data, out, max_steps=4, save_every=2))
    _replace_table(data, rl_rows()[1:])  # another table at the same path
    with pytest.raises(OvkitError, match=f"DATA {data} changed since"):
        train_rl(rl_cfg(model, data, out, max_steps=4, save_every=2, resume=True))
