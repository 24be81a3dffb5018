"""The sample table: the contract between stages, and its checks.

`images` uses the layout of the `datasets` Image feature (list<struct<bytes, path>>) and the parquet files carry the
`huggingface` schema metadata, so `datasets.load_dataset("parquet", ...)` decodes PIL images.

What is checked, and when (ovkit.data.io.read_samples runs these on every table a command reads):
- per file, from its footer: every known column's arrow type, nested fields included (a `content` of int64 is an
  error naming the column, not an ArrowTypeError later);
- per row, eagerly: a non-empty id unique in the dataset (across its part files and --shard parts), a source, roles
  system/user/assistant with string content, as many `<image>` markers as images, and for RL and eval tables
  (`answers=True`) a gold answer its scorer can read (ovkit.rewards.check_gold);
- per image: its bytes (at most MAX_IMAGE_BYTES), the header's size (at most MAX_IMAGE_PIXELS) and then, with
  `images="decode"`, the whole picture decoded (a truncated JPEG has a valid header). Commands that decode every
  image themselves before their first step read with `images="header"` and report a bad picture at that point with
  the same file, row and column (pack's length pass, the supervised stages' encoding pass).
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ovkit.errors import OvkitError, where

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

REQUIRED: dict[str, pa.DataType] = {
    "id": pa.string(),
    "images": pa.list_(IMAGE),
    "messages": pa.list_(MESSAGE),
    "source": pa.string(),
}
OPTIONAL: dict[str, pa.DataType] = {
    "category": pa.string(),
    "answer": pa.string(),
    "answer_type": pa.string(),
    "reward_kwargs": pa.string(),
}
ROLES = frozenset({"system", "user", "assistant"})
IMAGE_TOKEN = "<image>"

# An image larger than this many pixels is rejected before it is decoded (decompression bombs: a few KB of PNG can
# declare a 100k x 100k canvas). 8B-scale recipes cap images far lower (2.56M pixels in the Qwen2.5-VL processor).
MAX_IMAGE_PIXELS = 64_000_000
# An encoded image larger than this is refused unread: even uncompressed, a picture within MAX_IMAGE_PIXELS is at most
# 256 MB (RGBA). It bounds what one cell, or one image path `ovkit convert` reads, can cost.
MAX_IMAGE_BYTES = 256 << 20
IMAGE_CHECKS = ("decode", "header", "none")

# `datasets` reads this key from the parquet schema metadata and decodes `images` as a list of PIL images (and TRL's
# single `image` column as one). Every other column is described from its arrow type, so that columns a stage adds
# (balance weights, rl-curate pass rates, TRL content parts) do not stop the images from decoding.
IMAGE_COLUMNS = {"images": {"feature": {"_type": "Image"}, "_type": "List"}, "image": {"_type": "Image"}}
_VALUE_DTYPES = {"double": "float64", "float": "float32", "halffloat": "float16"}


def hf_feature(typ: pa.DataType) -> dict[str, Any] | None:
    """The `datasets` feature (its JSON form) of an arrow type, or None for a type this does not describe."""
    if pa.types.is_struct(typ):
        fields = {typ.field(i).name: hf_feature(typ.field(i).type) for i in range(typ.num_fields)}
        return None if any(v is None for v in fields.values()) else fields
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        inner = hf_feature(typ.value_type)
        return (
            None
            if inner is None
            else {"feature": inner, "_type": "LargeList" if pa.types.is_large_list(typ) else "List"}
        )
    if (
        pa.types.is_primitive(typ)
        or pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
        or pa.types.is_null(typ)
    ):
        if pa.types.is_timestamp(typ) or pa.types.is_date(typ) or pa.types.is_time(typ) or pa.types.is_decimal(typ):
            return None
        return {"dtype": _VALUE_DTYPES.get(str(typ), str(typ)), "_type": "Value"}
    return None


def _is_image_struct(typ: pa.DataType) -> bool:
    return pa.types.is_struct(typ) and {typ.field(i).name for i in range(typ.num_fields)} == {"bytes", "path"}


def hf_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    features = {}
    for name in schema.names:
        typ = schema.field(name).type
        if (
            name == "images"
            and (pa.types.is_list(typ) or pa.types.is_large_list(typ))
            and _is_image_struct(typ.value_type)
        ):
            features[name] = IMAGE_COLUMNS[name]
        elif name == "image" and _is_image_struct(typ):
            features[name] = IMAGE_COLUMNS[name]
        else:
            features[name] = hf_feature(typ)
            if features[name] is None:
                return {}  # a column we cannot describe: let `datasets` infer everything rather than half
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def check_columns(schema: pa.Schema, path: Path | str) -> None:
    """Missing or mistyped columns make the whole file unusable: one error naming the file and column. Types are
    compared all the way down (the role and content of `messages`, the bytes and path of `images`)."""
    for name, typ in REQUIRED.items():
        if name not in schema.names:
            raise OvkitError(
                f"{where(path, column=name)}: required column is missing (columns: {', '.join(schema.names)})"
            )
        got = schema.field(name).type
        if not compatible(got, typ):
            raise OvkitError(f"{where(path, 'every row', name)}: type is {got}, expected {typ}")
    for name, typ in OPTIONAL.items():
        if name in schema.names and not compatible(schema.field(name).type, typ):
            raise OvkitError(
                f"{where(path, 'every row', name)}: type is {schema.field(name).type}, expected {typ} or null"
            )


def compatible(got: pa.DataType, want: pa.DataType) -> bool:
    """`got` casts to `want` without loss: the same type up to large_ variants, struct field order and extra struct
    fields; an all-null column (type null) stands for any type."""
    if got.equals(want) or pa.types.is_null(got):
        return True
    if pa.types.is_string(want):
        return pa.types.is_string(got) or pa.types.is_large_string(got)
    if pa.types.is_binary(want):
        return pa.types.is_binary(got) or pa.types.is_large_binary(got)
    if pa.types.is_list(want):
        return (pa.types.is_list(got) or pa.types.is_large_list(got)) and compatible(got.value_type, want.value_type)
    if pa.types.is_struct(want):
        if not pa.types.is_struct(got):
            return False
        fields = {got.field(i).name: got.field(i).type for i in range(got.num_fields)}
        return all(
            want.field(i).name in fields and compatible(fields[want.field(i).name], want.field(i).type)
            for i in range(want.num_fields)
        )
    return False


def conform(table: pa.Table) -> pa.Table:
    """Cast the known columns to their canonical types (large_string -> string, struct field order) and put the
    required columns first; unknown columns are kept as they are."""
    cols, names = [], []
    for name in [*REQUIRED, *OPTIONAL, *[n for n in table.column_names if n not in REQUIRED and n not in OPTIONAL]]:
        if name not in table.column_names:
            continue
        col = table.column(name)
        want = REQUIRED.get(name) or OPTIONAL.get(name)
        if want is not None and not col.type.equals(want):
            col = pa.array(col.to_pylist(), type=want)
        cols.append(col)
        names.append(name)
    return pa.table(cols, names=names)


@dataclass(frozen=True)
class RowProblem:
    index: int
    column: str
    reason: str


def row_problems(
    table: pa.Table,
    *,
    images: str = "decode",
    seen_ids: dict[str, str] | None = None,
    answers: bool = False,
    origin: str = "",
    start: int = 0,
) -> list[RowProblem]:
    """Every row that breaks the contract, with the column and the reason. Assumes `check_columns` passed.

    `images`: "decode" (the whole picture), "header" (size and structure only) or "none". `seen_ids`: ids already
    read from this dataset, each with where it was (this table's are recorded as `origin` index `start` + row), so a
    repeat names its first occurrence. `answers`: RL / eval rows, whose gold answer must be scorable."""
    if images not in IMAGE_CHECKS:
        raise ValueError(f"images must be one of {IMAGE_CHECKS}, got {images!r}")
    seen = {} if seen_ids is None else seen_ids
    problems = []
    columns = ["id", "images", "messages", "source"]
    values = [table.column(c).to_pylist() for c in columns]
    gold = _gold_columns(table) if answers else None
    for i, (rid, imgs, msgs, src) in enumerate(zip(*values)):
        p = _row_problem(rid, imgs, msgs, src, seen, images)
        if p is None and gold is not None:
            p = answer_problem({k: v[i] for k, v in gold.items()} | {"id": rid, "source": src})
        if p is not None:
            problems.append(RowProblem(i, *p))
        else:
            seen[rid] = f"{origin} index {start + i}".strip()
    return problems


def _row_problem(rid, imgs, msgs, src, seen, images) -> tuple[str, str] | None:
    if not rid:
        return "id", "id is empty"
    if rid in seen:
        return "id", f"duplicate id {rid!r} (first at {seen[rid]}; ids are unique in a dataset)"
    if src is None:
        return "source", "source is null"
    if imgs is None:
        return "images", "images is null (use an empty list for text-only rows)"
    if not msgs:
        return "messages", "no messages"
    for m in msgs:
        if m is None or m.get("role") not in ROLES:
            role = None if m is None else m.get("role")
            return "messages", f"role {role!r} is not one of system/user/assistant"
        if m.get("content") is None:
            return "messages", "a message has null content"
    n_tokens = sum(m["content"].count(IMAGE_TOKEN) for m in msgs)
    if n_tokens != len(imgs):
        return "messages", f"{n_tokens} {IMAGE_TOKEN} marker(s) but {len(imgs)} image(s)"
    if images != "none":
        for k, img in enumerate(imgs):
            reason = image_problem(img, decode=images == "decode")
            if reason:
                return "images", f"image {k}: {reason}"
    return None


_GOLD = ("answer", "answer_type", "reward_kwargs")


def _gold_columns(table: pa.Table) -> dict[str, list[Any]]:
    return {c: table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows for c in _GOLD}


def answer_problem(row: dict[str, Any]) -> tuple[str, str] | None:
    """(column, reason) when an RL / eval row's gold answer cannot be scored (ovkit.rewards.check_gold: the scorer's
    own reading of its gold answer and reward_kwargs), else None."""
    # imported on use: the sample schema sits below the scorers and needs them only for RL / eval rows
    from ovkit.rewards import check_gold

    try:
        check_gold(row)
    except OvkitError as e:
        m = re.match(r"column '(\w+)': (.*)", str(e), re.S)
        return (m[1], m[2]) if m else ("answer", str(e))
    return None


def image_problem(img: dict[str, Any] | None, *, decode: bool = True) -> str | None:
    """Why an image cell is unusable, or None. Checks the byte size and the header's pixel count (bomb check) before
    decoding; `decode` then decodes the whole picture (a truncated file has a valid header), else PIL's structural
    `verify` (cheap: it does not decode pixels, and checks little for JPEG)."""
    # heavy: PIL loads on first use, not at CLI start or in config checks
    from PIL import Image

    if img is None or not img.get("bytes"):
        return "no image bytes (ovkit datasets are self-contained; convert path-only images with `ovkit convert`)"
    data = img["bytes"]
    if len(data) > MAX_IMAGE_BYTES:
        return f"{len(data):,} bytes, over the limit of {MAX_IMAGE_BYTES:,}"
    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                return f"image is {w}x{h} = {w * h} pixels, over the limit of {MAX_IMAGE_PIXELS}"
            if decode:
                im.load()
            else:
                im.verify()
    except Image.DecompressionBombError as e:
        return f"decompression bomb: {e}"
    except Exception as e:  # noqa: BLE001 -- PIL raises many types for corrupt data
        return f"unreadable image: {type(e).__name__}: {e}"
    return None


def read_image_file(path: Path, limit: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes of an image file, read only if it is a regular file of at most `limit` bytes: a device (/dev/zero)
    would be read until memory runs out, a FIFO would block forever. Raises OSError with the reason."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # opening a FIFO must not wait for a writer
    try:
        st = os.fstat(fd)  # of what was opened, not of what the name pointed to a moment earlier
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "directory"
                if stat.S_ISDIR(st.st_mode)
                else "FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "device or special file"
            )
            raise OSError(errno.EINVAL, f"not a regular file (a {kind})")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size:,} bytes, over the limit of {limit:,}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while being read
        raise OSError(errno.EFBIG, f"over the limit of {limit:,} bytes")
    return data


def image_cell(image: Any, fmt: str = "PNG") -> dict[str, Any]:
    """A PIL image (or raw encoded bytes) as one `images` cell, self-contained."""
    if isinstance(image, (bytes, bytearray)):
        return {"bytes": bytes(image), "path": None}
    buf = io.BytesIO()
    image.save(buf, format=fmt, optimize=False)
    return {"bytes": buf.getvalue(), "path": None}


def samples_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Build a sample table from Python dicts (required keys + any extra string/JSON-able columns)."""
    names: list[str] = list(REQUIRED)
    for r in rows:
        names.extend(k for k in r if k not in names)
    cols = {}
    for name in names:
        typ = REQUIRED.get(name) or OPTIONAL.get(name)
        cols[name] = pa.array([r.get(name) for r in rows], type=typ)
    return pa.table(cols) if rows else pa.table({n: pa.array([], type=t) for n, t in REQUIRED.items()})
