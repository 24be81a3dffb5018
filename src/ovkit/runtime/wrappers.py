"""A block's forward as a stack of per-block wrappers in one fixed order, whichever is applied first:

    block.forward                      activation checkpointing (ovkit.runtime.checkpointing), outermost
      -> block._ovkit_plain_forward    the compiled forward (ovkit.runtime.compiling)
        -> block._ovkit_eager_forward  the block's own forward

Each wrapper is a function of the block that calls the next one inward through its own slot (CHECKPOINTED calls
`_ovkit_plain_forward`, COMPILED calls `_ovkit_eager_forward`); `wrap` puts it at its place in the stack and `unwrap`
takes it out, leaving the others as they were, so neither wrapper knows of the other and this table alone owns the
order. Compile sits inside the checkpoint (the reverse of torchtitan's order) for the reason ovkit.runtime.compiling
gives: a checkpoint around a block whose attention breaks the graph would run the whole block eagerly.

Why bound methods in the block's instance dict and not wrapper modules (torchtitan's `checkpoint_wrapper`): a module
around each block adds a prefix to every parameter name below it, which save_pretrained, the checkpoints' state
dicts, LoRA's target names and ovkit.models.groups all read; here names stay as they are, and a deepcopy (the
asynchronous sampler's copy of the model) rebinds every slot to the copy.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

# The slots of the stack, outermost first: each holds what the wrapper above it calls.
CHECKPOINTED = "_ovkit_plain_forward"
COMPILED = "_ovkit_eager_forward"
ORDER = (CHECKPOINTED, COMPILED)


def _outer(block: nn.Module, slot: str) -> str:
    """The slot that holds the wrapper of `slot`: the nearest wrapper outside it that is applied, else `forward`."""
    above = ORDER[: ORDER.index(slot)]
    return next((s for s in reversed(above) if s in block.__dict__), "forward")


def wrap(block: nn.Module, slot: str, wrapper: Callable[..., Any]) -> bool:
    """Put `wrapper` (called as wrapper(block, *args, **kwargs); it calls `getattr(block, slot)`) at its place in
    the block's stack, in place; False when it is there already."""
    if slot in block.__dict__:
        return False
    outer = _outer(block, slot)
    block.__dict__[slot] = getattr(block, outer)
    setattr(block, outer, types.MethodType(wrapper, block))
    return True


def unwrap(block: nn.Module, slot: str) -> None:
    """Take the wrapper of `slot` out of the block's stack (nothing when it is not there); the others stay."""
    if slot not in block.__dict__:
        return
    outer = _outer(block, slot)
    inner = block.__dict__.pop(slot)
    if outer == "forward" and getattr(inner, "__func__", None) is type(block).forward:
        del block.__dict__["forward"]  # the block's own forward again, from its class
    else:
        setattr(block, outer, inner)
