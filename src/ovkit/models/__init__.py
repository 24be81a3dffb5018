"""Models: build the tiny default, compose a VLM from a vision encoder and an LLM, load any HF VLM, encode samples.

The loading policy lives beside loading: ovkit.models.precision (`--precision`), ovkit.models.attention
(`--attn-implementation`, the vision tower's varlen attention) and ovkit.models.lora (`--lora-r`).

Everything ovkit trains or evaluates is an ordinary transformers image-text-to-text model saved with
`save_pretrained`, so `AutoModelForImageTextToText` / `AutoProcessor` (and vLLM) load it without ovkit.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.hub import check_model, probe_hub


def load(
    path: Path | str,
    *,
    dtype: Any = None,
    device: Any = None,
    trust_remote_code: bool = False,
    quantization_config: Any = None,
) -> tuple[Any, Any]:
    """(model, processor) from a local model directory, or a hub id when the machine is online.

    `dtype`: a torch dtype or its name ("bfloat16", "float32", ...); "auto" keeps the checkpoint's; None gives
    torch's default (float32), what CPU training wants.
    """
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    where = locate(path)
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise OvkitError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16, float16, auto)")
        dtype = getattr(torch, dtype)
    try:
        processor = AutoProcessor.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (*_load_errors(), ValueError) as e:  # missing or damaged tokenizer / processor files
        raise OvkitError(f"--model {path}: cannot load its processor ({_one_line(e)})") from None
    try:
        quant = (
            {}
            if quantization_config is None
            else {"quantization_config": quantization_config, "device_map": {"": str(device or "cpu")}}
        )
        model = AutoModelForImageTextToText.from_pretrained(
            where, dtype=dtype, trust_remote_code=trust_remote_code, **quant
        )
    except _load_errors() as e:  # missing or damaged files, a hub id not in the cache while offline
        raise OvkitError(f"--model {path}: cannot load ({_one_line(e)})") from None
    except ValueError as e:  # an architecture without an image-text-to-text class, or custom code not trusted
        raise OvkitError(
            f"--model {path}: not a vision-language model transformers can load ({_one_line(e)})"
        ) from None
    if device is not None and quantization_config is None:  # a quantised model is placed by device_map
        model = model.to(device)
    return model, processor


def _load_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a model directory it cannot read (a damaged file the header check let through,
    a truncated pytorch_model.bin)."""

    # heavy: safetensors loads on first use, not at CLI start or in config checks
    from safetensors import SafetensorError

    return (OSError, SafetensorError, EOFError, pickle.UnpicklingError)


TOKENIZER_FILES = ("tokenizer*", "vocab*", "merges.txt", "*.model", "*.tiktoken")  # any tokenizer's saved files
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def locate(path: Path | str, flag: str = "--model", *, weights: bool = True) -> str:
    """What to hand `from_pretrained`: a local directory, checked by `check_model_dir` (weights too unless
    `weights=False`: a processor is all some commands read), or a Hub id. A name that looks local (it starts with
    `.`, `/` or `~`, or has no `/` or more than one) and does not exist is an error; a Hub id is looked up only when
    the Hub can answer: from the HF cache with HF_HUB_OFFLINE=1 (an uncached one is an error at once), else after
    one short probe of the Hub instead of transformers' minutes of retries."""
    text = str(path)
    local = Path(text).expanduser()
    if local.exists():
        check_model_dir(local, flag, weights=weights)
        return str(local)
    check_model(text, flag)
    if _offline():
        # heavy: huggingface_hub loads on first use, not at CLI start or in config checks
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(text, "config.json"), str):
            raise OvkitError(
                f"{flag} {text}: no such directory, and the Hub model {text!r} is not in the HF cache while "
                f"HF_HUB_OFFLINE=1"
            )
        return text
    probe_hub(f"{flag} {text}", "a model downloaded earlier loads with HF_HUB_OFFLINE=1, or give a local directory")
    return text


def _offline() -> bool:

    # heavy: huggingface_hub loads on first use, not at CLI start or in config checks
    from huggingface_hub import constants

    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE) or any(f in ("1", "ON", "YES", "TRUE") for f in flags)


