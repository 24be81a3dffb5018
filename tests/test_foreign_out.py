"""A path ovkit did not write is never removed, moved or replaced: an existing `--out` that is not a complete
ovkit output is refused with exit 2 naming it, `--overwrite` or not, before any model or data loads; the same for
what ovkit writes beside an output (`OUT.lock`, `OUT.partial`, a `--shard` part's parent, eval --compare's file)."""

import os

import pytest

from ovkit.errors import OvkitError
from ovkit.files import MARK, PROVENANCE, is_complete, mark, write_json, written_by_ovkit

NOTES = b"my notes: not ovkit's\n"


def _args(assets, tmp_path):
    """Every command with --out, as its smallest valid command line (inputs that exist; the refusal comes first)."""
    data, model = assets / "data", assets / "model"
    (tmp_path / "concepts.txt").write_text("red\n")
    return {
        "synth": ["synth"],
        "convert": ["convert", data],
        "init-model": ["init-model", "--preset", "tiny", "--corpus", data],
        "balance": ["balance", data, "--concepts", tmp_path / "concepts.txt", "--method", "text"],
        "caption": ["caption", data, "--model", model],
        "pack": ["pack", data, "--model", model, "--max-len", "256"],
        "align": ["align", data, "--model", model],
        "midtrain": ["midtrain", data, "--model", model],
        "sft": ["sft", data, "--model", model],
        "rl-curate": ["rl-curate", data, "--model", model],
        "rl-train": ["rl-train", data, "--model", model],
        "eval": ["eval", data, "--model", model],
        "mismatch-report": ["mismatch-report", "--model", model, "--generate", data],
        "eval --compare": ["eval", "--compare", tmp_path / "no-such-run"],  # refused before the runs are read
    }


COMMANDS = [
    "synth",
    "convert",
    "init-model",
    "balance",
    "caption",
    "pack",
    "align",
    "midtrain",
    "sft",
    "rl-curate",
    "rl-train",
    "eval",
    "mismatch-report",
    "eval --compare",
]


def _snapshot(root):
    """{relative path: bytes (None for a directory)} of everything under root."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _users(path, kind):
    if kind == "dir":
        path.mkdir()
        (path / "notes.txt").write_bytes(NOTES)
        (path / "sub").mkdir()
        (path / "sub" / "data.bin").write_bytes(bytes(range(256)))
        (path / "compare.md").write_bytes(NOTES)  # what eval --compare --out DIR writes: DIR/compare.md
    else:
        path.write_bytes(NOTES)


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
@pytest.mark.parametrize("kind", ["dir", "file"])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_out_ovkit_did_not_write_is_refused_and_left_byte_for_byte(assets, tmp_path, cli, command, kind, overwrite):
    args = _args(assets, tmp_path)[command]
    work = tmp_path / "work"
    work.mkdir()
    users = work / "mine"
    _users(users, kind)
    before = _snapshot(work)
    code, out, err = cli(*args, "--out", users, *(["--overwrite"] if overwrite else []))
    assert code == 2, (out, err)
    assert str(users) in err and "ovkit did not write" in err and "move" in err, err
    assert "Traceback" not in err and "ovkit did not write" not in out
    assert _snapshot(work) == before  # the user's bytes, and nothing beside them: no lock, no temp dir, no .old-


def test_an_empty_directory_is_taken_as_the_output(assets, tmp_path, cli):
    """`mkdir -p OUT` before a run: an empty directory holds nothing to lose, so it becomes the output."""
    out = tmp_path / "made-by-a-script"
    out.mkdir()
    code, _, err = cli("convert", assets / "data", "--out", out, "--quiet")
    assert code == 0, err
    assert is_complete(out) and not (out / MARK).exists()  # complete: its ovkit.json says whose it is
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made-by-a-script"]  # nothing left beside it


def test_overwrite_still_replaces_an_output_ovkit_wrote(assets, tmp_path, cli):
    out = tmp_path / "converted"
    assert cli("convert", assets / "data", "--out", out, "--quiet")[0] == 0
    code, stdout, _ = cli("convert", assets / "data", "--out", out, "--quiet")
    assert code == 0 and "skipped" in stdout
    first = (out / PROVENANCE).read_text()
    code, _, err = cli("convert", assets / "data", "--out", out, "--overwrite", "--quiet")
    assert code == 0, err
    assert (out / PROVENANCE).read_text() != first  # replaced (its start and end times differ)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]


def test_a_file_named_ovkit_json_that_ovkit_did_not_write_makes_no_output_complete(assets, tmp_path, cli):
    users = tmp_path / "mine"
    users.mkdir()
    (users / PROVENANCE).write_text('{"my": "settings"}')
    assert not is_complete(users) and not written_by_ovkit(users)
    code, _, err = cli("convert", assets / "data", "--out", users, "--overwrite")
    assert code == 2 and str(users) in err
    assert (users / PROVENANCE).read_text() == '{"my": "settings"}'


def test_a_learners_run_directory_that_ovkit_did_not_write_is_refused(assets, tmp_path, cli):
    """OUT.partial is where a learner runs and what --overwrite empties: a directory of that name of the user's
    stays, --overwrite or --resume alike."""
    users = tmp_path / "run.partial"
    _users(users, "dir")
    before = _snapshot(tmp_path)
    for flag in ("--overwrite", "--resume"):
        code, _, err = cli("sft", assets / "data", "--model", assets / "model", "--out", tmp_path / "run", flag)
        assert code == 2 and str(users) in err and "ovkit did not write" in err, err
        assert _snapshot(tmp_path) == before


def test_a_lock_file_that_ovkit_did_not_write_is_refused_and_kept(assets, tmp_path, cli):
    lock = tmp_path / "out.lock"
    lock.write_bytes(NOTES)
    code, _, err = cli("convert", assets / "data", "--out", tmp_path / "out", "--overwrite")
    assert code == 2 and str(lock) in err and "not an ovkit lock file" in err, err
    assert lock.read_bytes() == NOTES and sorted(p.name for p in tmp_path.iterdir()) == ["out.lock"]
    lock.unlink()
    (tmp_path / "out.lock").mkdir()  # a directory of that name: the same
    code, _, err = cli("convert", assets / "data", "--out", tmp_path / "out")
    assert code == 2 and "not an ovkit lock file" in err and (tmp_path / "out.lock").is_dir()


def test_a_lock_left_by_a_killed_run_is_still_taken_over(assets, tmp_path, cli):
    lock = tmp_path / "out.lock"
    lock.write_text('{"pid": 1, "host": "gone", "command": "convert", "started": "then"}\n')
    code, _, err = cli("convert", assets / "data", "--out", tmp_path / "out", "--quiet")
    assert code == 0, err
    assert not lock.exists()


def test_a_shard_part_never_writes_its_card_over_the_users_files(assets, tmp_path, cli):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "README.md").write_bytes(NOTES)
    code, _, err = cli("convert", assets / "data", "--shard", "0/2", "--out", users)
    assert code == 2 and str(users) in err, err
    assert sorted(p.name for p in users.iterdir()) == ["README.md"] and (users / "README.md").read_bytes() == NOTES
    out = tmp_path / "sharded"  # parts of ovkit's own, with their card, are fine
    for i in (0, 1):
        code, _, err = cli("convert", assets / "data", "--shard", f"{i}/2", "--out", out, "--quiet")
        assert code == 0, err
    assert (out / "README.md").is_file() and all(is_complete(p) for p in out.glob("part-*"))


def test_eval_compare_replaces_only_its_own_table(tmp_path, cli):
    """--compare --out FILE: a rerun replaces the table it wrote (its first line is ovkit's marker comment)."""
    from ovkit.commands.eval import COMPARE_MARK, _compare_target, _write_text

    path = tmp_path / "table.md"
    _write_text(_compare_target(path), "| a |\n")
    assert path.read_text() == COMPARE_MARK + "| a |\n"
    _write_text(_compare_target(path), "| b |\n")
    assert path.read_text() == COMPARE_MARK + "| b |\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.md"]
    path.write_text("| mine |\n")
    with pytest.raises(OvkitError, match="ovkit did not write"):
        _compare_target(path)


