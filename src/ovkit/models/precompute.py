"""What a forward pass would otherwise work out on the device from the batch's shapes, computed on the host ahead of
the step (in the data thread), so the training step runs without device-to-host syncs.

On a GPU every `.item()`, `.tolist()`, boolean-mask index or `nonzero` on a device tensor stops the host until the
device catches up; the kernels of the next op cannot be queued meanwhile. transformers' Qwen-VL forward does several
per micro-batch, and some per sample: the 3-D rope index loops over the samples with four `.item()` each, the vision
tower reads its window layout with `grid_thw.tolist()` and its longest sequence with `.max().item()`. All of these are
functions of token ids and image grids, which the collate function holds on the host anyway, so it computes them
there with transformers' own helpers (the values are the same by construction) and the model takes them as inputs:

- `position_ids` (3, B, T) of a padded batch: the per-sample rope index (`PackLayout.sample_positions`, as packed
  rows already had it);
- the vision tower's `image_cu_seqlens`, `image_max_seqlen`, `image_position_ids`, `image_window_index`,
  `image_cu_window_seqlens`, `image_max_window_seqlen` (transformers' precomputed-kwargs interface of the Qwen2.5-VL
  tower, `accepts_precomputed_kwargs`);
- `cu_seq_lens_q/k` and `max_length_q/k` of a packed row (the flash varlen kwargs: no boundary search per layer);
- `shared_prefix`: rl-train's learner row in which a group's completions share their prompt, planned as attention
  calls on the host (ovkit.models.attention.SharedPrefixPlan; ovkit.rollouts.shared);
- `varlen_plans`: for the boundaries above that the learner's `ovkit_varlen_flash` attention takes, its SDPA calls
  (ovkit.models.attention.VarlenPlan), planned from their values here; `to_device` binds each plan to the device
  copy of its boundaries, and transformers forwards the keyword to the attention function;
- `target_index`: the flat positions that carry a loss, so the loss gathers them with `index_select` instead of a
  boolean mask (whose output size the host must read back);
- `image_token_index`: where the image features go, so the learner builds the input embeddings itself
  (`ovkit.runtime.loss.hidden_states`) and transformers' forward never counts image tokens on the device (its check
  reads the count back twice per forward) or splits the features by `grid_thw.tolist()`.
"""

from __future__ import annotations

from typing import Any

import torch

from ovkit.models.attention import VARLEN, SharedPrefixPlan, VarlenPlan, VarlenPlans, text_implementation

# Keys that describe a batch for the loss, not inputs of the model's forward.
LOSS_KEYS = ("labels", "num_tokens", "num_targets", "target_index")
PLANS = "varlen_plans"  # {boundary key: VarlenPlan} on the host; a VarlenPlans on the device
# Inputs of the vision tower's own forward, under the names transformers' precomputed-kwargs interface strips.
VISION_KEYS = (
    "image_cu_seqlens",
    "image_max_seqlen",
    "image_position_ids",
    "image_window_index",
    "image_cu_window_seqlens",
    "image_max_window_seqlen",
)


def to_device(batch: dict[str, Any], device: Any, skip: tuple[str, ...] = LOSS_KEYS) -> dict[str, Any]:
    """The model inputs of `batch` on `device` (copies queued without waiting; host values stay as they are), with
    the batch's attention plans bound to the device copies of the boundaries they were made for."""
    out, moved = {}, {}
    for k, v in batch.items():
        if k in skip or k == PLANS:
            continue
        if isinstance(v, torch.Tensor):
            # one copy per host tensor: a packed row's cu_seq_lens_q and _k are one tensor, and stay one
            if id(v) not in moved:
                moved[id(v)] = v.to(device, non_blocking=True)
            v = moved[id(v)]
        elif isinstance(v, SharedPrefixPlan):
            v = v.to(device)
        out[k] = v
    plans = batch.get(PLANS)
    if plans:
        out[PLANS] = VarlenPlans([(out[k], plan.to(device)) for k, plan in plans.items() if k in out])
    return out


def with_plans(batch: dict[str, Any], plans: dict[str, VarlenPlan]) -> dict[str, Any]:
    """`batch` with `plans` added to its attention plans."""
    if plans:
        batch[PLANS] = {**batch.get(PLANS, {}), **plans}
    return batch