def adapter_message(d: Path, flag: str) -> str:
    """What to do with a peft adapter directory given where a model is expected (ovkit's --lora-r writes one into
    OUT/adapter/, beside the merged model at OUT's root)."""
    base = ""
    try:
        base = json.loads((d / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path") or ""
    except (OSError, ValueError, AttributeError):
        pass
    merged = d.parent if (d.parent / "config.json").is_file() else None
    return (
        f"{flag} {d}: a peft LoRA adapter (adapter_config.json), not a model"
        + (f"; give the merged model beside it, {flag} {merged}" if merged else "")
        + f" (or load it yourself: peft.PeftModel.from_pretrained(base, '{d}')"
        + (f", base {base}" if base else "")
        + ")"
    )


def check_model_dir(directory: Path | str, flag: str = "--model", *, weights: bool = True) -> None:
    """A model directory holds a readable config.json and, with `weights`, complete weight files: every safetensors
    file as long as its header says (a truncated copy is named here, not by the loader's deserialisation error).
    Without `weights` (a processor is all the caller reads) config.json may be absent, but must parse if present."""
    d = Path(directory)
    if not d.is_dir():
        raise OvkitError(f"{flag} {d}: not a directory (expected a model saved with save_pretrained)")
    config = d / "config.json"
    if not config.is_file() and (d / "adapter_config.json").is_file():
        raise OvkitError(adapter_message(d, flag))
    if config.is_file():
        try:
            parsed = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise OvkitError(f"{flag} {d}: config.json is not readable JSON ({_one_line(e)})") from None
        if not isinstance(parsed, dict):
            raise OvkitError(f"{flag} {d}: config.json holds a {type(parsed).__name__}, not an object")
    elif weights:
        raise OvkitError(f"{flag} {d}: not a model directory (no config.json)")
    if not any(f.is_file() for pattern in TOKENIZER_FILES for f in d.glob(pattern)):
        # without them transformers builds an empty tokenizer and fails only when a row is encoded
        raise OvkitError(f"{flag} {d}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    if not weights:
        return
    present = [name for name in WEIGHTS if (d / name).is_file()]
    if not present:
        raise OvkitError(f"{flag} {d}: no weights ({', '.join(WEIGHTS)})")
    for f in _safetensors_files(d, flag):
        problem = safetensors_problem(f)
        if problem:
            raise OvkitError(f"{flag} {d}: {f.name} {problem}; copy or save the model again")


def _safetensors_files(d: Path, flag: str) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        return [d / "model.safetensors"] if (d / "model.safetensors").is_file() else []
    try:
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise OvkitError(f"{flag} {d}: model.safetensors.index.json is not a weight index ({_one_line(e)})") from None
    missing = [s for s in shards if not (d / s).is_file()]
    if missing:
        raise OvkitError(
            f"{flag} {d}: {len(missing)} of {len(shards)} weight shards are missing ({', '.join(missing[:3])})"
        )
    return [d / s for s in shards]


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is damaged (its 8-byte header length, JSON header and the tensors' byte ranges against
    the file's size), or None. Reads the header only."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            return f"is truncated or not safetensors ({size:,} bytes, header length {n:,})"
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            return f"has an unreadable header ({type(e).__name__}: {e})"
    if 8 + n + end != size:
        return f"is {size:,} bytes but its header describes {8 + n + end:,} (truncated or damaged)"
    return None


def vocab_size(path: Path | str) -> int | None:
    """Rows of the model's input embedding, from config.json (`text_config.vocab_size` for a VLM); None if it does
    not say. Token ids at or above it index past the embedding."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for c in (config.get("text_config"), config.get("llm_config"), config):
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


def _one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def pad_token_id(processor: Any, model: Any = None) -> int:
    """The id that pads batches: the tokenizer's pad, else the model's, else end-of-sequence, else 0."""
    tokenizer = getattr(processor, "tokenizer", processor)
    config = getattr(model, "config", None)
    for pid in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if pid is not None:
            return int(pid)
    return 0


__all__ = ["check_model_dir", "load", "locate", "pad_token_id", "vocab_size"]
