"""Attention implementations: one option for every command that loads a model, and varlen attention for the ViT.

`--attn-implementation {auto,sdpa,flash_attention_2,flex_attention,eager}` picks the language model's attention (the
transformers implementation of that name) and, for vision towers that attend image by image (the Qwen-VL family's
native-resolution ViT attends per image and per window), how that is done:

| choice | language model | vision tower |
|---|---|---|
| `sdpa` | torch SDPA; packed rows get a block-diagonal mask from their restarting positions (one call per layer) |
`ovkit_varlen_flash`: varlen, one SDPA call per layer for images of one size (below) |
| `flash_attention_2` | the flash-attn package (varlen from cu_seqlens / position_ids) | the same kernel, varlen |
| `flex_attention` | torch flex attention | `ovkit_varlen_flash` |
| `eager` | transformers' reference (matmul + softmax) | transformers' reference, one call per image and window |
| `auto` | `flash_attention_2` on CUDA when flash-attn is installed, else `sdpa` | as above |

Why a registered function for the tower: transformers' Qwen-VL vision attention takes its one-call varlen branch
(cu_seqlens) only when the configured implementation's name contains "flash"; any other name loops over images and
windows, which made a padded batch of 16 images cost 4 x 16 attention calls on a 4-layer ViT. `ovkit_varlen_flash`
presents the flash varlen interface and computes it with PyTorch: `torch.nn.attention.varlen.varlen_attn` (a flash
kernel inside PyTorch) on CUDA in bf16/fp16, else SDPA over the sequences gathered into a padded batch (one call per
group of similar lengths: images of one size, and a tower's equal windows, are one call; a block-diagonal mask over
all tokens would cost T^2 instead of the sum of the sequences' squares).

A requested kernel that is missing (flash-attn not installed, no CUDA) falls back to `sdpa` with one warning; the
choice actually used is recorded in ovkit.json (`runtime.attention`).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ovkit.choices import ATTENTION  # noqa: F401 (re-exported: one definition, torch-free)
from ovkit.errors import OvkitError

VARLEN = "ovkit_varlen_flash"


@dataclass(frozen=True)
class Attention:
    """The attention in use: what was asked, what the language model and the vision tower run, and why."""

    requested: str
    text: str
    vision: str
    note: str = ""

    def as_dict(self) -> dict[str, str]:
        return {
            "requested": self.requested,
            "text": self.text,
            "vision": self.vision,
            **({"note": self.note} if self.note else {}),
        }


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def resolve(requested: str, device: torch.device | str, *, train: bool = False) -> Attention:
    """The implementations to use on `device` for `--attn-implementation requested`. `train`: a learner's model,
    whose language model takes `ovkit_varlen_flash` in place of sdpa, so packed rows attend varlen (boundaries from
    their restarting positions: no [T x T] mask) and padded batches as sdpa would."""
    if requested not in ATTENTION:
        raise OvkitError(f"--attn-implementation must be one of {', '.join(ATTENTION)}, got {requested!r}")
    cuda = torch.device(device).type == "cuda"
    sdpa_text = VARLEN if train else "sdpa"
    if requested == "auto":
        return (
            Attention("auto", "flash_attention_2", "flash_attention_2")
            if cuda and flash_attn_available()
            else Attention("auto", sdpa_text, VARLEN)
        )
    if requested == "flash_attention_2" and not (cuda and flash_attn_available()):
        why = "no CUDA device" if not cuda else "the flash-attn package is not installed (pip install flash-attn)"
        note = f"flash_attention_2 unavailable ({why}); using sdpa"
        _warn_once(note)
        return Attention(requested, sdpa_text, VARLEN, note)
    if requested == "flash_attention_2":
        return Attention(requested, "flash_attention_2", "flash_attention_2")
    if requested == "eager":
        return Attention(requested, "eager", "eager")
    return Attention(requested, sdpa_text if requested == "sdpa" else requested, VARLEN)


def for_shared_prefix(attention: Attention) -> Attention:
    """rl-train's learner attention with --shared-prefix on: under `--attn-implementation auto`, a language model that
    would take flash_attention_2 (flash-attn installed) takes ovkit's varlen function instead, which expresses the
    shared-prefix row (completions that see their prompt and never each other) and runs packed rows with torch's own
    varlen flash kernel; flash_attention_2 cannot mask completions apart, so sharing would be off wherever flash-attn
    is installed. The vision tower keeps what `auto` chose; the HF sampler, which shares (or copies) the learner's
    model, decodes padded batches through the same function (PyTorch SDPA). An implementation asked for by name is
    kept."""
    if attention.requested != "auto" or attention.text != "flash_attention_2":
        return attention
    note = (
        "--shared-prefix on: the language model attends with ovkit's varlen function (torch's varlen flash kernel "
        "on packed rows), which can keep completions apart; flash_attention_2 cannot"
    )
    return Attention(attention.requested, VARLEN, attention.vision, note)


@functools.cache
def _warn_once(message: str) -> None:
    print(f"ovkit: warning: {message}", file=sys.stderr, flush=True)


def apply(model: Any, attention: Attention) -> Attention:
    """Set the model's attention: the text config (and the top-level one) to `attention.text`, a vision config to
    `attention.vision`; models without a vision sub-config take `attention.text` throughout. An architecture that
    does not support the requested implementation (transformers says so; e.g. Qwen2.5-VL and flex_attention) falls
    back to sdpa with one warning. Returns what is in effect."""
    register()
    try:
        _set(model, attention)
        return attention
    except (ValueError, KeyError, ImportError) as e:
        if attention.text in ("sdpa", VARLEN):
            raise OvkitError(
                f"--attn-implementation {attention.requested}: {type(model).__name__} cannot use it ({e})"
            ) from None
        note = f"{type(model).__name__} does not support {attention.text}; using sdpa"
        _warn_once(note)
        fallback = Attention(attention.requested, "sdpa", VARLEN, note)
        _set(model, fallback)
        return fallback


def _set(model: Any, attention: Attention) -> None:
    # transformers validates a top-level "flash" name as a kernel to load, so `ovkit_varlen_flash` goes to the
    # sub-configs only (the ones the text and vision models read) and the top level keeps sdpa.
    top = "sdpa" if attention.text == VARLEN else attention.text
    config = model.config
    subs = [name for name in getattr(config, "sub_configs", {}) if getattr(config, name, None) is not None]
    if not subs:
        model.set_attn_implementation(top)
        return
    choice = {name: (attention.vision if "vision" in name else attention.text) for name in subs}
    choice[""] = top
    model.set_attn_implementation(choice)


def text_implementation(config: Any) -> str | None:
    """The attention the language model runs (its sub-config's, which may differ from the top level's)."""
    text = getattr(config, "text_config", None)
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


@functools.lru_cache(maxsize=1)
def register() -> None:
    """Make `ovkit_varlen_flash` known to transformers (attention function and mask function)."""
    # heavy: transformers loads on first use, not at CLI start or in config checks
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, padding_mask)


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask `varlen_attention` takes: the 2D padding mask as given (sliced to the keys), or None. transformers'
    flash mask also returns None for an all-ones mask, which costs a device-to-host read (`mask.all()`) per forward;
    ovkit's collate functions leave the mask out when a batch has no padding, so that check would never succeed."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def varlen_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool | None = None,
    varlen_plans: VarlenPlans | None = None,
    shared_prefix: SharedPrefixPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query/key/value (batch, heads, tokens, dim); returns (batch,
    tokens, heads, dim). Sequences are concatenated (batch 1) with boundaries `cu_seq_lens_*` (a vision tower), or
    from the restarting `position_ids` of a packed row (a language model, no mask); a language model's padded batch
    comes with its 2D padding mask and is plain causal SDPA. `varlen_plans`: the micro-batch's plans of its
    boundaries, made on the host with the batch (a model input that transformers forwards to this function).
    `shared_prefix`: a language model's row in which completions share their prompt (`SharedPrefixPlan`)."""
    causal = bool(getattr(module, "is_causal", False) if is_causal is None else is_causal)
    if cu_seq_lens_q is None and shared_prefix is not None:
        return _shared_sdpa(module, query, key, value, shared_prefix, scaling, dropout), None
    if cu_seq_lens_q is None:
        cu_seq_lens_q = _packed_boundaries(kwargs.get("position_ids"), attention_mask, query)
    if cu_seq_lens_q is None:
        return _causal_sdpa(module, query, key, value, attention_mask, scaling, dropout, causal), None
    if query.shape[0] != 1:
        raise ValueError("varlen attention takes concatenated sequences (batch dimension 1)")
    cu_k = cu_seq_lens_q if cu_seq_lens_k is None else cu_seq_lens_k
    key, value = _query_heads(query, key, value)
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _torch_varlen() is not None:
        out = _torch_varlen()(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu_seq_lens_q.to(torch.int32),
            cu_k.to(torch.int32),
            int(max_length_q or _longest(cu_seq_lens_q)),
            int(max_length_k or _longest(cu_k)),
            scale=scaling,
            window_size=(-1, 0) if causal else (-1, -1),
        )
        return out.unsqueeze(0), None
    if cu_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_q, cu_k):
        raise ValueError("varlen attention without a CUDA kernel needs the same boundaries for queries and keys")
    dropout = dropout if module.training else 0.0
    return _grouped_sdpa(query, key, value, cu_seq_lens_q, causal, dropout, scaling, varlen_plans), None


