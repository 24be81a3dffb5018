"""`ovkit convert`: the data formats users already have (anchors.md section 7) -> the sample table, and the sample
table -> TRL's conversational VLM format (`--to trl`).

Every input record becomes one output row or one reject; nothing is dropped silently, so rows in == rows out +
rejects. Records are read as a stream (a JSON list is decoded record by record, parquet batch by batch) and the
output is written in part files of at most `rows_per_file` rows, so memory stays bounded by one part file and one
batch, plus one id per row (duplicate ids are renamed, which needs the ids already emitted).

Each format's mapping (`FORMATS` names them):
- roles: human -> user, gpt -> assistant, system kept; any other role (function_call, observation, tool) is a reject.
- `<image>` markers are kept where they are. A record with N images and no marker at all gets N `<image>\\n` at the
  start of its first user turn (counted as `inserted_markers`); any other count mismatch is a reject.
- images are embedded as bytes (the original encoded bytes, JPEG stays JPEG), so the output is self-contained; a
  missing file or bytes that do not decode are a reject.
- string columns/keys the format does not use are kept as columns; anything else is dropped and named in the
  metrics (`dropped_columns`).
- the input may also be a Hub dataset id or a `datasets` directory (ovkit.data.sources): its rows are read from the
  `datasets` arrow table batch by batch, like parquet.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa

from ovkit import options as O
from ovkit.data.formats import BATCH, FORMATS, Input, Record, detect_format
from ovkit.data.parts import REJECTS, parse_shard, part_name, shard_bounds, write_table
from ovkit.data.schema import IMAGE_TOKEN, OPTIONAL, REQUIRED, conform, read_image_file, row_problems
from ovkit.data.sources import open_input
from ovkit.errors import OvkitError, where
from ovkit.options import option
from ovkit.rewards import resolve_scorer

TO_FORMATS = ("ovkit", "trl")
ALIASES = {"roll": "verl", "llama-factory": "sharegpt", "llava-onevision": "onevision"}

# Input keys each format turns into sample columns; every other string key is kept as a column of its own.
CONSUMED = {
    "llava": {"id", "image", "conversations", "data_source"},
    "onevision": {"id", "image", "conversations", "data_source"},
    "sharegpt": {"id", "messages", "conversations", "images", "system", "videos", "audios"},
    "ov-midtrain": {"id", "image", "caption"},
    "ov-rl": {"id", "images", "image", "problem", "answer", "answer_type", "problem_type", "source"},
    "verl": {"id", "data_source", "images", "prompt", "ability", "reward_model", "extra_info"},
    "trl": {"id", "images", "image", "messages", "prompt", "completion"},
    "ovkit": {"id", "images", "image", "messages", "prompt", "completion"},
}
# Optional sample columns each format fills (present in every output file, so all parts share one schema).
FILLS = {"ov-rl": ["category", "answer", "answer_type"], "verl": ["category", "answer"]}
# TRL's GRPO datasets (prompt, image(s), solution) keep the gold answer in `solution` and score it with TRL's
# accuracy_reward, a math_verify comparison of the completion with it: ovkit's `math` scorer. Such an input (or one
# whose `solution` was renamed `answer`) fills answer and, where a row names none, answer_type with it.
TRL_GOLD = ("solution", "answer")
TRL_SCORER = "math"
# Part of the key of a converted copy in the cache (ovkit.data.io.materialize): raised when a format's mapping
# changes, so a copy made by the older mapping (TRL's GRPO rows without their answer, before 2) is not reused.
MAPPING_REVISION = 2


def fills(fmt: str, extras: list[str]) -> list[str]:
    """The optional sample columns format `fmt` fills, given the input's other text columns."""
    if fmt == "trl" and any(k in extras for k in TRL_GOLD):
        return ["answer", "answer_type"]
    return FILLS.get(fmt, [])


