"""Each sample's exact token length under the model's own processor: text, chat template, image placeholders
expanded to the visual token count (vision start/end tokens included), with the processor's min/max pixels.

The reference is `ovkit.models.encode.encode_sample(...).length`, the very encoding training uses. It decodes and
preprocesses every image, which is the slow part on real data. The `sizes` method gets the same number without
touching pixels: it tokenizes the rendered template once (one placeholder per image) and adds each image's token
count from its header size through the processor's own size rule (`image_token_count`, transformers'
`_get_num_multimodal_tokens`, the rule vLLM uses). Before relying on it, `compute_lengths` checks it against the
reference on the first rows with images; any difference switches the whole run to the reference method.

Rows are processed in parallel (`workers` processes), in order, with a progress bar; results are cached in a table
keyed by the input's fingerprint and the processor's files, so re-packing with another --max-len is instant.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ovkit.data.schema import image_problem
from ovkit.errors import OvkitError
from ovkit.models import encode, locate
from ovkit.models.encode import decode_images, encode_sample, to_hf_messages

METHODS = ("sizes", "processor")
VERIFY_ROWS = 32  # rows with images on which `sizes` must match the processor before it is trusted
CHUNK = 64  # rows per task sent to a worker

# Files in a model directory that cannot change a token count (weights, provenance).
_NOT_PROCESSOR = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_NOT_PROCESSOR_NAMES = ("ovkit.json", "config.yaml", "generation_config.json")


@dataclass
class Lengths:
    """Per-row lengths (-1 where the row could not be encoded, with the reason in `errors`)."""

    lengths: np.ndarray
    errors: list[str | None]
    method: str
    note: str = ""
    cached: bool = False
    seconds: float = 0.0


# --- one sample ----------------------------------------------------------------------------------------------------


def length_by_processor(processor, messages: Sequence[dict], images: Sequence[dict]) -> int:
    """The reference: the full encoding's length (decodes and preprocesses the images)."""

    return encode_sample(processor, messages, decode_images(images)).length


def length_by_sizes(processor, messages: Sequence[dict], images: Sequence[dict], counts: dict | None = None) -> int:
    """The same number from the template text and the images' header sizes (no decoding, no preprocessing)."""
    # heavy: PIL loads on first use, not at CLI start or in config checks
    from PIL import Image

    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise OvkitError("the conversation has no assistant turn to train on")
    hf = to_hf_messages(messages[: last + 1])  # encode_sample drops turns after the last assistant turn
    text = processor.apply_chat_template(hf, tokenize=False, add_generation_prompt=False)
    tokenizer = getattr(processor, "tokenizer", processor)
    ids = tokenizer(text)["input_ids"]
    n_markers = sum(1 for m in hf for p in m["content"] if p["type"] == "image")
    image_id = encode.placeholder_token_id(processor)
    placeholders = sum(1 for t in ids if t == image_id)
    if placeholders != n_markers:  # a template that does not write one placeholder per image part
        raise _SizesUnsupported(f"{placeholders} image placeholders for {n_markers} images")
    counts = {} if counts is None else counts
    total = len(ids) - n_markers
    for cell in images[:n_markers]:
        data = cell.get("bytes")
        with Image.open(io.BytesIO(data)) if data is not None else Image.open(cell["path"]) as im:
            size = im.size
        if size not in counts:
            counts[size] = encode.image_token_count(processor, *size)  # read at call time: the one size rule
        total += counts[size]
    return total


class _SizesUnsupported(Exception):
    """The `sizes` shortcut does not apply to this processor or row."""


# --- many samples ------------------------------------------------------------------------------------------------


_WORKER: dict[str, Any] = {}


def _init_worker(model_dir: str, method: str) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch

    torch.set_num_threads(1)
    _WORKER.update(processor=load_processor(model_dir), method=method, counts={})


def _lengths_of(rows: list[tuple[list, list]]) -> list[tuple[int, str | None]]:

    processor, method, counts = _WORKER["processor"], _WORKER["method"], _WORKER["counts"]
    out = []
    for messages, images in rows:
        try:
            if method == "sizes":
                # The sizes need only headers, but this is the pass that reads every image: decode it whole here, so a
                # truncated picture is a reject now rather than an error in training (`processor` decodes anyway).
                bad = next((f"image {k}: {p}" for k, cell in enumerate(images) if (p := image_problem(cell))), None)
                out.append((-1, bad) if bad else (length_by_sizes(processor, messages, images, counts), None))
            else:
                out.append((length_by_processor(processor, messages, images), None))
        except OvkitError as e:
            out.append((-1, str(e)))
        except Exception as e:  # noqa: BLE001 -- the processor raises many types for a bad row: reject that row
            out.append((-1, f"{type(e).__name__}: {e}"))
    return out


