"""Compose a LLaVA-architecture VLM from a local vision encoder and a local causal LM: the recipe's stage-0 model.

The pretrained weights of both are kept exactly; the projector (2-layer MLP, LLaVA-1.5 style) is freshly initialised
from the seed, and is what the alignment stage trains first. The processor pairs the encoder's image processor with
the LLM's tokenizer, adds an `<image>` token, and uses a ChatML chat template (`<|im_start|>` / `<|im_end|>`, added
to the tokenizer when the LLM lacks them), the format LLaVA-OneVision-1.5 trains its Qwen LLM with.

Any vision encoder transformers builds with `AutoModel` works (CLIP, SigLIP, SigLIP2, DINOv2, ...; a dual encoder's
directory such as a full CLIP checkpoint contributes its vision tower). Encoders that need custom code
(`trust_remote_code`, e.g. RICE-ViT) cannot be rebuilt by `AutoModel.from_config` when the composed model is loaded,
so they are refused with a clear message.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.models.tiny import IM_END, IM_START, chatml_template

IMAGE = "<image>"


def compose(
    vision: Path | str,
    llm: Path | str,
    out_dir: Path | str,
    *,
    seed: int = 0,
    dtype: str = "auto",
    vision_feature_layer: int = -2,
) -> dict[str, Any]:
    """Build the composed model into `out_dir` (save_pretrained model + processor); returns headline facts."""
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch
    from transformers import GenerationConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    torch.manual_seed(seed)  # new embedding rows (if the vocabulary must grow) and the projector
    with _quiet_transformers():
        tower_cls, image_processor = _vision_parts(Path(vision))  # cheap checks before the LLM's weights are read
        lm, tokenizer = _load_llm(Path(llm), dtype)
        # One dtype for the whole model: "auto" means the LLM's (encoders are often saved in float32, LLMs in bf16).
        tower = tower_cls.from_pretrained(vision, dtype=lm.dtype)
        ids = _add_tokens(tokenizer, lm)
    extra, patches = _extra_tokens(tower, image_processor)
    tie = bool(getattr(lm.config, "tie_word_embeddings", False))
    config = LlavaConfig(
        vision_config=tower.config,
        text_config=lm.config,
        image_token_index=ids[IMAGE],
        image_seq_length=patches,
        projector_hidden_act="gelu",
        # CLIP-style encoders prepend a CLS token that LLaVA drops ("default"); SigLIP-style ones have none ("full").
        vision_feature_select_strategy="default" if extra else "full",
        vision_feature_layer=vision_feature_layer,
        tie_word_embeddings=tie,
    )
    # Build the shell without allocating weights, then put the loaded towers in: no second copy of an 8B LLM.
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    model.model.vision_tower = tower
    model.model.language_model = lm.get_decoder()
    model.lm_head = lm.get_output_embeddings()
    projector = LlavaMultiModalProjector(config).to(lm.dtype)
    model.model.multi_modal_projector = projector
    if tie:
        model.lm_head.weight = model.model.language_model.get_input_embeddings().weight
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"composed model has uninitialised tensors: {meta[:5]}")
    model.config.dtype = lm.dtype
    eos = [ids[IM_END]] + ([tokenizer.eos_token_id] if tokenizer.eos_token_id not in (None, ids[IM_END]) else [])
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    processor = _processor(image_processor, tokenizer, config, extra)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(out_dir)
        processor.save_pretrained(out_dir)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {
        "architecture": type(model).__name__,
        "vision": tower.config.model_type,
        "llm": lm.config.model_type,
        "parameters": count(model),
        "vision_parameters": count(tower),
        "projector_parameters": count(projector),
        "image_tokens": patches,
    }


def _processor(image_processor, tokenizer, config, extra: int):
    """LlavaProcessor: the encoder's image processor, the LLM's tokenizer, the ChatML template with `<image>`."""
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import LlavaProcessor

    tokenizer.eos_token = IM_END  # generation stops at the end of the assistant turn
    if getattr(tokenizer, "image_token", None) not in (None, IMAGE):
        tokenizer.image_token = IMAGE  # LlavaProcessor prefers the tokenizer's own image token over its argument
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=extra,
        chat_template=chatml_template(IMAGE),
        image_token=IMAGE,
    )


def _vision_parts(path: Path):
    """The encoder's model class (the one LlavaModel builds for its config) and its image processor."""
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import AutoConfig, AutoImageProcessor
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    _check_dir(path, "--vision")
    try:
        cfg = AutoConfig.from_pretrained(path)
    except ValueError as e:
        raise OvkitError(
            f"--vision {path}: transformers does not know this encoder without custom code ({e}); "
            "compose needs an encoder AutoModel builds (CLIP, SigLIP, SigLIP2, DINOv2, ...)"
        ) from None
    vision_config = getattr(cfg, "vision_config", None) or cfg
    tower_cls = MODEL_MAPPING.get(type(vision_config), None)
    if tower_cls is None or not hasattr(vision_config, "patch_size"):
        raise OvkitError(
            f"--vision {path}: '{vision_config.model_type}' is not a vision encoder AutoModel can build "
            "(use e.g. a CLIP or SigLIP vision model directory)"
        )
    try:
        image_processor = AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError):
        raise OvkitError(
            f"--vision {path}: no image processor (preprocessor_config.json); save the encoder's "
            "image processor into the directory"
        ) from None
    return tower_cls, image_processor


def _load_llm(path: Path, dtype: str):
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_dir(path, "--llm")
    try:
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except ValueError as e:
        raise OvkitError(f"--llm {path}: not a causal LM transformers can load ({e})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        raise OvkitError(f"--llm {path}: no tokenizer files; save the LLM's tokenizer into the directory") from None
    return lm, tokenizer


def _check_dir(path: Path, flag: str) -> None:
    if not path.is_dir():
        raise OvkitError(f"{flag} {path}: no such directory (a local save_pretrained directory)")
    if not (path / "config.json").is_file():
        raise OvkitError(f"{flag} {path}: no config.json")


def _add_tokens(tokenizer, lm) -> dict[str, int]:
    """Add `<image>` and the ChatML markers as special tokens where missing; grow the embeddings only if the LLM's
    vocabulary has no spare rows (Qwen LLMs reserve some). Existing rows stay exactly as trained."""
    # heavy: tokenizers loads on first use, not at CLI start or in config checks
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    new = [t for t in (IM_START, IM_END, IMAGE) if t not in vocab]
    if new:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in new], special_tokens=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > lm.get_input_embeddings().weight.shape[0]:
        lm.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    return {t: tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END, IMAGE)}


def _extra_tokens(tower, image_processor) -> tuple[int, int]:
    """(tokens the encoder adds besides one per patch, e.g. CLS; patches per image), by running it once."""
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch
    from PIL import Image

    size = getattr(tower.config, "image_size", 224)
    pixels = image_processor(images=[Image.new("RGB", (size, size))], return_tensors="pt")["pixel_values"]
    patch = tower.config.patch_size
    patches = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    with torch.no_grad():
        n = tower(pixel_values=pixels.to(tower.dtype)).last_hidden_state.shape[1]
    if n - patches not in (0, 1):
        raise OvkitError(
            f"vision encoder gives {n} tokens for {patches} patches; compose supports encoders that "
            "output one token per patch, optionally with one CLS token"
        )
    return n - patches, patches


@contextlib.contextmanager
def _quiet_transformers():
    """Loading one tower out of a dual-encoder checkpoint lists every unused weight; that is expected here."""
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers.utils import logging

    old = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(old)
        logging.enable_progress_bar()