# Which input field a contract column came from, for error messages that point at the user's data.
FIELD_OF = {
    "llava": {"images": "image", "messages": "conversations"},
    "onevision": {"images": "image", "messages": "conversations"},
    "sharegpt": {"images": "images", "messages": "messages"},
    "ov-midtrain": {"images": "image", "messages": "caption"},
    "ov-rl": {"images": "images", "messages": "problem"},
    "verl": {"images": "images", "messages": "prompt"},
    "trl": {"images": "images", "messages": "messages"},
    "ovkit": {"images": "images", "messages": "messages"},
}
ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

FILE_BYTES = 512 << 20  # a part file is also closed once its images reach this size


# --help panels of this config's own options (ovkit.options holds the shared ones)
RECORDS = "Records"


@dataclass
class ConvertConfig(O.StageConfig):
    launcher: ClassVar[str] = O.RANK_SHARDED  # what it does under torchrun / accelerate launch (ovkit.launch)

    input: str | None = option(
        None,
        help=(
            "A JSON / JSON-lines / parquet file, a directory of parquet files, a directory with a dataset "
            "card or saved by `datasets` (DIR[:CONFIG]\\[@SPLIT]), or a Hub dataset id "
            "(ORG/NAME[:CONFIG]\\[@SPLIT])."
        ),
        argument=True,
        doc="the file or directory to convert",
    )
    # one of FORMATS (or an alias); auto = detect from the keys/columns
    from_format: str = option(
        "auto",
        help=(
            "auto (detect from the keys/columns) | llava | sharegpt | onevision | ov-midtrain | ov-rl | verl "
            "(= roll) | trl | ovkit."
        ),
        panel=O.IO,
        flags=("--from",),
        choices=("auto", *FORMATS, *ALIASES),
        doc="the input format (table above); in a `--config` file the key is `from-format`",
    )
    to_format: str = option(
        "ovkit",
        help=(
            "ovkit (the sample table) | trl (TRL's conversational VLM format: images + messages with content parts)."
        ),
        panel=O.IO,
        flags=("--to",),
        choices=TO_FORMATS,
        doc=(
            "`ovkit`: the sample table; `trl`: TRL's conversational VLM format (above); in a `--config` file the "
            "key is `to-format`"
        ),
    )
    out: Path | None = O.out()
    # relative image paths are resolved against it (default: the input's folder)
    image_root: Path | None = option(
        None,
        help="Folder that relative image paths start from (default: the input's folder).",
        panel=O.IO,
        default_doc="the input's folder",
    )
    source: str | None = option(
        None,
        help="`source` of rows whose input names none (default: the input's file name).",
        panel=RECORDS,
        default_doc="the input's name",
    )
    caption_prompt: str = option(
        "Describe the image.", help="ov-midtrain: the user turn after '<image>\\n'.", panel=RECORDS
    )
    rows_per_file: int = option(10_000, help="Rows per output part file.", panel=RECORDS, min=1)
    shard: str | None = O.shard(
        doc="convert only records `[I*n/N, (I+1)*n/N)`, into `OUT/part-I-of-N/`", default_doc="all"
    )
    on_error: str = O.on_error()
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        O.validate(self)  # each option's declared range and choices; the checks across options follow
        if self.input is None:
            raise OvkitError("INPUT is required: the file or directory to convert")
        if self.out is None:
            raise OvkitError("--out is required")
        self.input, self.out = (
            str(self.input),
            Path(self.out),
        )  # the input stays text: `./org/name` must not become a Hub id
        self.image_root = Path(self.image_root) if self.image_root is not None else None
        self.from_format = ALIASES.get(str(self.from_format), str(self.from_format))
        parse_shard(self.shard)  # raises with the flag's name

    def conversion(self) -> Conversion:
        """What the converter reads of these options (INPUT and OUT are the entry point's)."""
        return Conversion(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Conversion)})

    @property
    def out_dir(self) -> Path:
        """Where this run's stage directory goes: OUT, or OUT/part-I-of-N/ for one shard (read as one dataset)."""
        shard = parse_shard(self.shard)
        return self.out / part_name(shard).removesuffix(".parquet") if shard else self.out


