"""Every command under a launcher either runs over N processes or refuses at start (ovkit.launch): training is
data-parallel (tests/test_train.py, tests/test_rl_train.py), data stages take one shard per process, the rest
refuse with exit 2 naming the launcher; an accelerate launch that asked for N processes and started one is an
error; a sharded output reads as one dataset only when every part is complete."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import many_llava, torchrun

from ovkit.data import read_samples
from ovkit.errors import OvkitError

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _torchrun(n: int, *args) -> subprocess.CompletedProcess:
    return torchrun(n, "-m", "ovkit", *args, timeout=300)


def test_a_data_stage_under_torchrun_writes_one_part_per_process(tmp_path, llava_images):
    root, _ = llava_images
    src = many_llava(tmp_path, 9)
    run = _torchrun(2, "convert", src, "--image-root", root, "--out", tmp_path / "out", "--quiet")
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == [
        "part-00000-of-00002",
        "part-00001-of-00002",
    ]
    assert read_samples(tmp_path / "out").table.column("id").to_pylist() == [f"r{i}" for i in range(9)]
    explicit = _torchrun(2, "convert", src, "--image-root", root, "--out", tmp_path / "x", "--shard", "0/2", "--quiet")
    assert explicit.returncode != 0 and "drop --shard" in explicit.stderr  # each process exits 2; torchrun reports 1


@pytest.mark.parametrize("command", ["eval", "synth"])
def test_a_one_process_command_refuses_a_launcher(tmp_path, command):
    args = ["--out", tmp_path / "out"] if command == "synth" else [tmp_path, "--compare", "--out", tmp_path / "out"]
    run = _torchrun(2, command, *args, "--quiet")
    assert run.returncode != 0 and f"ovkit {command} runs in one process" in run.stderr and "WORLD_SIZE=2" in run.stderr
    assert not (tmp_path / "out").exists()


def test_accelerate_asking_for_two_processes_and_starting_one_is_an_error(tmp_path, llava_images):
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    if accelerate is None:
        pytest.skip("accelerate's launcher is not on this environment's PATH")
    root, _ = llava_images
    src = many_llava(tmp_path, 3)

    def launch(*how: str) -> subprocess.CompletedProcess:
        args = ["convert", str(src), "--image-root", str(root), "--out", str(tmp_path / "out"), "--quiet"]
        return subprocess.run(
            [accelerate, "launch", *how, "-m", "ovkit", *args], env=ENV, capture_output=True, text=True, timeout=300
        )

    run = launch("--num_processes", "2", "--cpu")
    assert run.returncode != 0 and "asked for 2 processes and started one" in run.stderr
    assert not (tmp_path / "out").exists()
    # A MULTI_CPU config starts one process too (accelerate needs MPI for several CPU processes): the message says what
    # works here (torchrun, or MPI), not "use a MULTI_CPU config".
    (tmp_path / "multi_cpu.yaml").write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
    )
    run = launch("--config_file", str(tmp_path / "multi_cpu.yaml"))
    assert run.returncode != 0 and "asked for 2 processes and started one" in run.stderr, run.stderr[-2000:]
    assert "torchrun --nproc_per_node 2 -m ovkit convert" in run.stderr and "mpirun_hostfile" in run.stderr
    assert "config with distributed_type: MULTI_CPU" not in run.stderr


def test_an_engine_the_machine_cannot_run_is_named_in_a_warning(monkeypatch, tmp_path):
    """FSDP / DeepSpeed asked of accelerate on a machine that runs plain data-parallel processes: the warning names
    what was asked, what ran, and what works; Runtime records both in ovkit.json's runtime."""
    from ovkit import launch

    for var in launch.ENGINE_FLAGS:
        monkeypatch.delenv(var, raising=False)
    assert launch.engine_warning("MULTI_CPU") is None  # nothing asked
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert launch.requested_engine() == "FSDP"
    note = launch.engine_warning("MULTI_CPU")
    assert (
        note and "asked for FSDP" in note and "this run is MULTI_CPU" in note and "torchrun --nproc_per_node N" in note
    )
    assert launch.engine_warning("FSDP") is None
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # under accelerate launch, its config file says DEEPSPEED
    monkeypatch.setattr(
        launch, "_launch_config", lambda args=None: {"distributed_type": "DEEPSPEED", "num_processes": 2}
    )
    assert launch.requested_engine() == "DEEPSPEED" and "asked for DEEPSPEED" in launch.engine_warning("NO")


