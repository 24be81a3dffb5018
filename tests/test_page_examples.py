"""Every `ovkit ...` line in the fenced code blocks of commands/*.md and README.md runs, on the tiny default:
a page never shows a command that fails.

The examples are read off the pages (a changed page changes the test), run in-process through `ovkit`'s main() in one
scratch directory per module that holds the embedded default the pages assume: `data/` and `runs/tiny/data/` (one
small synth corpus) and the tiny model. The examples run in pipeline order (synth, init-model, convert, balance,
caption, pack, align, midtrain, sft, eval, rl-curate, rl-train, mismatch-report; within a command in page order), so
one example's output is the next one's input where the pages chain; a model directory an example reads and no earlier
example wrote is the untrained tiny model (RUNS_AS_TINY), and `OUT_CURATE` is rl-curate's example output (RENAME).

What changes in a line before it runs is in OVERRIDES (smaller step counts, token budgets and row limits, so that each
example takes seconds, not the minutes the page's numbers take), and what does not run at all is in SKIP, each with
its reason. Synopsis lines (`ovkit sft DATA... --model DIR ...`) carry placeholders and are not examples.
The few examples that take more than a few seconds are marked slow (SLOW; `make test-slow`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "commands").glob("*.md")), ROOT / "README.md"]
ORDER = [
    "synth",
    "init-model",
    "convert",
    "balance",
    "caption",
    "pack",
    "align",
    "midtrain",
    "sft",
    "eval",
    "rl-curate",
    "rl-train",
    "mismatch-report",
    "science-report",
]

# Lines that are examples but cannot run here: (a substring of the line, why).
SKIP = [
    ("llava_v1_5_mix665k.json", "needs the LLaVA-1.5 665K download"),
    ("stage1-normal/", "needs the LLaVA-OV-1.5 RL data download"),
    ("HuggingFaceH4/", "a Hub dataset: needs the network (offline here)"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "a 7B Hub model with vLLM: needs the network and a GPU"),
    ("--preset qwen2.5-vl-2b", "builds 2.2B random parameters: ~9 GB of memory and minutes on this box"),
]
RENAME = {"OUT_CURATE": "runs/tiny/rl-data"}  # the page's placeholder -> what rl-curate's example writes
# Options whose value is a model directory: when nothing has written it yet, it is the (untrained) tiny model.
RUNS_AS_TINY = ("--model",)

# command -> (option, value) set or added, and options removed. Why each:
# - synth --scale 0.02: 333 rows instead of ~8,000; the examples need every split, not its size.
# - align, midtrain, sft, rl-train: one or two optimiser steps run the whole engine (load, encode, step, save), where
#   the page's numbers take minutes to days: --epochs 0.01 (it also replaces a --config file's max-steps, as a flag
#   replaces the file's other half of an exclusive pair). --grad-accum 1:
#   the small corpus holds fewer packs than the 8B recipe's global batch of 14.
# - rl-train: 2 prompts x 2 samples, 8 new tokens (16 over all turns): the same loop, smaller.
# - eval, rl-curate, mismatch-report: 2 rows (per category) and 8 new tokens: the untrained model never stops early.
# - rl-curate --min-reward -1: the untrained model solves no prompt (reward 0, outside the default 0 < mean < 0.6),
#   so without it both stage sets are empty and rl-train's examples, which read them, have nothing to train on.
OVERRIDES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "synth": ({"--scale": "0.02"}, ()),
    "align": ({"--epochs": "0.01", "--grad-accum": "1"}, ()),
    "midtrain": ({"--epochs": "0.01", "--grad-accum": "1"}, ()),
    "sft": ({"--epochs": "0.01", "--grad-accum": "1"}, ()),
    "rl-train": (
        {
            "--epochs": "0.01",
            "--prompts-per-step": "2",
            "--group-size": "2",
            "--max-new-tokens": "8",
            "--max-response-tokens": "16",
        },
        (),
    ),
    "eval": ({"--limit": "2", "--max-new-tokens": "8"}, ()),
    "rl-curate": ({"--limit": "2", "--n": "2", "--max-new-tokens": "8", "--min-reward": "-1"}, ()),
    "mismatch-report": ({"--limit": "2", "--max-new-tokens": "8"}, ()),
    "caption": ({"--max-new-tokens": "8"}, ()),
}
# Lines that run only under `-m slow` (make test-slow): (a substring of the line, why). The rest takes ~25 s in all.
SLOW = [
    ("--preset tiny-clip", "trains the tiny CLIP on the captions: ~30 s on 2 cores"),
    ("--encoder runs/tiny/models/clip", "reads that CLIP"),
]


def logical_lines(block: str):
    """Lines of a code block with backslash continuations joined."""
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        yield line
        i += 1


def page_examples() -> list[tuple[str, str]]:
    """(page, command line) for every line of a fenced block that starts with `ovkit ` (after an optional `$ `)."""
    found = []
    for page in PAGES:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), re.S | re.M):
            for line in logical_lines(block):
                line = line.removeprefix("$ ")
                if re.match(r"(\w+=\S+ )*ovkit ", line):
                    found.append((page.relative_to(ROOT).as_posix(), line.strip()))
    return found


def words_of(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while "=" in words[0]:  # VAR=value prefixes
        words.pop(0)
    return words[1:]


def is_synopsis(words: list[str]) -> bool:
    """A usage line: a placeholder (DIR, DATA..., N, RUN..., $I/$N) or an optional part in [brackets]."""
    return any(re.fullmatch(r"[A-Z][A-Z0-9_.]*(\.\.\.)?|.*[\[\]|].*|.*\$\w.*", w) and w not in RENAME for w in words)


def skip_reason(line: str) -> str | None:
    for part, why in SKIP:
        if part in line:
            return why
    if is_synopsis(words_of(line)):
        return "a synopsis line (placeholders), not an example"
    return None


def command_of(words: list[str]) -> str:
    return words[0]


def overridden(words: list[str]) -> list[str]:
    words = [w for w in words]
    for placeholder, path in RENAME.items():
        words = [w.replace(placeholder, path) for w in words]
    if "--compare" in words or "--list-presets" in words:
        return words
    sets, drops = OVERRIDES.get(command_of(words), ({}, ()))
    for opt in drops:
        while opt in words:
            i = words.index(opt)
            del words[i : i + 2]
    for opt, value in sets.items():
        if opt in words:
            words[words.index(opt) + 1] = value
        else:
            words += [opt, value]
    return words


def _sort_key(item):
    index, (page, line) = item
    words = words_of(line)
    return ORDER.index(command_of(words)), "--compare" in words, index  # a comparison after the evals it reads


EXAMPLES = [ex for _, ex in sorted(enumerate(page_examples()), key=_sort_key)]


def _param(page: str, line: str):
    why = skip_reason(line)
    marks = [pytest.mark.skip(reason=why)] if why else [pytest.mark.slow] if any(p in line for p, _ in SLOW) else []
    return pytest.param(page, line, marks=marks, id=f"{page}:{line[:70]}")


def test_the_pages_have_examples_of_every_command():
    runnable = {command_of(words_of(line)) for _, line in EXAMPLES if not skip_reason(line)}
    assert runnable == set(ORDER), set(ORDER) - runnable


@pytest.fixture(scope="module")
def world(tmp_path_factory, cli):
    """The embedded default the pages assume, built once: data/ (= runs/tiny/data/) and the tiny model."""
    home = tmp_path_factory.mktemp("pages")
    old = os.getcwd()
    os.chdir(home)
    try:
        code, _, err = cli("synth", "--out", "data", "--scale", "0.02", "--quiet")
        assert code == 0, err
        code, _, err = cli(
            "init-model",
            "--preset",
            "tiny",
            "--corpus",
            "data/pretrain",
            "--corpus",
            "data/instruct",
            "--out",
            ".tiny",
            "--quiet",
        )
        assert code == 0, err
    finally:
        os.chdir(old)
    (home / "examples").symlink_to(ROOT / "examples")  # --config examples/... as typed in the repository root
    (home / "runs" / "tiny").mkdir(parents=True)
    (home / "runs" / "tiny" / "data").symlink_to(home / "data")
    return {"home": home, "seeded": set(), "written": {}}


def prepare(world, words: list[str]) -> None:
    """Model directories the example reads that no earlier example wrote are the tiny model; an output that was such a
    stand-in is removed so the example writes its own; so is an output another example wrote (two pages' examples
    may name the same output: the second would only print that it skipped)."""
    home = world["home"]
    for opt, value in zip(words, words[1:]):
        path = home / value.rstrip("/")
        if opt == "--out" and value.rstrip("/") in world["seeded"]:
            path.unlink()
            world["seeded"].discard(value.rstrip("/"))
        if opt == "--out" and world["written"].get(value.rstrip("/"), words) != words:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if opt == "--out":
            world["written"][value.rstrip("/")] = words
        if opt in RUNS_AS_TINY and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(home / ".tiny")
            world["seeded"].add(value.rstrip("/"))


@pytest.mark.parametrize("page, line", [_param(p, ln) for p, ln in EXAMPLES])
def test_page_example_runs(world, cli, monkeypatch, page, line):
    words = overridden(words_of(line))
    monkeypatch.chdir(world["home"])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    prepare(world, words)
    code, out, err = cli(*words, *[] if "--quiet" in words else ["--quiet"])  # no progress bars in the log
    assert code == 0, f"{page}: `{line}` (run as `ovkit {shlex.join(words)}`) exited {code}:\n{err[-3000:]}"
