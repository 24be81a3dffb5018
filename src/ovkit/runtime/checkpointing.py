"""Selective activation checkpointing for every learner (`--activation-checkpointing MODE`).

Backward needs the tensors that forward saved; for a VLM they are per token and per block, so a long packed row is
paid for in every decoder layer and every ViT block. Checkpointing a block keeps only its inputs and recomputes the
rest during backward (`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`: the math is unchanged, the
gradients are bit-identical on CPU; the non-reentrant form also gives gradients to parameters inside a checkpointed
block whose inputs do not require grad, e.g. LoRA adapters behind frozen embeddings). Modes, applied alike to the
language model's decoder layers and the vision tower's blocks:

    off       nothing is recomputed
    full      every block (the block's input is all it keeps)        = --gradient-checkpointing, TRL/HF's spelling
    every-K   the K-th, 2K-th, ... block of each stack (torchtitan's selective layer AC, `ac_freq`)
    mlp       only the MLP of each block: the wide intermediate activations (gate, up, act(gate) * up) are
              recomputed, attention keeps what it saved (the cheap part to recompute is the costly part to keep)
    auto      off on CPU; on CUDA `full` when the estimated activations of a micro-batch exceed the memory free after
              weights and optimiser state (`choose`), else off

Blocks are found by structure, not by architecture: a block stack is a ModuleList of same-class modules inside the
language model or the vision encoder, by the parameter-name groups of ovkit.models.groups (Qwen2.5-VL
`model.language_model.layers` and `model.visual.blocks`, LLaVA(-OneVision) `model.vision_tower...layers`, SmolVLM
`model.vision_model.encoder.layers` and `model.text_model.layers`); stacks inside a block (MoE experts) are not
blocks. A block's MLP is its child named mlp / feed_forward / ffn.

Checkpointing is the outermost wrapper of the block's forward (ovkit.runtime.wrappers owns the order of the per-block
wrappers: the compiled forward of --compile sits inside it), a bound method, so deepcopy -- the asynchronous
sampler's copy -- rebinds it to the copy, and parameter names, therefore save_pretrained, LoRA targets and groups,
stay unchanged. It only engages when autograd records (torch.is_grad_enabled()): generation and the no-grad proximal
pass of RL run the plain forward, so a KV cache is never updated twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ovkit.choices import CHECKPOINTING_MODES as MODES  # noqa: F401 (re-exported: one definition, torch-free)
from ovkit.choices import canonical_checkpointing as canonical  # noqa: F401
from ovkit.choices import check_checkpointing as check_option  # noqa: F401
from ovkit.models.groups import group_of
from ovkit.runtime import wrappers

MLP_NAMES = ("mlp", "feed_forward", "ffn")
STACKS = ("llm", "vision")

# Saved-for-backward bytes per token per block in bf16 without checkpointing, as a function of the block's widths,
# a * hidden + b * intermediate: the exact fit to bench/activation_bytes.py's decoder layers of Qwen2.5-VL 2B
# (1536 / 8960: 103,480 bytes) and 7B (3584 / 18944: 225,400 bytes) (BENCHMARKS.md, "Activation memory per token");
# it puts the ViT block (1280 / 3420) at 53 kB against 61 kB measured, close enough for an on/off decision.
BYTES_PER_HIDDEN = 19.66
BYTES_PER_INTERMEDIATE = 8.18
# Memory that `auto` leaves alone when it compares: allocator fragmentation, the loss head's chunk, temporaries.
HEADROOM = 0.10


def block_stacks(model: nn.Module) -> dict[str, list[tuple[str, nn.ModuleList]]]:
    """The outermost ModuleLists of same-class, parameterised modules in the language model and the vision encoder,
    by group ({"llm": [(name, list)], "vision": [...]}), in model order."""
    found: dict[str, list[tuple[str, nn.ModuleList]]] = {g: [] for g in STACKS}
    taken: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or any(name.startswith(t + ".") for t in taken):
            continue
        if len({type(m) for m in module}) != 1 or not any(True for _ in module[0].parameters()):
            continue
        group = group_of(f"{name}.0.weight")
        if group in found:
            found[group].append((name, module))
            taken.append(name)
    return found


def targets(model: nn.Module, mode: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of what `mode` checkpoints: blocks, or their MLPs."""
    mode = canonical(mode)
    if mode in ("off", "auto"):
        return []
    out = []
    for stacks in block_stacks(model).values():
        for name, blocks in stacks:
            for i, block in enumerate(blocks):
                if mode == "mlp":
                    mlp = next(
                        ((n, getattr(block, n)) for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)),
                        None,
                    )
                    if mlp is not None:
                        out.append((f"{name}.{i}.{mlp[0]}", mlp[1]))
                elif mode == "full" or (i + 1) % int(mode.split("-")[1]) == 0:
                    out.append((f"{name}.{i}", block))
    return out


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = getattr(self, wrappers.CHECKPOINTED)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)


