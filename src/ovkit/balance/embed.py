"""Assigning concepts to images by embedding similarity: top-K per image, the LLaVA-OneVision-1.5 way.

The embedding path follows the LLaVA-OneVision-1.5 paper and repository: images and a concept vocabulary are embedded by
one CLIP-family encoder, and each image takes its K most similar concepts. The vocabulary can be large (the recipe uses
~500K concepts), so similarities are computed against chunks of the vocabulary and merged into a running top-K: memory
is bounded by batch x chunk, never batch x vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ovkit.errors import OvkitError


def topk_chunked(
    queries: torch.Tensor, keys: torch.Tensor, k: int, chunk: int = 65536
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of `queries @ keys.T` per query row, scanning `keys` in chunks. Returns (scores, indices), both [Q, k],
    sorted by score descending; ties broken by the lower index (deterministic)."""
    k = min(k, keys.shape[0])
    best_s = torch.full((queries.shape[0], 0), float("-inf"), dtype=queries.dtype)
    best_i = torch.zeros((queries.shape[0], 0), dtype=torch.long)
    for start in range(0, keys.shape[0], chunk):
        s = queries @ keys[start : start + chunk].T
        kk = min(k, s.shape[1])
        cs, ci = torch.topk(s, kk, dim=1, sorted=False)
        best_s = torch.cat([best_s, cs], dim=1)
        best_i = torch.cat([best_i, ci + start], dim=1)
        if best_s.shape[1] > k:
            best_s, best_i = _keep_top(best_s, best_i, k)
    return _keep_top(best_s, best_i, k)


def _keep_top(scores: torch.Tensor, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Sort by (score desc, index asc) so the result does not depend on chunk boundaries.
    order = torch.argsort(idx, dim=1, stable=True)
    scores, idx = scores.gather(1, order), idx.gather(1, order)
    order = torch.argsort(-scores, dim=1, stable=True)[:, :k]
    return scores.gather(1, order), idx.gather(1, order)


class Encoder:
    """A CLIP-family dual encoder (CLIP, SigLIP/SigLIP2, MetaCLIP) loaded through transformers from a local
    directory."""

    def __init__(self, path: Path, *, device: str = "cpu", trust_remote_code: bool = False):
        from safetensors import SafetensorError
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        from ovkit.models import locate

        path = locate(path, "--encoder")  # a damaged directory is named before transformers reads it
        try:
            self.model = AutoModel.from_pretrained(path, trust_remote_code=trust_remote_code).to(device).eval()
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, SafetensorError) as e:
            raise OvkitError(f"--encoder {path}: cannot load a CLIP-family encoder ({e})") from None
        if not (hasattr(self.model, "get_image_features") and hasattr(self.model, "get_text_features")):
            raise OvkitError(f"--encoder {path}: {type(self.model).__name__} is not a dual (image/text) encoder")
        self.device = device
        # SigLIP was trained on text padded to a fixed length; CLIP pools at the end-of-text token.
        self.pad = "max_length" if "siglip" in self.model.config.model_type else True

    @torch.inference_mode()
    def embed_texts(self, texts: Sequence[str], batch_size: int = 256) -> torch.Tensor:
        out = []
        for s in range(0, len(texts), batch_size):
            enc = self.tokenizer(
                list(texts[s : s + batch_size]), padding=self.pad, truncation=True, return_tensors="pt"
            )
            enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            out.append(_features(self.model.get_text_features(**enc)).float().cpu())
        return torch.nn.functional.normalize(torch.cat(out), dim=-1)

    @torch.inference_mode()
    def embed_images(self, images: Sequence) -> torch.Tensor:
        pix = self.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        feats = _features(self.model.get_image_features(pixel_values=pix.to(self.device))).float().cpu()
        return torch.nn.functional.normalize(feats, dim=-1)


def _features(out) -> torch.Tensor:
    # transformers 5 returns a model output whose pooler_output is the projected embedding; 4.x returned the tensor.
    return out if isinstance(out, torch.Tensor) else out.pooler_output
