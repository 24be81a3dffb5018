"""Turn sample-table rows into model inputs with the model's own processor and chat template.

Works for any Hugging Face VLM processor that has a chat template (the tiny preset, Qwen2.5-VL, LLaVA, ...): the
conversation is rendered with `processor.apply_chat_template(..., tokenize=False)` and tokenized by
`processor(text=..., images=...)`, so image placeholders expand to exactly the number of visual tokens the model
expects. Training targets are the tokens of the last assistant turn, found by rendering the prompt up to the
generation prompt of that turn: the prompt's tokens must be a prefix of the full conversation's tokens.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ovkit.data.schema import IMAGE_TOKEN, MAX_IMAGE_PIXELS, read_image_file
from ovkit.errors import OvkitError

IGNORE = -100  # the label value torch's cross-entropy skips

# Processor outputs with one value per token (besides input_ids/attention_mask). Qwen-VL's 3D RoPE needs
# `mm_token_type_ids` (0 text, 1 image, 2 video) in transformers 5; Gemma-3 style processors return `token_type_ids`.
PER_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")


@dataclass
class Encoded:
    """One sample as the model sees it (no batch dimension in the lists)."""

    input_ids: list[int]
    labels: list[int]  # IGNORE except the last assistant turn's tokens, its end-of-turn token included
    mm: dict[str, Any] = field(default_factory=dict)  # per-image tensors: pixel_values, image_grid_thw, ...
    per_token: dict[str, list[int]] = field(default_factory=dict)  # e.g. mm_token_type_ids, aligned with input_ids

    @property
    def length(self) -> int:
        return len(self.input_ids)

    def model_inputs(self, *, labels: bool = True) -> dict[str, Any]:
        """Batch-of-one tensors for `model(**inputs)` (and `generate` with labels=False)."""
        # heavy: torch loads on first use, not at CLI start or in config checks
        import torch

        out: dict[str, Any] = {
            "input_ids": torch.tensor([self.input_ids]),
            "attention_mask": torch.ones(1, self.length, dtype=torch.long),
        }
        if labels:
            out["labels"] = torch.tensor([self.labels])
        out.update({k: torch.tensor([v]) for k, v in self.per_token.items()})
        out.update(self.mm)
        return out


def to_hf_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sample-table messages (`<image>` markers in text) -> HF content-part messages, one {"type": "image"} part
    where each marker was, in order."""
    out = []
    for m in messages:
        content = m["content"]
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(content.split(IMAGE_TOKEN)):
            if i > 0:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({"role": m["role"], "content": parts})
    return out


def decode_images(cells: Sequence[dict[str, Any]] | None) -> list:
    """The `images` column cells ({bytes, path}) -> RGB PIL images (bytes win over path, as in `datasets`). A cell
    that cannot be decoded is an OvkitError saying which image and why (the caller adds the file, row and column);
    the size limits are those of the read-time check (ovkit.data.schema)."""
    # heavy: PIL loads on first use, not at CLI start or in config checks
    from PIL import Image

    images = []
    for k, cell in enumerate(cells or []):
        data, path = cell.get("bytes"), cell.get("path")
        if data is None and not path:
            raise OvkitError(f"image {k}: the cell has neither bytes nor path")
        try:
            img = Image.open(io.BytesIO(data if data is not None else read_image_file(Path(path))))
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise OvkitError(
                    f"image {k}: image is {img.width}x{img.height}, over the limit of {MAX_IMAGE_PIXELS} pixels"
                )
            images.append(img.convert("RGB"))
        except OvkitError:
            raise
        except Exception as e:  # noqa: BLE001 -- PIL raises many types for corrupt data (OSError: image file is truncated, ...)
            raise OvkitError(f"image {k}: unreadable image: {type(e).__name__}: {e}") from None
    return images


def encode_sample(processor, messages: Sequence[dict[str, Any]], images: Sequence = ()) -> Encoded:
    """Tokenize a conversation for training: labels are the tokens of the last assistant turn up to and including
    its end-of-turn token (template text after it, e.g. a trailing newline, is input but not a target). Turns after
    the last assistant turn carry no target and are dropped."""
    last = _last_assistant(messages)
    kept = list(messages[: last + 1])
    prompt = _tokenize(processor, kept[:-1], images, generation_prompt=True)
    full = _tokenize(processor, kept, images, generation_prompt=False)
    ids = full.input_ids
    n = prompt.length
    if ids[:n] != prompt.input_ids:
        raise OvkitError(
            f"the chat template of {type(processor).__name__} renders the prompt differently with and without the "
            "answer (the prompt's tokens are not a prefix of the conversation's), so the answer tokens cannot be "
            "located; use a processor whose template appends the assistant turn after its generation prompt"
        )
    end = len(ids)
    tokenizer = getattr(processor, "tokenizer", processor)
    while end > n and not tokenizer.decode(ids[end - 1 : end]).strip():
        end -= 1  # trailing whitespace the template writes after the end-of-turn token is never generated
    if end == n:
        raise OvkitError("the last assistant turn is empty after tokenization")
    full.labels = [IGNORE] * n + ids[n:end] + [IGNORE] * (len(ids) - end)
    return full


def encode_prompt(
    processor, messages: Sequence[dict[str, Any]], images: Sequence = (), *, tools: Sequence[dict] | None = None
) -> Encoded:
    """Tokenize a prompt for generation (the generation prompt appended; labels all IGNORE). If the messages end
    with an assistant turn (an SFT row), the prompt is everything before it, so that
    `encode_prompt(m).input_ids + answer tokens == encode_sample(m).input_ids`. `tools` (JSON schemas) go to the
    chat template, which renders them where it puts tool preambles (Qwen: the system turn)."""
    msgs = list(messages)
    if msgs and msgs[-1]["role"] == "assistant":
        msgs = msgs[: _last_assistant(msgs)]
    return _tokenize(processor, msgs, images, generation_prompt=True, tools=tools)