# Under --compile (ovkit.runtime.compiling) this runs eagerly, one graph break per attention call: its plan comes
# from the boundaries' values on the host (data-dependent group count and widths), which Dynamo would otherwise
# specialise on and recompile for every new set of image sizes. The plans travel in here unopened for that reason.
@torch.compiler.disable
def _grouped_sdpa(
    query, key, value, cu: torch.Tensor, causal: bool, dropout: float, scaling: float | None, plans=None
) -> torch.Tensor:
    out = torch.empty_like(query)
    planned = plans.find(cu, causal) if plans is not None else None
    for flat, mask, keep, n, width in (planned or _own_plan(cu, causal)).calls:
        q, k, v = (t[0][:, flat].reshape(t.shape[1], n, width, -1).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        out[0][:, flat.index_select(0, keep)] = (
            o.transpose(0, 1).reshape(o.shape[1], -1, o.shape[-1]).index_select(1, keep)
        )
    return out.transpose(1, 2)


@dataclass(frozen=True)
class VarlenPlan:
    """The SDPA calls of `_groups(cu)` for one set of sequence boundaries: for each, the token positions to gather
    (padded past each sequence's end by repeating its start), the mask, the positions of the real tokens among them,
    the sequence count and the width. Made from the boundaries' values on the host (`of`), so planning costs the
    device nothing; a tower passes the same boundaries to every block, and each block uses the one plan."""

    causal: bool
    calls: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int], ...]

    @classmethod
    def of(cls, cu: list[int], causal: bool) -> VarlenPlan:
        calls = []
        for starts, lengths in _groups(cu):
            width = max(lengths)
            offsets = torch.arange(width)
            index = torch.tensor(starts)[:, None] + torch.minimum(offsets[None, :], torch.tensor(lengths)[:, None] - 1)
            valid = offsets[None, :] < torch.tensor(lengths)[:, None]  # (n, width)
            mask = valid[:, None, None, :]  # keys past a sequence's end are never attended to
            if causal:
                mask = mask & torch.ones(width, width, dtype=torch.bool).tril()
            keep = torch.tensor([r * width + c for r, n in enumerate(lengths) for c in range(n)])
            calls.append((index.reshape(-1), mask, keep, len(starts), width))
        return cls(causal, tuple(calls))

    def to(self, device: Any) -> VarlenPlan:
        """The plan on `device` (copies queued without waiting)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return VarlenPlan(self.causal, tuple((move(f), move(m), move(k), n, w) for f, m, k, n, w in self.calls))


class VarlenPlans:
    """A micro-batch's plans on its device, each with the boundaries tensor it was made for, as the model is given
    them (ovkit.models.precompute.to_device). The model takes them as the `varlen_plans` keyword, which transformers
    forwards through the vision tower and the language model to the attention function; the boundaries a call gets
    are matched by identity (the same tensor object travels from the inputs to every block)."""

    def __init__(self, bound: list[tuple[torch.Tensor, VarlenPlan]]):
        self.bound = bound

    def find(self, cu: torch.Tensor, causal: bool) -> VarlenPlan | None:
        return next((plan for t, plan in self.bound if t is cu and plan.causal == causal), None)


@dataclass(frozen=True)
class SharedPrefixPlan:
    """The attention of one packed row in which G completions share their prompt (rl-train's --shared-prefix): the
    prompt's tokens attend causally among themselves, and each completion's tokens attend to the whole prompt and
    causally to their own completion, never to another completion. Every token then sees exactly the keys it would see
    in its own trajectory's row, so the hidden states, the log-probs and (through the gathers' scatter-add) every
    gradient are the plain learner's, while the prompt and its images are computed once per group.

    Planned on the host from the row's segments (`of`). Each call is one SDPA over sequences of similar shape: the
    query positions, the key positions (a completion's: its prompt's, then its own), both padded by repeating a
    position and masked, the mask, the positions of the real queries among the padded ones, and the sizes. Costs
    follow the sum over sequences of queries x keys, not the row's T^2."""

    calls: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int], ...]

    @classmethod
    def of(cls, segments: list[tuple[int, int, list[tuple[int, int]]]]) -> SharedPrefixPlan:
        """`segments`: per prompt (start, length, [(start, length) of each of its completions]), in row positions."""
        seqs = []  # (query positions, key positions, keys every query sees)
        for start, length, suffixes in segments:
            prefix = list(range(start, start + length))
            seqs.append((prefix, prefix, 0))
            seqs += [(list(range(a, a + n)), prefix + list(range(a, a + n)), length) for a, n in suffixes if n]
        calls = []
        for group in _shape_groups(seqs):
            wq, wk = max(len(q) for q, _, _ in group), max(len(k) for _, k, _ in group)
            qi = torch.tensor([[q[min(j, len(q) - 1)] for j in range(wq)] for q, _, _ in group])
            ki = torch.tensor([[k[min(m, len(k) - 1)] for m in range(wk)] for _, k, _ in group])
            rows, cols = torch.arange(wq)[:, None], torch.arange(wk)[None, :]
            mask = torch.stack([(cols < len(k)) & ((cols < free) | (cols - free <= rows)) for _, k, free in group])[
                :, None
            ]
            keep = torch.tensor([r * wq + j for r, (q, _, _) in enumerate(group) for j in range(len(q))])
            calls.append((qi.reshape(-1), ki.reshape(-1), mask, keep, len(group), wq, wk))
        return cls(tuple(calls))

    def to(self, device: Any) -> SharedPrefixPlan:
        """The plan on `device` (copies queued without waiting)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return SharedPrefixPlan(
            tuple((move(q), move(k), move(m), move(e), n, a, b) for q, k, m, e, n, a, b in self.calls)
        )


def _shape_groups(seqs: list[tuple[list[int], list[int], int]]) -> list[list[tuple[list[int], list[int], int]]]:
    """`seqs` in batches that one SDPA call takes, padded to their longest queries and keys: sorted by cost (queries x
    keys) and split where padding would more than double the batch's cost (as `_groups`)."""
    batches: list[list[tuple[list[int], list[int], int]]] = []
    exact = wq = wk = 0
    for seq in sorted(seqs, key=lambda s: (len(s[0]) * len(s[1]), len(s[0]))):
        q, k = len(seq[0]), len(seq[1])
        if batches and (len(batches[-1]) + 1) * max(wq, q) * max(wk, k) <= 2 * (exact + q * k):
            batches[-1].append(seq)
            exact, wq, wk = exact + q * k, max(wq, q), max(wk, k)
        else:
            batches.append([seq])
            exact, wq, wk = q * k, q, k
    return batches


