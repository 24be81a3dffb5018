"""A micro-batch from encoded samples or packed rows: right-padded samples (`collate_padded`), packs as the rows of
one batch (`stack_packs`), and the host-side counts the loss and the logs read (`target_tokens`, `real_tokens`).

The training loop (ovkit.train.data) and the held-out loss while training (ovkit.evaluate.during) batch through the
same functions, so both live here, below both of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ovkit.models import precompute
from ovkit.models.encode import IGNORE, PER_TOKEN_KEYS, Encoded
from ovkit.pack.packed import attention_mask, segment_ids


def stack_packs(items: Sequence[dict[str, Any]], layout, pad_id: int) -> dict[str, Any]:
    """Packs as the rows of one batch (B, T), right-padded to the longest, each with its block-diagonal mask.

    With a dense mask (sdpa/eager, e.g. on CPU) attention costs T^2 per row, so B rows of one pack each cost B x
    capacity^2 where `collate_packed`'s single concatenated row would cost (B x capacity)^2. Padding becomes its own
    segment (positions restarting at 0, labels IGNORE), so no row attends to it and it attends only to itself."""
    width = max(int(it["input_ids"].shape[1]) for it in items)
    rows: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": []}
    per_token = [k for k in PER_TOKEN_KEYS if k in items[0]]
    masks, n_real = [], 0
    for it in items:
        n = int(it["input_ids"].shape[1])
        pad = width - n
        n_real += n
        rows["input_ids"].append(F.pad(it["input_ids"], (0, pad), value=pad_id))
        rows["labels"].append(F.pad(it["labels"], (0, pad), value=IGNORE))
        pos = it["position_ids"]
        rows["position_ids"].append(torch.cat([pos, torch.arange(pad).expand(*pos.shape[:-1], pad)], dim=-1))
        for k in per_token:
            rows.setdefault(k, []).append(F.pad(it[k], (0, pad), value=0))
        seg = segment_ids(it)
        seg = torch.cat([seg, torch.full((pad,), int(seg.max()) + 1 if n else 0)])
        masks.append(attention_mask(seg, layout))
    batch: dict[str, Any] = {k: torch.cat(v, dim=-2 if k == "position_ids" else 0) for k, v in rows.items()}
    for key in items[0]:
        if key not in batch and key != "attention_mask":
            batch[key] = torch.cat([it[key] for it in items], dim=layout.mm_dim)
    if masks[0] is not None:
        batch["attention_mask"] = torch.cat(masks, dim=0)
    batch["num_tokens"] = n_real
    return batch


def collate_padded(items: Sequence[Encoded], pad_id: int, layout: Any = None) -> dict[str, Any]:
    """Right-padded batch: input_ids/attention_mask/labels (IGNORE on padding) and per-token keys padded with 0;
    multimodal tensors concatenated along dim 0 in sample order (the layout every HF VLM processor uses for a
    batch: Qwen's flattened patches + image_grid_thw, LLaVA's per-image pixel_values). With the model's `layout`
    (ovkit.pack.PackLayout), what the forward would compute from ids and grids is computed here, on the host
    (ovkit.models.precompute)."""
    width = max(e.length for e in items)
    n = len(items)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    per_token = {k: torch.zeros((n, width), dtype=torch.long) for k in items[0].per_token}
    for r, e in enumerate(items):
        input_ids[r, : e.length] = torch.tensor(e.input_ids)
        labels[r, : e.length] = torch.tensor(e.labels)
        attention[r, : e.length] = 1
        for k, v in e.per_token.items():
            per_token[k][r, : e.length] = torch.tensor(v)
    batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention, "labels": labels, **per_token}
    if all(e.length == width for e in items):
        del batch["attention_mask"]  # no padding: plain causal attention, and no mask for the kernel to inspect
    batch["num_tokens"] = sum(e.length for e in items)
    for key in {k for e in items for k in e.mm}:
        parts = [e.mm[key] for e in items if key in e.mm]
        batch[key] = torch.cat(parts, dim=0)
    if layout is not None and layout.has_rope_index:
        batch["position_ids"] = precompute.padded_positions([layout.sample_positions(e) for e in items], width)
    return host_inputs(batch, layout)


def host_inputs(batch: dict[str, Any], layout: Any) -> dict[str, Any]:
    """The loss's target positions and counts, and the vision tower's layout, as host values (no device syncs)."""
    index = precompute.target_index(batch["labels"])
    batch["target_index"], batch["num_targets"] = index, int(index.numel())
    if layout is not None:
        vision = precompute.vision_inputs(layout.config, batch.get("image_grid_thw"), batch["input_ids"])
        precompute.with_plans(batch, vision.pop(precompute.PLANS, {}))  # beside a packed row's own
        batch.update(vision)
    return batch


def target_tokens(batch: dict[str, Any]) -> int:
    """Tokens that carry a loss in a batch (labels shifted by one, as the loss sees them)."""
    return int(batch["num_targets"])  # counted on the host by the collate (host_inputs)


def real_tokens(batch: dict[str, Any]) -> int:
    """Tokens that are not padding (both collates record them under `num_tokens`)."""
    return int(batch["num_tokens"])
