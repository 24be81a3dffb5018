"""kill -9 at a random point of every long stage, then the same command again: it resumes (training, --resume) or
redoes (data stages) cleanly, leaves no temporary directory beside its output, and ends with the output an
uninterrupted run writes: byte-identical data files for the data stages and sft, the same steps and weights within
float tolerance for rl-train (synchronous sampler).

Each test kills its stage at a point drawn from a seeded generator (OVKIT_CRASH_SEED, default 0; the drawn point is in
the assertion message): for a training stage a random optimiser step, for a data stage a random moment after its
temporary output directory appears. One stage per family runs in the default suite (pack: data, sft: the supervised
loop, rl-train: RL); the rest are in the slow suite (`pytest -m slow tests/test_crash.py`).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, micro_spec

from ovkit.files import is_complete

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
SEED = int(os.environ.get("OVKIT_CRASH_SEED", "0"))
# Files of an output that record when, where and how fast a run went, not what it produced.
RUN_RECORDS = {"ovkit.json", "README.md", "metrics.jsonl", "config.yaml"}  # config.yaml: names its own --out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny model and a small synthetic corpus (every split), built through the CLI once for this module."""
    from ovkit.data.synth import pretrain_rows
    from ovkit.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("crash")
    _ovkit("synth", "--out", root / "data", "--scale", "0.02", "--quiet")
    texts = [m["content"] for r in pretrain_rows(0, {"all": 48}, {}) for m in r["messages"]] * 2
    spec = micro_spec()
    build_tiny(root / "model", texts, spec=spec, seed=0)
    return root


def _ovkit(*args, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "ovkit", *map(str, args)], env=ENV, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, f"ovkit {' '.join(map(str, args))}: exit {done.returncode}\n{done.stderr[-3000:]}"
    return done