def wrap(module: nn.Module) -> nn.Module:
    """Checkpoint `module`'s forward, in place (once)."""
    wrappers.wrap(module, wrappers.CHECKPOINTED, _checkpointed_forward)
    return module


def apply(model: nn.Module, mode: str) -> list[str]:
    """Checkpoint what `mode` selects, in place; the names of the checkpointed modules."""
    found = targets(model, mode)
    for _, module in found:
        wrap(module)
    return [name for name, _ in found]


def remove(model: nn.Module) -> None:
    """Undo `apply` (benchmarks and tests compare modes on one model)."""
    for module in model.modules():
        wrappers.unwrap(module, wrappers.CHECKPOINTED)


# -- auto ------------------------------------------------------------------------------------------------------------


def _widths(block: nn.Module) -> tuple[int, int]:
    """(hidden, intermediate) of a block, read off its MLP's Linear layers (generic across architectures)."""
    mlp = next((getattr(block, n) for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), block)
    linears = [m for m in mlp.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    if not linears:
        return 0, 0
    return linears[0].in_features, max(m.out_features for m in linears)


def activation_bytes(model: nn.Module, tokens: int, element_bytes: int = 2) -> int:
    """Estimated saved-for-backward bytes of a micro-batch of `tokens` tokens without checkpointing: every block of
    both stacks at the measured bytes per token (BYTES_PER_*, bf16; scaled by `element_bytes` / 2). The ViT sees
    patches, not tokens; counting one patch per token is a middle between text-only rows and 4 patches per image
    token of the 2x2 merger."""
    total = 0.0
    for stacks in block_stacks(model).values():
        for _, blocks in stacks:
            hidden, intermediate = _widths(blocks[0])
            total += len(blocks) * (BYTES_PER_HIDDEN * hidden + BYTES_PER_INTERMEDIATE * intermediate)
    return int(total * tokens * element_bytes / 2)


def optimiser_bytes(model: nn.Module, state_element_bytes: int = 4, gradients: bool = True) -> int:
    """Gradients and AdamW's two moments of the trainable parameters: memory the first step will take. `gradients`
    False: each is freed as soon as its parameter has stepped (--optimizer-in-backward)."""
    n, grad = 0, 0
    for p in model.parameters():
        if p.requires_grad:
            n += p.numel()
            grad += p.numel() * p.element_size()
    return (grad if gradients else 0) + 2 * n * state_element_bytes


def choose(mode: str, device: torch.device, needed: int | None = None, free: int | None = None) -> tuple[str, str]:
    """(mode, why): `auto` resolved from the device and, on CUDA, the estimated activations `needed` against the
    `free` bytes; any other mode is kept as given."""
    mode = canonical(mode)
    if mode != "auto":
        return mode, "asked for"
    if device.type != "cuda":
        return "off", f"auto: {device.type} (memory is not the limit there; recomputing only costs time)"
    if needed is None or free is None:
        return "full", "auto: cuda, no estimate of the activations"
    gib = 1 << 30
    budget = free * (1 - HEADROOM)
    if needed > budget:
        return (
            "full",
            f"auto: activations ~{needed / gib:.1f} GiB > {budget / gib:.1f} GiB free after weights and optimiser "
            f"state",
        )
    return (
        "off",
        f"auto: activations ~{needed / gib:.1f} GiB fit in {budget / gib:.1f} GiB free after weights and optimiser "
        f"state",
    )


def free_cuda_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


# -- measurement -----------------------------------------------------------------------------------------------------


def saved_bytes(fn: Callable[[], Any], exclude: nn.Module | None = None) -> tuple[int, Any]:
    """(bytes, fn()): the bytes autograd keeps for backward while `fn` runs, counted with saved_tensors_hooks and
    de-duplicated by storage; storages of `exclude`'s parameters and buffers (weights are not activations) are left
    out. A checkpointed block shows up as the inputs the checkpoint keeps to recompute it."""
    skip = set()
    if exclude is not None:
        skip = {t.untyped_storage().data_ptr() for t in [*exclude.parameters(), *exclude.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