@torch.compiler.disable  # a data-dependent plan, as _grouped_sdpa's
def _shared_sdpa(module, query, key, value, plan: SharedPrefixPlan, scaling, dropout) -> torch.Tensor:
    """SDPA over a shared-prefix row (`SharedPrefixPlan`): query/key/value (1, heads, tokens, dim) -> (1, tokens,
    heads, dim). A prompt's keys and values are gathered once per completion that reads them; autograd's scatter-add
    sums their gradients over the completions, which is the plain learner's sum over the group's trajectories."""
    if query.shape[0] != 1:
        raise ValueError("shared-prefix attention takes one packed row (batch dimension 1)")
    heads = query.shape[1]
    key, value = _query_heads(query, key, value)
    dropout = dropout if module.training else 0.0
    out = torch.empty_like(query)
    for qi, ki, mask, keep, n, wq, wk in plan.calls:
        q = query[0][:, qi].reshape(heads, n, wq, -1).transpose(0, 1)
        k, v = (t[0][:, ki].reshape(heads, n, wk, -1).transpose(0, 1) for t in (key, value))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        out[0][:, qi.index_select(0, keep)] = o.transpose(0, 1).reshape(heads, -1, o.shape[-1]).index_select(1, keep)
    return out.transpose(1, 2)


def _own_plan(cu: torch.Tensor, causal: bool) -> VarlenPlan:
    """The plan of boundaries that came without one: those the model works out itself on the device (generation's
    vision tower) or a packed row's restarts. Their values are read back once and the plan is kept on the tensor
    (`cu` lives for one forward and belongs to the thread that runs it), so a tower's blocks after the first reuse
    it instead of reading the device again."""
    own = cu.__dict__.setdefault("_ovkit_varlen_plans", {})
    if causal not in own:
        own[causal] = VarlenPlan.of(cu.tolist(), causal).to(cu.device)
    return own[causal]


