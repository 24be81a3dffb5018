"""Errors a user can cause point to the fix: a file in a format ovkit converts names `ovkit convert --from ...`,
messages name the user's input and never ovkit's cache, no command suggests an option it lacks, HF/TRL spellings of
options are accepted and a misspelt option or YAML key gets the nearest match, and an input error comes before torch
is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from ovkit.data import read_samples, sources, write_samples
from ovkit.data.schema import image_cell, samples_table
from ovkit.errors import OvkitError

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OVKIT_CACHE", str(tmp_path / "ovkit-cache"))
    monkeypatch.setattr(sources, "_loaded", {})
    monkeypatch.setattr(sources, "_described", {})


def _row(i: int, markers: int = 1, **extra) -> dict:
    return {
        "id": f"r{i}",
        "images": [image_cell(Image.new("RGB", (28, 28), "red"))],
        "messages": [{"role": "user", "content": "<image>" * markers + "\nq"}, {"role": "assistant", "content": "a"}],
        "source": "t",
        **extra,
    }


# ------------------------------------------------------------------------------------------------ data inputs


def test_raw_llava_json_names_convert_with_its_format(tmp_path):
    f = tmp_path / "llava.json"
    f.write_text(
        json.dumps(
            [
                {
                    "id": "a",
                    "image": "a.png",
                    "conversations": [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "x"}],
                }
            ]
        )
    )
    with pytest.raises(OvkitError) as e:
        read_samples(f)
    assert f"`ovkit convert {f} --from llava --out DIR`" in str(e.value)
    assert "Parquet magic" not in str(e.value)


def test_csv_says_what_to_do_instead_of_parquet_magic_bytes(tmp_path):
    f = tmp_path / "data.csv"
    f.write_text("image,question,answer\na.png,how many?,3\n")
    with pytest.raises(OvkitError) as e:
        read_samples(f)
    message = str(e.value)
    assert "not a sample table" in message and "ovkit convert" in message and "--from" in message
    assert "Parquet magic" not in message


def test_trl_grpo_set_without_answer_names_the_input_and_its_solution_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    prompt = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "how many?"}]}]
    ds = datasets.Dataset.from_dict(
        {"prompt": [prompt, prompt], "image": [Image.new("RGB", (28, 28), "red")] * 2, "solution": ["1", "2"]}
    )
    ds.save_to_disk(str(tmp_path / "grpo"))
    # TRL's GRPO layout reads as it is: `solution` is the answer, scored with math as TRL's accuracy_reward does
    table = read_samples(tmp_path / "grpo", answers=True).table
    assert table.column("answer").to_pylist() == ["1", "2"] and table.column("answer_type").to_pylist() == ["math"] * 2
    # the same rows in ovkit's own layout, the gold answer still under `solution`: the message names the column
    plain = table.drop(["answer", "answer_type"])
    (tmp_path / "plain").mkdir()
    pq.write_table(plain, tmp_path / "plain" / "part-00000-of-00001.parquet")
    with pytest.raises(OvkitError) as e:
        read_samples(tmp_path / "plain", answers=True)
    message = str(e.value)
    assert str(tmp_path / "plain") in message and "'solution'" in message and "rename" in message
    assert "ovkit-cache" not in message and "training split" not in message


def test_a_bad_row_suggests_on_error_only_to_a_command_that_has_it(tmp_path):
    write_samples(samples_table([_row(0), _row(1, markers=2)]), tmp_path / "bad")
    with pytest.raises(OvkitError) as e:  # sft, eval, rl-train: no --on-error
        read_samples(tmp_path / "bad")
    assert "--on-error skip to move" not in str(e.value)
    assert f"`ovkit convert {tmp_path / 'bad'} --on-error skip --out DIR`" in str(e.value)
    with pytest.raises(OvkitError, match="use --on-error skip"):  # balance, caption, pack: their own option
        read_samples(tmp_path / "bad", on_error="fail")
    assert read_samples(tmp_path / "bad", on_error="skip").n_rejects == 1


# ------------------------------------------------------------------------------------------------ option names


def _sft_config(cli, monkeypatch, tmp_path, *args):
    """The SFTConfig `ovkit sft` resolves from `args` (training itself stubbed out), run in `tmp_path`, where DATA
    `d` and --model `m` exist (they are checked with the options)."""
    import ovkit.train

    monkeypatch.chdir(tmp_path)
    for name in ("d", "m"):
        (tmp_path / name).mkdir(exist_ok=True)
    seen = {}
    monkeypatch.setattr(
        ovkit.train, "train", lambda cfg: seen.setdefault("cfg", cfg) and type("R", (), {"status": "skipped"})()
    )
    code, out, err = cli("sft", *args)
    return code, seen.get("cfg"), err


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--learning-rate",
            "3e-4",
            "--num-train-epochs",
            "2",
            "--gradient-accumulation-steps",
            "4",
            "--per-device-train-batch-size",
            "2",
            "--output-dir",
            "o",
        ],
        [
            "--learning_rate",
            "3e-4",
            "--num_train_epochs",
            "2",
            "--gradient_accumulation_steps",
            "4",
            "--per_device_train_batch_size",
            "2",
            "--output_dir",
            "o",
        ],
    ],
)
def test_hf_and_trl_spellings_of_options_are_aliases(cli, monkeypatch, tmp_path, flags):
    code, cfg, err = _sft_config(cli, monkeypatch, tmp_path, "d", "--model", "m", *flags)
    assert code == 0, err
    assert (cfg.lr, cfg.epochs, cfg.grad_accum, cfg.batch_size, cfg.out) == (3e-4, 2.0, 4, 2, Path("o"))


def test_hf_spellings_show_in_help(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    _, out, _ = cli("sft", "--help")
    for name in (
        "--learning-rate",
        "--num-train-epochs",
        "--gradient-accumulation-steps",
        "--per-device-train-batch-size",
        "--output-dir",
    ):
        assert name in out


def test_yaml_keys_take_the_hf_names_and_a_typo_gets_the_nearest(cli, monkeypatch, tmp_path):
    good = tmp_path / "hf.yaml"
    good.write_text("learning_rate: 3.0e-4\noutput_dir: o\nper_device_train_batch_size: 2\n")
    code, cfg, err = _sft_config(cli, monkeypatch, tmp_path, "d", "--model", "m", "--config", good)
    assert code == 0, err
    assert (cfg.lr, cfg.out, cfg.batch_size) == (3e-4, Path("o"), 2)
    typo = tmp_path / "typo.yaml"
    typo.write_text("learnig_rate: 3.0e-4\n")
    code, _, err = _sft_config(cli, monkeypatch, tmp_path, "d", "--model", "m", "--out", "o", "--config", typo)
    assert code == 2 and "unknown key 'learnig_rate'; did you mean 'learning_rate'?" in err
    both = tmp_path / "both.yaml"
    both.write_text("learning_rate: 3.0e-4\nlr: 1.0e-4\n")
    code, _, err = _sft_config(cli, monkeypatch, tmp_path, "d", "--model", "m", "--out", "o", "--config", both)
    assert code == 2 and "same option" in err


def test_a_misspelt_option_gets_the_nearest_one(cli):
    code, _, err = cli("sft", "--learnig-rate", "1")
    assert code == 2 and "Did you mean --learning-rate?" in err


# ------------------------------------------------------------------------------------------------ names


def test_each_precision_spelling_has_one_meaning():
    from ovkit.models.precision import canonical

    assert canonical("bf16") == canonical("bf16-mixed") == "bf16-mixed"
    assert canonical("32") == canonical("float32") == "fp32"
    with pytest.raises(OvkitError, match="ambiguous: say bf16-mixed .* or bf16-true"):
        canonical("bfloat16")


def test_shipped_configs_use_no_ambiguous_precision():
    import yaml

    from ovkit.models.precision import AMBIGUOUS

    for f in (Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"):
        values = yaml.safe_load(f.read_text()) or {}
        assert str(values.get("precision")) not in AMBIGUOUS, f
