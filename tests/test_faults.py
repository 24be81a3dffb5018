"""Failures of the machine, not of the input (#28): each one ends in one message and an exit code that say what
happened and what to do, and leaves nothing a later run would trip on.

- one writer per output: a second run of the same OUT exits 2 naming the first one's pid and host; the parts of a
  sharded output still run in parallel; a killed holder never blocks the next run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ovkit.errors import OvkitError
from test_train import ENV, _one_thread, assets, config  # noqa: F401 (fixtures)


def _holder(out: Path, command: str = "sft") -> subprocess.Popen:
    """Another process that holds the lock on `out` until it is killed."""
    code = f"from ovkit.faults import hold; l = hold({str(out)!r}, {command!r}); print('held', flush=True); import time; time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    proc.stdout and proc.stdout.close()


# -- one writer per output -----------------------------------------------------------------------------------------


def test_a_second_data_stage_exits_2_naming_the_holder_and_a_killed_holder_blocks_nothing(tmp_path, cli):
    out = tmp_path / "data"
    proc = _holder(out, "synth")
    try:
        code, _, err = cli("synth", "--out", out, "--scale", "0.005", "--quiet")
        assert code == 2, err
        assert f"pid {proc.pid} on host {socket.gethostname()}" in err and "ovkit synth" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data.lock"]  # the holder's; nothing of the refused run
    finally:
        _stop(proc)  # SIGKILL: the kernel drops the lock, the file stays
    code, _, err = cli("synth", "--out", out, "--scale", "0.005", "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # the lock file went with the run


def test_the_parts_of_a_sharded_output_lock_separately(tmp_path):
    from ovkit.faults import hold

    out = tmp_path / "captioned"
    proc = _holder(out / "part-0-of-2", "caption")
    try:
        mine = hold(out / "part-1-of-2", "caption")  # the other part: runs in parallel
        with pytest.raises(OvkitError, match=f"pid {proc.pid}"):
            hold(out / "part-0-of-2", "caption")
        mine.release()
        assert not (out / "part-1-of-2.lock").exists()
    finally:
        _stop(proc)


def test_a_second_learner_exits_2_while_the_first_trains_on(assets, tmp_path):
    from ovkit.train import train

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ovkit", "sft", str(assets / "data"), "--model", str(assets / "model"), "--out", str(out),
           "--batch-size", "2", "--max-steps", "6", "--precision", "fp32", "--quiet"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not (tmp_path / "run.partial").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the first run must still be going"
        with pytest.raises(OvkitError, match=f"being written by another run \\(ovkit sft, pid {proc.pid} "):
            train(config("SFTConfig", assets, out, max_steps=6, batch_size=2, resume=True))
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    finally:
        proc.poll() is None and proc.kill()
        proc.stderr.close()
    assert (out / "ovkit.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
