"""A tiny CLIP trained on the synthetic corpus, so the embedded default exercises `balance --method embed` for real.

The recipe embeds images and concepts with a MetaCLIP encoder. No such checkpoint can be downloaded here, so the
`tiny-clip` preset trains a small CLIP (transformers' CLIPModel, standard contrastive loss) on the image/caption
pairs of a sample table. It is saved with save_pretrained, tokenizer and image processor included, and loads like
any CLIP checkpoint, so `balance` has one code path for it and for real encoders.
"""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ovkit.data import read_table
from ovkit.errors import OvkitError


@dataclass
class TinyClipSpec:
    image_size: int = 84
    patch_size: int = 14
    vision_hidden: int = 96
    vision_layers: int = 2
    text_hidden: int = 96
    text_layers: int = 2
    heads: int = 4
    projection_dim: int = 64
    max_text_len: int = 32
    vocab_size: int = 400
    steps: int = 200
    batch_size: int = 64
    lr: float = 1e-3


def _pairs(data: list[Path], max_rows: int = 20000) -> tuple[list[bytes], list[str]]:
    """(first image bytes, caption) for rows with an image and an assistant turn."""
    images, texts = [], []
    for d in data:
        t = read_table(d, columns=["images", "messages"])
        for imgs, msgs in zip(t.column("images").to_pylist(), t.column("messages").to_pylist()):
            answer = next((m["content"] for m in reversed(msgs) if m["role"] == "assistant"), None)
            if imgs and answer:
                images.append(imgs[0]["bytes"])
                texts.append(answer)
            if len(images) >= max_rows:
                break
    if len(images) < 8:
        raise OvkitError(f"--corpus {', '.join(map(str, data))}: need at least 8 image/caption rows to train tiny-clip")
    return images, texts


def _tokenizer(texts: list[str], spec: TinyClipSpec, seed: int):
    # heavy: tokenizers loads on first use, not at CLI start or in config checks
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Not id 2 for end-of-text: CLIPTextTransformer treats eos_token_id == 2 as the legacy "pool at argmax id" case.
    specials = ["<|startoftext|>", "<|endoftext|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sorted(set(texts)), trainer=trainer)
    bos, eos = tok.token_to_id("<|startoftext|>"), tok.token_to_id("<|endoftext|>")
    # CLIP pools the text embedding at the end-of-text token, so every encoding must end with it.
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>", special_tokens=[("<|startoftext|>", bos), ("<|endoftext|>", eos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=spec.max_text_len,
    )


def build_tiny_clip(
    out: Path, data: list[Path], *, seed: int = 0, spec: TinyClipSpec | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Train the tiny CLIP on `data` and save it into `out`. Returns training metrics."""
    # heavy: transformers, PIL load on first use, not at CLI start or in config checks
    from PIL import Image
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    spec = spec or TinyClipSpec()
    torch.manual_seed(seed)
    images, texts = _pairs(data)
    tokenizer = _tokenizer(texts, spec, seed)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=spec.text_hidden * 4,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.heads,
            max_position_embeddings=spec.max_text_len,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            image_size=spec.image_size,
            patch_size=spec.patch_size,
            hidden_size=spec.vision_hidden,
            intermediate_size=spec.vision_hidden * 4,
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.heads,
        ),
        projection_dim=spec.projection_dim,
    )
    model = CLIPModel(config)
    processor = CLIPImageProcessor(
        size={"shortest_edge": spec.image_size},
        crop_size={"height": spec.image_size, "width": spec.image_size},
    )
    pix = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")[
        "pixel_values"
    ]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=spec.max_text_len, return_tensors="pt")
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / spec.steps))
    )
    rng = np.random.default_rng(seed)
    model.train()
    t0, losses = time.time(), []
    for _ in tqdm(range(spec.steps), desc="tiny-clip", disable=quiet):
        b = torch.from_numpy(rng.choice(len(texts), size=min(spec.batch_size, len(texts)), replace=False))
        loss = model(
            input_ids=enc["input_ids"][b],
            attention_mask=enc["attention_mask"][b],
            pixel_values=pix[b],
            return_loss=True,
        ).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    return {
        "preset": "tiny-clip",
        "parameters": params,
        "pairs": len(texts),
        "steps": spec.steps,
        "loss_first": round(float(np.mean(losses[:10])), 4),
        "loss_last": round(float(np.mean(losses[-10:])), 4),
        "chance_loss": round(math.log(min(spec.batch_size, len(texts))), 4),
        "seconds": round(time.time() - t0, 1),
    }
