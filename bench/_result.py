"""The one result format of every bench: its final table printed as markdown (the form BENCHMARKS.md holds, so a
table is pasted, not retyped) and, where the environment variable BENCH_JSON names a file, the same rows appended to
it as JSON lines, one per row, so a BENCHMARKS.md table can be regenerated from a run instead of copied by hand:

    BENCH_JSON=/tmp/bench.jsonl python bench/pack.py
    {"bench": "pack", "table": "...", "commit": "cc6473a", "host": "...", "time": "...", <the row's columns>}

A row is a dict of column -> value; numbers are printed with `formats` ({column: format spec}, else `.4g`) and written
as numbers. A bench imports it as its neighbours import `_workers` (`python bench/NAME.py` puts bench/ on the path).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV = "BENCH_JSON"


def _commit() -> str | None:
    try:
        run = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() or None


def _cell(value: Any, spec: str | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).replace("|", "\\|")
    return format(value, spec or ("d" if isinstance(value, int) else ".4g"))


def markdown(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, formats: Mapping[str, str] = {}):
    """`rows` as a markdown table: one column per key (the first row's order, or `columns`)."""
    columns = list(columns or (rows[0].keys() if rows else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c), formats.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def table(
    bench: str,
    title: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    columns: Sequence[str] | None = None,
    formats: Mapping[str, str] = {},
    file: Any = None,
) -> None:
    """Print `title` and `rows` as a markdown table; with BENCH_JSON set, append one JSON line per row (`bench`,
    `table`, the commit and host, then the row's columns)."""
    out = file or sys.stdout
    print(f"\n{title}\n", file=out)
    print(markdown(rows, columns, formats), file=out)
    path = os.environ.get(ENV)
    if not path:
        return
    context = {
        "bench": bench,
        "table": title,
        "commit": _commit(),
        "host": platform.node(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({**context, **{k: row[k] for k in (columns or row.keys()) if k in row}}, default=str))
            f.write("\n")