def _packed_boundaries(
    position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, query: torch.Tensor
) -> torch.Tensor | None:
    """cu_seqlens of a packed row (one row whose positions restart at 0), else None."""
    if (
        attention_mask is not None
        or position_ids is None
        or query.shape[0] != 1
        or position_ids.shape[-1] != query.shape[2]
    ):
        return None
    return _restarts(position_ids)


@torch.compiler.disable  # data-dependent (where positions restart): eager under --compile, like _grouped_sdpa
def _restarts(position_ids: torch.Tensor) -> torch.Tensor | None:
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1)
    if starts.numel() <= 1 or int(starts[0]) != 0:
        return None
    return torch.cat([starts, torch.tensor([pos.numel()], device=starts.device)]).to(torch.int64)


def _causal_sdpa(module, query, key, value, attention_mask, scaling, dropout, causal) -> torch.Tensor:
    """SDPA of a language model's batch: causal, keys outside the 2D padding mask (or a 4D mask as given) masked."""
    key, value = _query_heads(query, key, value)
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = attention_mask
    if mask is not None and mask.dim() == 2:  # (batch, kv) padding: 1 = a real token
        mask = mask[:, None, None, -kv_len:].bool()
        if causal:
            mask = mask & torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    use_causal = causal and mask is None and q_len == kv_len
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        is_causal=use_causal,
    )
    return out.transpose(1, 2)


