"""The sample table: the contract between stages (DESIGN.md, "The sample table").

`images` uses the layout of the `datasets` Image feature (list<struct<bytes, path>>) and the parquet files carry the
`huggingface` schema metadata, so `datasets.load_dataset("parquet", ...)` decodes PIL images.
"""

from __future__ import annotations

import io
import json
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
        return None if inner is None else {"feature": inner, "_type": "LargeList" if pa.types.is_large_list(typ) else "List"}
    if pa.types.is_primitive(typ) or pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_null(typ):
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
        if name == "images" and (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and _is_image_struct(typ.value_type):
            features[name] = IMAGE_COLUMNS[name]
        elif name == "image" and _is_image_struct(typ):
            features[name] = IMAGE_COLUMNS[name]
        else:
            features[name] = hf_feature(typ)
            if features[name] is None:
                return {}  # a column we cannot describe: let `datasets` infer everything rather than half
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def check_columns(schema: pa.Schema, path: Path | str) -> None:
    """Missing or mistyped columns make the whole file unusable: one error naming the file and column."""
    for name, typ in REQUIRED.items():
        if name not in schema.names:
            raise OvkitError(f"{where(path, column=name)}: required column is missing (columns: {', '.join(schema.names)})")
        got = schema.field(name).type
        if not _compatible(got, typ):
            raise OvkitError(f"{where(path, 'every row', name)}: type is {got}, expected {typ}")
    for name, typ in OPTIONAL.items():
        if name in schema.names and not _compatible(schema.field(name).type, typ):
            got = schema.field(name).type
            if not pa.types.is_null(got):
                raise OvkitError(f"{where(path, 'every row', name)}: type is {got}, expected {typ}")


def _compatible(got: pa.DataType, want: pa.DataType) -> bool:
    if got.equals(want):
        return True
    if pa.types.is_large_string(got) and pa.types.is_string(want):
        return True
    if (pa.types.is_list(got) or pa.types.is_large_list(got)) and pa.types.is_list(want):
        gv, wv = got.value_type, want.value_type
        if pa.types.is_struct(gv) and pa.types.is_struct(wv):
            names = {gv.field(i).name for i in range(gv.num_fields)}
            return all(wv.field(i).name in names for i in range(wv.num_fields))
        return _compatible(gv, wv)
    return pa.types.is_binary(want) and pa.types.is_large_binary(got)


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


def row_problems(table: pa.Table, *, check_images: bool = True, seen_ids: set[str] | None = None) -> list[RowProblem]:
    """Every row that breaks the contract, with the column and the reason. Assumes `check_columns` passed."""
    seen = set() if seen_ids is None else seen_ids
    problems = []
    ids = table.column("id").to_pylist()
    images = table.column("images").to_pylist()
    messages = table.column("messages").to_pylist()
    sources = table.column("source").to_pylist()
    for i, (rid, imgs, msgs, src) in enumerate(zip(ids, images, messages, sources)):
        p = _row_problem(rid, imgs, msgs, src, seen, check_images)
        if p is not None:
            problems.append(RowProblem(i, *p))
        elif rid is not None:
            seen.add(rid)
    return problems


def _row_problem(rid, imgs, msgs, src, seen, check_images) -> tuple[str, str] | None:
    if not rid:
        return "id", "id is empty"
    if rid in seen:
        return "id", f"duplicate id {rid!r}"
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
    if check_images:
        for k, img in enumerate(imgs):
            reason = image_problem(img)
            if reason:
                return "images", f"image {k}: {reason}"
    return None


def image_problem(img: dict[str, Any] | None) -> str | None:
    """Why an image cell is unusable, or None. Reads the header for the size (bomb check) before decoding."""
    from PIL import Image

    if img is None or not img.get("bytes"):
        return "no image bytes (ovkit datasets are self-contained; convert path-only images with `ovkit convert`)"
    try:
        with Image.open(io.BytesIO(img["bytes"])) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                return f"image is {w}x{h} = {w * h} pixels, over the limit of {MAX_IMAGE_PIXELS}"
            im.verify()
    except Image.DecompressionBombError as e:
        return f"decompression bomb: {e}"
    except Exception as e:  # noqa: BLE001 -- PIL raises many types for corrupt data
        return f"unreadable image: {type(e).__name__}: {e}"
    return None


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