def test_a_sharded_output_with_a_missing_or_unfinished_part_is_not_a_dataset(tmp_path, llava_images, cli):
    root, _ = llava_images
    src = many_llava(tmp_path, 6)
    out = tmp_path / "out"
    for i in (0, 2):
        assert cli("convert", src, "--image-root", root, "--out", out, "--shard", f"{i}/3", "--quiet")[0] == 0
    with pytest.raises(OvkitError, match=r"1 of its 3 parts are missing or unfinished \(--shard 1/3\)"):
        read_samples(out)
    assert cli("convert", src, "--image-root", root, "--out", out, "--shard", "1/3", "--quiet")[0] == 0
    assert read_samples(out).table.num_rows == 6
    (out / "part-00001-of-00003" / "ovkit.json").unlink()  # as if that shard had died before finishing
    code, _, err = cli("convert", out, "--out", tmp_path / "next", "--quiet")  # the next stage refuses it
    assert code == 2 and "--shard 1/3" in err and not (tmp_path / "next").exists()


@pytest.mark.timeout(600)  # 66 s on a loaded 2-core box: two torchrun launches of eval
def test_eval_under_torchrun_shares_the_rows_and_writes_what_one_process_writes(tmp_path, eval_set, eval_tiny):
    """Each process samples and scores its share of the rows (every row from its own seed) and the main process
    writes one output: the same scores, samples and results as one process, apart from the timings."""
    import json

    model = eval_tiny
    (tmp_path / "eval.yaml").write_text(
        "n: 2\ntemperature: 1.0\n"
    )  # torchrun's own parser takes `--n` for an abbreviation of its options
    args = [
        "eval",
        eval_set,
        "--model",
        model,
        "--max-new-tokens",
        "5",
        "--config",
        tmp_path / "eval.yaml",
        "--save-logprobs",
        "--quiet",
    ]
    for n in (1, 2):
        run = _torchrun(n, *args, "--out", tmp_path / f"p{n}")
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.count("eval: reward") == 1  # one summary line: the main process's
    one, two = tmp_path / "p1", tmp_path / "p2"
    assert json.loads((two / "ovkit.json").read_text())["runtime"]["processes"] == 2
    plain = lambda doc: {k: v for k, v in doc.items() if k not in ("date", "total_evaluation_time_seconds")}  # noqa: E731
    summary = lambda d: {k: v for k, v in json.loads((d / "summary.json").read_text()).items() if k != "results"}  # noqa: E731 (a timestamped name)
    assert summary(one) == summary(two)
    files = lambda d: sorted(d.rglob("*_*.json*"))  # noqa: E731 (lmms-eval's <timestamp>_results.json, _samples_<task>.jsonl)
    assert [f.name.split("_", 2)[-1] for f in files(one)] == [f.name.split("_", 2)[-1] for f in files(two)] and files(
        one
    )
    for a, b in zip(files(one), files(two)):
        if a.suffix == ".jsonl":
            assert a.read_text() == b.read_text(), a.name
        else:
            assert plain(json.loads(a.read_text())) == plain(json.loads(b.read_text())), a.name
    assert pq_rows(one / "rollouts.parquet") == pq_rows(two / "rollouts.parquet")


def pq_rows(path: Path) -> list:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def test_close_tears_down_the_process_group(tmp_path):
    """An un-destroyed gloo group aborted a finished 2-process eval at interpreter exit in CI ("terminate called
    without an active exception": about 1 run in 5 with a 10-line torchrun script here, 0 in 25 with the
    destroy_process_group that `ovkit.cli.main` now runs through launch.close). One process, a file store: close
    destroys the group, and is a no-op when there is none."""
    import torch.distributed as dist

    from ovkit import launch

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    launch.close()
    assert not dist.is_initialized()
    launch.close()  # nothing left to tear down: no error


def test_the_cli_closes_the_process_group_whatever_the_outcome(monkeypatch):
    """main() calls launch.close on the way out of a success (exit 0) and of a usage error (exit 2) alike."""
    from ovkit import cli, launch

    calls = []
    monkeypatch.setattr(launch, "close", lambda: calls.append(1))
    for argv, code in ((["ovkit", "--version"], 0), (["ovkit", "pack", "--no-such-option"], 2)):
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as e:
            cli.main()
        assert e.value.code == code
    assert len(calls) == 2
