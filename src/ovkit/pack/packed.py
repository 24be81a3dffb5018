"""Packed training rows from a plan: several samples in one row, each seeing only itself.

A packed row is the concatenation of its samples' encodings (`ovkit.models.encode.encode_sample`):
- `input_ids`, `labels` (1, T): labels are -100 outside each sample's last assistant turn, and at each sample's
  first token (in a packed row it would be predicted from the previous sample's last token);
- `position_ids`: positions restart at 0 for every sample. For the Qwen-VL family (models with `get_rope_index`)
  each sample's 3D rope index is computed by the model's own `get_rope_index` on that sample alone and the results
  are concatenated, so text after an image continues from the image's rope offset exactly as it would unpacked.
  The shape is then (4, 1, T): row 0 the plain per-sample text positions, rows 1-3 the (t, h, w) rope positions --
  the layout transformers' Qwen-VL text model reads as "packed" (it builds per-sample masks and flash-attention
  varlen boundaries from row 0). Other models get (1, T);
- multimodal tensors concatenated in sample order (`pixel_values`, `image_grid_thw`, ...). The Qwen2.5-VL vision
  tower takes its attention boundaries from `image_grid_thw`, one block per image, so images never attend to each
  other whichever sample they come from (checked in tests/test_pack_packed.py);
- `attention_mask` (1, 1, T, T), block-diagonal causal: bool for sdpa, additive float (0 / finfo.min) for eager.
  With flash-attention (and other kernels) no mask is passed: transformers derives the varlen `cu_seqlens` from
  the restarting `position_ids`;
- per-token processor outputs (`mm_token_type_ids`) concatenated.

Text `cu_seqlens` are not an input key on purpose: transformers 5's Qwen-VL vision tower pops a `cu_seqlens`
keyword from the forward kwargs and would use it as the *vision* boundaries. `cu_seqlens(item)` computes them.

API for training (stable):

    ds = PackedDataset(plan_dir, data_dir, processor, model_or_config)   # one item per pack
    item = ds[i]                        # dict of tensors, batch dim 1
    loss = model(**item).loss           # token-weighted mean over every sample's target tokens
    ds.info(i)                          # {"samples", "tokens", "capacity", "padding_ratio", "ids"}, no encoding
    ds.lengths, ds.capacity             # tokens of every pack (numpy), the plan's --max-len
    packed_row_stats(item, capacity)    # samples, tokens, label_tokens, padding_ratio of any item or batch
    DataLoader(ds, batch_size=1, collate_fn=ds.collate)  # batch_size > 1 concatenates packs into one row
"""

from __future__ import annotations

import collections
import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ovkit.errors import OvkitError, where
from ovkit.models.attention import text_implementation

IGNORE = -100
PER_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
# Processors that put a batch dimension in front of the images (pixel_values (1, n_images, ...)): concatenated
# along dim 1. Every other multimodal tensor is per image / per patch and is concatenated along dim 0.
MM_BATCH_FIRST = frozenset({"idefics2", "idefics3", "smolvlm"})


