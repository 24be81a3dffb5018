"""docs/python.md ("ovkit from Python") runs as written: its bash block makes the embedded default with the CLI, then
every python block runs, in page order, in one namespace and one scratch directory (each asserts what it shows)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_examples_of_every_entry_point():
    code = "\n".join(blocks("python"))
    assert all(f"{name}(" in code for name in ("train", "train_rl", "run_eval", "compare_table"))


@pytest.mark.usefixtures("one_thread")
def test_every_python_example_runs(cli, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for line in blocks("bash")[0].splitlines():
        argv = shlex.split(line)
        assert argv[0] == "ovkit"
        code, _, err = cli(*argv[1:], "--quiet")
        assert code == 0, err
    namespace: dict = {}
    for n, source in enumerate(blocks("python")):
        exec(compile(source, f"{PAGE.name} block {n + 1}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "done 3" in out and "--max-steps 3 -> 5" in out and "| category" in out