def target_index(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Flat indices into labels[:, 1:] (row-major) of the tokens that carry a loss: the next-token targets."""
    return (labels[:, 1:] != ignore_index).reshape(-1).nonzero().reshape(-1)


def padded_positions(rope: list[torch.Tensor], width: int) -> torch.Tensor:
    """(3, B, width) rope position ids of a right-padded batch from each sample's (3, n) rope index, continued past
    each sample's end (padding is masked: only the real tokens' values matter, and those equal the model's own).
    Without a 4th row of text positions the model never looks for packed sequences in them (transformers' Qwen-VL:
    only a (4, B, T) tensor is read as packed), which would cost a device-to-host read per forward."""
    out = torch.empty(3, len(rope), width, dtype=torch.long)
    for r, pos in enumerate(rope):
        n = pos.shape[1]
        out[:, r, :n] = pos
        start = int(pos.max()) + 1 if n else 0
        out[:, r, n:] = torch.arange(start, start + width - n)
    return out


def varlen_boundaries(text_positions: torch.Tensor, config: Any = None) -> dict[str, Any]:
    """The flash varlen kwargs of one packed row (positions restart at 0 where a sample starts), and their plan
    when `config`'s language model attends with `ovkit_varlen_flash`."""
    pos = text_positions.reshape(-1)
    starts = (pos == 0).nonzero().reshape(-1)
    cu = torch.cat([starts, torch.tensor([pos.numel()])]).to(torch.int32)
    values = cu.tolist()
    longest = _longest(values)
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    plans = {"cu_seq_lens_q": VarlenPlan.of(values, causal=True)} if text_implementation(config) == VARLEN else {}
    return with_plans(out, plans)


def vision_inputs(config: Any, grid_thw: torch.Tensor | None, input_ids: torch.Tensor | None = None) -> dict[str, Any]:
    """The Qwen2.5-VL vision tower's layout for `grid_thw` (host tensor), under the names its forward pops; empty
    for other architectures or a transformers without the precomputed-kwargs interface. With `input_ids`, also
    `image_token_index`: the flat positions of the image tokens, where the features go (ovkit.runtime.loss builds the
    input embeddings from it, so transformers' forward does not count the tokens on the device); a count that does
    not match the grids is an error here, on the host."""
    if grid_thw is None or getattr(config, "model_type", "") != "qwen2_5_vl":
        return {}
    try:
        # optional: the package (or this name in it) may be missing; imported only where it is used
        from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index
    except ImportError:
        return {}
    vision = config.vision_config
    grid = grid_thw.to(torch.long)
    cu = get_vision_cu_seqlens(grid)
    window_index, cu_window = get_vision_window_index(
        grid, spatial_merge_size=vision.spatial_merge_size, window_size=vision.window_size, patch_size=vision.patch_size
    )
    out: dict[str, Any] = {}
    if input_ids is not None:
        index = (input_ids.reshape(-1) == config.image_token_id).nonzero().reshape(-1)
        features = int(grid.prod(-1).sum()) // vision.spatial_merge_size**2
        if index.numel() != features:
            raise ValueError(f"the batch has {index.numel()} image tokens for {features} image features")
        out["image_token_index"] = index
    values, window_values = cu.tolist(), cu_window.tolist()
    out |= {
        "image_cu_seqlens": cu,
        "image_max_seqlen": _longest(values),
        "image_position_ids": get_vision_position_ids(grid, vision.spatial_merge_size),
        "image_window_index": window_index,
        "image_cu_window_seqlens": cu_window,
        "image_max_window_seqlen": _longest(window_values),
    }
    if getattr(vision, "_attn_implementation", None) != VARLEN:
        return out
    plans = {
        "image_cu_seqlens": VarlenPlan.of(values, causal=False),
        "image_cu_window_seqlens": VarlenPlan.of(window_values, causal=False),
    }
    return with_plans(out, plans)


def _longest(cu: list[int]) -> int:
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


def on_device(tensor: torch.Tensor | None, device) -> torch.Tensor | None:
    """One loss-side tensor of a batch (labels, target_index) on `device`, None staying None."""
    return None if tensor is None else tensor.to(device, non_blocking=True)


def model_inputs(batch: dict[str, Any], device) -> dict[str, Any]:
    """The forward's inputs of a collated batch on `device` (the training loop's and the held-out loss's)."""
    return to_device(batch, device)  # not the loss's keys (labels, counts, target positions)