@dataclass
class PackLayout:
    """How a model wants a packed row: its attention mode, its rope index, its multimodal layout."""

    attention: str  # "sdpa" (bool 4D mask) | "eager" (float 4D mask) | "positions" (no mask, packed position_ids)
    config: Any = None
    has_rope_index: bool = False
    mm_dim: int = 0
    _rope_module: Any = None

    @classmethod
    def for_model(cls, model_or_config, attention: str | None = None) -> PackLayout:
        config = getattr(model_or_config, "config", model_or_config)
        if attention is None:
            impl = text_implementation(config) or "sdpa"
            attention = impl if impl in ("sdpa", "eager") else "positions"
        if attention not in ("sdpa", "eager", "positions"):
            raise OvkitError(f"attention must be sdpa, eager or positions, got {attention!r}")
        layout = cls(attention, config, mm_dim=1 if getattr(config, "model_type", "") in MM_BATCH_FIRST else 0)
        layout.has_rope_index = layout.rope_module() is not None
        return layout

    def rope_module(self):
        """The model's base module with `get_rope_index`, built on the meta device (no weights: the rope index
        depends only on the config), once per process."""
        if self._rope_module is None:
            # heavy: transformers loads on first use, not at CLI start or in config checks
            from transformers import AutoModel

            try:
                cls = AutoModel._model_mapping[type(self.config)]
            except KeyError:  # not a transformers architecture ovkit can look up: no rope index to honour
                cls = None
            if cls is None or not hasattr(cls, "get_rope_index"):
                self._rope_module = False
            else:  # eager: building must not depend on kernels (flash-attention) this machine may lack
                config = copy.deepcopy(self.config)
                with torch.device("meta"):
                    self._rope_module = cls._from_config(config, attn_implementation="eager")
        return self._rope_module or None

    def __getstate__(self):  # DataLoader workers rebuild the meta module themselves
        return {**self.__dict__, "_rope_module": None}

    def sample_positions(self, enc) -> torch.Tensor:
        """(3, n) rope positions of one sample computed on the sample alone (Qwen-VL family)."""
        ids = torch.tensor([enc.input_ids])
        if "mm_token_type_ids" in enc.per_token:
            types = torch.tensor([enc.per_token["mm_token_type_ids"]])
        else:  # what Qwen-VL processors return: 1 on image tokens, 2 on video tokens
            types = torch.zeros_like(ids)
            for value, name in ((1, "image_token_id"), (2, "video_token_id")):
                tid = getattr(self.config, name, None)
                if tid is not None:
                    types[ids == tid] = value
        grids = {k: enc.mm[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in enc.mm}
        with torch.no_grad():
            positions, _ = self.rope_module().get_rope_index(ids, mm_token_type_ids=types, **grids)
        return positions[:, 0, :].to(torch.long)


def pack_encoded(samples: Sequence[Any], layout: PackLayout) -> dict[str, torch.Tensor]:
    """One packed row (batch dim 1) from encoded samples (`ovkit.models.encode.Encoded`), in order."""
    if not samples:
        raise ValueError("a pack needs at least one sample")
    lengths = [s.length for s in samples]
    input_ids = torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.long)
    labels = torch.tensor([t for s in samples for t in s.labels], dtype=torch.long)
    labels[torch.tensor(np.cumsum([0, *lengths[:-1]]))] = IGNORE  # a sample's first token is never a target
    restarts = torch.cat([torch.arange(n) for n in lengths])  # per-sample text positions
    item: dict[str, torch.Tensor] = {"input_ids": input_ids[None], "labels": labels[None]}
    if layout.has_rope_index:
        rope = torch.cat([layout.sample_positions(s) for s in samples], dim=1)
        item["position_ids"] = torch.cat([restarts[None], rope])[:, None, :]
    else:
        item["position_ids"] = restarts[None]
    for key in PER_TOKEN_KEYS:
        if any(key in s.per_token for s in samples):
            if not all(key in s.per_token for s in samples):
                raise OvkitError(f"some samples of a pack have '{key}' and some do not")
            item[key] = torch.tensor([t for s in samples for t in s.per_token[key]], dtype=torch.long)[None]
    for key in sorted({k for s in samples for k in s.mm}):
        parts = [s.mm[key] for s in samples if key in s.mm]
        item[key] = torch.cat(parts, dim=layout.mm_dim) if isinstance(parts[0], torch.Tensor) else parts
    mask = attention_mask(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), layout)
    if mask is not None:
        item["attention_mask"] = mask
    return item


