"""Reading a dataset as one table: whatever ovkit.data.sources locates (a parquet file or directory of shards, a
dataset card, a saved `datasets` directory, a Hub id), converted once into the cache when it is not ovkit parquet.

This is the top of the data package: it reads through sources and the converter; writing part files and the
`--shard I/N` names are ovkit.data.parts, below all of them.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ovkit import __version__
from ovkit.data.convert import MAPPING_REVISION, Conversion, convert_input
from ovkit.data.formats import FORMATS, detect_format, input_of, schema_has_parts
from ovkit.data.parts import REJECTS, local_parquet_files, shard_bounds
from ovkit.data.schema import check_columns, conform, row_problems
from ovkit.data.sources import Located, locate, note_converted
from ovkit.errors import OvkitError, where
from ovkit.files import fingerprint, is_complete, write_json
from ovkit.hub import is_hub_id
from ovkit.rewards import ALIASES, SCORERS


def parquet_files(path: Path | str) -> list[Path]:
    """The parquet files that make up a sample table, in row order. `path` is anything `ovkit.data.sources` reads: a
    parquet file or directory, a directory with a dataset card (`DIR:CONFIG@SPLIT`), a `datasets` saved directory or
    a Hub dataset id; sources that are not ovkit parquet are converted once into the cache and read from there."""
    return sample_files(path)


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
        if answers and (reason := no_scorer(f, schema)):
            raise OvkitError(f"{shown(f, path, column='answer_type')}: {reason}")
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
                f"RL and eval rows need a gold answer in column 'answer' (columns: {shown_columns}); this input "
                f"keeps it in "
                f"'{name}': rename that column to 'answer' (e.g. `Dataset.rename_column(\"{name}\", \"answer\")`) "
                f"and add a column 'answer_type' naming each row's scorer (e.g. math); {TRL_GRPO_HINT}"
            )
    return (
        f"RL and eval rows need a gold answer in column 'answer' (columns: {shown_columns}); this looks like a "
        f"training split"
    )


TRL_GRPO_HINT = (
    "TRL's GRPO layout (prompt with image(s), and solution or answer) is read as it is, scored with math like TRL's "
    "accuracy_reward (`ovkit convert DATA --from trl --out DIR` writes that table)"
)


def no_scorer(f: Path, schema: pa.Schema) -> str | None:
    """Why no row of file `f` can be scored, when its `answer_type` column is missing or all null (one message with
    the fix, not a first bad row whose suggested --on-error skip would reject them all); else None."""
    if "answer_type" in schema.names and _read_file(f, ["answer_type"]).column("answer_type").null_count < _num_rows(f):
        return None
    known = ", ".join(sorted({*SCORERS, *ALIASES}))
    return (
        f"RL and eval rows name the scorer of their answer in column 'answer_type', and no row of this file does: "
        f"add that column ({known}); {TRL_GRPO_HINT}"
    )


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


# ------------------------------------------------------------------------------------------------ any source, as
# parquet


def sample_files(text: str | Path) -> list[Path]:
    """The parquet files of the sample table named by `text`, in row order (converted into the cache if needed)."""
    loc = locate(text)
    if loc.dataset is None and len(loc.files) == 1 and not is_parquet(loc.files[0]):
        return materialize(loc)  # a JSON file: TRL's / ShareGPT's layout is read, any other is named with its --from
    if loc.dataset is None:
        fmt = _parquet_layout(loc.files)
        if fmt is None or fmt == "ovkit":
            return (
                loc.files
            )  # parquet in ovkit's layout, or not parquet / not a known layout: the reader says what is wrong
    return materialize(loc)


def materialize(loc: Located) -> list[Path]:
    """Convert a source in ovkit's or TRL's layout into the cache (once per content) and return its part files."""
    spec = loc.spec
    try:
        inp = input_of(loc)
    except OvkitError:
        if loc.dataset is None and loc.files and not is_parquet(loc.files[0]):
            raise not_convertible(spec.text) from None
        raise
    keys, _ = inp.keys()
    try:
        fmt, _ = detect_format(keys, parts=inp.parts())
    except OvkitError:
        raise not_a_sample_table(spec.text, keys) from None
    if fmt not in READABLE:
        raise not_a_sample_table(spec.text, keys, fmt)
    key = f"{spec.text}\0{inp.fingerprint()}\0{fmt}\0{__version__}\0{MAPPING_REVISION}"
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    slug = re.sub(r"[^\w.-]+", "_", spec.text.strip("/~."))[-80:]
    out = cache_dir() / f"{slug}-{key}"
    if not is_complete(out):
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            metrics = convert_input(Conversion.default(from_format=fmt, quiet=True), inp, tmp)
        except OvkitError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            # the reading command may have no --on-error of its own: the way past bad rows is convert's
            reason = str(e).replace(f" (use --on-error skip to move bad records to {REJECTS})", "")
            raise OvkitError(
                f"{reason}; to read the rows that are good, convert it first: `ovkit convert {spec.text} --on-error "
                f"skip --out DIR`"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_json(
            tmp / "ovkit.json",
            {
                "command": "read",
                "source": spec.text,
                "source_fingerprint": inp.fingerprint(),
                "ovkit_version": __version__,
                "metrics": metrics,
            },
        )
        try:
            tmp.rename(out)
        except OSError:  # another process converted the same source first: theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    provenance = {
        "path": spec.text,
        "format": fmt,
        "source_fingerprint": inp.fingerprint(),
        "converted": fingerprint(out),
    }
    if is_hub_id(spec.base) and not Path(spec.base).exists():
        provenance["hub"] = spec.base
    note_converted(spec.text, provenance)
    return local_parquet_files(out)


# The layouts a stage reads directly; other formats go through `ovkit convert`. `messages` + `images` with text content
# is both ShareGPT's and TRL's layout (the detector calls it sharegpt), and maps the same way.
READABLE = ("ovkit", "trl", "sharegpt")


def _parquet_layout(files: list[Path]) -> str | None:
    """The layout of local parquet files (from the first file's schema), None when not parquet or not recognised."""
    if not files or files[0].suffix != ".parquet":
        return None
    try:
        schema = pq.read_schema(files[0])
    except (pa.ArrowInvalid, OSError):
        return None
    try:
        fmt, _ = detect_format(schema.names, parts=schema_has_parts(schema))
    except OvkitError:
        return None
    if fmt not in READABLE:
        raise not_a_sample_table(str(files[0]), schema.names, fmt)
    return fmt


def is_parquet(path: Path) -> bool:
    """Whether a file starts with parquet's magic bytes (whatever its name)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"PAR1"
    except OSError:
        return path.suffix == ".parquet"  # unreadable: the parquet reader names the problem


def not_a_sample_table(where: str, names: list[str], fmt: str | None = None) -> OvkitError:
    missing = next((c for c in ("messages", "images") if c not in names), "messages")
    if fmt:
        how = f"it looks like --from {fmt}: convert it first with `ovkit convert {where} --from {fmt} --out DIR`"
    else:
        how = f"convert it first with `ovkit convert {where} --from {{{','.join(FORMATS)}}} --out DIR`"
    return OvkitError(
        f"{where}, column '{missing}': not a sample table (columns: {', '.join(names[:20])}); stages read ovkit's "
        f"layout and "
        f"TRL's (images + messages); {how}"
    )


def not_convertible(where: str) -> OvkitError:
    """A file that is neither parquet nor JSON (a CSV, a TSV, an archive) given where a sample table is expected."""
    kind = Path(where).suffix.lstrip(".").upper() or "this"
    return OvkitError(
        f"file {where}: not a sample table: stages read parquet (a file, or a directory of shards), and `ovkit "
        f"convert` turns "
        f"parquet, JSON and JSON lines in the layouts {', '.join(FORMATS)} into one; a {kind} file: write it as "
        f"JSON lines or "
        f'parquet first (e.g. `datasets.load_dataset("csv", data_files=...)["train"].to_json("data.jsonl")`), then '
        f"`ovkit convert data.jsonl --from FORMAT --out DIR`"
    )


def cache_dir() -> Path:
    return Path(os.environ.get("OVKIT_CACHE") or Path.home() / ".cache" / "ovkit") / "datasets"