def load_processor(model_dir: str | Path):
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import AutoProcessor

    where = locate(model_dir, weights=False)  # only the processor is read: a damaged weight file does not matter here
    try:
        return AutoProcessor.from_pretrained(where)
    except (OSError, ValueError) as e:
        raise OvkitError(f"--model {model_dir}: cannot load its processor ({' '.join(str(e).split())})") from None


def compute_lengths(
    table: pa.Table,
    model_dir: Path,
    *,
    method: str = "sizes",
    workers: int = 1,
    progress: bool = True,
) -> Lengths:
    """Token length of every row of a sample table (columns `messages`, `images`), in row order."""

    if method not in METHODS:
        raise OvkitError(f"length method must be one of {', '.join(METHODS)}, got {method!r}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked after the tokenizer ran here
    start = time.perf_counter()
    messages = table.column("messages").to_pylist()
    images = table.column("images").to_pylist()
    rows = list(zip(messages, images))
    note = ""
    if method == "sizes":
        method, note = _check_sizes(model_dir, rows)
    out = _run(rows, str(model_dir), method, workers, progress)
    lengths = np.array([n for n, _ in out], dtype=np.int64)
    return Lengths(lengths, [e for _, e in out], method, note, seconds=time.perf_counter() - start)


def _check_sizes(model_dir: Path, rows: list) -> tuple[str, str]:
    """Trust `sizes` only if it equals the processor's encoding on the first rows with images (and one without)."""
    processor = load_processor(model_dir)
    with_images = [r for r in rows if r[1]][:VERIFY_ROWS]
    without = [r for r in rows if not r[1]][:1]
    checked = 0
    for messages, images in with_images + without:
        try:
            fast = length_by_sizes(processor, messages, images)
        except _SizesUnsupported as e:
            return "processor", f"sizes method not applicable ({e}); every row was encoded by the processor"
        except Exception:  # noqa: BLE001 -- a bad row: the main pass will report it
            continue
        try:
            ref = length_by_processor(processor, messages, images)
        except Exception:  # noqa: BLE001
            continue
        if fast != ref:
            return (
                "processor",
                f"sizes method gave {fast} where the processor gives {ref}; every row was encoded by the processor",
            )
        checked += 1
    return "sizes", f"sizes method matched the processor on {checked} checked rows"


def _run(rows: list, model_dir: str, method: str, workers: int, progress: bool) -> list[tuple[int, str | None]]:
    # heavy: tqdm loads on first use, not at CLI start or in config checks
    from tqdm.auto import tqdm

    chunks = [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)]
    bar = tqdm(total=len(rows), desc=f"lengths ({method})", unit="row", file=sys.stderr, disable=not progress)
    out: list[tuple[int, str | None]] = []
    try:
        if workers <= 1 or len(chunks) <= 1:
            _init_worker(model_dir, method)
            for chunk in chunks:
                out += _lengths_of(chunk)
                bar.update(len(chunk))
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ctx.Pool(min(workers, len(chunks)), initializer=_init_worker, initargs=(model_dir, method)) as pool:
                for part in pool.imap(_lengths_of, chunks):  # ordered: the result does not depend on scheduling
                    out += part
                    bar.update(len(part))
    finally:
        bar.close()
    return out


# --- the cache ---------------------------------------------------------------------------------------------------


def cache_key(data_fingerprint: dict, model_dir: Path, method: str, shard: tuple[int, int] | None) -> str:
    """Changes when the input, the processor's files, the method or the shard change; not with --max-len."""
    h = hashlib.sha256()
    # "images": what the pass checks of each image; rows measured before it decoded them whole must be measured again
    h.update(
        json.dumps(
            {"data": data_fingerprint, "method": method, "shard": shard, "images": "decode"}, sort_keys=True
        ).encode()
    )
    for f in sorted(Path(model_dir).rglob("*")):
        if f.is_file() and not f.name.endswith(_NOT_PROCESSOR) and f.name not in _NOT_PROCESSOR_NAMES:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def default_cache_dir() -> Path:
    return Path(os.environ.get("OVKIT_CACHE") or Path.home() / ".cache" / "ovkit") / "lengths"


def read_cached(path: Path, ids: list[str]) -> Lengths | None:
    """A cached lengths table if it exists and covers exactly these row ids, in order."""
    if not path.is_file():
        return None
    try:
        t = pq.read_table(path)
    except (pa.ArrowInvalid, OSError):
        return None
    if t.column("id").to_pylist() != ids:
        return None
    meta = json.loads((t.schema.metadata or {}).get(b"ovkit", b"{}"))
    return Lengths(
        t.column("length").to_numpy().astype(np.int64),
        t.column("error").to_pylist(),
        meta.get("method", "?"),
        meta.get("note", ""),
        cached=True,
    )


def write_cached(path: Path, ids: list[str], result: Lengths) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "id": pa.array(ids, pa.string()),
            "length": pa.array(result.lengths, pa.int64()),
            "error": pa.array(result.errors, pa.string()),
        }
    ).replace_schema_metadata({"ovkit": json.dumps({"method": result.method, "note": result.note})})
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    tmp.replace(path)
