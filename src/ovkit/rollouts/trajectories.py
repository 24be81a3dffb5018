"""Rollouts as a learner batch, and the learner's log-probs of them.

`build_trajectories` lays a step's groups out as one right-padded [N, T] batch (prompt + response tokens, the loss
mask, the sampler's log-probs, per-token processor values, per-trajectory images); `forward_all` / `sequence_logprobs`
give the learner's log-probs of the sampled tokens at the sampling temperature, through the chunked head of
ovkit.runtime.loss (no [tokens x vocab] tensor). rl-train's update and mismatch-report's re-scoring both use them, so
the gap the report measures is the one the learner sees.

A learner forward's inputs are planned on the host (`Trajectories.micro_batch`): its rows, width, model inputs with
what the model would otherwise work out from ids and grids on the device (rope positions, the vision tower's layout:
ovkit.models.precompute) and the flat positions of its response tokens, all from host tensors and the trajectories'
Python lists. The log-probs then stay on the model's device: no device-to-host read in the gradient pass
(each one stalls a GPU's queue).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ovkit.models import precompute
from ovkit.models.attention import VARLEN, text_implementation
from ovkit.models.encode import merge_mm
from ovkit.models.precompute import to_device
from ovkit.rollouts.groups import Group
from ovkit.runtime.loss import TokenScorer, score, score_at


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
    # host values, from the rollouts' Python lists (derived from the tensors when not given)
    lengths: list[int] | None = None  # real tokens of each row
    mask_cols: list[list[int]] | None = None  # each row's response columns (`mask` True)
    turn_tokens: tuple[int, int] | None = None  # response tokens of the first turn, of the later turns
    # the prompt each row starts with, for a learner that forwards it once per group (ovkit.rollouts.shared): its
    # key (rows of one key share their first `prompt_lengths` tokens and `prompt_mm`), length, and processor outputs,
    # and each row's own (an episode's observation images)
    prompt_keys: list[int] | None = None
    prompt_lengths: list[int] | None = None
    prompt_mm: list[dict[str, Any]] | None = None
    response_mm: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = [int(n) for n in self.attention_mask.sum(-1).tolist()]
        if self.mask_cols is None:
            self.mask_cols = [[j for j, m in enumerate(row) if m] for row in self.mask.tolist()]
        if self.turn_tokens is None:
            turns = self.turn_ids.tolist() if self.turn_ids is not None else [[0] * self.mask.shape[1]] * self.size
            later = sum(1 for i, cols in enumerate(self.mask_cols) for j in cols if turns[i][j] > 0)
            self.turn_tokens = (sum(map(len, self.mask_cols)) - later, later)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def by_length(self, idx: Sequence[int]) -> list[int]:
        """`idx` sorted by sequence length, so that micro-batches of similar lengths carry little padding."""
        return sorted(idx, key=lambda i: self.lengths[i])

    def model_inputs(self, idx: Sequence[int], device: Any) -> tuple[dict[str, Any], int]:
        """Inputs for trajectories `idx`, trimmed to their longest length W; returns (inputs, W)."""

        plan = self.micro_batch(idx)
        return to_device(plan.inputs, device, skip=()), plan.width

    def micro_batch(self, idx: Sequence[int], layout: Any = None) -> MicroBatch:
        """The host side of one learner forward over trajectories `idx` (module docstring). With the model's
        `layout` (ovkit.pack.PackLayout), the inputs carry its rope positions and vision layout."""

        rows = list(idx)
        width = max(self.lengths[i] for i in rows)
        r = torch.tensor(rows, dtype=torch.long)
        inputs: dict[str, Any] = {
            "input_ids": self.input_ids[r, :width],
            "attention_mask": self.attention_mask[r, :width],
            **{k: v[r, :width] for k, v in self.per_token.items()},
        }
        for key in sorted({k for i in rows for k in self.mm[i]}):
            inputs[key] = torch.cat([self.mm[i][key] for i in rows if key in self.mm[i]], dim=0)
        if layout is not None:
            if all(self.lengths[i] == width for i in rows):
                del inputs["attention_mask"]  # no padding: plain causal attention, no mask for the kernel to inspect
            if layout.has_rope_index:
                inputs["position_ids"] = precompute.padded_positions(
                    [layout.sample_positions(self.as_sample(i)) for i in rows], width
                )
            inputs.update(precompute.vision_inputs(layout.config, inputs.get("image_grid_thw"), inputs["input_ids"]))
        index = [k * (width - 1) + j for k, i in enumerate(rows) for j in self.mask_cols[i] if j < width - 1]
        return MicroBatch(rows, width, inputs, torch.tensor(index, dtype=torch.long), r)

    def as_sample(self, i: int) -> SimpleNamespace:
        """Row i as an encoded sample (what PackLayout.sample_positions reads)."""
        n = self.lengths[i]
        per_token = {k: v[i, :n].tolist() for k, v in self.per_token.items()}
        return SimpleNamespace(input_ids=self.input_ids[i, :n].tolist(), per_token=per_token, mm=self.mm[i])


@dataclass
class MicroBatch:
    """One learner forward, planned on the host: trajectories `rows` trimmed to `width` tokens."""

    rows: list[int]
    width: int
    inputs: dict[
        str, Any
    ]  # host model inputs (with what the forward would compute from ids and grids, when planned so)
    index: torch.Tensor  # flat positions (row-major in [len(rows), width - 1]) of the response tokens
    row_index: torch.Tensor  # `rows` as a tensor
    # a shared-prefix row (ovkit.rollouts.shared): the flat positions of the hidden states that predict the response
    # tokens (`index`'s order), and those tokens; None: one padded row per trajectory, read by shifting one
    hidden_index: torch.Tensor | None = None
    targets: torch.Tensor | None = None


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
    pairs = [(g, c, r) for g in groups for c, r in zip(g.completions, g.rewards)]
    cut = [_trainable_tokens(c.token_ids, forbidden, c.loss_mask) for _, c, _ in pairs]
    width = max(g.prompt.encoded.length + n for (g, _, _), n in zip(pairs, cut))
    n = len(pairs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    keys = sorted({k for g, c, _ in pairs for k in (*g.prompt.encoded.per_token, *c.per_token)})
    per_token = {k: torch.zeros((n, width), dtype=torch.long) for k in keys}
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    mask_cols: list[list[int]] = []
    later = 0
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
            mask_cols.append([L - 1 + j for j, m in enumerate(c.mask[:R]) if m])
            if c.turn_ids is not None:
                later += sum(1 for m, t in zip(c.mask[:R], c.turn_ids[:R]) if m and t > 0)
        else:
            group_ids[i] = -1 - i
            mask_cols.append([])
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
        lengths=[g.prompt.encoded.length + n for (g, _, _), n in zip(pairs, cut)],
        mask_cols=mask_cols,
        turn_tokens=(sum(map(len, mask_cols)) - later, later),
        prompt_keys=[k for k, g in enumerate(groups) for _ in g.completions],
        prompt_lengths=[g.prompt.encoded.length for g, _, _ in pairs],
        prompt_mm=[g.prompt.encoded.mm for g, _, _ in pairs],
        response_mm=[c.mm or {} for _, c, _ in pairs],
    )


def sequence_logprobs(
    model,
    batch: Trajectories,
    idx: Sequence[int],
    temperature: float,
    *,
    entropy: bool = False,
    plan: MicroBatch | None = None,
):
    """Log-probs of the sampled tokens under `model` (logits / temperature, as the sampler drew them): [len(idx), W-1],
    at the trained positions (`batch.mask`; zero elsewhere), and the per-token entropy of that distribution when asked,
    on the model's device. `model` is a bare transformers model or a prepared ovkit.runtime.loss.TokenScorer
    (DDP/FSDP-wrapped or not); `plan`: trajectories `idx` planned on the host (`Trajectories.micro_batch`)."""

    device = next(model.parameters()).device
    plan = plan if plan is not None else batch.micro_batch(idx)
    inputs = to_device(plan.inputs, device, skip=())
    if plan.hidden_index is not None:
        return _shared_logprobs(model, plan, inputs, temperature, entropy, device)
    targets = inputs["input_ids"][:, 1:]
    where = batch.mask[plan.row_index, : plan.width - 1].to(device, non_blocking=True)
    index = plan.index.to(device, non_blocking=True)
    if isinstance(getattr(model, "module", model), TokenScorer):
        logp, ent = model(inputs, targets=targets, where=where, index=index, temperature=temperature, entropy=entropy)
    else:
        logp, ent = score(model, inputs, targets, where, index=index, temperature=temperature, entropy=entropy)
    return logp, ent, plan.width


def _shared_logprobs(model, plan: MicroBatch, inputs: dict[str, Any], temperature: float, entropy: bool, device):
    """`sequence_logprobs` of a shared-prefix row (ovkit.rollouts.shared), which only ovkit's varlen attention
    reads: under any other attention its completions would attend to each other."""
    config = getattr(model, "module", model).config
    if text_implementation(config) != VARLEN:
        raise ValueError(f"a shared-prefix micro-batch needs the {VARLEN} attention, not {text_implementation(config)}")
    kw = dict(
        hidden_index=plan.hidden_index.to(device, non_blocking=True),
        targets=plan.targets.to(device, non_blocking=True),
        index=plan.index.to(device, non_blocking=True),
        shape=(len(plan.rows), plan.width - 1),
        temperature=temperature,
        entropy=entropy,
    )
    if isinstance(getattr(model, "module", model), TokenScorer):
        logp, ent = model(inputs, **kw)
    else:
        logp, ent = score_at(model, inputs, **kw)
    return logp, ent, plan.width


def chunks(indices: Sequence[int], size: int) -> list[list[int]]:
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


@torch.no_grad()
def forward_all(
    model,
    batch: Trajectories,
    micro: int,
    temperature: float,
    *,
    entropy: bool = False,
    plans: Sequence[MicroBatch] | None = None,
    device: Any = None,
):
    """[N, T-1] log-probs (and entropies) of every trajectory, micro-batch by micro-batch, no gradient, on `device`
    (default: the batch's). `plans`: the micro-batches planned on the host (default: by length, `micro` rows each)."""
    if plans is None:
        plans = [batch.micro_batch(idx) for idx in chunks(batch.by_length(range(batch.size)), micro)]
    device = batch.behave_logprobs.device if device is None else device
    logp = torch.zeros(batch.behave_logprobs.shape, dtype=torch.float32, device=device)
    ent = torch.zeros_like(logp)
    for plan in plans:
        lp, e, width = sequence_logprobs(model, batch, plan.rows, temperature, entropy=entropy, plan=plan)
        rows = plan.row_index.to(device, non_blocking=True)
        logp[rows, : width - 1] = lp.to(device)
        if e is not None:
            ent[rows, : width - 1] = e.to(device)
    return logp, ent
