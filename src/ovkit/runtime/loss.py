"""Token log-probs and the language-model loss without a [tokens x vocab] fp32 tensor.

The head (hidden -> vocabulary logits) is applied only at the positions that carry a target (SFT: the answer
tokens; RL: the response tokens), in chunks of rows, by one autograd function (`ChunkedHeadLogprob`): its forward
keeps no logits, its backward recomputes each chunk's logits, turns them into the gradient of the log-prob
(one-hot minus softmax, times the incoming gradient, over the temperature) and accumulates the head's weight gradient
into one [vocab x hidden] buffer in place. Peak memory of the loss is then one chunk of logits and their gradient,
whatever the sequence length: with Qwen2.5's 151,936-token vocabulary and the default 64 MiB budget, 110 rows at a
time (Liger-Kernel's fused linear cross-entropy does the same on CUDA, in Triton).

With `--kernels liger` (ovkit.runtime.kernels: CUDA, Liger-Kernel installed) the supervised loss uses Liger's fused
linear + cross-entropy instead (the same numbers; it never materialises the logits either); the chunked head is the
path everywhere else, and the fallback.

`TokenScorer` wraps the model so that the whole computation is one module's forward: DDP and FSDP see the loss
inside their forward (their gradient hooks and parameter gathering apply), and `accelerate.prepare` takes it like any
model. `score(model, inputs, targets, where)` is the same for code that holds a bare model.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ovkit.models.precompute import PLANS, VISION_KEYS

CHUNK_BYTES = 64 << 20  # fp32 logits of one chunk (its gradient and the softmax double it in the backward pass)


def chunk_rows(vocab: int, budget: int = CHUNK_BYTES) -> int:
    return max(1, budget // (4 * vocab))


def _head(model: Any) -> tuple[nn.Module, Any]:
    """(the module returning the last hidden state, the output embedding)."""
    base = getattr(model, model.base_model_prefix, None) if getattr(model, "base_model_prefix", "") else None
    head = model.get_output_embeddings()
    if base is None or head is None:
        raise ValueError(f"{type(model).__name__}: no base model / output embeddings to compute a chunked loss from")
    return base, head


def _unsupported(model: Any) -> str | None:
    return head_unsupported(model.config)


def head_unsupported(config: Any) -> str | None:
    """What of a model's head (by its `config`) the chunked log-prob cannot reproduce; None when it can."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and (
            getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0)
        ):
            return "final logit soft-capping / scaling"
    return None


