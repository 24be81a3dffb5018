"""`--compile`: torch.compile per decoder layer and per vision block, the way torchtitan compiles a model.

Each block of the language model's and the vision tower's stacks (found as activation checkpointing finds them:
ovkit.runtime.checkpointing.block_stacks) gets a forward that runs through one `torch.compile`d function. It composes
with activation checkpointing the other way round from torchtitan (which checkpoints each block, then compiles the
checkpointed block, so the checkpoint is a higher-order op inside the graph): here a checkpointed block's checkpoint
stays eager and calls the compiled forward, in forward and again to recompute it in backward, whichever of the two is
applied first (ovkit.runtime.wrappers owns that order). The reason is the graph break below: Dynamo cannot break a
graph inside a checkpoint, so a checkpoint around a block whose attention breaks runs the whole block eagerly
(measured: no graph compiled at all with `--activation-checkpointing full`). With `mlp` checkpointing the
checkpointed MLP has no break and sits inside the compiled block, as in torchtitan. Compiling blocks, not the whole
model: the model's own forward holds the data-dependent work (image placement, rotary indices, the chunked loss) that
would break the graph anyway, while every block of a stack is the same code with other weights, so one graph serves
them all (Dynamo lifts a module's parameters to graph inputs instead of guarding on the module's identity) and
compile time does not grow with depth.

Graphs, breaks and recompiles. `dynamic=True`: sequence length, batch size and image count vary from step to step,
and a graph specialised to the first step's shapes would recompile on the next; with symbolic shapes what compiles
is one variant per structure (text block, vision block; a padded batch's mask or none; with and without grad, for
rl-train's no-grad proximal pass), each the first time it is met, and the counts then stop growing
(tests/test_compile.py checks it across new lengths and batch sizes). The learner's
attention (`ovkit_varlen_flash`, ovkit.models.attention) plans its SDPA calls from the sequence boundaries' values
on the host; that part runs eagerly (`torch.compiler.disable`), so each attention call is one graph break: the
projections, norms, rotary embedding and MLP around it are compiled, the grouped SDPA is not. The counts measured
since `apply` are in ovkit.json (`runtime.compile`).

What stays eager: a block called with a KV cache (generation from the learner's own model, the synchronous sampler
of rl-train: one token at a time would recompile for every new cache length), and a deep copy of the model (the
asynchronous sampler's, which generates on another thread).

The math is unchanged up to float rounding (the compiler fuses and reorders reductions): losses agree with eager
within float tolerance, not bit for bit, so `--compile` is run control, not part of the resume trajectory.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from ovkit.runtime import wrappers
from ovkit.runtime.checkpointing import block_stacks

BACKEND = "inductor"  # tests switch to aot_eager (graph capture and AOTAutograd without code generation: fast)


def _run_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return getattr(block, wrappers.COMPILED)(*args, **kwargs)


@functools.cache
def _compiled(backend: str):
    return torch.compile(_run_block, backend=backend, dynamic=True)


def _compiled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    cached = kwargs.get("past_key_values", kwargs.get("past_key_value")) is not None
    if cached or self.__dict__.get("_ovkit_compiled_id") != id(self):  # generation / a deep copy: eager
        return getattr(self, wrappers.COMPILED)(*args, **kwargs)
    return _compiled(BACKEND)(self, *args, **kwargs)


def wrap(block: nn.Module) -> nn.Module:
    """Run `block`'s forward compiled, in place (once). A checkpointed block (ovkit.runtime.checkpointing.wrap)
    keeps its checkpoint outside: the checkpoint calls the compiled forward, in forward and again to recompute."""
    if wrappers.wrap(block, wrappers.COMPILED, _compiled_forward):
        block._ovkit_compiled_id = id(block)
    return block


def apply(model: nn.Module) -> dict[str, Any]:
    """Compile every block of both stacks; what was compiled, for ovkit.json (`runtime.compile`)."""
    blocks: dict[str, int] = {}
    for group, stacks in block_stacks(model).items():
        for _, stack in stacks:
            for block in stack:
                wrap(block)
            blocks[group] = blocks.get(group, 0) + len(stack)
    return {"enabled": True, "backend": BACKEND, "dynamic": True, "blocks": blocks, "_start": counts()}


def remove(model: nn.Module) -> None:
    """Undo `apply` (tests and benchmarks compare on one model)."""
    for module in model.modules():
        if wrappers.COMPILED in module.__dict__:
            wrappers.unwrap(module, wrappers.COMPILED)
            del module.__dict__["_ovkit_compiled_id"]


def counts() -> dict[str, int]:
    """Process-wide Dynamo counters: graphs compiled, graph breaks, frames compiled (first compiles + recompiles)."""
    from torch._dynamo.utils import counters  # heavy: Dynamo loads only when a run compiles or reads its counters

    return {
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames": int(counters["frames"].get("ok", 0)),
    }


def report(info: dict[str, Any]) -> dict[str, Any]:
    """`apply`'s record with the counters since then (what this run compiled)."""
    if not info.get("enabled"):
        return info
    start, now = info.get("_start", {}), counts()
    return {**{k: v for k, v in info.items() if k != "_start"}, **{k: now[k] - start.get(k, 0) for k in now}}
