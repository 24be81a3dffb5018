"""Leaf file utilities of every output: its provenance file (`ovkit.json`), content fingerprints, atomic JSON, and
what tells a path ovkit wrote from one it did not.

Imports nothing of ovkit, so data, cards, the runtime and the stages all read and write outputs through it without
an import circle; the `Stage` that turns a temp dir into a complete output is ovkit.runs.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

PROVENANCE = "ovkit.json"
# Written first into every directory ovkit makes beside an output before it is complete (a Stage's `OUT.tmp-<pid>`,
# a learner's `OUT.partial`): what lets a later run remove one left by a killed run, and nothing else of that name.
MARK = ".ovkit-writing"


def is_provenance(obj: Any) -> bool:
    """Whether `obj` has the shape of ovkit's provenance (a run's `ovkit.json`, or a checkpoint's)."""
    return isinstance(obj, dict) and isinstance(obj.get("command"), str) and "ovkit_version" in obj


def is_complete(out: Path) -> bool:
    """A complete output of ovkit's: an `ovkit.json` of its provenance shape (a file of that name the user wrote is
    not one)."""
    return is_provenance(read_provenance(out))


def mark(directory: Path, command: str) -> None:
    """Mark `directory` (just made, or a run directory being continued) as ovkit's work in progress."""
    info = {
        "command": command,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(Path(directory) / MARK, info)


def is_marked(directory: Path) -> bool:
    try:
        info = json.loads((Path(directory) / MARK).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and "pid" in info and "command" in info


def written_by_ovkit(path: Path) -> bool:
    """Whether ovkit may replace or remove `path`: a directory with ovkit's `ovkit.json` (a complete output), its
    work-in-progress mark, or a checkpoint of its own (a learner's run directory from before marks), or an empty
    directory (it holds nothing to lose: `mkdir -p OUT` before a run is common). Anything else is the user's, a plain
    file included, and is never removed, moved or replaced."""
    p = Path(path)
    if not p.is_dir():
        return False
    try:
        if not any(p.iterdir()):
            return True
    except OSError:
        return False
    if is_complete(p) or is_marked(p):
        return True
    checkpoints = p / "checkpoints"
    return checkpoints.is_dir() and any(is_complete(c) for c in checkpoints.iterdir() if c.is_dir())


def fingerprint(path: Path) -> dict[str, Any]:
    """Size + mtime of every file under `path`, and a hash of parquet footers (cheap, changes with the content)."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    size = 0
    for f in files:
        st = f.stat()
        size += st.st_size
        h.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{st.st_size}".encode())
        if f.suffix == ".parquet" and st.st_size >= 8:
            with open(f, "rb") as fh:
                fh.seek(-8, os.SEEK_END)
                footer_len = int.from_bytes(fh.read(4), "little")
                fh.seek(max(0, st.st_size - 8 - footer_len))
                h.update(fh.read())
        elif st.st_size <= 1 << 20:
            h.update(f.read_bytes())
        else:
            h.update(str(st.st_mtime_ns).encode())
    return {"path": str(path), "files": len(files), "bytes": size, "sha256": h.hexdigest()[:16]}


def read_provenance(path: Path) -> dict[str, Any] | None:
    p = Path(path) / PROVENANCE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, default=str) + "\n")
    tmp.replace(path)
