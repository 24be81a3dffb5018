"""Failures of the machine, not of the input (#28): each one ends in one message and an exit code that say what
happened and what to do, and leaves nothing a later run would trip on.

- one writer per output: a second run of the same OUT exits 2 naming the first one's pid and host; the parts of a
  sharded output still run in parallel; a killed holder never blocks the next run.
- interrupted on purpose: SIGTERM stops a learner at the step's end with a checkpoint (exit 143) and --resume continues
  the same trajectory; a second signal stops at once (exit 130 for SIGINT); SIGINT stops a data stage at once and
  removes its partial output (exit 130); never a traceback.
- broken checkpoints: --resume skips a truncated, foreign or incomplete newest checkpoint with a warning naming it,
  resumes from the one before and ends where an undisturbed run ends; with none sound it exits 2 naming the run.
- out of GPU memory (torch.cuda.OutOfMemoryError raised inside a step, on CPU): one message naming the stage, the step,
  the tokens per micro-batch and the options that lower memory, exit 3, the last checkpoint kept and resumable.
- out of space or not writable (OSError(ENOSPC) and the libraries' own errors injected at the write, shutil.disk_usage
  shrunk for the estimate, EROFS at the lock): one line naming the path and the free space, exit 2, no temp output
  left; a learner keeps its last complete checkpoint and --resume ends where an undisturbed run ends. A failure at the
  end of a learner (its ovkit.json) moves the run back to OUT.partial instead of deleting it.
- reward workers killed from outside (SIGKILL, as the OOM killer sends): the item is scored again on a fresh worker,
  the death is counted (rewards/worker_crashes), and the next batch is scored by live workers.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ENV, config, losses, weights

from ovkit.errors import OvkitError

pytestmark = pytest.mark.usefixtures("one_thread")


def _holder(out: Path, command: str = "sft") -> subprocess.Popen:
    """Another process that holds the lock on `out` until it is killed."""
    code = (
        f"from ovkit.faults import hold; l = hold({str(out)!r}, {command!r}); print('held', flush=True); import "
        f"time; time.sleep(600)"
    )
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
        "6",
        "--precision",
        "fp32",
        "--quiet",
    ]
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


# -- interrupted on purpose ----------------------------------------------------------------------------------------

SFT = dict(batch_size=2, max_steps=12, lr=1e-2, save_every=4)


def _sft(assets: Path, out: Path) -> subprocess.Popen:
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
        "4",
        "--precision",
        "fp32",
        "--quiet",
    ]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not cond() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be interrupted"


def _logged(out: Path) -> int:
    try:
        return len((out.parent / f"{out.name}.partial" / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_sigterm_stops_a_learner_with_a_checkpoint_and_resume_continues_the_same_run(assets, tmp_path):
    from ovkit.train import train

    ref, out = tmp_path / "ref", tmp_path / "run"
    train(config("SFTConfig", assets, ref, **SFT))
    proc = _sft(assets, out)
    _wait_for(lambda: _logged(out) >= 2, proc)  # mid-way between the checkpoints of steps 4 and 8 (or just after)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "stopped by SIGTERM after step" in err and "--resume" in err, err[-3000:]
    stopped = int(err.split("after step ")[1].split()[0])
    assert (
        2 <= stopped < 12
        and (tmp_path / "run.partial" / "checkpoints" / f"step-{stopped:06d}" / "ovkit.json").is_file()
    )
    assert not out.exists() and not (tmp_path / "run.lock").exists()

    res = train(config("SFTConfig", assets, out, resume=True, **SFT))
    assert res.metrics["resumed_from"].endswith(f"step-{stopped:06d}")
    assert losses(out) == losses(ref)  # the same trajectory, every step logged once
    w_ref, w_out = weights(ref), weights(out)
    assert all(w_ref[k].equal(w_out[k]) for k in w_ref)


def test_a_second_signal_stops_a_learner_at_once(assets, tmp_path):
    out = tmp_path / "run"
    proc = _sft(assets, out)
    _wait_for(lambda: _logged(out) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGINT)  # before the step ends: no checkpoint is waited for
    err = proc.communicate(timeout=300)[1]
    # Python runs pending handlers in signal-number order: the one handled second is the one that stopped the run
    second = (
        signal.Signals[err.split("stopped at once by ")[-1].split()[0].rstrip(";")]
        if "stopped at once by " in err
        else None
    )
    assert second is not None and proc.returncode == 128 + second, err[-3000:]
    assert "Traceback" not in err and "stopping after this step" in err, err[-3000:]
    assert not out.exists() and (tmp_path / "run.partial").is_dir() and not (tmp_path / "run.lock").exists()


def test_sigint_stops_a_data_stage_and_removes_its_partial_output(tmp_path):
    out = tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ovkit", "synth", "--out", str(out), "--scale", "0.2", "--quiet"],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(lambda: any(p.name.startswith("data.tmp-") for p in tmp_path.iterdir()), proc)
    time.sleep(0.2)  # into the writing
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "synth: stopped by SIGINT; its partial output was removed" in err, err[-3000:]
    assert list(tmp_path.iterdir()) == []


# -- broken checkpoints --------------------------------------------------------------------------------------------

CKPT = dict(batch_size=2, max_steps=6, lr=1e-2, save_every=2, keep_checkpoints=3)


@pytest.fixture(scope="module")
def finished(assets, tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 2 and 4, trained with one intra-op thread like the resumed runs
    compared with it (`one_thread` applies to tests, after a module fixture is made): another thread count sums in
    another order, and the final weights would differ in their last bits."""
    import torch

    from ovkit.train import train

    out = tmp_path_factory.mktemp("ckpt") / "ref"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(config("SFTConfig", assets, out, **CKPT))
    finally:
        torch.set_num_threads(threads)
    return out


