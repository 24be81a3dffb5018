"""The learning check (opt-in: `pytest -m slow tests/test_rl_learning.py`): from an SFT checkpoint of the pipeline,
rl-curate, then rl-train stage 1, then stage 2, on the synthetic RL split, with the tiny example configs; held-out
eval before and after.

Point it at a pipeline's outputs with OVKIT_RL_DATA=<synth dir> and OVKIT_RL_SFT=<sft model dir> (as
`make full-pipeline` leaves them); without them the test builds its own (synth, init-model, a 600-step SFT: about 15
minutes on 2 idle cores, much longer on a busy machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ovkit(*args) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True, cwd=ROOT)


def _sft(tmp: Path) -> tuple[Path, Path]:
    if os.environ.get("OVKIT_RL_DATA") and os.environ.get("OVKIT_RL_SFT"):
        return Path(os.environ["OVKIT_RL_DATA"]), Path(os.environ["OVKIT_RL_SFT"])
    data, stage0, sft = tmp / "data", tmp / "stage0", tmp / "sft"
    ovkit("synth", "--out", data)
    ovkit("init-model", "--preset", "tiny", "--corpus", data, "--out", stage0)
    ovkit(
        "sft",
        data / "instruct",
        "--model",
        stage0,
        "--out",
        sft,
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--batch-size",
        "16",
        "--max-steps",
        "600",
        "--warmup-ratio",
        "0.03",
    )
    return data, sft


def _overall(run: Path) -> float:
    return json.loads((run / "summary.json").read_text())["overall"]


@pytest.mark.slow
def test_rl_curriculum_learns(tmp_path):
    data, sft = _sft(tmp_path)
    curate, rl1, rl2 = tmp_path / "rl-data", tmp_path / "rl1", tmp_path / "rl2"
    ovkit(
        "rl-curate",
        data / "rl",
        "--model",
        sft,
        "--out",
        curate,
        "--n",
        "8",
        "--limit",
        "24",
        "--max-new-tokens",
        "64",
        "--no-system-prompt",
    )
    stats = json.loads((curate / "stats.json").read_text())
    assert stats["stage1"] > 0 and stats["stage2"] > 0
    assert stats["always_solved"] + stats["never_solved"] + stats["kept"] <= stats["prompts"]
    ovkit(
        "rl-train", curate / "stage1", "--model", sft, "--out", rl1, "--config", ROOT / "examples/tiny/rl-stage1.yaml"
    )
    ovkit(
        "rl-train", curate / "stage2", "--model", rl1, "--out", rl2, "--config", ROOT / "examples/tiny/rl-stage2.yaml"
    )
    for name, model in [("sft", sft), ("rl1", rl1), ("rl2", rl2)]:
        ovkit("eval", "--model", model, data / "eval", "--out", tmp_path / f"eval-{name}")
    before, after1, after2 = (_overall(tmp_path / f"eval-{n}") for n in ("sft", "rl1", "rl2"))
    print(f"held-out reward: sft {before:.3f} -> rl stage 1 {after1:.3f} -> rl stage 2 {after2:.3f}")
    # Measured on the development machine (SFT of 600 steps, seed 0): 0.195 -> 0.219 -> 0.251. Stage 1 must not lose
    # held-out reward (0.02 tolerance for greedy-eval noise on 440 rows) and the whole curriculum must gain.
    assert after1 >= before - 0.02
    assert after2 > before
