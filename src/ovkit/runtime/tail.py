"""What both learners' loops (ovkit.train.loop, ovkit.rl.loop) do at the end of every step and around the loop, once:

    tail = Tail(rt, scorer, processor, logger, evaluate, n_steps, cfg.save_every, cfg.keep_checkpoints)
    with faults.deferred_signals(), tail.running(state):
        for ...:
            ... the step; state updated
            metrics = tail.log(step, metrics)   # the held-out evaluation merged in, one log line
            ... what the loop keeps of the metrics in `state`
            tail.end_step(step, state)          # a checkpoint every --save-every steps; a stop a signal asked for

`running` turns the failures that end a run into their one message: CUDA out of memory (exit 3), a divergence
(exit 2), a write the machine refused (exit 2); the last complete checkpoint stays for `--resume` in each case.
`step` is 1-based here: the number of steps done, as the checkpoints and metrics.jsonl count them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ovkit.runtime.guard import NonFiniteSteps


@dataclass
class Tail:
    """The shared end of a learner's step (module docstring)."""

    rt: Any  # ovkit.runtime.Runtime
    scorer: Any
    processor: Any
    logger: Any
    evaluate: Callable[[int, Any], dict[str, Any]]  # ovkit.evaluate.during.evaluator
    n_steps: int
    save_every: int | None
    keep: int

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` with the held-out evaluation merged in (every --eval-every steps and at the end; the trajectory
        is untouched), logged."""
        metrics.update(self.evaluate(step, self.scorer))
        self.logger.log(step, metrics)
        return metrics

    def end_step(self, step: int, state: dict[str, Any]) -> None:
        """A checkpoint every `save_every` steps (not the last: the final save follows), then the stop a
        SIGINT/SIGTERM asked for during the step (a checkpoint, then ovkit.faults.Interrupted)."""
        # not inside a streak of non-finite steps: the checkpoint would hold the weights that failed (guard)
        if self.save_every and step % self.save_every == 0 and step < self.n_steps and not self.rt.guard.diverging:
            self.rt.save_checkpoint(self.scorer, self.processor, state, self.keep)
        self.rt.stop_if_asked(self.scorer, self.processor, state, self.keep, self.n_steps)

    @contextmanager
    def running(self, state: dict[str, Any]) -> Iterator[None]:
        """The loop's failures as one message each; the logger closed however the loop ends."""
        rt = self.rt
        try:
            yield
        except torch.cuda.OutOfMemoryError as e:  # one message, exit 3; the last checkpoint stays
            raise rt.out_of_memory(e, state) from e
        except NonFiniteSteps as e:  # diverged: one message, exit 2; the last checkpoint from before it stays
            raise rt.diverged(e) from None
        except OSError as e:  # disk full while logging or writing rollouts: one line, exit 2
            failure = rt.write_failure(e, rt.run_dir, saving=False)
            if failure is None:
                raise
            raise failure from e
        finally:
            self.logger.close()