@dataclass(frozen=True)
class Conversion:
    """What one conversion does (convert_input): `ovkit convert`'s options less INPUT and OUT. The command builds it
    from its config (ConvertConfig.conversion); a stage that reads a foreign table (ovkit.data.io) from the options'
    declared defaults and the format it detected (`Conversion.default`)."""

    from_format: str
    to_format: str
    image_root: Path | None
    source: str | None
    caption_prompt: str
    rows_per_file: int
    shard: str | None
    on_error: str
    quiet: bool

    @classmethod
    def default(cls, **given: Any) -> Conversion:
        """`ovkit convert`'s declared defaults (ConvertConfig's fields), `given` overriding them."""
        declared = {name: flat.field.default for name, flat in O.flatten(ConvertConfig).items()}
        return cls(**{f.name: given.get(f.name, declared[f.name]) for f in dataclasses.fields(cls)})


class BadRecord(Exception):
    """A record that cannot become a sample: `field` is the input's key/column, `reason` says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(reason)
        self.field, self.reason = field, reason


# ---------------------------------------------------------------- mapping one record


class Converter:
    """Maps records of one format to sample rows and keeps the counts the summary reports."""

    def __init__(self, fmt: str, cfg: Conversion, inp: Input, extras: list[str]):
        self.fmt, self.cfg, self.extras = fmt, cfg, extras
        self.root = cfg.image_root or (inp.path if inp.path.is_dir() else inp.path.parent)
        self.name = inp.path.stem if inp.path.is_file() else inp.path.name
        self.default_source = cfg.source or self.name
        filled = fills(fmt, extras)
        self.columns = [*REQUIRED, *filled, *[c for c in extras if c not in filled]]
        self.ids: set[str] = set()
        self.counts: Counter[str] = Counter()
        self.first_rename = ""

    def row(self, rec: Record) -> dict[str, Any]:
        if rec.unparsed is not None:
            raise BadRecord("record", rec.unparsed)
        if not isinstance(rec.raw, dict):
            raise BadRecord("record", f"record is a {type(rec.raw).__name__}, not an object")
        row = MAPPERS[self.fmt](rec.raw, self)
        row["id"] = self._unique_id(row.get("id"), rec.number)
        if not isinstance(row.get("source"), str) or not row["source"]:
            given = rec.raw.get("source")
            row["source"] = given if isinstance(given, str) and given else self.default_source
        for k in self.extras:
            if k not in row:
                v = rec.raw.get(k)
                if v is not None and not isinstance(v, str):
                    self.counts[f"non-string {k}"] += 1  # reported: kept as null in this row
                row[k] = v if isinstance(v, str) else None
        return row

    def _unique_id(self, rid: Any, number: int) -> str:
        """The input's id; `<name>-<n>` where it has none; `<id>-<n>` when the id was already used earlier."""
        rid = f"{self.name}-{number}" if rid is None or rid == "" else str(rid)
        if rid in self.ids:
            if not self.counts["renamed_ids"]:
                self.first_rename = f"{rid!r} of record {number} became {rid + '-' + str(number)!r}"
            rid = f"{rid}-{number}"
            self.counts["renamed_ids"] += 1
        self.ids.add(rid)
        return rid

    def images(self, value: Any, field: str) -> list[dict[str, Any]]:
        if value is None:
            return []
        items = value if isinstance(value, list) else [value]
        return [self._image(v, f"{field}[{k}]" if isinstance(value, list) else field) for k, v in enumerate(items)]

    def _image(self, value: Any, field: str) -> dict[str, Any]:
        """One image as a self-contained cell: bytes as given (HF {bytes, path} struct or raw binary) or read from a
        path relative to the image root. Decodability is checked later by the schema's row checks."""
        if isinstance(value, (bytes, bytearray)):
            return {"bytes": bytes(value), "path": None}
        if isinstance(value, dict):
            if isinstance(value.get("bytes"), str):  # a `bytes` field typed string: text, not an encoded picture
                raise BadRecord(field, f"image bytes are a string ({value['bytes'][:40]!r}), not binary")
            if value.get("bytes"):
                return {"bytes": bytes(value["bytes"]), "path": value.get("path")}
            value = value.get("path") or value.get("image")
        if not isinstance(value, str) or not value:
            raise BadRecord(field, f"no image bytes and no path ({type(value).__name__})")
        path = Path(value.removeprefix("file://"))
        full = path if path.is_absolute() else self.root / path
        try:
            return {
                "bytes": read_image_file(full),
                "path": value,
            }  # a regular file under the size limit, never a device or FIFO
        except FileNotFoundError:
            hint = "set --image-root to the folder the paths are relative to"
            raise BadRecord(field, f"image file not found: {full} ({hint})") from None
        except OSError as e:
            raise BadRecord(field, f"cannot read image file {full}: {e.strerror}") from None

    def markers(self, messages: list[dict[str, str]], n_images: int) -> list[dict[str, str]]:
        """Images but no `<image>` marker anywhere: put one per image at the start of the first user turn."""
        if n_images and not any(IMAGE_TOKEN in m["content"] for m in messages):
            for m in messages:
                if m["role"] == "user":
                    m["content"] = f"{IMAGE_TOKEN}\n" * n_images + m["content"]
                    self.counts["inserted_markers"] += 1
                    break
        return messages


