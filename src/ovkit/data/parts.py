"""A dataset's local files: the parquet part files of a directory, `--shard I/N` parts, and atomic parquet writes.

The lower half of ovkit.data.io: it reads no dataset spec (no Hub, no dataset card, no conversion), so the format
detector, ovkit.data.sources and the converter all write and list part files through it without an import circle.
Shards are named `part-I-of-N.parquet` (zero-padded) so that a directory written by N machines with `--shard I/N`
sorts into the same row order as a single-machine run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ovkit.data.schema import conform, hf_metadata
from ovkit.errors import OvkitError

REJECTS = "rejects.parquet"


def local_parquet_files(path: Path | str) -> list[Path]:
    """The parquet files of a local file or directory (no dataset card). In a directory written by ovkit only the
    `part-*.parquet` files are data (side tables such as rejects.parquet or a plan sit beside them); in any other
    directory every parquet file is, except rejects and hidden files."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*.parquet")
            if p.name != REJECTS and not any(s.startswith(".") or ".tmp-" in s for s in p.relative_to(path).parts)
        )
        parts = [p for p in files if p.name.startswith("part-")]
        if parts or files:
            return parts or files
        raise OvkitError(f"{path}: directory holds no parquet files")
    raise OvkitError(f"{path}: no such file or directory")


PART_DIR = re.compile(r"part-(\d+)-of-(\d+)")


def check_parts(path: Path) -> None:
    """A sharded output (OUT/part-I-of-N/ directories) is one dataset only when all N parts are there and complete
    (each has its ovkit.json): a missing or unfinished part is an error naming it, never a silently smaller dataset."""
    found: dict[int, set[int]] = {}
    for d in path.iterdir():
        m = PART_DIR.fullmatch(d.name)
        if m and d.is_dir():
            found.setdefault(int(m.group(2)), set()).update([int(m.group(1))] if (d / "ovkit.json").is_file() else [])
    for n, done in found.items():
        missing = sorted(set(range(n)) - done)
        if missing:
            shards = ", ".join(f"--shard {i}/{n}" for i in missing[:4]) + (" ..." if len(missing) > 4 else "")
            raise OvkitError(
                f"{path}: {len(missing)} of its {n} parts are missing or unfinished ({shards}); run them first"
            )


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'3/8' -> (3, 8): the 4th of 8 parts (0-based, like a rank)."""
    if text is None or text == "":
        return None
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise OvkitError(f"--shard must look like I/N (e.g. 3/8), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise OvkitError(f"--shard {text}: need 0 <= I < N")
    return i, n


def shard_bounds(n_rows: int, shard: tuple[int, int]) -> tuple[int, int]:
    """Rows [lo, hi) of part I of N: contiguous, sizes differ by at most one, the parts cover every row once."""
    i, n = shard
    return (n_rows * i) // n, (n_rows * (i + 1)) // n


def part_name(shard: tuple[int, int] | None) -> str:
    i, n = shard or (0, 1)
    return f"part-{i:05d}-of-{n:05d}.parquet"


def shard_out(out: Path | str, shard: tuple[int, int] | None) -> Path:
    """Where a sharded run writes: `OUT/part-I-of-N/` (complete or absent on its own), so N machines can share one
    OUT and the next stage reads OUT as one dataset (shard directories sort in row order)."""
    return Path(out) if shard is None else Path(out) / part_name(shard).removesuffix(".parquet")


def write_table(table: pa.Table, path: Path | str, *, row_group_size: int = 256) -> Path:
    """Write one parquet file atomically (temp file + rename), with `datasets` feature metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = hf_metadata(table.schema)
    if meta:
        table = table.replace_schema_metadata(meta)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if table.num_rows:
        pq.write_table(table, tmp, row_group_size=row_group_size, compression="zstd")
    else:  # no row group at all: `datasets` fails on an empty one ("BatchSize must be greater than 0")
        pq.ParquetWriter(tmp, table.schema, compression="zstd").close()
    tmp.replace(path)
    return path


def write_samples(table: pa.Table, out_dir: Path | str, shard: tuple[int, int] | None = None) -> Path:
    """Write a sample table as shard `part-I-of-N.parquet` of the dataset directory `out_dir`."""
    return write_table(conform(table), Path(out_dir) / part_name(shard))


def write_rejects(rejects: pa.Table | None, out_dir: Path | str) -> Path | None:
    if rejects is None or rejects.num_rows == 0:
        return None
    return write_table(rejects, Path(out_dir) / REJECTS)
