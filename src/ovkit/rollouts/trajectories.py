"""Rollouts as a learner batch, and the learner's log-probs of them.

`build_trajectories` lays a step's groups out as one right-padded [N, T] batch (prompt + response tokens, the loss
mask, the sampler's log-probs, per-token processor values, per-trajectory images); `forward_all` / `sequence_logprobs`
give the learner's log-probs of the sampled tokens at the sampling temperature, through the chunked head of
ovkit.runtime.loss (no [tokens x vocab] tensor). rl-train's update and mismatch-report's re-scoring both use them, so
the gap the report measures is the one the learner sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ovkit.rollouts.groups import Group


@dataclass
class Trajectories:
    """A step's trajectories in one right-padded [N, T] layout. Token tensors are shifted by one: column j holds the
    log-prob of input_ids[:, j + 1], so `mask` marks response tokens and `behave_logprobs` lines up with it."""

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    per_token: dict[str, torch.Tensor]  # e.g. mm_token_type_ids [N, T]
    mm: list[dict[str, Any]]  # per trajectory: pixel_values, image_grid_thw, ...
    mask: torch.Tensor  # [N, T-1] bool
    behave_logprobs: torch.Tensor  # [N, T-1]
    group_ids: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N] the optimised reward (task and format mixed)
    versions: list[int]
    turn_ids: torch.Tensor | None = None  # [N, T-1] the assistant turn of each response token (multi-turn)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def by_length(self, idx: Sequence[int]) -> list[int]:
        """`idx` sorted by sequence length, so that micro-batches of similar lengths carry little padding."""
        lengths = self.attention_mask.sum(-1).tolist()
        return sorted(idx, key=lambda i: lengths[i])

    def model_inputs(self, idx: Sequence[int], device: Any) -> tuple[dict[str, Any], int]:
        """Inputs for trajectories `idx`, trimmed to their longest length W; returns (inputs, W)."""
        rows = torch.as_tensor(list(idx))
        width = int(self.attention_mask[rows].sum(-1).max())
        inputs: dict[str, Any] = {
            "input_ids": self.input_ids[rows, :width],
            "attention_mask": self.attention_mask[rows, :width],
            **{k: v[rows, :width] for k, v in self.per_token.items()},
        }
        for key in sorted({k for i in idx for k in self.mm[i]}):
            inputs[key] = torch.cat([self.mm[i][key] for i in idx if key in self.mm[i]], dim=0)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, width


def multimodal_token_ids(model) -> set[int]:
    """Placeholder tokens (image/video pads, vision start/end) a sampler may emit but a learner cannot re-read: the
    forward pass would look for image features behind them."""
    config = getattr(model, "module", model).config  # a bare model, a TokenScorer, or either under DDP
    found = set()
    for cfg in (config, getattr(config, "text_config", None)):
        for name, value in vars(cfg or object()).items():
            if isinstance(value, int) and any(w in name for w in ("image_token", "video_token", "vision_start", "vision_end")):
                found.add(value)
    return found


def _trainable_tokens(token_ids: Sequence[int], forbidden: set[int], loss_mask: Sequence[int] | None = None) -> int:
    """How many leading response tokens the learner can re-read: up to the first multimodal placeholder the policy
    sampled (an observation's image placeholders, loss mask 0, are real images and stay)."""
    mask = loss_mask if loss_mask is not None else [1] * len(token_ids)
    return next((j for j, (t, m) in enumerate(zip(token_ids, mask)) if m and t in forbidden), len(token_ids))


def build_trajectories(groups: Sequence[Group], pad_id: int, forbidden: set[int] = frozenset()) -> Trajectories:
    """Trajectories of the groups; a response is cut before any multimodal placeholder it sampled (the rest trains
    nothing, its reward still counts). Multi-turn trajectories train only their sampled tokens (loss mask 1); their
    observation images are appended to the prompt's processor outputs, once per key. A trajectory whose environment
    failed (env_error) trains nothing and sits in a group of its own, so its reward moves no other advantage."""
    from ovkit.rollouts.episodes import merge_mm

    pairs = [(g, c, r) for g in groups for c, r in zip(g.completions, g.rewards)]
    cut = [_trainable_tokens(c.token_ids, forbidden, c.loss_mask) for _, c, _ in pairs]
    width = max(g.prompt.encoded.length + n for (g, _, _), n in zip(pairs, cut))
    n = len(pairs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    keys = sorted({k for g, c, _ in pairs for k in (*g.prompt.encoded.per_token, *c.per_token)})
    per_token = {k: torch.zeros((n, width), dtype=torch.long) for k in keys}
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    behave = torch.zeros((n, width - 1), dtype=torch.float32)
    turns = torch.zeros((n, width - 1), dtype=torch.long)
    group_ids = [g.index for g, _, _ in pairs]
    mm = []
    for i, (g, c, _) in enumerate(pairs):
        enc, L, R = g.prompt.encoded, g.prompt.encoded.length, cut[i]
        input_ids[i, :L] = torch.tensor(enc.input_ids)
        input_ids[i, L : L + R] = torch.tensor(c.token_ids[:R], dtype=torch.long)
        attention_mask[i, : L + R] = 1
        for k, values in enc.per_token.items():
            per_token[k][i, :L] = torch.as_tensor(values).reshape(-1)  # sampled response tokens are text (0)
        for k, values in c.per_token.items():
            per_token[k][i, L : L + R] = torch.as_tensor(values[:R], dtype=torch.long)
        if c.termination != "env_error":
            mask[i, L - 1 : L + R - 1] = torch.tensor(c.mask[:R], dtype=torch.bool)
        else:
            group_ids[i] = -1 - i
        behave[i, L - 1 : L + R - 1] = torch.tensor(c.logprobs[:R], dtype=torch.float32)
        if c.turn_ids is not None:
            turns[i, L - 1 : L + R - 1] = torch.tensor(c.turn_ids[:R], dtype=torch.long)
        mm.append(merge_mm([enc.mm, c.mm]) if c.mm else enc.mm)  # the observations' images after the prompt's
    return Trajectories(
        input_ids=input_ids,
        attention_mask=attention_mask,
        per_token=per_token,
        mm=mm,
        mask=mask,
        behave_logprobs=behave,
        group_ids=torch.tensor(group_ids),
        rewards=torch.tensor([r for _, _, r in pairs], dtype=torch.float32),
        versions=[g.version for g, _, _ in pairs],
        turn_ids=turns,
    )


def sequence_logprobs(model, batch: Trajectories, idx: Sequence[int], temperature: float, *, entropy: bool = False):
    """Log-probs of the sampled tokens under `model` (logits / temperature, as the sampler drew them): [len(idx), W-1],
    at the trained positions (`batch.mask`; zero elsewhere), and the per-token entropy of that distribution when asked.
    `model` is a bare transformers model or a prepared ovkit.runtime.loss.TokenScorer (DDP/FSDP-wrapped or not)."""
    from ovkit.runtime.loss import TokenScorer, score

    device = next(model.parameters()).device
    inputs, width = batch.model_inputs(idx, device)
    targets = inputs["input_ids"][:, 1:]
    where = batch.mask[list(idx), : width - 1].to(device)
    if isinstance(getattr(model, "module", model), TokenScorer):
        logp, ent = model(inputs, targets=targets, where=where, temperature=temperature, entropy=entropy)
    else:
        logp, ent = score(model, inputs, targets, where, temperature=temperature, entropy=entropy)
    return logp.cpu(), (ent.cpu() if ent is not None else None), width


def chunks(indices: Sequence[int], size: int) -> list[list[int]]:
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


@torch.no_grad()
def forward_all(model, batch: Trajectories, micro: int, temperature: float, *, entropy: bool = False):
    """[N, T-1] log-probs (and entropies) of every trajectory, micro-batch by micro-batch, no gradient."""
    logp = torch.zeros_like(batch.behave_logprobs)
    ent = torch.zeros_like(batch.behave_logprobs)
    for idx in chunks(batch.by_length(range(batch.size)), micro):
        lp, e, width = sequence_logprobs(model, batch, idx, temperature, entropy=entropy)
        logp[idx, : width - 1] = lp
        if e is not None:
            ent[idx, : width - 1] = e
    return logp, ent
