"""The one skip guard of every learner (align, midtrain, sft, rl-train): whether an optimiser step is applied.

Each optimiser step reads the device once, after the backward and the gradient clipping and before
`optimizer.step()`: its loss and gradient norm (the step's metrics, which the loop reads anyway) come back in that one
read, so the decision costs no host sync of its own (tests/test_step_costs.py and tests/test_rl_syncs.py count the
reads). A step is not applied when

- it has nothing to learn from (rl-train: every token of the minibatch masked): `empty`, not an error;
- its loss or gradient norm is not finite: the optimiser does not step, so the weights, the AdamW moments and the
  step count stay exactly as they were (a NaN gradient in AdamW's moments would poison every later step), and the
  streak is counted. A streak of `--max-nonfinite-steps` such steps in a row ends the run (`NonFiniteSteps`; the
  runtime turns it into one message with the step, the loss, the options that usually cause it and the checkpoint
  --resume continues from: Runtime.diverged). A finite step ends the streak.

With --optimizer-in-backward each parameter was stepped inside backward, before any host read: a non-finite step
cannot be skipped there, so the first one stops the run (its weights are not saved).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

from ovkit.runtime.optim import OptimizerInBackward


class NonFiniteSteps(Exception):
    """`limit` optimiser steps in a row had a non-finite loss or gradient norm (or one, stepped in backward)."""

    def __init__(self, streak: list[tuple[int, float, float]], last_applied: int, in_backward: bool):
        super().__init__(f"{len(streak)} non-finite optimiser steps in a row")
        self.streak, self.last_applied, self.in_backward = streak, last_applied, in_backward


@dataclass
class StepGuard:
    """Counts non-finite optimiser steps in a row (module docstring). `last_applied`: the last step whose update was
    applied (the run's start step until one is): its weights are the ones that went on to diverge."""

    limit: int
    command: str = "learner"
    main: bool = True  # the process that prints the warning of a skipped step (every process decides the same)
    last_applied: int = 0
    streak: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, grad norm) in a row
    nonfinite: int = 0  # this process's non-finite steps, in a row or not

    def admit(
        self, step: int, loss: float, grad_norm: float, *, empty: bool = False, in_backward: bool = False
    ) -> bool:
        """Whether to apply the optimiser step of loop step `step` (1-based), from the values the step's one device
        read returned; raises NonFiniteSteps when the streak reaches the limit."""
        if empty:
            return False
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak.clear()
            self.last_applied = step
            return True
        self.streak.append((step, loss, grad_norm))
        self.nonfinite += 1
        if in_backward or len(self.streak) >= self.limit:
            raise NonFiniteSteps(list(self.streak), self.last_applied, in_backward)
        if self.main:
            print(
                f"warning: {self.command} step {step}: loss {loss:.4g}, grad norm {grad_norm:.4g}: not applied "
                f"({len(self.streak)} of --max-nonfinite-steps {self.limit} in a row)",
                file=sys.stderr,
                flush=True,
            )
        return False

    @property
    def diverging(self) -> bool:
        """Inside a streak: the weights are those of `last_applied`, which just failed; no checkpoint is written now
        (it would hold them, and prune good ones)."""
        return bool(self.streak)


def in_backward(optimizer: Any) -> bool:
    """Whether the optimiser steps inside backward (OptimizerInBackward), before the guard can see the step."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), OptimizerInBackward)