def test_output_made_by_the_user_during_a_run_is_not_swapped_away(tmp_path):
    """A learner runs for hours: a directory the user makes at OUT meanwhile is checked again before the rename."""
    from ovkit.data.synth import SynthConfig
    from ovkit.runs import Stage

    out = tmp_path / "out"
    stage = Stage("synth", SynthConfig(out=out), out)
    with pytest.raises(OvkitError, match="ovkit did not write"):
        with stage:
            assert (stage.path / MARK).is_file()  # marked before anything else is written
            _users(out, "dir")
    assert (out / "notes.txt").read_bytes() == NOTES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the temp dir went, the lock too


def test_what_counts_as_ovkits(tmp_path):
    assert written_by_ovkit(_made(tmp_path / "empty"))
    marked = _made(tmp_path / "marked", "x")
    mark(marked, "sft")
    assert written_by_ovkit(marked)
    done = _made(tmp_path / "done", "x")
    write_json(done / PROVENANCE, {"command": "sft", "ovkit_version": "1"})
    assert written_by_ovkit(done)
    ckpt = _made(tmp_path / "old-run" / "checkpoints" / "step-000002", "x")  # a run dir from before the mark
    write_json(ckpt / PROVENANCE, {"command": "sft", "ovkit_version": "1"})
    assert written_by_ovkit(tmp_path / "old-run")
    assert not written_by_ovkit(_made(tmp_path / "users", "x"))
    (tmp_path / "file").write_bytes(b"")
    assert not written_by_ovkit(tmp_path / "file")
    bad_mark = _made(tmp_path / "bad-mark")
    (bad_mark / MARK).write_text("not json")
    assert not written_by_ovkit(bad_mark)
    os.symlink(tmp_path / "users", tmp_path / "link")
    assert not written_by_ovkit(tmp_path / "link")


def _made(path, file=None):
    path.mkdir(parents=True)
    if file:
        (path / file).write_text("x")
    return path


def test_a_caption_work_directory_that_ovkit_did_not_write_is_refused_before_the_model_loads(assets, tmp_path, cli):
    work = tmp_path / ".out.caption-work"  # where caption keeps the chunks of an unfinished run of tmp_path/out
    _users(work, "dir")
    before = _snapshot(tmp_path)
    code, _, err = cli("caption", assets / "data", "--model", assets / "model", "--out", tmp_path / "out")
    assert code == 2 and str(work) in err and "ovkit did not write" in err, err
    assert _snapshot(tmp_path) == before


def test_overwrite_through_a_link_to_ovkits_output_leaves_what_it_points_to(assets, tmp_path, cli):
    real, link = tmp_path / "real", tmp_path / "latest"
    assert cli("convert", assets / "data", "--out", real, "--quiet")[0] == 0
    before = _snapshot(real)
    os.symlink(real, link)
    code, _, err = cli("convert", assets / "data", "--out", link, "--overwrite", "--quiet")
    assert code == 0, err
    assert _snapshot(real) == before and is_complete(link) and not link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "real"]
