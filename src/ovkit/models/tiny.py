"""The `tiny` preset: a Qwen2.5-VL-architecture model small enough to learn the synthetic tasks in minutes on 2 CPU
cores, with a byte-level BPE tokenizer trained on the corpus text and a processor with a ChatML chat template.

Qwen2.5-VL is the closest public analogue of LLaVA-OneVision-1.5 (native-resolution ViT with 2D RoPE, 2x2
patch-merger projector, decoder LLM), and every stage that works on it works on the real checkpoints unchanged.
The sizes below were checked to learn count/colour/shape on 84x84 images within ~700 steps on 2 CPU
cores; with 56x56 images (4 visual tokens) the same model stayed at chance after 1,500.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ovkit.prompts import ANSWER_PROMPT, SYSTEM_PROMPT, THINK_PROMPT

# Qwen2-VL's special tokens, so real Qwen checkpoints and the tiny model share one chat format.
PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny preset (about 2.6M parameters)."""

    vocab_size: int = 330  # byte-level BPE: 256 bytes + merges; the special tokens come on top
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4  # head_dim 48 -> 24 rotary frequencies, split (t, h, w) by mrope_section
    num_kv_heads: int = 2
    intermediate_size: int = 512
    mrope_section: tuple[int, int, int] = (8, 8, 8)
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    vision_hidden_size: int = 96
    vision_depth: int = 4
    vision_heads: int = 4
    vision_intermediate_size: int = 256
    patch_size: int = 14
    spatial_merge_size: int = 2  # 2x2 patches -> one LLM token: 84x84 images give 9 visual tokens
    temporal_patch_size: int = 2  # Qwen's patch embedding is a 3D conv over 2 frames; a still image is repeated
    # 84x84 stays 84x84 and 168x84 stays 168x84 (sides are rounded to multiples of 28); larger pictures are scaled
    # down to at most 448x448 pixels (256 visual tokens) so a real photo does not swamp the tiny model.
    min_pixels: int = 28 * 28
    max_pixels: int = 448 * 448


TINY = TinySpec()


def chatml_template(image: str, video: str | None = None) -> str:
    """A Qwen2-VL style chat template: `<|im_start|>role\\n...<|im_end|>\\n` per turn, `image` where each image part
    goes. Content may be a string or a list of parts ({"type": "text", "text": ...}, {"type": "image"}). No default
    system prompt: a stage that wants one adds it (ovkit.prompts.with_instruction(..., system=True))."""
    video_branch = "{%- elif part['type'] == 'video' or 'video' in part -%}{{- '" + video + "' -}}" if video else ""
    return (
        "{%- for message in messages -%}"
        "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{%- for part in message['content'] -%}"
        "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}{{- '"
        + image
        + "' -}}"
        + video_branch
        + "{%- elif 'text' in part -%}{{- part['text'] -}}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    )


TINY_CHAT_TEMPLATE = chatml_template(VISION_START + IMAGE_PAD + VISION_END, VISION_START + VIDEO_PAD + VISION_END)


def train_tokenizer(texts: Iterable[str], vocab_size: int = TINY.vocab_size, *, extra_special: Iterable[str] = ()):
    """A byte-level BPE tokenizer trained on `texts` (any byte sequence stays encodable), with Qwen's special
    tokens appended after the learnt vocabulary. Returns a transformers fast tokenizer with pad/eos set."""
    # heavy: tokenizers loads on first use, not at CLI start or in config checks
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    specials = [*SPECIAL_TOKENS, *extra_special]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=IM_END,
        unk_token=None,
        bos_token=None,
        model_max_length=TINY.max_position_embeddings,
        padding_side="left",  # generation pads prompts on the left; training packs and never pads
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD},
    )


def tiny_config(tokenizer, spec: TinySpec = TINY):
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    head_dim = spec.hidden_size // spec.num_heads
    if sum(spec.mrope_section) * 2 != head_dim:
        raise ValueError(f"mrope_section {spec.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(spec.mrope_section),
        },
        bos_token_id=ids[PAD],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD],
    )
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden_size,
        intermediate_size=spec.vision_intermediate_size,
        num_heads=spec.vision_heads,
        patch_size=spec.patch_size,
        spatial_merge_size=spec.spatial_merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        out_hidden_size=spec.hidden_size,
        window_size=spec.patch_size * spec.spatial_merge_size * 4,
        fullatt_block_indexes=[i for i in range(spec.vision_depth) if i % 2 == 1],
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )


def tiny_processor(tokenizer, spec: TinySpec = TINY):
    # heavy: torch, transformers load on first use, not at CLI start or in config checks
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    vision = dict(
        patch_size=spec.patch_size,
        merge_size=spec.spatial_merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
    )
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        video_processor=Qwen2VLVideoProcessor(**vision),
        tokenizer=tokenizer,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def build_tiny(out_dir: Path | str, texts: Iterable[str], *, seed: int = 0, spec: TinySpec = TINY) -> Path:
    """Build the `tiny` preset into `out_dir` (model + processor via save_pretrained); deterministic given `texts`
    and `seed`. Loadable offline with AutoModelForImageTextToText / AutoProcessor (or ovkit.models.load)."""
    # heavy: torch loads on first use, not at CLI start or in config checks
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    texts = list(texts)
    # Every turn starts with its role name and eval/RL prompts carry the stage instructions: weight them as often as
    # they occur in training sequences, so they get merges even though the corpus text lacks them.
    roles = ["user", "assistant"] * max(2, len(texts) // 2)
    fixed = [SYSTEM_PROMPT, ANSWER_PROMPT, THINK_PROMPT] * max(2, len(texts) // 20)
    tokenizer = train_tokenizer([*roles, *fixed, *texts], spec.vocab_size)
    config = tiny_config(tokenizer, spec)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.text_config.eos_token_id,
        pad_token_id=config.text_config.pad_token_id,
        bos_token_id=config.text_config.bos_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tiny_processor(tokenizer, spec).save_pretrained(out_dir)
    return out_dir


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
