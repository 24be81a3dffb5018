"""Reading and writing datasets: a parquet file or a directory of parquet shards, read as one table.

Shards are named `part-I-of-N.parquet` (zero-padded) so that a directory written by N machines with `--shard I/N`
sorts into the same row order as a single-machine run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ovkit.data.schema import check_columns, conform, hf_metadata, row_problems
from ovkit.errors import OvkitError, where

REJECTS = "rejects.parquet"


def parquet_files(path: Path | str) -> list[Path]:
    """The parquet files that make up a sample table, in row order. `path` is anything `ovkit.data.sources` reads: a
    parquet file or directory, a directory with a dataset card (`DIR:CONFIG@SPLIT`), a `datasets` saved directory or
    a Hub dataset id; sources that are not ovkit parquet are converted once into the cache and read from there."""
    from ovkit.data.sources import sample_files

    return sample_files(path)


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


def read_table(path: Path | str, columns: Sequence[str] | None = None) -> pa.Table:
    """Read every shard of a dataset into one table (no validation)."""
    tables = [_read_file(f, columns) for f in parquet_files(path)]
    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="default")
    except pa.ArrowException as e:
        raise OvkitError(f"{path}: shards have incompatible schemas ({e})") from None


def _read_file(f: Path, columns: Sequence[str] | None = None) -> pa.Table:
    try:
        t = pq.read_table(f, columns=list(columns) if columns else None)
    except (
        pa.ArrowException,
        OSError,
    ) as e:  # a zero-byte, truncated or corrupt file (ArrowInvalid, ArrowIOError, ...)
        raise OvkitError(f"{where(f)}: not a readable parquet file ({e})") from None
    return t.replace_schema_metadata(None)


def read_schema(f: Path) -> pa.Schema:
    """A parquet file's schema, from its footer; an unreadable file is an error naming it."""
    try:
        return pq.read_schema(f)
    except (pa.ArrowException, OSError) as e:
        raise OvkitError(f"{where(f)}: not a readable parquet file ({e})") from None


@dataclass
class Samples:
    """Rows that passed validation, and the ones that did not (with a `reason` column)."""

    table: pa.Table
    rejects: pa.Table | None
    files: list[Path]
    rows: list[int]  # the dataset-wide row number of each kept row (stable across --shard splits and rejects)
    counts: list[int] = field(default_factory=list)  # rows in each of `files`

    @property
    def n_rejects(self) -> int:
        return 0 if self.rejects is None else self.rejects.num_rows

    def where(self, i: int, column: str) -> str:
        """`file F, row 'ID' (index K), column 'C'` of row i of `table`: the part file it came from and its index there,
        for a problem found after reading (a picture that fails to decode in a later pass)."""
        row, start = self.rows[i], 0
        for f, n in zip(self.files, self.counts):
            if row < start + n:
                return where(f, f"{self.table.column('id')[i].as_py()!r} (index {row - start})", column)
            start += n
        raise IndexError(i)


def read_samples(
    path: Path | str,
    *,
    shard: tuple[int, int] | None = None,
    on_error: str | None = None,
    images: str = "decode",
    answers: bool = False,
) -> Samples:
    """Read and validate a sample table (ovkit.data.schema: every file's column types, then every row). With
    `on_error='fail'` the first bad row raises an error naming its file, row id and column; with `'skip'` bad rows
    are returned as rejects, so rows in == rows out + rejects.

    `images`: "decode" decodes every picture (the default: complete); "header" checks sizes and structure only, for
    a caller that decodes every image itself before its first step and reports failures the same way. `answers`:
    RL and eval tables, whose rows need a gold answer their scorer can read. `on_error=None`: fail, for a command
    that has no --on-error (its message then says how to drop bad rows with `ovkit convert` instead)."""
    if on_error not in (None, "fail", "skip"):
        raise OvkitError(f"--on-error must be 'fail' or 'skip', got {on_error!r}")
    files = parquet_files(path)
    counts = [_num_rows(f) for f in files]
    for f in files:  # every file's columns, also those outside this --shard part: a bad file is named at once
        schema = read_schema(f)
        check_columns(schema, f)
        if answers and "answer" not in schema.names:
            raise OvkitError(f"{shown(f, path, column='answer')}: {no_answer(schema.names)}")
    total = sum(counts)
    lo, hi = shard_bounds(total, shard) if shard else (0, total)
    seen = _ids_before(files, counts, lo, hi)  # a repeat of an earlier --shard part's id is a duplicate here too
    good, bad, rows = [], [], []
    offset = 0
    for f, n in zip(files, counts):
        a, b = max(lo - offset, 0), min(hi - offset, n)
        offset += n
        if a >= b:
            continue
        t = conform(_read_file(f).slice(a, b - a))
        problems = row_problems(t, images=images, seen_ids=seen, answers=answers, origin=f.name, start=a)
        if problems and on_error != "skip":
            p = problems[0]
            rid = t.column("id")[p.index].as_py()
            index = (
                f"{rid!r} (index {a + p.index})" if shown(f, path) == where(f) else repr(rid)
            )  # a converted copy's index is not the input's
            raise OvkitError(f"{shown(f, path, index, p.column)}: {p.reason} ({skip_hint(path, on_error)})")
        bad_idx = {p.index: p for p in problems}
        keep = [i for i in range(t.num_rows) if i not in bad_idx]
        good.append(t.take(pa.array(keep, pa.int64())))
        rows.extend(offset - n + a + i for i in keep)
        if bad_idx:
            rej = t.take(pa.array(sorted(bad_idx), pa.int64()))
            reasons = [
                f"{f.name} row {a + i}, column '{bad_idx[i].column}': {bad_idx[i].reason}" for i in sorted(bad_idx)
            ]
            bad.append(rej.append_column("reason", pa.array(reasons, pa.string())))
    if not good:
        raise OvkitError(
            f"{path}: dataset is empty" + (f" (shard {shard[0]}/{shard[1]} of {total} rows)" if shard else "")
        )
    table = pa.concat_tables(good, promote_options="default")
    rejects = pa.concat_tables(bad, promote_options="default") if bad else None
    return Samples(table, rejects, files, rows, counts)


