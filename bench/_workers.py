"""Running each benchmark case in a fresh process (so its peak memory is its own): the parent writes a spec, each
child runs `script --worker NAME --spec SPEC` and prints one `RESULT {json}` line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_workers(script: str, names: list[str], spec: dict[str, Any], work: Path) -> dict[str, dict[str, Any]]:
    """{name: the child's result} for every case that finished; a failing case is reported on stderr and left out."""
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    results = {}
    for name in names:
        run = subprocess.run(
            [sys.executable, script, "--worker", name, "--spec", str(path)], capture_output=True, text=True
        )
        line = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
        if run.returncode != 0 or not line:
            print(f"{name}: failed\n{run.stderr[-3000:]}", file=sys.stderr)
            continue
        results[name] = json.loads(line[-1][len("RESULT ") :])
    return results


def report_result(result: dict[str, Any]) -> None:
    """What a child prints for its parent."""
    print("RESULT " + json.dumps(result))


def find_key(tree, key: str):
    """The first value of `key` anywhere in a JSON tree (ovkit.json keeps the runtime facts under its stage record)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for v in tree:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


def tiny_default(work: Path, data: str, model: str) -> None:
    """The synthetic corpus (scale 0.25, seed 0) in work/data and the tiny model trained on its text in work/model,
    each made once (a later run on another checkout reuses them: same inputs)."""

    def ovkit(*args):
        subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)

    if not (work / data / "ovkit.json").is_file():
        ovkit("synth", "--out", work / data, "--scale", "0.25", "--seed", "0")
    if not (work / model / "ovkit.json").is_file():
        ovkit("init-model", "--preset", "tiny", "--corpus", work / data, "--out", work / model)