def _unfinished(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run made to look killed after step 4: OUT.partial with both checkpoints."""
    import shutil

    shutil.copytree(finished, tmp_path / "run.partial")
    return tmp_path / "run"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _foreign(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))  # same size: only the checksum sees it


@pytest.mark.parametrize("harm", ["truncated", "foreign", "missing"])
def test_resume_skips_a_damaged_checkpoint_and_uses_the_one_before(assets, finished, tmp_path, capsys, harm):
    from ovkit.train import train

    out = _unfinished(finished, tmp_path)
    step4 = tmp_path / "run.partial" / "checkpoints" / "step-000004"
    state = sorted((step4 / "state").glob("*.bin"))[0]  # the model or optimiser state accelerate wrote
    {"truncated": _truncate, "foreign": _foreign, "missing": Path.unlink}[harm](state)
    res = train(config("SFTConfig", assets, out, resume=True, **CKPT))
    err = capsys.readouterr().err
    assert f"checkpoint {step4} is damaged" in err and state.name in err, err
    assert res.metrics["resumed_from"].endswith("step-000002")
    assert (out / "checkpoints" / "step-000004.damaged").is_dir()  # kept for a look, never pruned in favour of others
    assert losses(out) == losses(finished)
    w_ref, w_out = weights(finished), weights(out)
    assert all(w_ref[k].equal(w_out[k]) for k in w_ref)


def test_resume_with_every_checkpoint_damaged_exits_2_naming_the_run(assets, finished, tmp_path, cli):
    out = _unfinished(finished, tmp_path)
    for ckpt in (tmp_path / "run.partial" / "checkpoints").glob("step-*"):
        _truncate(ckpt / "model.safetensors")
    code, _, err = cli(
        "sft",
        assets / "data",
        "--model",
        assets / "model",
        "--out",
        out,
        "--resume",
        "--batch-size",
        "2",
        "--max-steps",
        "6",
        "--lr",
        "1e-2",
        "--save-every",
        "2",
        "--keep-checkpoints",
        "3",
        "--precision",
        "fp32",
        "--quiet",
    )
    assert code == 2 and f"every checkpoint of {tmp_path / 'run.partial'} is damaged" in err, err


def test_a_checkpoint_without_a_manifest_that_does_not_load_is_named(assets, finished, tmp_path):
    """A checkpoint from before manifests is loaded unchecked: a foreign state file is still an error naming it."""
    from ovkit.train import train

    out = _unfinished(finished, tmp_path)
    step4 = tmp_path / "run.partial" / "checkpoints" / "step-000004"
    (step4 / "manifest.json").unlink()
    _foreign(sorted((step4 / "state").glob("*.bin"))[0])
    with pytest.raises(OvkitError, match="step-000004/state could not be loaded .* move step-000004 aside"):
        train(config("SFTConfig", assets, out, resume=True, **CKPT))


# -- out of GPU memory ---------------------------------------------------------------------------------------------


def test_out_of_memory_in_a_learner_step_exits_3_with_what_to_lower_and_resumes(
    assets, finished, tmp_path, cli, monkeypatch
):
    import torch

    from ovkit.train import loop

    real, calls = loop._step, []

    def step(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kw)

    monkeypatch.setattr(loop, "_step", step)
    out = tmp_path / "run"
    args = [
        "sft",
        assets / "data",
        "--model",
        assets / "model",
        "--out",
        out,
        "--batch-size",
        "2",
        "--max-steps",
        "6",
        "--lr",
        "1e-2",
        "--save-every",
        "2",
        "--keep-checkpoints",
        "3",
        "--precision",
        "fp32",
        "--quiet",
    ]
    code, _, err = cli(*args)
    assert code == 3, err
    line = err.strip()
    assert "\n" not in line and line.startswith("error: sft: out of GPU memory at step 3 ("), err
    for option in (
        "tokens per micro-batch",
        "--batch-size",
        "--activation-checkpointing",
        "--precision",
        "--max-len",
        "--resume continues from",
    ):
        assert option in line, (option, line)
    assert (tmp_path / "run.partial" / "checkpoints" / "step-000002" / "ovkit.json").is_file() and not out.exists()

    monkeypatch.setattr(loop, "_step", real)
    code, _, err = cli(*args, "--resume")
    assert code == 0, err
    assert losses(out) == losses(finished)


def test_out_of_memory_in_a_data_stage_exits_3_naming_it(tmp_path, cli, monkeypatch):
    import torch

    from ovkit.data import synth

    def build(cfg, path):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(synth, "build_corpus", build)
    code, _, err = cli("synth", "--out", tmp_path / "data", "--quiet")
    assert code == 3 and "synth: out of GPU memory; lower --batch-size" in err, err
    assert list(tmp_path.iterdir()) == []  # nothing partial, no lock


# -- out of space or not writable ----------------------------------------------------------------------------------

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
SFT_ARGS = [
    "--batch-size",
    "2",
    "--max-steps",
    "6",
    "--lr",
    "1e-2",
    "--save-every",
    "2",
    "--keep-checkpoints",
    "3",
    "--precision",
    "fp32",
    "--quiet",
]


def _sft_cli(cli, assets: Path, out: Path, *more: str):
    return cli("sft", assets / "data", "--model", assets / "model", "--out", out, *SFT_ARGS, *more)


def test_a_full_disk_in_a_data_stage_exits_2_naming_the_file_and_leaves_nothing(tmp_path, cli, monkeypatch):
    import pyarrow.parquet as pq

    def full(table, where, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))

    monkeypatch.setattr(pq, "write_table", full)
    code, _, err = cli("synth", "--out", tmp_path / "data", "--scale", "0.005", "--quiet")
    line = err.strip()
    assert code == 2 and "\n" not in line and "Traceback" not in err, err
    assert line.startswith(f"error: {tmp_path}/data.tmp-") and ".parquet" in line, line  # the file being written
    assert (
        "could not write: no space left on device (" in line
        and " free); free space there or choose another --out" in line
    ), line
    assert list(tmp_path.iterdir()) == []  # no OUT.tmp-<pid>, no lock


def test_a_full_disk_at_a_learner_checkpoint_keeps_the_last_one_and_resume_ends_the_same(
    assets, finished, tmp_path, cli, monkeypatch
):
    import torch

    real, calls = torch.save, []

    def save(obj, f, *a, **kw):  # torch.save's own error on a full disk names no errno (checked against /dev/full)
        calls.append(str(f))
        if "step-000004" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "run"
    code, _, err = _sft_cli(cli, assets, out)
    line = err.strip()
    ckpts = tmp_path / "run.partial" / "checkpoints"
    assert code == 2 and "\n" not in line and "Traceback" not in err, err
    assert (
        f"error: {ckpts / '.step-000004.tmp'}: could not write: no space left on device (" in line and "needed)" in line
    ), line
    assert f"--resume: it continues from {ckpts / 'step-000002'}" in line, line
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002"] and not out.exists()

    monkeypatch.setattr(torch, "save", real)
    code, _, err = _sft_cli(cli, assets, out, "--resume")
    assert code == 0, err
    assert losses(out) == losses(finished)


def test_a_full_disk_at_the_final_save_keeps_the_checkpoints(assets, finished, tmp_path, cli, monkeypatch):
    from safetensors import SafetensorError
    from transformers import modeling_utils

    real = modeling_utils.safe_save_file

    def save(tensors, filename, *a, **kw):  # what `ovkit sft` printed on a full disk before (#28)
        if Path(filename).parent.name == "run.partial":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *a, **kw)

    monkeypatch.setattr(modeling_utils, "safe_save_file", save)
    out = tmp_path / "run"
    code, _, err = _sft_cli(cli, assets, out)
    assert code == 2 and "Traceback" not in err and "internal error" not in err, err
    assert (
        "could not write: no space left on device" in err
        and "--resume: it continues from" in err
        and "step-000004" in err
    ), err
    assert (tmp_path / "run.partial" / "checkpoints" / "step-000004" / "ovkit.json").is_file() and not out.exists()

    monkeypatch.setattr(modeling_utils, "safe_save_file", real)
    code, _, err = _sft_cli(cli, assets, out, "--resume")
    assert code == 0, err
    assert losses(out) == losses(finished)


def test_a_learner_that_cannot_fit_its_checkpoints_exits_2_before_writing(assets, tmp_path, cli, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: real(p)._replace(free=100_000)
    )  # saves at steps 2 and 4 (6 is the end): ~1.4 MiB each
    code, _, err = _sft_cli(cli, assets, tmp_path / "run")
    line = err.strip()
    assert code == 2 and "\n" not in line, err
    assert (
        line.startswith(f"error: --out {tmp_path / 'run'}: 2 checkpoints of about ")
        and "and the final model need about " in line
    ), line
    assert "its filesystem has 97.7 KiB free; free space there or choose another --out" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_output_place_exits_2_before_the_work(tmp_path, cli, monkeypatch):
    from ovkit import faults

    real = os.open

    def read_only(path, *a, **kw):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(faults.os, "open", read_only)  # as root, chmod stops no write: the filesystem's answer instead
    code, _, err = cli("synth", "--out", tmp_path / "data", "--scale", "0.005", "--quiet")
    assert (
        code == 2
        and f"--out {tmp_path / 'data'}: cannot write in {tmp_path} (Read-only file system); choose a writable place"
        in err
    ), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod")
def test_a_directory_without_write_permission_exits_2_before_the_work(tmp_path, cli):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code, _, err = cli("synth", "--out", ro / "data", "--scale", "0.005", "--quiet")
    finally:
        ro.chmod(0o755)
    assert code == 2 and f"cannot write in {ro} (Permission denied)" in err, err
    assert list(ro.iterdir()) == []


def test_write_failures_are_told_apart_from_other_errors():
    from safetensors import SafetensorError

    from ovkit.faults import write_errno

    assert (
        write_errno(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
        == errno.ENOSPC
    )
    assert write_errno(OSError(errno.EDQUOT, "Disk quota exceeded")) == errno.EDQUOT
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
    assert write_errno(wrapped) == errno.EROFS
    assert write_errno(RuntimeError("unexpected pos 704 vs 598")) is None  # torch's writer: only from a save
    assert write_errno(RuntimeError("unexpected pos 704 vs 598"), saving=True) == errno.ENOSPC
    forbidden = PermissionError(errno.EACCES, "Permission denied", "/data/in.parquet")
    assert write_errno(forbidden) is None and write_errno(forbidden, within=Path("/out")) is None  # reading an input
    assert (
        write_errno(PermissionError(errno.EACCES, "Permission denied", "/out/x.parquet"), within=Path("/out"))
        == errno.EACCES
    )
    assert write_errno(FileNotFoundError(errno.ENOENT, "No such file")) is None


# -- a failure at the very end of a learner ------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["bug", "disk full"])
def test_a_failure_while_finishing_a_learner_gives_the_run_back_to_resume(
    assets, finished, tmp_path, cli, monkeypatch, failure
):
    """Runtime.finish moves OUT.partial into the Stage's temp dir before it writes ovkit.json: a failure there must not
    delete the run (checkpoints included) but move it back, so --resume ends it."""
    from ovkit import runs

    real = runs.write_json

    def write_json(path, obj):
        if (
            Path(path).name == "ovkit.json" and ".tmp-" in Path(path).parent.name
        ):  # the end's provenance, not a checkpoint's
            raise (
                OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                if failure == "disk full"
                else RuntimeError("boom")
            )
        return real(path, obj)

    monkeypatch.setattr(runs, "write_json", write_json)
    out = tmp_path / "run"
    code, _, err = _sft_cli(cli, assets, out)
    assert code == (2 if failure == "disk full" else 1), err
    if failure == "disk full":
        assert f"--resume: it continues from {tmp_path / 'run.partial'}" in err, err
    partial = tmp_path / "run.partial"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.partial"], list(tmp_path.iterdir())
    assert (partial / "checkpoints" / "step-000004" / "ovkit.json").is_file() and not (partial / "ovkit.json").exists()

    monkeypatch.setattr(runs, "write_json", real)
    code, _, err = _sft_cli(cli, assets, out, "--resume")
    assert code == 0, err
    assert losses(out) == losses(finished)


# -- reward workers killed from outside ----------------------------------------------------------------------------


def test_a_reward_worker_killed_from_outside_is_replaced_and_its_item_scored_again(tmp_path):
    import threading

    import pool_tasks

    from ovkit.rewards.pool import WorkerPool

    pool = WorkerPool()
    marks, killed = tmp_path / "marks", []
    marks.mkdir()

    def kill_the_first_worker():  # as the OOM killer would: SIGKILL, while it scores
        deadline = time.time() + 60
        while not any(marks.iterdir()) and time.time() < deadline:
            time.sleep(0.01)
        pid = int(sorted(marks.iterdir(), key=lambda p: p.stat().st_mtime_ns)[0].name)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    try:
        killer = threading.Thread(target=kill_the_first_worker)
        killer.start()
        # the first two items are slow: whichever started first is still scoring when it is killed
        results = pool.run(
            [(pool_tasks.slow, str(marks), "1.5", {})] * 2 + [(pool_tasks.slow, str(marks), "0.2", {})] * 2,
            workers=2,
            timeout=30,
        )
        killer.join()
        assert len(killed) == 1
        assert all(r.reward == 1.0 for r in results), results  # every item came back, scored
        crashed = [r for r in results if r.parts.get("worker_crashes")]
        assert len(crashed) == 1 and crashed[0].parts["worker_crashes"] == 1 and crashed[0].parts["pid"] != killed[0]

        again = pool.run([(pool_tasks.slow, str(marks), "0.1", {})] * 2, workers=2, timeout=30)  # the next batch
        assert all(r.reward == 1.0 and not r.parts.get("worker_crashes") for r in again)
        assert killed[0] not in {r.parts["pid"] for r in again}

        dead = pool.run([(pool_tasks.die, "", "", {})], workers=1, timeout=30)[
            0
        ]  # killed every time: a failure, counted
        assert dead.reward == 0.0 and dead.parts == {"crashed": True, "worker_crashes": 2}
    finally:
        pool.shutdown()


def test_worker_crashes_are_step_metrics():
    from types import SimpleNamespace

    from ovkit.rl.metrics import rollout_metrics
    from ovkit.rollouts.groups import Group

    completion = SimpleNamespace(mask=[1, 1], finish_reason="stop", termination=None)
    group = Group(
        prompt=SimpleNamespace(category="math"),
        index=0,
        version=0,
        completions=[completion] * 3,
        task_rewards=[1.0, 0.0, 0.0],
        format_rewards=[0.0] * 3,
        rewards=[1.0, 0.0, 0.0],
        parts=[
            {"accuracy": 1.0, "worker_crashes": 1},
            {"accuracy": 0.0, "crashed": True, "worker_crashes": 2},
            {"accuracy": 0.0},
        ],
    )
    metrics = rollout_metrics([group])
    assert metrics["rewards/worker_crashes"] == 3 and metrics["rewards/crashed"] == 1