def encode_messages(
    processor,
    messages: Sequence[dict[str, Any]],
    images: Sequence = (),
    *,
    generation_prompt: bool,
    tools: Sequence[dict] | None = None,
) -> Encoded:
    """Tokenize `messages` exactly as rendered by the chat template (labels all IGNORE)."""
    return _tokenize(processor, messages, images, generation_prompt=generation_prompt, tools=tools)


def image_token_count(processor, width: int, height: int) -> int:
    """How many tokens one `width` x `height` image becomes in the model's input (placeholder expansion only; the
    template's own wrapper tokens such as <|vision_start|> are not counted). Uses the processor's size rule where it
    has one (transformers' `_get_num_multimodal_tokens`, the one vLLM uses), else processes a blank image."""
    counter = getattr(processor, "_get_num_multimodal_tokens", None)
    if counter is not None:
        try:
            counts = counter(image_sizes=[(height, width)])
            return int(counts["num_image_tokens"][0])
        except (NotImplementedError, KeyError, TypeError, AttributeError):
            pass
    # heavy: PIL loads on first use, not at CLI start or in config checks
    from PIL import Image

    image_id = placeholder_token_id(processor)
    if image_id is None:
        raise OvkitError(f"{type(processor).__name__} has no image placeholder token (image_token / image_token_id)")
    enc = _tokenize(
        processor,
        [{"role": "user", "content": IMAGE_TOKEN}],
        [Image.new("RGB", (width, height))],
        generation_prompt=False,
    )
    return sum(1 for t in enc.input_ids if t == image_id)


def _last_assistant(messages: Sequence[dict[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            return i
    raise OvkitError("the conversation has no assistant turn to train on")


def _tokenize(
    processor,
    messages: Sequence[dict[str, Any]],
    images: Sequence,
    *,
    generation_prompt: bool,
    tools: Sequence[dict] | None = None,
) -> Encoded:
    hf = to_hf_messages(messages)
    n_images = sum(1 for m in hf for p in m["content"] if p["type"] == "image")
    if n_images > len(images):
        raise OvkitError(f"the messages have {n_images} {IMAGE_TOKEN} markers but the row has {len(images)} images")
    if getattr(processor, "chat_template", None) is None:
        raise OvkitError(
            f"{type(processor).__name__} has no chat template; give the model directory one (chat_template.jinja)"
        )
    extra = {"tools": list(tools)} if tools else {}
    text = processor.apply_chat_template(hf, tokenize=False, add_generation_prompt=generation_prompt, **extra)
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if n_images:
        kwargs["images"] = list(images[:n_images])
    out = processor(**kwargs)
    ids = out["input_ids"][0].tolist()
    per_token = {k: out[k][0].tolist() for k in PER_TOKEN_KEYS if k in out}
    mm = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", *PER_TOKEN_KEYS)}
    return Encoded(input_ids=ids, labels=[IGNORE] * len(ids), mm=mm, per_token=per_token)


# ------------------------------------------------------------------------------------------------ facts about a
# processor


def merge_mm(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-turn processor outputs -> one tensor per key, concatenated once (in turn order)."""
    import torch  # heavy: loads on first use; this module stays importable without torch (as model_inputs above)

    keys = dict.fromkeys(k for p in parts for k in p)
    return {k: torch.cat([p[k] for p in parts if k in p], dim=0) for k in keys}


def placeholder_token_id(processor: Any, kind: str = "image", tokenizer: Any = None) -> int | None:
    """The id of the processor's `kind` ("image" or "video") placeholder token (`<|image_pad|>`, `<|video_pad|>` on
    Qwen-VL): its `{kind}_token_id`, else its `{kind}_token` looked up in the vocabulary of `tokenizer` (default: the
    processor's own); None where it has none. The one answer the vLLM engines, the mismatch scorer and the samplers'
    suppression read."""
    tid = getattr(processor, f"{kind}_token_id", None)
    token = getattr(processor, f"{kind}_token", None)
    if tid is None and isinstance(token, str):
        tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", processor)
        tid = tokenizer.get_vocab().get(token) if hasattr(tokenizer, "get_vocab") else None
    return int(tid) if tid is not None and int(tid) >= 0 else None


def placeholder_ids(processor: Any) -> set[int]:
    """Image/video placeholder tokens and Qwen-VL's vision start/end markers, for engines without a transformers model
    (vLLM): what a sampler must never emit."""
    tokenizer = getattr(processor, "tokenizer", processor)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    pads = {placeholder_token_id(processor, kind) for kind in ("image", "video")}
    return {t for t in pads if t is not None} | {vocab[n] for n in ("<|vision_start|>", "<|vision_end|>") if n in vocab}


def multimodal_token_ids(model) -> set[int]:
    """Placeholder tokens (image/video pads, vision start/end) a sampler may emit but a learner cannot re-read: the
    forward pass would look for image features behind them."""
    inner = getattr(model, "module", model)  # a bare model, a TokenScorer, either under DDP, or a model's config
    config = getattr(inner, "config", inner)
    found = set()
    for cfg in (config, getattr(config, "text_config", None)):
        for name, value in vars(cfg or object()).items():
            if isinstance(value, int) and any(
                w in name for w in ("image_token", "video_token", "vision_start", "vision_end")
            ):
                found.add(value)
    return found