def attention_mask(segments: torch.Tensor, layout: PackLayout) -> torch.Tensor | None:
    """Block-diagonal causal mask (1, 1, T, T) from each token's sample index; None where the kernel takes
    packed position_ids instead."""
    if layout.attention == "positions":
        return None
    t = segments.numel()
    allowed = (segments[:, None] == segments[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    if layout.attention == "sdpa":
        return allowed[None, None]
    # eager adds the mask to the scores; float32 promotes lower-precision scores, min keeps softmax finite
    return torch.zeros(1, 1, t, t).masked_fill(~allowed[None, None], torch.finfo(torch.float32).min)


def text_positions(item: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-sample text positions (T,) of a packed row: row 0 of Qwen-VL's (4, 1, T), else (1, T)."""
    pos = item["position_ids"]
    return pos[0, 0] if pos.ndim == 3 else pos[0]


def segment_ids(item: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each token's sample index within the row (a sample starts where its position is 0)."""
    return torch.cumsum((text_positions(item) == 0).long(), 0) - 1


def cu_seqlens(item: dict[str, torch.Tensor]) -> torch.Tensor:
    """Cumulative sample lengths [0, n1, n1+n2, ..., T] (int32), the flash-attention varlen boundaries."""
    pos = text_positions(item)
    starts = torch.nonzero(pos == 0).flatten()
    return torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)


def packed_row_stats(item: dict[str, torch.Tensor], capacity: int | None = None) -> dict[str, Any]:
    """Samples, tokens, target tokens and (given the pack capacity) the share of the capacity left empty."""
    tokens = int(item["input_ids"].numel())
    out = {
        "samples": int((text_positions(item) == 0).sum()),
        "tokens": tokens,
        "label_tokens": int((item["labels"] != IGNORE).sum()),
    }
    if capacity:
        out["capacity"] = capacity
        out["padding_ratio"] = max(0.0, 1 - tokens / capacity)
    return out


def collate_packed(items: Sequence[dict[str, torch.Tensor]], *, mm_dim: int = 0) -> dict[str, torch.Tensor]:
    """Batch packed rows: one item is returned as is; several are concatenated into one longer row (their samples
    stay independent), which is what varlen attention wants and needs no padding. `mm_dim`: the image dimension
    of multimodal tensors (`PackLayout.mm_dim`; `PackedDataset.collate` passes it)."""
    if len(items) == 1:
        return items[0]
    first = items[0]
    out: dict[str, torch.Tensor] = {}
    for key in first:
        if key == "attention_mask":
            continue
        values = [it[key] for it in items]
        if key in ("input_ids", "labels", *PER_TOKEN_KEYS):
            out[key] = torch.cat(values, dim=1)
        elif key == "position_ids":
            out[key] = torch.cat(values, dim=-1)
        else:
            out[key] = torch.cat(values, dim=mm_dim)
    if "attention_mask" in first:
        mask = first["attention_mask"]
        layout = PackLayout("sdpa" if mask.dtype == torch.bool else "eager")
        out["attention_mask"] = attention_mask(segment_ids(out), layout)
    return out


# --- the dataset ---------------------------------------------------------------------------------------------------


class _Rows:
    """Random access to a dataset's rows by global row index, reading one parquet row group at a time (a small
    LRU cache of row groups; packs gather rows from anywhere in the input)."""

    def __init__(self, data: Path | str, columns=("id", "messages", "images"), cache_groups: int = 8):
        # heavy: pyarrow loads on first use, not at CLI start or in config checks
        import pyarrow.parquet as pq

        from ovkit.data import parquet_files

        self.path = data
        self.columns = list(columns)
        self.groups: list[tuple[Path, int]] = []
        starts = []
        offset = 0
        for f in parquet_files(data):
            meta = pq.ParquetFile(f).metadata
            for g in range(meta.num_row_groups):
                starts.append(offset)
                self.groups.append((f, g))
                offset += meta.row_group(g).num_rows
        self.starts = np.array(starts, dtype=np.int64)
        self.n_rows = offset
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.cache_groups = cache_groups

    def __getitem__(self, row: int) -> dict[str, Any]:
        if not 0 <= row < self.n_rows:
            raise OvkitError(
                f"the plan refers to row {row} but the dataset has {self.n_rows} rows; was it packed from this data?"
            )
        g = int(np.searchsorted(self.starts, row, side="right")) - 1
        key = (os.getpid(), g)
        table = self.cache.get(key)
        if table is None:
            # heavy: pyarrow loads on first use, not at CLI start or in config checks
            import pyarrow.parquet as pq

            f, i = self.groups[g]
            table = pq.ParquetFile(f).read_row_group(i, columns=self.columns).to_pylist()
            self.cache[key] = table
            if len(self.cache) > self.cache_groups:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return table[row - int(self.starts[g])]


class PackedDataset(torch.utils.data.Dataset):
    """The packs of a plan (`ovkit pack` output, all --shard parts) as training rows; see the module docstring.

    `data`: the dataset the plan was made from. `processor`: the model's processor (the plan's lengths were
    measured with it; a sample whose length differs is an error, not a silent overflow). `model`: the model or its
    config (for the attention implementation and the rope index). `attention`: override "sdpa" | "eager" |
    "positions" (default: from the model's `_attn_implementation`; flash-attention and other kernels get
    "positions")."""

    def __init__(self, plan_dir: Path | str, data: Path | str, processor, model, *, attention: str | None = None):
        # heavy: pyarrow loads on first use, not at CLI start or in config checks
        from ovkit.pack.plan import read_plan

        plan, self.capacity = read_plan(plan_dir)
        self.ids = plan.column("id").to_pylist()
        self.rows = plan.column("row").to_numpy()
        self.sample_lengths = plan.column("length").to_numpy().astype(np.int64)
        key = plan.column("shard").to_numpy().astype(np.int64) << 40 | plan.column("pack").to_numpy()
        bounds = np.flatnonzero(np.diff(key)) + 1 if key.size else np.zeros(0, np.int64)
        self.bounds = np.concatenate([[0], bounds, [key.size]]).astype(np.int64) if key.size else np.zeros(1, np.int64)
        # tokens in each pack (what a length-aware sampler or a token budget wants), without encoding anything
        self.lengths = np.add.reduceat(self.sample_lengths, self.bounds[:-1]) if key.size else np.zeros(0, np.int64)
        self.data = _Rows(data)
        self.processor = processor
        self.layout = PackLayout.for_model(model, attention)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def members(self, i: int) -> range:
        """Plan row indices of pack i."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        return range(int(self.bounds[i]), int(self.bounds[i + 1]))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # heavy: pyarrow loads on first use, not at CLI start or in config checks
        from ovkit.models.encode import decode_images, encode_sample

        encoded = []
        for j in self.members(i):
            row = self.data[int(self.rows[j])]
            if row["id"] != self.ids[j]:
                raise OvkitError(
                    f"plan row {j}: id {self.ids[j]!r} is {row['id']!r} in the data; the plan was made from other data"
                )
            try:
                images = decode_images(row["images"])
            except OvkitError as e:  # the plan's pack pass decoded it; the data changed since
                raise OvkitError(
                    f"{where(self.data.path, f'{self.ids[j]!r} (index {int(self.rows[j])})', 'images')}: {e}"
                ) from None
            enc = encode_sample(self.processor, row["messages"], images)
            if enc.length != int(self.sample_lengths[j]):
                raise OvkitError(
                    f"sample {self.ids[j]!r} encodes to {enc.length} tokens but the plan says "
                    f"{int(self.sample_lengths[j])}: "
                    "the plan was measured with another processor; re-run `ovkit pack` with this model"
                )
            encoded.append(enc)
        return pack_encoded(encoded, self.layout)

    def collate(self, items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`collate_packed` with this model's multimodal layout (use as the DataLoader's collate_fn)."""
        return collate_packed(items, mm_dim=self.layout.mm_dim)

    def info(self, i: int) -> dict[str, Any]:
        """Logging numbers of pack i without encoding it."""
        m = self.members(i)
        tokens = int(self.lengths[i])
        return {
            "samples": len(m),
            "tokens": tokens,
            "capacity": self.capacity,
            "padding_ratio": 1 - tokens / self.capacity,
            "ids": self.ids[m.start : m.stop],
        }
