"""Reading any input `ovkit convert` accepts, record by record, and telling which format it is in.

The formats users already have (anchors.md section 7) are named in `FORMATS`; `detect_format` picks one from an
input's keys/columns. Records are read as a stream (a JSON list is decoded record by record, parquet batch by batch),
so memory stays bounded by one batch. ovkit.data.sources reads an input's layout through this module and the
converter (ovkit.data.convert) maps its records: neither imports the other for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ovkit.data.schema import REQUIRED
from ovkit.errors import OvkitError, where
from ovkit.files import fingerprint

FORMATS = {
    "llava": "LLaVA-1.5 JSON: id, image (path or list of paths), conversations [{from: human|gpt, value}]",
    "sharegpt": "ShareGPT / LLaMA-Factory: messages [{role, content}] or conversations [{from, value}], images, system",
    "onevision": "LLaVA-OneVision-Data parquet: id, image, conversations, data_source",
    "ov-midtrain": "LLaVA-OV-1.5 mid-training parquet: id, image, caption",
    "ov-rl": "LLaVA-OV-1.5-RL parquet: id, images, problem, answer (list), answer_type, problem_type, source, "
    "prompt_type",
    "verl": "ROLL / verl RL parquet: data_source, images, prompt (chat list), ability, reward_model.ground_truth",
    "trl": "TRL conversational VLM: images (or image), messages [{role, content: text or [{type: text|image}]}] or "
    "prompt + completion; TRL's GRPO datasets: prompt, image(s), solution (the gold answer, scored with math as "
    "TRL's accuracy_reward does, unless a row names its answer_type)",
    "ovkit": "ovkit's sample table (e.g. from the Hub): id, images, messages [{role, content}], source",
}
BATCH = 256  # records mapped and validated together
SAMPLE = 1000  # JSON records looked at to detect the format and the extra string keys
CHUNK = 1 << 20  # characters read at a time from a JSON list
MAX_RECORD_CHARS = 256 << 20  # one JSON record larger than this is treated as malformed


@dataclass
class Record:
    file: Path
    index: int  # position in `file`
    number: int  # position in the whole input (all files), used for generated ids
    raw: Any  # the decoded record (a dict when well-formed)
    unparsed: str | None = None  # a JSON line that did not parse: why


@dataclass
class Input:
    path: Path
    kind: str  # json | jsonl | parquet | arrow (a `datasets.Dataset`: Hub id, saved dir, card dir)
    files: list[Path]
    dataset: Any = None

    def records(self, lo: int = 0, hi: int | None = None) -> Iterator[Record]:
        """Records number lo..hi-1 of the whole input, in order."""
        if self.kind == "parquet":
            yield from _parquet_records(self.files, lo, hi)
            return
        if self.kind == "arrow":
            yield from _dataset_records(self.dataset, self.path, lo, hi)
            return
        reader = _json_array if self.kind == "json" else _json_lines
        for index, raw, unparsed in reader(self.files[0]):
            if hi is not None and index >= hi:
                return
            if index >= lo:
                yield Record(self.files[0], index, index, raw, unparsed)

    def count(self) -> int:
        if self.kind == "parquet":
            return sum(_parquet_meta(f).num_rows for f in self.files)
        if self.kind == "arrow":
            return len(self.dataset)
        return sum(1 for _ in (_json_array if self.kind == "json" else _json_lines)(self.files[0]))

    def keys(self) -> tuple[list[str], dict[str, bool]]:
        """The input's keys in order, and whether each holds strings (parquet: all files' schemas; JSON: a sample)."""
        if self.kind in ("parquet", "arrow"):
            is_str: dict[str, bool] = {}
            for schema in self._schemas():
                for fld in schema:
                    string = pa.types.is_string(fld.type) or pa.types.is_large_string(fld.type)
                    is_str[fld.name] = is_str.get(fld.name, True) and string
            return list(is_str), is_str
        is_str = {}
        for rec in _take(self.records(0, SAMPLE), SAMPLE):
            if isinstance(rec.raw, dict):
                for k, v in rec.raw.items():
                    is_str[k] = is_str.get(k, False) or isinstance(v, str)
        return list(is_str), is_str

    def parts(self) -> bool:
        """Whether chat content comes as lists of typed parts (TRL / OpenAI style) rather than text."""
        if self.kind in ("parquet", "arrow"):
            return any(schema_has_parts(schema) for schema in self._schemas()[:1])
        for rec in _take(self.records(0, SAMPLE), SAMPLE):
            raw = rec.raw if isinstance(rec.raw, dict) else {}
            for key in CHAT_COLUMNS:
                turns = raw.get(key)
                if isinstance(turns, list) and turns and isinstance(turns[0], dict):
                    return isinstance(turns[0].get("content"), list)
        return False

    def fingerprint(self) -> str:
        """Changes with the content: the `datasets` fingerprint, or ovkit's file fingerprint."""
        if self.kind == "arrow":
            return str(getattr(self.dataset, "_fingerprint", "")) or repr(self.dataset)

        return "+".join(fingerprint(f)["sha256"] for f in self.files)

    def _schemas(self) -> list[pa.Schema]:
        if self.kind == "arrow":
            return [self.dataset.features.arrow_schema]
        return [_parquet_meta(f).schema.to_arrow_schema() for f in self.files]


