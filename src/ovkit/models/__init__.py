"""Models: build the tiny default, compose a VLM from a vision encoder and an LLM, load any HF VLM, encode samples.

Everything ovkit trains or evaluates is an ordinary transformers image-text-to-text model saved with
`save_pretrained`, so `AutoModelForImageTextToText` / `AutoProcessor` (and vLLM) load it without ovkit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError


def load(
    path: Path | str,
    *,
    dtype: Any = None,
    device: Any = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any]:
    """(model, processor) from a local model directory, or a hub id when the machine is online.

    `dtype`: a torch dtype or its name ("bfloat16", "float32", ...); "auto" keeps the checkpoint's; None gives
    torch's default (float32), what CPU training wants.
    """
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path_str = str(path)
    local = Path(path_str).expanduser()
    if not local.exists() and (path_str.startswith((".", "/", "~")) or path_str.count("/") != 1):
        raise OvkitError(f"--model {path_str}: no such directory (expected a model saved with save_pretrained, e.g. by `ovkit init-model`)")
    if local.is_dir() and not (local / "config.json").is_file():
        raise OvkitError(f"--model {path_str}: not a model directory (no config.json)")
    if isinstance(dtype, str) and dtype != "auto":
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise OvkitError(f"--dtype {dtype!r} is not a torch dtype (e.g. float32, bfloat16, float16, auto)")
        dtype = getattr(torch, dtype)
    where = str(local) if local.exists() else path_str
    try:
        processor = AutoProcessor.from_pretrained(where, trust_remote_code=trust_remote_code)
        model = AutoModelForImageTextToText.from_pretrained(where, dtype=dtype, trust_remote_code=trust_remote_code)
    except OSError as e:  # missing files, or a hub id while offline
        raise OvkitError(f"--model {path_str}: cannot load ({e})") from None
    except ValueError as e:  # an architecture without an image-text-to-text class, or custom code not trusted
        raise OvkitError(f"--model {path_str}: not a vision-language model transformers can load ({e})") from None
    if device is not None:
        model = model.to(device)
    return model, processor


def pad_token_id(processor: Any, model: Any = None) -> int:
    """The id that pads batches: the tokenizer's pad, else the model's, else end-of-sequence, else 0."""
    tokenizer = getattr(processor, "tokenizer", processor)
    config = getattr(model, "config", None)
    for pid in (getattr(tokenizer, "pad_token_id", None), getattr(config, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if pid is not None:
            return int(pid)
    return 0


__all__ = ["load", "pad_token_id"]
