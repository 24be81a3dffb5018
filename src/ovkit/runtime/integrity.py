"""Checkpoints are written completely or not at all, and checked before a resume loads one.

At save, after every file of `checkpoints/.step-N.tmp` is written: `manifest.json` lists each file's size and CRC32,
every file and directory is fsynced, and only then is the directory renamed to `step-N` (and its parent fsynced), so
a crash of the machine during a save leaves a temp directory that is ignored, never a damaged `step-N`. `--resume`
checks the newest checkpoint against its manifest (every file present, same size, same checksum) before loading it.

Why CRC32: the check is against damage (a truncated file, a block the filesystem lost, something else copied over a
file), not against an attacker (state files load with torch.load(weights_only=True) either way). zlib's CRC32 runs at
several GB/s and releases the GIL, so the files are summed on a few threads: a multi-GB checkpoint costs seconds, the
same order as writing it. A checkpoint written before manifests existed is loaded unchecked.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 8 << 20


def crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _files(root: Path, skip: set[str]) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and str(p.relative_to(root)) not in skip)


def write_manifest(root: Path, *, last: str) -> None:
    """`root/manifest.json`: size and CRC32 of every file but `last` (written after it: its presence marks the
    checkpoint complete)."""
    files = _files(root, {MANIFEST, last})
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = list(pool.map(crc32, files))
    entries = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "crc32": c} for p, c in zip(files, sums)}
    (root / MANIFEST).write_text(json.dumps({"algorithm": "crc32", "files": entries}, indent=1) + "\n")


def fsync_tree(root: Path) -> None:
    """Every file and directory under `root` (and `root`) on disk, not only in the page cache."""
    for p in [*_files(root, set()), *sorted((d for d in root.rglob("*") if d.is_dir()), reverse=True), root]:
        fsync(p)


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def damage(root: Path, *, last: str) -> str | None:
    """What is wrong with checkpoint `root` (None: nothing found): a file missing, of another size or checksum than
    at save time, or a JSON record that does not parse."""
    try:
        json.loads((root / last).read_text())
    except (OSError, ValueError) as e:
        return f"{last} unreadable ({e})"
    if not (root / MANIFEST).is_file():
        return None  # written before manifests: nothing to check against
    try:
        entries = json.loads((root / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{MANIFEST} unreadable ({e})"
    for rel, want in entries.items():
        p = root / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want["bytes"]:
            return f"{rel} has {p.stat().st_size} bytes, {want['bytes']} were written"
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = dict(zip(entries, pool.map(crc32, [root / rel for rel in entries])))
    for rel, want in entries.items():
        if sums[rel] != want["crc32"]:
            return f"{rel} does not match its checksum (its content changed after the save)"
    return None