CHAT_COLUMNS = ("messages", "prompt", "completion")


def schema_has_parts(schema: pa.Schema) -> bool:
    """A chat column whose turns' `content` is a list (of {type, text} parts)."""
    for key in CHAT_COLUMNS:
        if key in schema.names:
            typ = schema.field(key).type
            if (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_struct(typ.value_type):
                turn = typ.value_type
                if turn.get_field_index("content") >= 0:
                    content = turn.field("content").type
                    return pa.types.is_list(content) or pa.types.is_large_list(content)
    return False


def input_of(loc: Any) -> Input:
    if loc.dataset is not None:
        return Input(Path(loc.spec.base), "arrow", [], dataset=loc.dataset)
    path = Path(loc.spec.base).expanduser()
    if path.is_dir():
        return Input(path, "parquet", loc.files)
    with open(path, "rb") as fh:
        head = fh.read(4)
    if path.suffix == ".parquet" or head == b"PAR1":
        return Input(path, "parquet", [path])
    if path.suffix == ".jsonl":
        return Input(path, "jsonl", [path])
    first = _first_char(path)
    if first == "[":
        return Input(path, "json", [path])
    if first == "{" and _first_line_is_object(path):
        return Input(path, "jsonl", [path])
    raise OvkitError(f"{where(path)}: expected a parquet file, a JSON list of records or JSON lines")


def _first_char(path: Path) -> str:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        while chunk := f.read(4096):
            text = chunk.lstrip()
            if text:
                return text[0]
    return ""


def _first_line_is_object(path: Path) -> bool:
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(json.loads(line), dict)
                except json.JSONDecodeError:
                    return False
    return False


def _json_array(path: Path) -> Iterator[tuple[int, Any, None]]:
    """Decode a JSON list one element at a time (a 665K-record LLaVA file is ~1 GB; it is never held whole)."""
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf, pos, eof = _refill(f, "", 0)
        pos = _skip_ws(buf, pos)
        if buf[pos : pos + 1] != "[":
            raise OvkitError(f"{where(path)}: expected a JSON list of records")
        pos, index, after_record = pos + 1, 0, False
        while True:
            pos = _skip_ws(buf, pos)
            if pos >= len(buf):
                if eof:
                    raise OvkitError(
                        f"{where(path, f'index {index}')}: the file ends before the closing ']' (truncated?)"
                    )
                buf, pos, eof = _refill(f, buf, pos)
                continue
            if buf[pos] == "]":
                return
            if after_record:
                if buf[pos] != ",":
                    raise OvkitError(f"{where(path, f'index {index}')}: expected ',' or ']' after record {index - 1}")
                pos, after_record = pos + 1, False
                continue
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof or len(buf) - pos > MAX_RECORD_CHARS:  # a malformed list cannot be resynchronised: stop
                    raise OvkitError(f"{where(path, f'index {index}')}: not valid JSON ({e.msg})") from None
                buf, pos, eof = _refill(f, buf, pos)
                continue
            if end == len(buf) and not eof:  # a number or literal may continue in the next chunk
                buf, pos, eof = _refill(f, buf, pos)
                continue
            yield index, obj, None
            index, pos, after_record = index + 1, end, True


def _refill(f, buf: str, pos: int) -> tuple[str, int, bool]:
    try:
        chunk = f.read(max(CHUNK, len(buf) - pos))  # grows geometrically while one record spans several chunks
    except UnicodeDecodeError as e:
        raise OvkitError(f"{where(f.name)}: not UTF-8 text ({e.reason} near byte {e.start} of a read)") from None
    return buf[pos:] + chunk, 0, not chunk


def _skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in " \t\r\n":
        pos += 1
    return pos


def _json_lines(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """One record per non-blank line; a line that does not parse is a bad record (it can be skipped), not fatal."""
    with open(path, encoding="utf-8-sig") as f:
        index = 0
        try:
            for line in f:
                if not line.strip():
                    continue
                try:
                    record, unparsed = json.loads(line), None
                except json.JSONDecodeError as e:
                    record, unparsed = line.rstrip("\n"), f"not valid JSON ({e.msg} at column {e.colno})"
                yield index, record, unparsed
                index += 1
        except UnicodeDecodeError as e:
            raise OvkitError(f"{where(path, f'index {index}')}: not UTF-8 text ({e.reason})") from None


def _parquet_meta(f: Path) -> pq.FileMetaData:
    try:
        return pq.ParquetFile(f).metadata
    except (pa.ArrowInvalid, OSError) as e:
        raise OvkitError(f"{where(f)}: not a readable parquet file ({e})") from None


def _dataset_records(dataset: Any, path: Path, lo: int, hi: int | None) -> Iterator[Record]:
    """Rows lo..hi-1 of a `datasets.Dataset`, read as arrow batches (images stay encoded {bytes, path})."""
    table = dataset.with_format("arrow")
    hi = len(table) if hi is None else min(hi, len(table))
    for start in range(lo, hi, BATCH):
        for k, raw in enumerate(table[start : min(start + BATCH, hi)].to_pylist()):
            yield Record(path, start + k, start + k, raw)


def _parquet_records(files: list[Path], lo: int, hi: int | None) -> Iterator[Record]:
    """Rows lo..hi-1 across the files, read batch by batch from the row groups that hold them."""
    offset = 0
    for f in files:
        meta = _parquet_meta(f)
        a, b = max(lo - offset, 0), meta.num_rows if hi is None else min(hi - offset, meta.num_rows)
        if a < b:
            groups, row = _row_groups(meta, a, b)
            try:
                for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH, row_groups=groups):
                    for raw in batch.to_pylist():
                        if a <= row < b:
                            yield Record(f, row, offset + row, raw)
                        row += 1
                    if row >= b:
                        break
            except (pa.ArrowInvalid, OSError) as e:
                raise OvkitError(f"{where(f, f'index {row}')}: cannot read the parquet data ({e})") from None
        offset += meta.num_rows


def _row_groups(meta: pq.FileMetaData, a: int, b: int) -> tuple[list[int], int]:
    """The row groups holding rows a..b-1, and the first row of the first of them."""
    groups, start, first = [], 0, None
    for g in range(meta.num_row_groups):
        end = start + meta.row_group(g).num_rows
        if end > a and start < b:
            groups.append(g)
            first = start if first is None else first
        start = end
    return groups, first or 0


def _take(it: Iterator[Any], n: int) -> list[Any]:
    out = []
    for x in it:
        out.append(x)
        if len(out) >= n:
            break
    return out


def detect_format(keys: list[str], parts: bool = False) -> tuple[str, str]:
    """(format, why) from the input's keys/columns (and whether chat content comes as typed parts); no match or several
    matches is an error asking for --from."""
    k = set(keys)
    shown = ", ".join(keys[:20]) + (", ..." if len(keys) > 20 else "")
    chat = "messages" if "messages" in k else "prompt" if "prompt" in k else None
    if "reward_model" not in k and "conversations" not in k and chat is not None:
        has_images = bool(k & {"images", "image"})
        if parts:  # ovkit's own messages are text; typed parts are TRL's (and what `--to trl` writes)
            return "trl", f"{chat} with content parts" + (
                " + images" if "images" in k else " + image" if "image" in k else ""
            )
        if {"prompt", "completion"} <= k and has_images:
            return "trl", "prompt + completion + " + ("images" if "images" in k else "image")
        if chat == "messages" and "image" in k and "images" not in k:
            return "trl", "messages + image"
        if chat == "prompt" and "solution" in k:  # TRL's GRPO datasets: the prompt as text, the gold answer
            return "trl", "prompt + solution" + (" + images" if "images" in k else " + image" if "image" in k else "")
    if set(REQUIRED) <= k:
        return "ovkit", "id + images + messages + source"
    matches = []
    if {"prompt", "reward_model"} <= k:
        matches.append(("verl", "prompt + reward_model"))
    if {"problem", "answer"} <= k:
        matches.append(("ov-rl", "problem + answer"))
    if {"caption", "image"} <= k and "conversations" not in k:
        matches.append(("ov-midtrain", "image + caption"))
    if "messages" in k or ("conversations" in k and "images" in k):
        matches.append(("sharegpt", " + ".join(x for x in ("messages", "conversations", "images") if x in k)))
    if "conversations" in k and "messages" not in k and not ("images" in k and "image" not in k):
        fmt = "onevision" if "data_source" in k else "llava"
        matches.append((fmt, " + ".join(x for x in ("conversations", "image", "data_source") if x in k)))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        choices = ",".join(FORMATS)
        raise OvkitError(f"cannot tell the input's format from its keys ({shown}); name it with --from {{{choices}}}")
    names = " or ".join(f"{m[0]} ({m[1]})" for m in matches)
    raise OvkitError(f"the input could be {names}; name the format with --from")
