"""The learner's log-probs of saved rollouts: one teacher-forced forward pass over `prompt_ids + response_ids`.

Token-in/token-out: the learner reads exactly the token ids the sampler produced (image placeholders already
expanded in `prompt_ids`), never re-tokenised text. What the tokens alone do not carry is the pixels: they come
from the rollout's `images` column (eval `--save-logprobs` and rl-curate store them) or, for rollout tables without
it (rl-train `--save-rollouts`), from the prompt row with the same id in `--data`. The images are downscaled with
the same `--max-pixels` rule as rl-curate / rl-train and run through the model's processor, whose per-token outputs
(Qwen-VL's `mm_token_type_ids`, which drive its 3D RoPE) are mapped onto the stored ids by token value. The number
of image placeholders in the ids must equal what the processor makes of the images; if it does not, the images
(or the pixel cap) differ from the sampler's and the report would compare different inputs, so it stops.

The forward pass is rl-train's own (`ovkit.rollouts.trajectories.forward_all`: logits / temperature in fp32, no top-p),
so the
numbers are the ones rl-train's corrections would see. Like rl-train, a response is compared only up to a
multimodal placeholder token the sampler emitted (the learner would look for image features behind it).

Multi-turn rollouts: tokens with loss_mask 0 (observations, later user turns) are read as context, not compared;
each compared token belongs to an assistant turn, taken from an optional per-token `turn_ids` column (list<int32>,
0 = first turn) or else counted from the loss mask (every run of loss_mask-1 tokens is one assistant turn). Images
of later turns are the rollout's `images` after the prompt's, in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.models import pad_token_id
from ovkit.models.encode import placeholder_token_id
from ovkit.rollouts.prompts import cap_pixels

TURN_COLUMN = "turn_ids"
WINDOW_BATCHES = 8  # learner batches whose rows (and images) are prepared together


@dataclass
class Rescored:
    """The learner's view of N rollouts, per rollout aligned with `response_ids`."""

    learner: list[list[float]] = field(default_factory=list)  # learner log-prob (0.0 where not compared)
    compared: list[list[int]] = field(default_factory=list)  # 1: sampled (loss_mask 1) and re-read by the learner
    turns: list[list[int]] = field(default_factory=list)  # assistant turn of each token (0 = first)
    cut_tokens: int = 0  # sampled tokens at/after a multimodal placeholder the sampler emitted (not compared)


def turn_ids(loss_mask: Sequence[int], explicit: Sequence[int] | None = None) -> list[int]:
    """Each response token's assistant turn: `explicit` if the rollout has a turn column, else the index of the run
    of loss_mask-1 tokens it is in (observation tokens get the turn before them)."""
    if explicit is not None:
        if len(explicit) != len(loss_mask):
            raise OvkitError(f"column {TURN_COLUMN!r}: {len(explicit)} values for {len(loss_mask)} response tokens")
        return [int(t) for t in explicit]
    out, turn, previous = [], -1, 0
    for m in loss_mask:
        if m and not previous:
            turn += 1
        out.append(max(turn, 0))
        previous = m
    return out


@dataclass
class ImageInputs:
    """What the processor makes of a rollout's images: per-image tensors, and per-token values by token id."""

    mm: dict[str, Any]
    token_values: dict[str, dict[int, int]]  # e.g. {"mm_token_type_ids": {image_pad_id: 1}}
    placeholders: int  # image placeholder tokens the images expand to


class ImageEncoder:
    """Runs the processor on a rollout's images (the last result is kept: a group's rollouts share a prompt)."""

    def __init__(self, processor: Any, max_pixels: int | None):
        self.processor = processor
        self.max_pixels = max_pixels
        self.image_id = placeholder_token_id(processor)
        self._last: tuple[Any, ImageInputs] | None = None

    def __call__(self, key: Any, cells: Sequence[dict[str, Any]]) -> ImageInputs:
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        # heavy: pyarrow loads on first use, not at CLI start or in config checks
        from ovkit.data.schema import IMAGE_TOKEN
        from ovkit.models.encode import decode_images, encode_prompt

        images = [cap_pixels(im, self.max_pixels) for im in decode_images(cells)]
        if not images:
            found = ImageInputs({}, {}, 0)
        else:
            enc = encode_prompt(self.processor, [{"role": "user", "content": IMAGE_TOKEN * len(images)}], images)
            values = {k: {t: int(v) for t, v in zip(enc.input_ids, vals) if v} for k, vals in enc.per_token.items()}
            count = sum(1 for t in enc.input_ids if t == self.image_id)
            found = ImageInputs(dict(enc.mm), values, count)
        self._last = (key, found)
        return found


def data_images(data: Path | None) -> Callable[[str], list | None] | None:
    """prompt id -> the `images` cells of that row of `data` (for rollout tables without an images column)."""
    if data is None:
        return None
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    from ovkit.data.io import read_samples

    table = read_samples(data).table  # checked like every sample table: a bad picture is named here, not mid-report
    cells = dict(zip(map(str, table.column("id").to_pylist()), table.column("images").to_pylist()))
    return cells.get


@dataclass
class _Row:
    index: int
    ids: list[int]  # prompt + the part of the response the learner re-reads
    prompt_len: int
    kept: int  # response tokens kept
    images: ImageInputs


