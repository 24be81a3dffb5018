"""The learner's micro-batch with each prompt forwarded once: rl-train's `--shared-prefix`.

GRPO samples every prompt G times, and for a VLM the prompt is mostly image (a 448x448 picture is 256 visual tokens
before a 30-token question). A plain learner forwards each trajectory as its own row, so the vision tower and the
whole prompt run G times per group in the gradient pass, and again in the proximal and reference passes. Here a
micro-batch is one packed row that holds each group's prompt once, followed by its completions:

    [ prompt A | completion A1 | completion A2 | ... | prompt B | completion B1 | ... ]

and the attention (ovkit.models.attention.SharedPrefixPlan) lets each completion's tokens see their prompt and the
earlier tokens of their own completion, nothing else: exactly the keys they see in their own row. Rope positions are
each trajectory's own (a completion continues from its prompt), the prompt's images go through the tower once, and
an episode's observation images (multi-turn: only the first turn, the prompt, is shared) stay with their completion.
The log-prob of a completion's first token is read from the prompt's last hidden state, which every completion of the
group shares; the others from the completion's own positions (`MicroBatch.hidden_index`). The values, and every
gradient, are the plain learner's up to float summation order: the prompt's keys and values are gathered once per
completion, and autograd sums their gradients over the group as the plain learner sums them over its G rows.

Trajectories with no trained token are left out of the row (their log-probs are zero either way). Where sharing is
not exact or cannot be expressed, the learner falls back to one row per trajectory and says so once
(`unsupported`): a language model whose attention is not ovkit's varlen function (flash-attention 2 or eager asked
for by name, flex: under `auto` rl-train gives the language model the varlen function, ovkit.models.attention.
for_shared_prefix; and a text-only model, whose top-level config transformers lets take only sdpa of the two),
a head the chunked log-prob does not reproduce (logit soft-capping), or a model whose images batch by sample
(Idefics-style pixel tensors).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ovkit.models import precompute
from ovkit.models.attention import VARLEN, SharedPrefixPlan, text_implementation
from ovkit.models.encode import merge_mm
from ovkit.rollouts.trajectories import MicroBatch, Trajectories
from ovkit.runtime.loss import head_unsupported

KEY = "shared_prefix"  # the model input the plan travels as (transformers forwards it to the attention function)


def unsupported(config: Any, layout: Any) -> str | None:
    """Why a model with `config` (and its ovkit.pack.PackLayout) cannot share prompts in the learner; None if it can."""
    if text_implementation(config) != VARLEN:
        return f"its language model attends with {text_implementation(config)}, which cannot mask completions apart"
    if head_unsupported(config):
        return f"its head ({head_unsupported(config)}) needs every position's logits"
    if layout is not None and layout.mm_dim != 0:
        return "its images are batched per sample"
    return None


def sharing(requested: bool, config: Any, layout: Any) -> bool:
    """Whether the learner shares prompts: asked for and possible; when not possible, said once on stderr."""
    if not requested:
        return False
    why = unsupported(config, layout)
    if why is not None:
        _say_once(f"--shared-prefix on: {type(config).__name__}: {why}; the learner forwards one row per trajectory")
    return why is None


@functools.cache
def _say_once(message: str) -> None:
    print(f"ovkit: note: {message}", file=sys.stderr, flush=True)


def by_prompt(batch: Trajectories, idx: Sequence[int]) -> list[int]:
    """`idx` with the rows of one prompt together (in the order prompts first appear), so that a micro-batch cut from
    it holds whole groups."""
    first: dict[int, int] = {}
    for i in idx:
        first.setdefault(batch.prompt_keys[i], len(first))
    return sorted(idx, key=lambda i: (first[batch.prompt_keys[i]], i))


def micro_batch(batch: Trajectories, idx: Sequence[int], layout: Any) -> MicroBatch:
    """The host side of one learner forward over trajectories `idx` as a shared-prefix row (module docstring). Its
    `index` and `width` are those of `Trajectories.micro_batch(idx)`: the log-probs come back in the same grid."""
    rows = list(idx)
    width = max(batch.lengths[i] for i in rows)
    members: dict[int, list[tuple[int, int]]] = {}
    for k, i in enumerate(rows):
        if batch.mask_cols[i]:  # a row that trains nothing needs no forward
            members.setdefault(batch.prompt_keys[i], []).append((k, i))
    if not members:  # nothing to train here: the plain rows give the zero log-probs and a backward that moves nothing
        return batch.micro_batch(rows, layout)
    pieces: list[tuple[int, int, int]] = []  # (row, first, end): token spans of the trajectories, in row order
    mm: list[dict[str, Any]] = []
    positions: list[torch.Tensor] = []
    segments: list[tuple[int, int, list[tuple[int, int]]]] = []
    hidden: list[int] = []
    out: list[int] = []
    target_at: list[tuple[int, int]] = []
    pos = 0
    for group in members.values():
        i0 = group[0][1]
        length, start = batch.prompt_lengths[i0], pos
        rope = {i: _positions(batch, i, layout) for _, i in group}
        pieces.append((i0, 0, length))
        positions.append(rope[i0][..., :length])
        mm.append(batch.prompt_mm[i0])
        pos += length
        suffixes = []
        for k, i in group:
            n = batch.lengths[i] - length
            pieces.append((i, length, length + n))
            positions.append(rope[i][..., length:])
            mm.append(batch.response_mm[i])
            suffixes.append((pos, n))
            for j in batch.mask_cols[i]:  # column j: the token after position j, from position j's hidden state
                hidden.append(start + j if j < length else pos + j - length)
                out.append(k * (width - 1) + j)
                target_at.append((i, j + 1))
            pos += n
        segments.append((start, length, suffixes))
    take = lambda t: torch.cat([t[i, a:b] for i, a, b in pieces])[None]  # noqa: E731
    input_ids = take(batch.input_ids)
    inputs: dict[str, Any] = {"input_ids": input_ids, **{k: take(v) for k, v in batch.per_token.items()}}
    inputs.update(merge_mm([m for m in mm if m]))
    inputs["position_ids"] = torch.cat(positions, dim=-1).unsqueeze(-2)  # (3, 1, T) rope, or (1, T)
    if layout is not None:
        inputs.update(precompute.vision_inputs(layout.config, inputs.get("image_grid_thw"), input_ids))
    inputs[KEY] = SharedPrefixPlan.of(segments)
    at = torch.tensor(target_at, dtype=torch.long).reshape(-1, 2)
    targets = batch.input_ids[at[:, 0], at[:, 1]]
    return MicroBatch(
        rows,
        width,
        inputs,
        torch.tensor(out, dtype=torch.long),
        torch.tensor(rows, dtype=torch.long),
        hidden_index=torch.tensor(hidden, dtype=torch.long),
        targets=targets,
    )


def _positions(batch: Trajectories, i: int, layout: Any) -> torch.Tensor:
    """Row i's position ids as its own row has them: the model's rope index (3, n) where it has one, else 0..n-1."""
    if layout is not None and layout.has_rope_index:
        return layout.sample_positions(batch.as_sample(i))
    return torch.arange(batch.lengths[i])