def _steps_logged(out: Path) -> int:
    metrics = out.parent / f"{out.name}.partial" / "metrics.jsonl"
    try:
        return sum(1 for line in metrics.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def _temporaries(out: Path) -> list[Path]:
    return sorted(
        p
        for p in out.parent.iterdir()
        if p.name.startswith(f"{out.name}.tmp-") or p.name.startswith(f"{out.name}.old-")
    )


def writing_window(args: list, out: Path) -> float:
    """Run `ovkit *args` to the end and return for how long (seconds) its temporary output directory existed: the
    part of the run that writes, where a data stage is killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ovkit", *map(str, args)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not _temporaries(out) and proc.poll() is None:
        time.sleep(0.002)
    start = time.monotonic()
    err = proc.communicate()[1]
    assert proc.returncode == 0, err[-3000:]
    return time.monotonic() - start


def kill_at_random(args: list, out: Path, *, rng: random.Random, steps: int | None = None, window: float = 0.0) -> str:
    """Start `ovkit *args`, SIGKILL it at a random point, and return where (for assertion messages).

    `steps`: a training stage with this many optimiser steps, killed just after a random step in [1, steps - 1] was
    logged (between checkpoints, mid-way through the next step); else a data stage, killed at a uniformly random
    moment of the first 90% of its `window` (writing_window) after its temporary output directory appeared."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ovkit", *map(str, args)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    if steps is not None:
        k = rng.randint(1, steps - 1)
        while _steps_logged(out) < k and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        where = f"after step {k} of {steps}"
    else:
        while not _temporaries(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        delay = rng.uniform(0.0, 0.9) * window
        time.sleep(delay)
        where = f"{delay * 1000:.0f} ms of {window * 1000:.0f} into writing"
    finished = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    err = proc.stderr.read()
    proc.stderr.close()
    assert not finished or proc.returncode == 0, err[-3000:]
    assert not out.exists() or is_complete(out), f"killed {where}: the output must be complete or absent"
    where += " (it had already finished)" if finished else ""
    if os.environ.get("OVKIT_CRASH_VERBOSE"):
        print(f"{args[0]}: killed {where}", file=sys.stderr)
    return where


# Keys of a JSON output that say how the run went (durations, whether a cache or an earlier attempt was reused).
HOW_IT_WENT = {"seconds", "lengths_cached", "resumed_rows", "resumed_from", "date", "total_evaluation_time_seconds"}
STAMP = re.compile(r"^\d{8}_\d{6}_")  # eval's lmms-eval files are named by the run's start time


def _content(path: Path):
    if path.suffix == ".json":

        def strip(x):
            if isinstance(x, dict):
                return {k: strip(v) for k, v in x.items() if k not in HOW_IT_WENT}
            if isinstance(x, str):
                return re.sub(r"\d{8}_\d{6}_", "", x)  # the stamped file names of eval's results
            return [strip(v) for v in x] if isinstance(x, list) else x

        return strip(json.loads(path.read_text()))
    return path.read_bytes()


def assert_same_files(a: Path, b: Path, where: str, skip: set[str] = RUN_RECORDS) -> None:
    """Every file of outputs `a` and `b` byte-identical (JSON: the same values, how-it-went keys aside), except the
    run records."""

    def files(root: Path) -> dict[str, Path]:
        return {
            str(p.parent.relative_to(root) / STAMP.sub("", p.name)): p
            for p in root.rglob("*")
            if p.is_file() and p.name not in skip
        }

    files_a, files_b = files(a), files(b)
    assert sorted(files_a) == sorted(files_b), where
    for rel in files_a:
        assert _content(files_a[rel]) == _content(files_b[rel]), f"{rel} differs (killed {where})"


def own(args: list, out: Path) -> list:
    """`args` with CACHE replaced by a cache directory of output `out`'s own."""
    return [out.parent / f"{out.name}-cache" if a == "CACHE" else a for a in args]


def _data_stage(corpus: Path, tmp_path: Path, args: list, *, name: str) -> None:
    """Uninterrupted run, killed run, re-run of the killed one: same files, nothing left beside the output."""
    rng = random.Random(f"{SEED}-{name}")
    ref, out = tmp_path / "ref", tmp_path / "run"
    window = writing_window([*own(args, ref), "--out", ref, "--quiet"], ref)
    where = kill_at_random([*own(args, out), "--out", out, "--quiet"], out, rng=rng, window=window)
    _ovkit(*own(args, out), "--out", out, "--quiet")  # the killed run's cache, as far as it got
    assert _temporaries(out) == [], f"killed {where}: the re-run left {_temporaries(out)}"
    assert_same_files(ref, out, where)


def _train_stage(corpus: Path, tmp_path: Path, command: str, args: list, *, steps: int, exact: bool) -> None:
    """Uninterrupted run, killed run, the same command (refused: an unfinished run is never silently discarded),
    --resume: the same steps logged once each, and the same weights (bit-identical when `exact`)."""
    from safetensors.torch import load_file

    rng = random.Random(f"{SEED}-{command}")
    ref, out = tmp_path / "ref", tmp_path / "run"
    _ovkit(command, *args, "--out", ref, "--quiet")
    where = kill_at_random([command, *args, "--out", out, "--quiet"], out, steps=steps, rng=rng)
    again = _ovkit(command, *args, "--out", out, "--quiet", check=False)
    assert again.returncode == 2 and "--resume" in again.stderr, again.stderr[-2000:]
    _ovkit(command, *args, "--out", out, "--resume", "--quiet")
    assert _temporaries(out) == [] and not (tmp_path / "run.partial").exists(), where
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert logged == list(range(1, steps + 1)), f"killed {where}: steps logged {logged}"
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            assert a[name].equal(b[name]), f"{name} differs (killed {where})"
        else:
            assert (a[name] - b[name]).abs().max() <= 1e-5, f"{name} differs (killed {where})"
    if exact:
        ref_losses = [json.loads(x)["loss"] for x in (ref / "metrics.jsonl").read_text().splitlines()]
        out_losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert ref_losses == out_losses, where


# -- data stages ---------------------------------------------------------------------------------------------------


def test_pack(corpus, tmp_path):
    _data_stage(
        corpus,
        tmp_path,
        ["pack", corpus / "data" / "pretrain", "--model", corpus / "model", "--max-len", "512", "--cache", "CACHE"],
        name="pack",
    )


@pytest.mark.slow
def test_balance(corpus, tmp_path):
    _data_stage(
        corpus,
        tmp_path,
        ["balance", corpus / "data" / "pretrain", "--concepts", corpus / "data" / "concepts.txt", "--method", "text"],
        name="balance",
    )


@pytest.mark.slow
def test_caption(corpus, tmp_path):
    _data_stage(
        corpus,
        tmp_path,
        [
            "caption",
            corpus / "data" / "pretrain",
            "--model",
            corpus / "model",
            "--max-new-tokens",
            "6",
            "--chunk-rows",
            "8",
            "--precision",
            "fp32",
        ],
        name="caption",
    )


@pytest.mark.slow
def test_eval(corpus, tmp_path):
    _data_stage(
        corpus,
        tmp_path,
        [
            "eval",
            corpus / "data" / "eval",
            "--model",
            corpus / "model",
            "--limit",
            "4",
            "--max-new-tokens",
            "8",
            "--precision",
            "fp32",
        ],
        name="eval",
    )


@pytest.mark.slow
def test_rl_curate(corpus, tmp_path):
    _data_stage(
        corpus,
        tmp_path,
        [
            "rl-curate",
            corpus / "data" / "rl",
            "--model",
            corpus / "model",
            "--n",
            "2",
            "--limit",
            "3",
            "--max-new-tokens",
            "8",
            "--precision",
            "fp32",
            "--reward-workers",
            "1",
            "--no-system-prompt",
            "--seed",
            "1",
        ],
        name="rl-curate",
    )


# -- supervised training -------------------------------------------------------------------------------------------

TRAIN = ["--batch-size", "2", "--max-steps", "8", "--lr", "1e-2", "--save-every", "2", "--precision", "fp32"]


def test_sft(corpus, tmp_path):
    _train_stage(
        corpus,
        tmp_path,
        "sft",
        [corpus / "data" / "instruct", "--model", corpus / "model", *TRAIN],
        steps=8,
        exact=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("command", ["align", "midtrain"])
def test_packed_training_stages(corpus, tmp_path, command):
    plan = tmp_path / "plan"
    _ovkit(
        "pack",
        corpus / "data" / "pretrain",
        "--model",
        corpus / "model",
        "--max-len",
        "512",
        "--out",
        plan,
        "--cache",
        tmp_path / "cache",
        "--quiet",
    )
    _train_stage(
        corpus,
        tmp_path,
        command,
        [corpus / "data" / "pretrain", "--plan", plan, "--model", corpus / "model", *TRAIN],
        steps=8,
        exact=True,
    )


# -- RL ------------------------------------------------------------------------------------------------------------

RL = [
    *TINY,
    "--max-staleness",
    "0",
    "--max-steps",
    "4",
    "--save-every",
    "1",
    "--keep-checkpoints",
    "1",
    "--precision",
    "fp32",
]


@pytest.mark.timeout(600)  # 86 s on a loaded 2-core box: four RL steps, each killed and resumed
def test_rl_train(corpus, tmp_path):
    _train_stage(
        corpus, tmp_path, "rl-train", [corpus / "data" / "rl", "--model", corpus / "model", *RL], steps=4, exact=False
    )
