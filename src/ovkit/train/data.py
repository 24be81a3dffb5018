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
from tqdm import tqdm

from ovkit.data.io import read_samples
from ovkit.errors import OvkitError
from ovkit.models import precompute
from ovkit.models.encode import Encoded, decode_images, encode_sample
from ovkit.pack import PackedDataset
from ovkit.pack.batches import collate_padded, host_inputs, stack_packs
from ovkit.pack.packed import PackLayout

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


def encode_row(processor, samples: Any, i: int) -> Encoded:
    """Row `i` of a read sample table (ovkit.data.io.Samples) encoded as `ovkit sft` trains it: the loss on the last
    assistant turn. A row the processor cannot encode is an error naming the file, row id and column."""
    column = "images"
    try:
        images = decode_images(samples.table.column("images")[i].as_py())
        column = "messages"
        return encode_sample(processor, samples.table.column("messages")[i].as_py(), images)
    except OvkitError as e:
        raise OvkitError(f"{samples.where(i, column)}: {e}") from None
    except Exception as e:  # noqa: BLE001 -- the processor raises many types for a row it cannot encode (pack rejects those)
        raise OvkitError(
            f"{samples.where(i, column)}: the processor cannot encode this row ({type(e).__name__}: "
            f"{' '.join(str(e).split())})"
        ) from None


class SampleSource:
    """Rows of one or more sample tables, read as one and encoded one by one (`encode_sample`: loss on the last
    assistant turn)."""

    kind = "padded"

    def __init__(self, data: Path | Sequence[Path], processor, *, max_len: int, quiet: bool = True, model: Any = None):

        paths = [Path(data)] if isinstance(data, (str, Path)) else [Path(p) for p in data]
        # images="header": the encoding pass below decodes every picture before the first step, and names a bad one
        samples = [read_samples(p, images="header") for p in paths]
        self.origin = [(s, i) for s in samples for i in range(s.table.num_rows)]  # where each row came from, for errors
        self.processor = processor
        # the model (or its config), for the inputs computed on the host (ovkit.models.precompute); None: none
        self.layout = PackLayout.for_model(model) if model is not None else None
        self.memo = Memo(self._encode)
        lengths, keep, self.skipped = [], [], 0
        rows = range(len(self.origin))
        if not quiet:
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
        samples, i = self.origin[row]
        return encode_row(self.processor, samples, i)

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

        self.dataset = PackedDataset(plan, data, processor, model)
        self.memo = Memo(self._pack)
        self.lengths = [int(n) for n in self.dataset.lengths]
        self.skipped = 0
        if self.lengths and max(self.lengths) > max_len:
            raise OvkitError(
                f"--plan {plan} has packs of {max(self.lengths)} tokens, above --max-len {max_len}; re-pack with a "
                f"smaller --max-len or raise it"
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
            batch.update(precompute.varlen_boundaries(text, layout.config))
            return host_inputs(batch, layout)
        return host_inputs(stack_packs(items, layout, pad_id), layout)


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