def _query_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with one head per query head (grouped-query attention repeats each kv head); (batch, heads,
    tokens, dim) throughout."""
    if key.shape[1] == query.shape[1]:
        return key, value
    repeat = query.shape[1] // key.shape[1]
    return key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)


def _longest(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _groups(cu: list[int]) -> list[tuple[list[int], list[int]]]:
    """The sequences of `cu` as batches of (starts, lengths) that one SDPA call takes, each padded to its longest:
    sorted by length and split where padding would more than double the batch's attention cost. Sequences of one
    image size (and a tower's equal windows) are one batch: calls per layer follow the distinct lengths, not the
    images, and no compute is spent across sequence boundaries (a block-diagonal mask would spend T^2)."""
    seqs = sorted((b - a, a) for a, b in zip(cu, cu[1:]) if b > a)
    groups: list[tuple[list[int], list[int]]] = []
    exact = 0
    for length, start in seqs:
        if groups and (len(groups[-1][0]) + 1) * length**2 <= 2 * (exact + length**2):
            groups[-1][0].append(start)
            groups[-1][1].append(length)
            exact += length**2
        else:
            groups.append(([start], [length]))
            exact = length**2
    return groups


@functools.lru_cache(maxsize=1)
def _torch_varlen():
    try:
        # optional: the package (or this name in it) may be missing; imported only where it is used
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn
    except ImportError:
        return None