def _turns(turns: Any, field: str) -> list[dict[str, str]]:
    """A chat list as {role, content} messages, from {from, value} (LLaVA/ShareGPT) or {role, content} (OpenAI)."""
    if not isinstance(turns, list) or not turns:
        raise BadRecord(field, "missing or empty chat list")
    messages = []
    for k, t in enumerate(turns):
        if not isinstance(t, dict):
            raise BadRecord(field, f"turn {k} is not an object")
        role = t.get("from", t.get("role"))
        if role not in ROLE_NAMES:
            raise BadRecord(field, f"turn {k}: role {role!r} is not supported (human/user, gpt/assistant, system)")
        messages.append({"role": ROLE_NAMES[role], "content": _content(t.get("value", t.get("content")), field, k)})
    return messages


def _content(value: Any, field: str, k: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI-style content parts: images become markers where they stand
        parts = []
        for p in value:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            elif kind in ("image", "image_url"):
                parts.append(IMAGE_TOKEN)
            else:
                raise BadRecord(field, f"turn {k}: content part {p!r:.60} is neither text nor image")
        return "".join(parts)
    raise BadRecord(field, f"turn {k}: content is {type(value).__name__}, not text")


def _text(raw: dict[str, Any], key: str) -> str:
    v = raw.get(key)
    if not isinstance(v, str) or not v.strip():
        raise BadRecord(key, f"{key} is missing or empty")
    return v


def _optional_text(raw: dict[str, Any], key: str) -> str | None:
    v = raw.get(key)
    if v is not None and not isinstance(v, str):
        raise BadRecord(key, f"{key} is {type(v).__name__}, not text")
    return v


def from_llava(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    """LLaVA-1.5 JSON and LLaVA-OneVision-Data parquet (which adds `data_source`)."""
    images = c.images(raw.get("image"), "image")
    messages = c.markers(_turns(raw.get("conversations"), "conversations"), len(images))
    return {"id": raw.get("id"), "images": images, "messages": messages, "source": raw.get("data_source")}


def from_sharegpt(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    for key in ("videos", "audios"):
        if raw.get(key):
            raise BadRecord(key, f"{key} are not supported (ovkit samples hold images only)")
    field = "messages" if "messages" in raw else "conversations"
    messages = _turns(raw.get(field), field)
    system = _optional_text(raw, "system")
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    images = c.images(raw.get("images"), "images")
    return {"id": raw.get("id"), "images": images, "messages": c.markers(messages, len(images)), "source": None}


def from_midtrain(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    caption = _text(raw, "caption")
    images = c.images(raw.get("image"), "image")
    if len(images) != 1:
        raise BadRecord("image", f"a caption record needs exactly one image, got {len(images)}")
    messages = [
        {"role": "user", "content": f"{IMAGE_TOKEN}\n{c.cfg.caption_prompt}"},
        {"role": "assistant", "content": caption},
    ]
    return {"id": raw.get("id"), "images": images, "messages": messages, "source": None}


def from_ov_rl(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    """Prompt-only messages; the stage instruction is added by the RL/eval command (`prompt_type` stays a column)."""
    images = c.images(raw["images"] if "images" in raw else raw.get("image"), "images")
    messages = c.markers([{"role": "user", "content": _text(raw, "problem")}], len(images))
    answer_type = _optional_text(raw, "answer_type")  # released names; the rewards registry takes them as aliases
    return {
        "id": raw.get("id"),
        "images": images,
        "messages": messages,
        "source": _optional_text(raw, "source"),
        "category": _optional_text(raw, "problem_type"),
        "answer": rl_answer(raw.get("answer"), answer_type, c.counts),
        "answer_type": answer_type,
    }


# Scorers that read an `answer` holding a JSON list of strings as alternatives (ovkit.rewards.base.alternatives).
TAKES_ALTERNATIVES = frozenset({"ocr", "multiple_choice", "string"})


def rl_answer(value: Any, answer_type: str | None, counts: Counter[str]) -> str:
    """The released RL data stores `answer` as a list of strings. One -> that string. Several -> a JSON list where
    the answer type's scorer takes alternatives (any one is right), else the first (counted: `answers_cut_to_first`),
    since a math, number or box scorer would read the list as one malformed answer."""
    if isinstance(value, str) and value.strip():
        return value
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise BadRecord("answer", f"answer must be a non-empty string or list of strings, got {value!r:.80}")
    if len(value) == 1:
        return value[0]
    if _scorer(answer_type) in TAKES_ALTERNATIVES:
        return json.dumps(value, ensure_ascii=False)
    counts["answers_cut_to_first"] += 1
    return value[0]


def _scorer(answer_type: str | None) -> str | None:

    try:
        return resolve_scorer(answer_type) if answer_type else None
    except OvkitError:  # a scorer ovkit does not know (yet): the RL command reports it
        return None


def from_verl(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    images = c.images(raw.get("images"), "images")
    messages = c.markers(_turns(raw.get("prompt"), "prompt"), len(images))
    rm = raw.get("reward_model")
    truth = rm.get("ground_truth") if isinstance(rm, dict) else None
    if truth is None:
        raise BadRecord("reward_model", "reward_model.ground_truth is missing")
    extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
    return {
        "id": raw.get("id") or extra.get("id"),
        "images": images,
        "messages": messages,
        "source": _optional_text(raw, "data_source"),
        "category": _optional_text(raw, "ability"),
        "answer": truth if isinstance(truth, str) else json.dumps(truth, ensure_ascii=False),
    }


def from_chat(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    """ovkit's table and TRL's conversational VLM layout: `messages`, or `prompt` (+ `completion`), each a chat list
    (or, TRL's standard format, a string); `images`, or one `image`. Content is text with `<image>` markers or a list
    of {type: text|image} parts, an image part becoming `<image>` where it stands. As in TRL's
    prepare_multimodal_messages, an image part carrying its own image (`{"type": "image", "image": ...}`) keeps it and
    the others take `images` in order; text content with images and no marker gets the markers before the first
    user turn's text (Converter.markers)."""
    if raw.get("messages") is not None:
        field, turns = "messages", raw["messages"]
    else:
        field = "prompt"
        turns = _as_turns(raw.get("prompt"), "user", "prompt") + _as_turns(
            raw.get("completion"), "assistant", "completion"
        )
    messages = _turns(turns, field)
    given = raw["images"] if raw.get("images") is not None else [raw["image"]] if raw.get("image") is not None else []
    images = c.images(_inline_images(turns, given if isinstance(given, list) else [given]), "images")
    return {"id": raw.get("id"), "images": images, "messages": c.markers(messages, len(images)), "source": None}


def from_trl(raw: dict[str, Any], c: Converter) -> dict[str, Any]:
    """TRL's layouts (from_chat), and for its GRPO datasets the gold answer: `answer`, else `solution`, scored by
    `answer_type` where the row names one, else by TRL_SCORER."""
    row = from_chat(raw, c)
    if "answer_type" in c.columns:
        gold = raw.get("answer") if raw.get("answer") is not None else raw.get("solution")
        row["answer"] = gold if gold is None or isinstance(gold, str) else json.dumps(gold, ensure_ascii=False)
        row["answer_type"] = _optional_text(raw, "answer_type") or TRL_SCORER
    return row


def _as_turns(value: Any, role: str, field: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise BadRecord(field, f"{field} is {type(value).__name__}, not a chat list or text")


def _inline_images(turns: list[Any], given: list[Any]) -> list[Any]:
    """The images in the order their parts stand: a part's own image, else the next of `given`."""
    parts = [p for t in turns if isinstance(t, dict) and isinstance(t.get("content"), list) for p in t["content"]]
    image_parts = [p for p in parts if isinstance(p, dict) and p.get("type") in ("image", "image_url")]
    if not any(p.get("image") is not None for p in image_parts):
        return given
    queue, out = list(given), []
    for p in image_parts:
        if p.get("image") is not None:
            out.append(p["image"])
        elif queue:
            out.append(queue.pop(0))
        else:
            raise BadRecord(
                "images", f"{len(image_parts)} image parts but only {len(given)} image(s) in `images` to fill them"
            )
    return out + queue


# ---------------------------------------------------------------- writing TRL's layout

TRL_PART = pa.struct([("type", pa.string()), ("text", pa.string())])
TRL_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.list_(TRL_PART))])


def content_parts(text: str) -> list[dict[str, Any]]:
    """'<image>\nWhat is it?' -> [{type: image}, {type: text, text: '\nWhat is it?'}]: each marker an image part
    where it stands, the text between them as text parts (empty pieces dropped, so joining them back is exact)."""
    parts: list[dict[str, Any]] = []
    for k, piece in enumerate(text.split(IMAGE_TOKEN)):
        if k:
            parts.append({"type": "image", "text": None})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def to_trl(table: pa.Table) -> pa.Table:
    """Sample rows -> TRL's conversational VLM layout: `messages` content as typed parts (TRL fills the image parts from
    `images` in order, and HF chat templates render them as the model's image tokens); every other column is kept."""
    table = conform(table)
    messages = [
        [{"role": m["role"], "content": content_parts(m["content"])} for m in turns]
        for turns in table.column("messages").to_pylist()
    ]
    return table.set_column(table.column_names.index("messages"), "messages", pa.array(messages, pa.list_(TRL_MESSAGE)))


MAPPERS: dict[str, Callable[[dict[str, Any], Converter], dict[str, Any]]] = {
    "llava": from_llava,
    "sharegpt": from_sharegpt,
    "onevision": from_llava,
    "ov-midtrain": from_midtrain,
    "ov-rl": from_ov_rl,
    "verl": from_verl,
    "trl": from_trl,
    "ovkit": from_chat,
}


# ---------------------------------------------------------------- writing


class Parts:
    """Good rows, written as part files of at most `rows_per_file` rows (or FILE_BYTES of images), renamed to
    part-k-of-K.parquet at the end so that the files sort into row order."""

    def __init__(self, out_dir: Path, rows_per_file: int, layout: Callable[[pa.Table], pa.Table] = conform):
        self.out_dir, self.rows_per_file, self.layout = Path(out_dir), rows_per_file, layout
        self.pending: list[pa.Table] = []
        self.rows = self.bytes = 0
        self.written: list[Path] = []

    def add(self, table: pa.Table) -> None:
        while table.num_rows:
            take = min(table.num_rows, self.rows_per_file - self.rows)
            head, table = table.slice(0, take), table.slice(take)
            self.pending.append(head)
            self.rows += head.num_rows
            self.bytes += head.column("images").nbytes
            if self.rows >= self.rows_per_file or self.bytes >= FILE_BYTES:
                self.flush()

    def flush(self) -> None:
        if self.pending:
            table = pa.concat_tables(self.pending)
            self.written.append(
                write_table(self.layout(table), self.out_dir / f".chunk-{len(self.written):05d}.parquet")
            )
        self.pending, self.rows, self.bytes = [], 0, 0

    def finish(self, empty: pa.Table) -> list[Path]:
        self.flush()
        if not self.written:  # every record was rejected: still a well-formed (empty) dataset
            self.written.append(write_table(self.layout(empty), self.out_dir / ".chunk-00000.parquet"))
        n = len(self.written)
        return [p.rename(self.out_dir / part_name((k, n))) for k, p in enumerate(self.written)]


def sample_table(rows: list[dict[str, Any]], columns: list[str]) -> pa.Table:
    types = {**REQUIRED, **OPTIONAL}
    return pa.table({c: pa.array([r.get(c) for r in rows], type=types.get(c, pa.string())) for c in columns})


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return {"base64": base64.b64encode(v).decode()}
    return str(v)


@dataclass
class Reject:
    rec: Record
    id: str | None
    field: str
    reason: str

    def as_row(self) -> dict[str, Any]:
        # The record as JSON (binary values as {"base64": ...}); a JSON line that did not parse, as it was.
        rec = self.rec
        record = rec.raw if rec.unparsed is not None else json.dumps(rec.raw, ensure_ascii=False, default=_jsonable)
        return {
            "file": str(rec.file),
            "index": rec.index,
            "id": self.id,
            "field": self.field,
            "reason": self.reason,
            "record": record,
        }

    def message(self) -> str:
        row = f"{self.id!r} (index {self.rec.index})" if self.id else f"index {self.rec.index}"
        return (
            f"{where(self.rec.file, row, self.field)}: {self.reason} (use --on-error skip to move bad records to "
            f"{REJECTS})"
        )


REJECT_SCHEMA = pa.schema(
    [
        ("file", pa.string()),
        ("index", pa.int64()),
        ("id", pa.string()),
        ("field", pa.string()),
        ("reason", pa.string()),
        ("record", pa.string()),
    ]
)


def convert_batch(records: list[Record], conv: Converter) -> tuple[pa.Table, list[Reject]]:
    """Map a batch and validate it with the schema's row checks (markers, image decodability, bomb check)."""
    rows, owners, rejects = [], [], []
    for rec in records:
        try:
            row = conv.row(rec)
        except BadRecord as e:
            rid = rec.raw.get("id") if isinstance(rec.raw, dict) else None
            rejects.append(Reject(rec, None if rid is None else str(rid), e.field, e.reason))
            continue
        rows.append(row)
        owners.append(rec)
    table = sample_table(rows, conv.columns)
    fields = FIELD_OF[conv.fmt]
    bad = {p.index: p for p in row_problems(table, images="decode", seen_ids={})}
    for i, p in bad.items():
        field = fields.get(p.column, p.column)
        if field == "messages" and "messages" not in owners[i].raw:  # sharegpt data may use `conversations`
            field = "conversations"
        rejects.append(Reject(owners[i], rows[i]["id"], field, p.reason))
    rejects.sort(key=lambda r: r.rec.number)
    keep = [i for i in range(table.num_rows) if i not in bad]
    return (table if not bad else table.take(pa.array(keep, pa.int64()))), rejects


def convert(cfg: ConvertConfig, out_dir: Path, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`ovkit convert`: `cfg.input` into the dataset directory `out_dir` (convert_input); returns the metrics."""
    return convert_input(cfg.conversion(), open_input(cfg.input), out_dir, log)


def convert_input(
    cfg: Conversion, inp: Input, out_dir: Path, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Convert the opened input `inp` into the dataset directory `out_dir` (part files + rejects.parquet), in
    ovkit's layout or, with `to_format='trl'`, TRL's; returns the metrics."""
    log = log or (lambda msg: None if cfg.quiet else print(msg, file=sys.stderr))
    keys, is_str = inp.keys()
    fmt, detected = cfg.from_format, cfg.from_format == "auto"
    if detected:
        fmt, why = detect_format(keys, parts=inp.parts())
        log(f"convert: {inp.path} looks like --from {fmt} ({why})")
    extras = [k for k in keys if is_str[k] and k not in CONSUMED[fmt] and k not in REQUIRED]
    dropped = [k for k in keys if not is_str[k] and k not in CONSUMED[fmt] and k not in REQUIRED]
    if dropped:
        log(f"convert: dropping columns that are not text: {', '.join(dropped)}")
    conv = Converter(fmt, cfg, inp, extras)

    shard = parse_shard(cfg.shard)
    total = inp.count() if shard or inp.kind == "parquet" else None
    lo, hi = shard_bounds(total, shard) if shard else (0, total)
    parts, rejects, rows_in, rows_out = (
        Parts(out_dir, cfg.rows_per_file, to_trl if cfg.to_format == "trl" else conform),
        [],
        0,
        0,
    )
    for batch in _batches(_progress(inp.records(lo, hi), None if hi is None else hi - lo, cfg.quiet)):
        good, bad = convert_batch(batch, conv)
        if bad and cfg.on_error == "fail":
            raise OvkitError(bad[0].message())
        rows_in += len(batch)
        rows_out += good.num_rows
        rejects.extend(bad)
        parts.add(good)
    files = parts.finish(sample_table([], conv.columns))
    if rejects:
        write_table(pa.Table.from_pylist([r.as_row() for r in rejects], schema=REJECT_SCHEMA), out_dir / REJECTS)
    if rows_in != rows_out + len(rejects):  # the promise of every data stage; a mismatch is a bug
        raise RuntimeError(f"rows in {rows_in} != rows out {rows_out} + rejects {len(rejects)}")
    if conv.counts["renamed_ids"]:  # said even with --quiet: the output's ids are not the input's
        print(
            f"warning: {conv.counts['renamed_ids']} record(s) repeat an earlier id and were renamed (ids are unique "
            f"in a sample "
            f"table); e.g. {conv.first_rename}",
            file=sys.stderr,
        )
    return {
        "format": fmt,
        "detected": detected,
        "to": cfg.to_format,
        "rows_in": rows_in,
        "rows_out": rows_out,
        "rejects": len(rejects),
        "reject_fields": dict(Counter(r.field for r in rejects)),
        "files": len(files),
        "shard": cfg.shard,
        "renamed_ids": conv.counts["renamed_ids"],
        "inserted_markers": conv.counts["inserted_markers"],
        "answers_cut_to_first": conv.counts["answers_cut_to_first"],
        "kept_columns": extras,
        "dropped_columns": dropped,
        "null_non_string_values": {
            k.removeprefix("non-string "): n for k, n in conv.counts.items() if k.startswith("non-string ")
        },
    }


def _batches(records: Iterator[Record]) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for rec in records:
        batch.append(rec)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def _progress(it: Iterator[Record], total: int | None, quiet: bool) -> Iterator[Record]:
    # heavy: tqdm loads on first use, not at CLI start or in config checks
    from tqdm import tqdm

    return iter(tqdm(it, total=total, disable=quiet, unit="rec", desc="convert", file=sys.stderr, mininterval=1.0))
