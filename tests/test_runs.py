"""Stage outputs: the temporary directories of a killed run are removed by the next run of the same output, never
those of a live process (a concurrent run), of another output (another --shard part), or a path of that name that
ovkit did not write."""

import subprocess
import sys

import pytest
from PIL import Image

from ovkit.data import image_cell, samples_table, write_samples
from ovkit.files import PROVENANCE, mark, write_json
from ovkit.runs import pid_alive, remove_stale


@pytest.fixture()
def pids():
    """(a pid that was a process and has exited, the pid of a live process)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield done.pid, live.pid
    live.kill()
    live.wait()


GONE = 2**22 - 1  # above the usual pid_max: no process


def _leftovers(out, dead, live):
    """What runs leave beside `out` as ovkit writes them (a temp dir marked first, a replaced output with its
    ovkit.json), and a directory of the user's that only shares the name pattern."""
    made = {
        "dead_tmp": out.parent / f"{out.name}.tmp-{dead}",
        "dead_old": out.parent / f"{out.name}.old-{dead}",
        "live_tmp": out.parent / f"{out.name}.tmp-{live}",
        "other_output": out.parent / f"{out.name}-2.tmp-{dead}",  # not this output's
        "users": out.parent / f"{out.name}.old-{GONE}",  # not ovkit's: no mark, no ovkit.json
    }
    assert not pid_alive(GONE)
    for p in made.values():
        p.mkdir(parents=True)
        (p / "part-00000-of-00001.parquet").write_bytes(b"half a file")
    for key in ("dead_tmp", "live_tmp", "other_output"):
        mark(made[key], "balance")
    write_json(made["dead_old"] / PROVENANCE, {"command": "balance", "ovkit_version": "0"})
    return made


def test_pid_alive(pids):
    dead, live = pids
    assert not pid_alive(dead) and pid_alive(live) and pid_alive(1)


@pytest.mark.parametrize("shard", [None, "1/2"])
def test_a_rerun_removes_a_killed_runs_temporary_directories(cli, tmp_path, pids, shard):
    dead, live = pids
    data = tmp_path / "data"
    cell = image_cell(Image.new("RGB", (28, 28), "red"))
    rows = [
        {
            "id": f"r{i}",
            "images": [cell],
            "messages": [{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "a red square"}],
            "source": "t",
        }
        for i in range(4)
    ]
    write_samples(samples_table(rows), data)
    (tmp_path / "concepts.txt").write_text("red\n")
    out = tmp_path / "out"
    target = out / "part-00001-of-00002" if shard else out  # a sharded run's output is its part directory
    made = _leftovers(target, dead, live)
    args = ["balance", data, "--concepts", tmp_path / "concepts.txt", "--method", "text", "--out", out, "--quiet"]
    if shard:
        args += ["--shard", shard, "--phase", "assign"]
    code, _, err = cli(*args)
    assert code == 0, err
    assert not made["dead_tmp"].exists() and not made["dead_old"].exists()
    assert made["live_tmp"].exists() and made["other_output"].exists()
    assert (made["users"] / "part-00000-of-00001.parquet").read_bytes() == b"half a file"
    assert f"removed {made['dead_tmp']}" in err and str(made["users"]) not in err

    # a skipped rerun (the output is complete) cleans up as well
    made["dead_tmp"].mkdir()
    code, stdout, _ = cli(*args)
    assert code == 0 and "skipped" in stdout and not made["dead_tmp"].exists()


def test_a_rerun_with_other_options_is_refused_naming_them(cli, tmp_path):
    """A complete OUT re-run with the same options skips (run-control ones, like --quiet, may differ); with an option
    that shapes the result changed it exits 2 naming each as old -> new and --overwrite, and leaves OUT as it was."""
    data = tmp_path / "data"
    cell = image_cell(Image.new("RGB", (28, 28), "red"))
    rows = [
        {
            "id": f"r{i}",
            "images": [cell],
            "messages": [{"role": "user", "content": "<image>a red square"}],
            "source": "t",
        }
        for i in range(4)
    ]
    write_samples(samples_table(rows), data)
    (tmp_path / "concepts.txt").write_text("red\n")
    out = tmp_path / "out"
    args = ["balance", data, "--concepts", tmp_path / "concepts.txt", "--method", "text", "--out", out]
    code, _, err = cli(*args, "--quiet")
    assert code == 0, err
    before = (out / PROVENANCE).read_text()
    code, stdout, err = cli(*args)  # --quiet is run control: the same result
    assert code == 0 and "skipped" in stdout, err
    code, stdout, err = cli(*args, "--quiet", "--seed", "3", "--threshold", "5")
    assert code == 2 and not stdout
    assert "--seed 0 -> 3" in err and "--threshold 20.0 -> 5.0" in err and "--overwrite" in err and str(out) in err
    assert (out / PROVENANCE).read_text() == before
    code, _, err = cli(*args, "--quiet", "--seed", "3", "--overwrite")
    assert code == 0 and (out / PROVENANCE).read_text() != before, err


def test_remove_stale_leaves_the_own_process_and_unrelated_names(tmp_path, pids):
    import os

    dead, _ = pids
    out = tmp_path / "o"
    own = tmp_path / f"o.tmp-{os.getpid()}"
    for p in (own, tmp_path / f"o.tmp-{dead}x", tmp_path / "o.tmp-", tmp_path / f"oo.tmp-{dead}"):
        p.mkdir()
    mark(tmp_path / f"o.tmp-{dead}x", "synth")
    (tmp_path / f"o.old-{dead}").write_text("a file, not a directory")  # ovkit only ever leaves directories
    (tmp_path / f"o.tmp-{dead}").mkdir()
    mark(tmp_path / f"o.tmp-{dead}", "synth")
    removed = remove_stale(out)
    assert removed == [tmp_path / f"o.tmp-{dead}"]
    assert (tmp_path / f"o.old-{dead}").read_text() == "a file, not a directory"
    assert own.exists() and (tmp_path / f"o.tmp-{dead}x").exists() and (tmp_path / f"oo.tmp-{dead}").exists()