def hidden_states(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """The last hidden state [B, T, H] for `inputs` (no logits computed)."""
    base, _ = _head(model)
    return base(**_embedded(base, inputs), use_cache=False).last_hidden_state


def _embedded(base: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """Qwen-VL inputs with `image_token_index` (ovkit.models.precompute): the input embeddings with the vision
    tower's features put in place here, by index, so the model's forward skips its own merge, which reads the device
    back three times (the image-token count check, twice, and `grid_thw.tolist()` to split the features). The same
    numbers: the tower, the embedding table and the merge are the model's own; only where the features go comes
    from the host. Other inputs pass through unchanged."""
    index = inputs.get("image_token_index")
    if index is None or not hasattr(base, "visual"):
        return {k: v for k, v in inputs.items() if k != "image_token_index"}

    rest = {
        k: v
        for k, v in inputs.items()
        if k not in ("image_token_index", "pixel_values", "image_grid_thw", *VISION_KEYS)
    }
    vision = {k.removeprefix("image_"): inputs[k] for k in VISION_KEYS if k in inputs}
    if PLANS in inputs:  # the tower's boundaries' plans (the language model gets them with `rest`)
        vision[PLANS] = inputs[PLANS]
    features = base.visual(
        inputs["pixel_values"].type(base.visual.dtype), grid_thw=inputs["image_grid_thw"], **vision
    ).pooler_output
    embeds = base.get_input_embeddings()(rest.pop("input_ids"))
    flat = embeds.reshape(-1, embeds.shape[-1]).index_copy(0, index, features.to(embeds.dtype))
    return {**rest, "inputs_embeds": flat.view_as(embeds)}


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


class ChunkedHeadLogprob(torch.autograd.Function):
    """log softmax(hidden @ weight.T + bias) / temperature at `targets`, chunk by chunk, never holding more than one
    chunk of logits (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, rows: int):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], rows):
            logits = _chunk_logits(hidden[s : s + rows], weight, bias, temperature)
            out[s : s + rows] = logits.gather(-1, targets[s : s + rows, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        t = ctx.temperature if ctx.temperature > 0 else 1.0
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b and bias is not None else None
        for s in range(0, hidden.shape[0], ctx.rows):
            h, g = hidden[s : s + ctx.rows], grad[s : s + ctx.rows].float()
            # d log p(y) / d logits = onehot(y) - softmax; logits = (h W^T + b) / t
            d = _chunk_logits(h, weight, bias, ctx.temperature)  # -softmax in place: one chunk-sized buffer, not two
            d.sub_(torch.logsumexp(d, dim=-1, keepdim=True)).exp_().neg_()
            d.scatter_add_(-1, targets[s : s + ctx.rows, None], torch.ones_like(g)[:, None])
            d.mul_((g / t)[:, None])
            if grad_h is not None:
                grad_h[s : s + ctx.rows] = (d.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(d.t(), h.float())
            if grad_b is not None:
                grad_b.add_(d.sum(0))
        return (
            grad_h,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
        )


@torch.no_grad()
def _chunk_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logp = torch.log_softmax(_chunk_logits(hidden, weight, bias, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def head_logprobs(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] (differentiable) for hidden rows [N, H], and their entropies [N] when asked (no grad)."""
    weight, bias = head.weight, getattr(head, "bias", None)
    rows = chunk or chunk_rows(weight.shape[0])
    logp = ChunkedHeadLogprob.apply(hidden, weight, bias, targets, temperature, rows)
    if not entropy:
        return logp, None
    ent = [
        _chunk_entropy(
            hidden[s : s + rows].detach(), weight.detach(), None if bias is None else bias.detach(), temperature
        )
        for s in range(0, hidden.shape[0], rows)
    ]
    return logp, torch.cat(ent) if ent else hidden.new_zeros((0,), dtype=torch.float32)


def score(
    model: Any,
    inputs: dict[str, Any],
    targets: torch.Tensor,
    where: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk: int | None = None,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-position log-probs [B, T-1] of `targets` [B, T-1] (column j: the token after position j) at the positions
    `where` [B, T-1] (bool), zero elsewhere; entropies likewise when asked. `index`: the flat positions of `where`
    (row-major) when the caller has them from the host: gathered and scattered by index, the step never reads the
    selection's size back from the device, which a boolean mask would."""
    if _unsupported(model):
        return _score_full(model, inputs, targets, where, temperature=temperature, entropy=entropy)
    _, head = _head(model)
    hidden = hidden_states(model, inputs)[:, :-1]
    if index is None:
        picked, ent = head_logprobs(
            hidden[where], head, targets[where], temperature=temperature, entropy=entropy, chunk=chunk
        )
        out = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device).masked_scatter(where, picked)
        if entropy:
            ent = torch.zeros(where.shape, dtype=torch.float32, device=hidden.device).masked_scatter(where, ent)
        return out, ent
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    picked, ent = head_logprobs(
        rows, head, targets.reshape(-1).index_select(0, index), temperature=temperature, entropy=entropy, chunk=chunk
    )
    flat = torch.zeros(where.numel(), dtype=torch.float32, device=hidden.device)
    out = flat.index_copy(0, index, picked).view(where.shape)
    return out, (flat.index_copy(0, index, ent).view(where.shape) if entropy else None)


def score_at(
    model: Any,
    inputs: dict[str, Any],
    *,
    hidden_index: torch.Tensor,
    targets: torch.Tensor,
    index: torch.Tensor,
    shape: tuple[int, int],
    temperature: float = 1.0,
    entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [shape] of `targets` [K] read from the last hidden states at the flat positions `hidden_index` [K] of
    `inputs`, written at the flat positions `index` [K] of a zero [shape] grid; entropies likewise when asked. For a
    row whose tokens are not one sequence (ovkit.rollouts.shared: one hidden state, a prompt's last, predicts the first
    token of every completion of its group), where `score`'s shift by one does not hold."""
    _, head = _head(model)
    hidden = hidden_states(model, inputs)
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_index)
    picked, ent = head_logprobs(rows, head, targets, temperature=temperature, entropy=entropy, chunk=chunk)
    flat = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=hidden.device)
    out = flat.index_copy(0, index, picked).view(shape)
    return out, (flat.index_copy(0, index, ent).view(shape) if entropy else None)


def _score_full(model, inputs, targets, where, *, temperature, entropy):
    """The plain path (every position's logits) for heads the chunked path cannot reproduce."""
    logits = (
        model(**{k: v for k, v in inputs.items() if k != "image_token_index"}, use_cache=False).logits[:, :-1].float()
    )
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * where
    ent = (-(logp.exp() * logp).sum(-1) * where).detach() if entropy else None
    return out, ent


def nll_sum(
    model: Any,
    inputs: dict[str, Any],
    labels: torch.Tensor,
    ignore_index: int = -100,
    index: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """Sum of next-token NLLs over the target tokens (labels != ignore_index), the supervised loss's numerator.
    `index`: the flat positions of those targets in labels[:, 1:] when the caller has them (computed on the host,
    ovkit.models.precompute.target_index): gathered with index_select, the step never reads a count back from the
    device, which a boolean mask would (its output size). `fused`: Liger-Kernel's fused linear cross-entropy
    (`--kernels liger`) where the head allows it, else the chunked head."""
    targets = labels[:, 1:]
    if _unsupported(model):
        logp, _ = score(model, inputs, targets.clamp(min=0), targets != ignore_index)
        return -logp.sum()
    if index is None:
        index = (targets != ignore_index).reshape(-1).nonzero().reshape(-1)
    _, head = _head(model)
    hidden = hidden_states(model, inputs)[:, :-1]
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    targets = targets.reshape(-1).index_select(0, index)
    if fused and _liger_ok(model, labels):
        # optional: the package (or this name in it) may be missing; imported only where it is used
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(
            hidden, head.weight, targets, getattr(head, "bias", None), reduction="sum"
        )
    logp, _ = head_logprobs(hidden, head, targets)
    return -logp.sum()


def _liger_ok(model: Any, labels: torch.Tensor) -> bool:
    return labels.is_cuda and importlib.util.find_spec("liger_kernel") is not None and not _unsupported(model)


class TokenScorer(nn.Module):
    """The model with the loss in its forward (for DDP / FSDP / accelerate.prepare). `forward(inputs, labels=...)`
    returns the NLL sum; `forward(inputs, targets=..., where=..., temperature=..., entropy=...)` the log-probs
    (`score`), and with `hidden_index=`, `shape=` those of a shared-prefix row (`score_at`)."""

    def __init__(self, model: nn.Module, fused_ce: bool = False):
        super().__init__()
        self.model, self.fused_ce = model, fused_ce  # fused_ce: --kernels liger (nll_sum's `fused`)
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # FSDP's auto-wrap policy reads it

    @property
    def config(self) -> Any:
        return self.model.config

    def forward(
        self,
        inputs: dict[str, Any],
        labels: torch.Tensor | None = None,
        target_index: torch.Tensor | None = None,
        **kw: Any,
    ):
        if labels is not None:
            return nll_sum(self.model, inputs, labels, index=target_index, fused=self.fused_ce)
        if "hidden_index" in kw:
            return score_at(self.model, inputs, **kw)
        return score(self.model, inputs, **kw)
