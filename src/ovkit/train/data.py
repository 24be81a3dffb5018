"""What the training loop eats: micro-batches of padded samples or of packed rows, in a deterministic order.

Order. The samples of every optimiser step are fixed by the *global* batch size (batch size x accumulation x
processes), the seed and the epoch, never by how a step is split: the epoch's samples are shuffled, cut into chunks
of 64 global batches, each chunk sorted by length (bucketing: similar lengths share a batch, so little padding) and
cut into global batches, whose order is shuffled again. A global batch is then sorted by length and cut into
micro-batches, dealt round-robin to the processes. Hence batch 1 x accumulation 4 sees the same samples per step as
batch 4 x accumulation 1, two processes see the same steps as one, and a resumed run rebuilds the exact order from
(seed, step) alone -- the data position is the step counter.

Encoding a sample (chat template + image processor) costs ~10 ms, a third of what a training step spends on it for
the tiny model, so encoded samples (and packs) are memoised in memory up to a byte budget; beyond it they are
encoded again when next needed.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ovkit.errors import OvkitError
from ovkit.models import precompute
from ovkit.models.encode import IGNORE, PER_TOKEN_KEYS, Encoded, decode_images, encode_sample

CHUNK_BATCHES = 64  # length-bucketing window, in global batches
CACHE_BYTES = 4 << 30  # memoised encodings; the tiny corpus fits many times over


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return 8 * len(obj) if obj and not isinstance(obj[0], (torch.Tensor, dict)) else sum(_nbytes(v) for v in obj)
    return 64


class Memo:
    """Items of `fetch(i)` kept in memory until `budget` bytes are used."""

    def __init__(self, fetch, budget: int = CACHE_BYTES):
        self.fetch, self.budget, self.used = fetch, budget, 0
        self.items: dict[int, Any] = {}

    def __call__(self, i: int) -> Any:
        item = self.items.get(i)
        if item is None:
            item = self.fetch(i)
            size = self._size(item)
            if self.used + size <= self.budget:
                self.items[i] = item
                self.used += size
        return item

    def drop(self, i: int) -> None:
        if i in self.items:
            self.used -= self._size(self.items.pop(i))

    @staticmethod
    def _size(item: Any) -> int:
        return _nbytes(item.__dict__ if isinstance(item, Encoded) else item)


class SampleSource:
    """Rows of one or more sample tables, read as one and encoded one by one (`encode_sample`: loss on the last
    assistant turn)."""

    kind = "padded"

    def __init__(self, data: Path | Sequence[Path], processor, *, max_len: int, quiet: bool = True, model: Any = None):
        import pyarrow as pa

        from ovkit.data.io import read_samples
        from ovkit.pack.packed import PackLayout

        paths = [Path(data)] if isinstance(data, (str, Path)) else [Path(p) for p in data]
        # images="header": the encoding pass below decodes every picture before the first step, and names a bad one
        samples = [read_samples(p, images="header") for p in paths]
        table = pa.concat_tables(
            [s.table.select(["id", "messages", "images"]) for s in samples], promote_options="default"
        )
        self.origin = [(s, i) for s in samples for i in range(s.table.num_rows)]  # where each row came from, for errors
        self.processor = processor
        # the model (or its config), for the inputs computed on the host (ovkit.models.precompute); None: none
        self.layout = PackLayout.for_model(model) if model is not None else None
        self._messages = table.column("messages")
        self._images = table.column("images")
        self._ids = table.column("id")
        self.memo = Memo(self._encode)
        lengths, keep, self.skipped = [], [], 0
        rows = range(table.num_rows)
        if not quiet:
            from tqdm import tqdm

            rows = tqdm(rows, desc="encode", file=sys.stderr, leave=False)
        for i in rows:  # one pass to learn lengths (bucketing needs them); the memo keeps the encodings
            n = self.memo(i).length
            if n > max_len:
                self.skipped += 1
                self.memo.drop(i)
                continue
            keep.append(i)
            lengths.append(n)
        self.rows, self.lengths = keep, lengths

    def _encode(self, row: int) -> Encoded:
        column = "images"
        try:
            images = decode_images(self._images[row].as_py())
            column = "messages"
            return encode_sample(self.processor, self._messages[row].as_py(), images)
        except OvkitError as e:
            samples, i = self.origin[row]
            raise OvkitError(f"{samples.where(i, column)}: {e}") from None
        except Exception as e:  # noqa: BLE001 -- the processor raises many types for a row it cannot encode (pack rejects those)
            samples, i = self.origin[row]
            raise OvkitError(
                f"{samples.where(i, column)}: the processor cannot encode this row ({type(e).__name__}: {' '.join(str(e).split())})"
            ) from None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Encoded:
        return self.memo(self.rows[i])

    def collate(self, items: Sequence[Encoded], pad_id: int) -> dict[str, Any]:
        return collate_padded(items, pad_id, self.layout)


class PackedSource:
    """Packed rows of a pack plan (ovkit.pack.PackedDataset): one item = one pack, attention kept per sample.
    Packs are memoised without their (T x T) attention mask, which is rebuilt per micro-batch."""

    kind = "packed"

    def __init__(self, plan: Path, data: Path, processor, model, *, max_len: int):
        from ovkit.pack import PackedDataset

        self.dataset = PackedDataset(plan, data, processor, model)
        self.memo = Memo(self._pack)
        self.lengths = [int(n) for n in self.dataset.lengths]
        self.skipped = 0
        if self.lengths and max(self.lengths) > max_len:
            raise OvkitError(
                f"--plan {plan} has packs of {max(self.lengths)} tokens, above --max-len {max_len}; re-pack with a smaller --max-len or raise it"
            )

    def _pack(self, i: int) -> dict[str, Any]:
        item = dict(self.dataset[i])
        item.pop("attention_mask", None)
        return item

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.memo(i)

    def collate(self, items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, Any]:
        layout = self.dataset.layout
        if layout.attention == "positions":  # varlen kernels: one long row, boundaries from the positions
            batch = dict(self.dataset.collate(items))
            batch["num_tokens"] = batch["input_ids"].numel()
            text = batch["position_ids"][0] if batch["position_ids"].ndim == 3 else batch["position_ids"]
            batch.update(precompute.varlen_boundaries(text))
            return _host_inputs(batch, layout)
        return _host_inputs(stack_packs(items, layout, pad_id), layout)


def stack_packs(items: Sequence[dict[str, Any]], layout, pad_id: int) -> dict[str, Any]:
    """Packs as the rows of one batch (B, T), right-padded to the longest, each with its block-diagonal mask.

    With a dense mask (sdpa/eager, e.g. on CPU) attention costs T^2 per row, so B rows of one pack each cost B x
    capacity^2 where `collate_packed`'s single concatenated row would cost (B x capacity)^2. Padding becomes its own
    segment (positions restarting at 0, labels IGNORE), so no row attends to it and it attends only to itself."""
    from ovkit.pack.packed import attention_mask, segment_ids

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
    return _host_inputs(batch, layout)


def _host_inputs(batch: dict[str, Any], layout: Any) -> dict[str, Any]:
    """The loss's target positions and counts, and the vision tower's layout, as host values (no device syncs)."""
    index = precompute.target_index(batch["labels"])
    batch["target_index"], batch["num_targets"] = index, int(index.numel())
    if layout is not None:
        batch.update(precompute.vision_inputs(layout.config, batch.get("image_grid_thw"), batch["input_ids"]))
    return batch


@dataclass(frozen=True)
class Schedule:
    """Which items every micro-batch of every step holds. `steps_per_epoch` full global batches per epoch (the
    remainder of an epoch is dropped: every step has the same number of samples)."""

    lengths: tuple[int, ...]
    batch_size: int
    grad_accum: int
    processes: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.processes

    @property
    def steps_per_epoch(self) -> int:
        return len(self.lengths) // self.global_batch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of one epoch, length-bucketed, in training order."""
        g = self.global_batch
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        order = order[: self.steps_per_epoch * g]
        batches = []
        for c in range(0, len(order), g * CHUNK_BATCHES):
            chunk = sorted(order[c : c + g * CHUNK_BATCHES], key=lambda i: self.lengths[i])
            batches += [chunk[b : b + g] for b in range(0, len(chunk), g)]
        rng.shuffle(batches)
        return batches

    def micro_batches(self, step_batch: list[int], rank: int) -> list[list[int]]:
        """This process's `grad_accum` micro-batches of one global batch (sorted by length, dealt round-robin)."""
        ordered = sorted(step_batch, key=lambda i: (self.lengths[i], i))
        micro = [
            ordered[m * self.batch_size : (m + 1) * self.batch_size] for m in range(self.grad_accum * self.processes)
        ]
        return micro[rank :: self.processes]

    def steps(self, start_step: int, total_steps: int, rank: int):
        """Yield (step, epoch, micro-batches) for steps start_step+1 .. total_steps (1-based step numbers)."""
        spe = self.steps_per_epoch
        step = start_step
        while step < total_steps:
            epoch = step // spe
            batches = self.epoch_batches(epoch)
            for b in batches[step - epoch * spe :]:
                if step >= total_steps:
                    return
                step += 1
                yield step, epoch, self.micro_batches(b, rank)


def total_steps(max_steps: int | None, epochs: float | None, steps_per_epoch: int) -> int:
    if max_steps is not None:
        return max_steps
    return max(1, math.ceil((epochs or 1.0) * steps_per_epoch))


def target_tokens(batch: dict[str, Any]) -> int:
    """Tokens that carry a loss in a batch (labels shifted by one, as the loss sees them)."""
    return int(batch["num_targets"])  # counted on the host by the collate (_host_inputs)


def real_tokens(batch: dict[str, Any]) -> int:
    """Tokens that are not padding (both collates record them under `num_tokens`)."""
    return int(batch["num_tokens"])