def rescore(
    model: Any,
    processor: Any,
    rows: Sequence[dict[str, Any]],
    *,
    temperature: float,
    batch_size: int = 16,
    max_pixels: int | None = 512 * 512,
    images_for: Callable[[str], list | None] | None = None,
    progress: bool = False,
) -> Rescored:
    """The learner's log-probs of every rollout row (dicts with the rollout schema's columns)."""
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    from ovkit.models.encode import multimodal_token_ids

    forbidden = multimodal_token_ids(model)
    encoder = ImageEncoder(processor, max_pixels)
    out = Rescored(learner=[[] for _ in rows])
    window = batch_size * WINDOW_BATCHES  # rows prepared at once: bounds the pixel tensors held in memory
    bar = _progress(len(rows), progress)
    for first in range(0, len(rows), window):
        prepared = []
        for i in range(first, min(first + window, len(rows))):
            row = rows[i]
            response, mask = list(row["response_ids"]), list(row["loss_mask"])
            cut = next((j for j, (t, m) in enumerate(zip(response, mask)) if m and t in forbidden), len(response))
            out.cut_tokens += sum(1 for m in mask[cut:] if m)
            out.compared.append([int(bool(m)) for m in mask[:cut]] + [0] * (len(response) - cut))
            out.turns.append(turn_ids(mask, row.get(TURN_COLUMN)))
            ids = list(row["prompt_ids"]) + response[:cut]
            prepared.append(_Row(i, ids, len(row["prompt_ids"]), cut, _images(encoder, row, ids, images_for)))
        prepared.sort(key=lambda r: len(r.ids))  # similar lengths share a batch: less padding
        for start in range(0, len(prepared), batch_size):
            chunk = prepared[start : start + batch_size]
            for r, logps in zip(chunk, _forward(model, processor, chunk, temperature)):
                out.learner[r.index] = logps + [0.0] * (len(rows[r.index]["response_ids"]) - r.kept)
            bar.update(len(chunk))
    bar.close()
    return out


def _images(encoder: ImageEncoder, row: dict[str, Any], ids: list[int], images_for) -> ImageInputs:
    rid = str(row.get("prompt_id"))
    cells = row.get("images")
    if cells is None and images_for is not None:
        cells = images_for(rid)
        if cells is None:
            raise OvkitError(f"rollout of prompt {rid!r}: no row with that id in --data")
    found = encoder((rid, _fingerprint(cells or [])), cells or [])
    wanted = sum(1 for t in ids if t == encoder.image_id) if encoder.image_id is not None else 0
    if wanted != found.placeholders:
        if cells is None:
            raise OvkitError(
                f"rollout of prompt {rid!r}: its tokens hold {wanted} image placeholders but the rollout table has no "
                "images column; pass --data with the prompt rows (rl-train --save-rollouts stores images only when "
                "an environment returned some)"
            )
        raise OvkitError(
            f"rollout of prompt {rid!r}: its tokens hold {wanted} image placeholders, its images make "
            f"{found.placeholders}; "
            "the images differ from the ones the sampler saw: pass the --max-pixels the rollouts were sampled with "
            "(rl-curate / rl-train: 262144; eval does not downscale: 0)"
        )
    return found


def _fingerprint(cells: Sequence[dict[str, Any]]) -> str:

    h = hashlib.sha1()
    for cell in cells:
        h.update(cell.get("bytes") or str(cell.get("path")).encode())
    return h.hexdigest()


def _forward(model: Any, processor: Any, chunk: Sequence[_Row], temperature: float) -> list[list[float]]:
    """rl-train's learner forward over one batch: the log-prob of every kept response token."""
    # heavy: torch, pyarrow load on first use, not at CLI start or in config checks
    import torch

    from ovkit.rollouts.trajectories import Trajectories, forward_all

    n, width = len(chunk), max(len(r.ids) for r in chunk)
    input_ids = torch.full((n, width), pad_token_id(processor), dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    keys = sorted({k for r in chunk for k in r.images.token_values})
    per_token = {k: torch.zeros((n, width), dtype=torch.long) for k in keys}
    mask = torch.zeros((n, max(width - 1, 1)), dtype=torch.bool)
    for i, r in enumerate(chunk):
        input_ids[i, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
        attention_mask[i, : len(r.ids)] = 1
        for k, values in r.images.token_values.items():
            per_token[k][i, : len(r.ids)] = torch.tensor([values.get(t, 0) for t in r.ids], dtype=torch.long)
        mask[i, r.prompt_len - 1 : r.prompt_len - 1 + r.kept] = True
    batch = Trajectories(
        input_ids=input_ids,
        attention_mask=attention_mask,
        per_token=per_token,
        mm=[r.images.mm for r in chunk],
        mask=mask,
        behave_logprobs=torch.zeros(mask.shape, dtype=torch.float32),
        group_ids=torch.zeros(n, dtype=torch.long),
        rewards=torch.zeros(n),
        versions=[0] * n,
    )
    logp, _ = forward_all(model, batch, n, temperature)
    return [logp[i, r.prompt_len - 1 : r.prompt_len - 1 + r.kept].double().tolist() for i, r in enumerate(chunk)]


def _progress(total: int, enabled: bool) -> Any:
    # heavy: tqdm loads on first use, not at CLI start or in config checks
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="learner log-probs", unit="rollout", leave=False, disable=not enabled)
