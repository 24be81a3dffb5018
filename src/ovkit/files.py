"""Leaf file utilities of every output: its provenance file (`ovkit.json`), content fingerprints and atomic JSON.

Imports nothing of ovkit, so data, cards, the runtime and the stages all read and write outputs through it without
an import circle; the `Stage` that turns a temp dir into a complete output is ovkit.runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

PROVENANCE = "ovkit.json"


def is_complete(out: Path) -> bool:
    return (Path(out) / PROVENANCE).is_file()


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
