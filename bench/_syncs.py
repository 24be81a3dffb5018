"""Count, on any machine, the points of a training step where a GPU would make the host wait.

On CUDA a read of a device value on the host (`.item()`, `float(t)`, `bool(t)`, `.tolist()`, `.cpu()`) and every op
whose output size depends on the data (`nonzero`, a boolean-mask index, `masked_select`, `unique`) waits for the device
to drain its queue: no kernel of what follows can be queued meanwhile. On a CPU box nothing waits, but the same calls
happen, so counting them is a CPU proxy for the GPU's stalls (the issue's `aten::_local_scalar_dense` count, plus the
reads that do not go through it).

`SyncCounter` counts them on the thread that enters it (the training loop's; the data thread prepares host tensors
and never touches the device), per optimiser step when `steps=True`:

    with SyncCounter(steps=True) as syncs:
        train(cfg)
    syncs.per_step[2]        # Counter of where the syncs of the third optimiser step came from

A torch dispatch mode sees the ops; `Tensor.tolist`, `.numpy` and `.cpu` never reach the dispatcher on a CPU tensor,
so they are wrapped for the counter's life (on its thread only).

A measuring tool, not part of ovkit: patching torch.Tensor's methods is acceptable in a benchmark or a test, never
in the library. The benchmarks import it with bench/ on their path (`from _syncs import SyncCounter`), the tests
through tests/helpers.py, which loads this file.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that read a device value back, or whose output size the host must learn from the device
SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::nonzero_static",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::equal",
    "aten::is_nonzero",
}
HOST_READS = ("tolist", "numpy", "cpu")


class SyncCounter(TorchDispatchMode):
    """Counts device-to-host syncs on this thread: `total`, `where` (a Counter of 'file:line:function' of the nearest
    frame outside torch), and `per_step` (one Counter per optimiser step, `steps=True`)."""

    def __init__(self, steps: bool = False):
        super().__init__()
        self.total = 0
        self.where: Counter[str] = Counter()
        self.per_step: list[Counter[str]] = [Counter()]
        self._thread = threading.get_ident()
        self._steps = steps
        self._undo: list[Any] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNC_OPS or (name == "aten::index" and _bool_index(args)):
            self._record(name)
        return func(*args, **kwargs)

    def _record(self, what: str) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-2]
            if "/torch/" not in f.filename and not f.filename.endswith("syncs.py")
        ]
        site = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}:{frames[-1].name}" if frames else "?"
        self.total += 1
        self.where[f"{site} ({what})"] += 1
        self.per_step[-1][f"{site} ({what})"] += 1

    def __enter__(self):
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._undo.append((name, original))
            setattr(torch.Tensor, name, self._wrap(original, name))
        if self._steps:
            self._undo.append(("hook", OptimizerSteps(lambda: self.per_step.append(Counter()))))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in reversed(self._undo):
            if name == "hook":
                original.remove()
            else:
                setattr(torch.Tensor, name, original)
        self._undo.clear()
        return super().__exit__(*exc)

    def _wrap(self, original, name: str):
        counter = self

        def read(tensor, *args, **kwargs):
            if threading.get_ident() == counter._thread:
                counter._record(f"Tensor.{name}")
            return original(tensor, *args, **kwargs)

        return read

    def step_counts(self) -> list[int]:
        """Syncs of each complete optimiser step (the period from one step's end to the next's)."""
        return [sum(c.values()) for c in self.per_step[1:-1]]


class OptimizerSteps:
    """Calls `on_step()` after each outermost optimizer.step, and `on_start()` (if given) as one begins:
    MixedPrecisionAdamW's step calls AdamW's inside it, which is one step, not two; the per-parameter steps that
    OptimizerInBackward runs inside backward are not steps either (its own step() is the loop's). `remove()`
    unregisters."""

    def __init__(self, on_step, on_start=None):

        self.depth, self.on_step, self.on_start = 0, on_step, on_start
        self.handles = [register_optimizer_step_pre_hook(self._enter), register_optimizer_step_post_hook(self._leave)]

    def _enter(self, optimizer, *a):
        if getattr(optimizer, "in_backward", False):
            return
        self.depth += 1
        if self.depth == 1 and self.on_start is not None:
            self.on_start()

    def _leave(self, optimizer, *a):
        if getattr(optimizer, "in_backward", False):
            return
        self.depth -= 1
        if self.depth == 0:
            self.on_step()

    def remove(self):
        for h in self.handles:
            h.remove()


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
