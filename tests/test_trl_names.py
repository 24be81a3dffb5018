"""TRL's GRPOConfig / SFTConfig names on ovkit's learners: aliases where ovkit has the meaning (flags and YAML keys),
translations where the value convention differs (`bf16: true`), refusals that say what ovkit does instead, every
problem of a config file in one message, and a "did you mean" only for a close misspelling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ovkit.config import load_yaml, merge
from ovkit.errors import OvkitError
from ovkit.rl.config import RLTrainConfig
from ovkit.train import SFTConfig
from ovkit.trl_names import GRPO, TRAINER

PAGE = Path(__file__).resolve().parent.parent / "docs" / "trl.md"
IO = {"data": [Path("d")], "model": Path("m")}

# (TRL key, value, ovkit option, the value ovkit holds)
GRPO_KEYS = [
    ("num_generations", 8, "group_size", 8),
    ("max_completion_length", 256, "max_new_tokens", 256),
    ("learning_rate", 1e-6, "lr", 1e-6),
    ("beta", 0.04, "kl_coef", 0.04),
    ("epsilon", 0.1, "eps_clip", 0.1),
    ("epsilon_high", 0.3, "eps_clip_high", 0.3),
    ("num_train_epochs", 2, "epochs", 2),
    ("output_dir", "/tmp/x", "out", Path("/tmp/x")),
    ("save_steps", 50, "save_every", 50),
    ("save_total_limit", 3, "keep_checkpoints", 3),
    ("eval_steps", 20, "eval_every", 20),
    ("torch_compile", True, "compile", True),
    ("vllm_server_base_url", "http://h:9", "vllm_server_url", "http://h:9"),
    ("bf16", True, "precision", "bf16-mixed"),
    ("use_vllm", True, "engine", "vllm"),
    ("use_vllm", False, "engine", "hf"),
    ("vllm_mode", "server", "engine", "vllm-server"),
    ("vllm_importance_sampling_correction", False, "correction", "none"),
    ("vllm_importance_sampling_mode", "token_truncate", "correction", "token-tis"),
    ("vllm_importance_sampling_mode", "sequence_mask", "correction", "seq-mis"),
    ("resume_from_checkpoint", True, "resume", True),
]
SFT_KEYS = [
    ("per_device_train_batch_size", 3, "batch_size", 3),
    ("gradient_accumulation_steps", 2, "grad_accum", 2),
    ("bf16", True, "precision", "bf16-mixed"),
    ("save_steps", 10, "save_every", 10),
    ("save_total_limit", 1, "keep_checkpoints", 1),
]


def _build(cls, tmp_path: Path, values: dict, cli: dict | None = None):
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(values))
    cli = {**IO, **({} if "output_dir" in values else {"out": Path("o")}), **(cli or {})}
    return merge(cls, cli, set(cli), load_yaml(path), path)


@pytest.mark.parametrize(
    "cls, key, value, option, held", [(RLTrainConfig, *k) for k in GRPO_KEYS] + [(SFTConfig, *k) for k in SFT_KEYS]
)
def test_a_trl_key_sets_the_ovkit_option_of_its_meaning(tmp_path, cls, key, value, option, held):
    needs = {"eval_steps": {"eval_data": [Path("held-out")]}}.get(key, {})  # an interval needs its data
    assert getattr(_build(cls, tmp_path, {key: value}, needs), option) == held


def test_a_false_bf16_keeps_the_default_precision(tmp_path):
    assert _build(RLTrainConfig, tmp_path, {"bf16": False}).precision == RLTrainConfig(**IO, out=Path("o")).precision


def test_every_problem_of_a_trl_file_is_named_in_one_message(tmp_path):
    values = {
        "num_generations": 8,  # taken
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 4,
        "max_prompt_length": 512,
        "num_iterations": 2,
        "fp16": True,
        "use_vllm": "maybe",
        "gamma": 0.9,
    }
    with pytest.raises(OvkitError) as e:
        _build(RLTrainConfig, tmp_path, values)
    text = str(e.value)
    assert "7 keys are not taken" in text
    for key in (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "max_prompt_length",
        "num_iterations",
        "fp16",
        "use_vllm",
        "gamma",
    ):
        assert f"'{key}'" in text, key
    assert "--prompts-per-step" in text and "--ppo-minibatches" in text and "--max-pixels" in text
    assert "unknown key 'gamma'; keys are the command's option names" in text  # no suggestion of another meaning


def test_num_iterations_1_is_what_ovkit_does(tmp_path):
    assert _build(RLTrainConfig, tmp_path, {"num_iterations": 1}).ppo_minibatches == 1


def test_a_translated_key_and_its_option_saying_two_things_is_refused(tmp_path):
    with pytest.raises(OvkitError, match="'use_vllm: True' .* means engine: vllm, but the file also says engine: hf"):
        _build(RLTrainConfig, tmp_path, {"use_vllm": True, "engine": "hf"})


def test_max_steps_wins_over_num_train_epochs_in_a_file_as_in_the_hf_trainer(tmp_path, capsys):
    cfg = _build(RLTrainConfig, tmp_path, {"max_steps": 100, "num_train_epochs": 3})
    assert (cfg.max_steps, cfg.epochs) == (100, None)
    assert "epochs ignored, max_steps 100 given" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, option, held",
    [
        ("--num_generations", "4", "group_size", 4),
        ("--num-generations", "4", "group_size", 4),
        ("--beta", "0.1", "kl_coef", 0.1),
        ("--epsilon", "0.1", "eps_clip", 0.1),
        ("--epsilon-high", "0.3", "eps_clip_high", 0.3),
        ("--max_completion_length", "64", "max_new_tokens", 64),
        ("--save-steps", "7", "save_every", 7),
    ],
)
def test_trl_names_are_flags_too(cli, tmp_path, monkeypatch, flag, value, option, held):
    """The config rl-train builds from the command line, caught where it checks its inputs (before any model)."""
    import ovkit.commands.rl_train as command

    built = []

    def caught(cfg):
        built.append(cfg)
        raise OvkitError("stopped by the test")

    monkeypatch.setattr(command, "check_inputs", caught)
    code, _, err = cli("rl-train", tmp_path / "d", "--model", tmp_path / "m", "--out", tmp_path / "o", flag, value)
    assert code == 2 and "stopped by the test" in err, err
    assert getattr(built[0], option) == held


@pytest.mark.parametrize(
    "typed, says",
    [
        ("--beta", None),  # an alias now: no error about the option at all
        ("--betta", "Did you mean --beta?"),
        ("--gamma", "See --help for the options."),  # no suggestion of another meaning (it used to offer --stage)
        ("--per-device-train-batch-size", "(TRL's per_device_train_batch_size): ovkit counts prompts"),
        ("--bf16", "TRL's bf16 is read from a --config file: true: --precision bf16-mixed"),
    ],
)
def test_an_unknown_flag_gets_a_close_suggestion_or_what_ovkit_does(cli, tmp_path, typed, says):
    args = ["rl-train", tmp_path / "no-data", "--model", tmp_path / "m", "--out", tmp_path / "o", typed]
    code, _, err = cli(*args, *([] if typed == "--bf16" else ["1"]))
    err = " ".join(err.replace("│", " ").split())
    assert code == 2
    if says is None:
        assert "No such option" not in err and "no-data" in err  # parsed, then stopped at the missing DATA
    else:
        assert says in err, err


def test_the_page_names_every_translated_or_refused_key_and_every_alias_row_holds():
    page = PAGE.read_text()
    rows = re.findall(r"^\| (.+?) \| (.+?) \|", page, re.M)
    named = {name for trl, _ in rows for name in re.findall(r"`([a-z_0-9]+)(?:[:`])", trl)}
    assert set(GRPO) | set(TRAINER) <= named, sorted((set(GRPO) | set(TRAINER)) - named)
    assert {k for k, *_ in GRPO_KEYS} | {k for k, *_ in SFT_KEYS} <= named
    # an alias row's ovkit flag is the flag of the option the key sets (tested above)
    flags = {opt: "--" + opt.replace("_", "-") for *_, opt, _ in GRPO_KEYS}
    for trl, ovkit in rows:
        keys = re.findall(r"`([a-z_0-9]+)`", trl)
        if len(keys) == 1 and ovkit.startswith("`--"):
            want = next((flags[o] for k, _, o, _ in GRPO_KEYS if k == keys[0] and o in flags), None)
            if want and ovkit.count("`") == 2:
                assert ovkit.strip("`").split()[0] in {want, "--precision", "--engine", "--correction"}, (trl, ovkit)