def shown(f: Path, path: Path | str, row: object = None, column: str | None = None) -> str:
    """`where` for a row of file `f` of the input `path`, naming the user's input when `f` is ovkit's converted copy
    of it in the cache (a TRL / JSON / Hub source), never the internal cache path."""
    from ovkit.data.sources import cache_dir

    if Path(f).resolve().is_relative_to(cache_dir().resolve()):
        return where(f"{path} (read through its converted copy)", row, column)
    return where(f, row, column)


def skip_hint(path: Path | str, on_error: str | None) -> str:
    """How to get past bad rows: the command's own --on-error skip, or `ovkit convert`'s for a command without it."""
    if on_error is not None:
        return f"use --on-error skip to move bad rows to {REJECTS}"
    return f"fix the row, or move bad rows to DIR/{REJECTS} first with `ovkit convert {path} --on-error skip --out DIR`"


def no_answer(columns: list[str]) -> str:
    """Why a table without an `answer` column is no RL / eval set, and what to do about it."""
    shown_columns = ", ".join(columns[:20])
    for name in ("solution", "ground_truth", "gold", "label", "answers"):
        if name in columns:  # TRL's GRPO datasets call it `solution`
            return (
                f"RL and eval rows need a gold answer in column 'answer' (columns: {shown_columns}); this input keeps it in "
                f"'{name}': rename that column to 'answer' (e.g. `Dataset.rename_column(\"{name}\", \"answer\")`) and give "
                f"'answer_type' (the scorer) where the default does not fit"
            )
    return f"RL and eval rows need a gold answer in column 'answer' (columns: {shown_columns}); this looks like a training split"


def _num_rows(f: Path) -> int:
    try:
        return pq.ParquetFile(f).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise OvkitError(f"{where(f)}: not a readable parquet file ({e})") from None


def count_rows(path: Path | str) -> int:
    """Rows of a dataset, from its files' footers; an unreadable file is an error naming it."""
    return sum(_num_rows(f) for f in parquet_files(path))


def _ids_before(files: list[Path], counts: list[int], lo: int, hi: int) -> dict[str, str]:
    """{id: where} for the ids of rows [lo, hi) that already occur in rows [0, lo) (earlier --shard parts), where
    being the first occurrence. Only the id column is read, and compared in arrow: no Python set of every id."""
    if lo == 0:
        return {}
    earlier, ours, starts = [], [], []
    offset = 0
    for f, n in zip(files, counts):
        if offset >= hi:
            break
        ids = _read_file(f, ["id"]).column("id").cast(pa.string())
        if offset < lo:
            earlier.append(ids.slice(0, lo - offset))
            starts.append((offset, f))
        a, b = max(lo - offset, 0), min(hi - offset, n)
        if a < b:
            ours.append(ids.slice(a, b - a))
        offset += n
    before = pa.chunked_array([c for e in earlier for c in e.chunks], pa.string())
    mine = pa.chunked_array([c for e in ours for c in e.chunks], pa.string())
    repeated = pc.filter(mine, pc.is_in(mine, value_set=before.combine_chunks(), skip_nulls=True)).to_pylist()
    seen: dict[str, str] = {}
    for rid in set(repeated) - {None, ""}:
        first = pc.index(before, rid).as_py()
        start, f = max((s for s in starts if s[0] <= first), key=lambda s: s[0])
        seen[rid] = f"{f.name} index {first - start}"
    return seen


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
