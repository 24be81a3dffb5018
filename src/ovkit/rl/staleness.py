"""Asynchronous rollouts with bounded staleness: admission control and version tags (AReaL).

The learner is at version v after v optimizer steps; the sampler's weights are synced to it after every step.
Every group of rollouts carries the sampler version that generated it, and groups are consumed first in, first out,
`groups_per_step` at a time, so the k-th group ever started (k = 0, 1, ...) is consumed by step k // groups_per_step.
Its staleness when consumed is that step minus its version. Admission control starts group k only while

    k < (v + max_staleness + 1) * groups_per_step        (v = the learner version now)

which guarantees staleness <= max_staleness for every sample: rollouts are held back *before* they start rather than
dropped when consumed (dropping biases the data toward prompts whose rollouts finish fast). max_staleness = 0 is
synchronous on-policy training: step v's batch can only be generated at version v.
"""

from __future__ import annotations

import threading
from collections import Counter


class StalenessController:
    """Decides how many rollout groups may start; the learner bumps the version after each weight sync."""

    def __init__(self, max_staleness: int, groups_per_step: int, version: int = 0):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.version = version
        self.started = version * groups_per_step  # groups before this version were consumed by earlier steps
        self.closed = False
        self._cond = threading.Condition()

    def capacity(self) -> int:
        """How many more groups may start now."""
        return (self.version + self.max_staleness + 1) * self.groups_per_step - self.started

    def acquire(self, n: int = 1, timeout: float | None = None) -> int:
        """Block until at least one group may start; reserve up to `n` and return how many (0 if closed or timed
        out). The caller must tag those groups with the sampler version it reads *after* this returns."""
        with self._cond:
            self._cond.wait_for(lambda: self.closed or self.capacity() > 0, timeout=timeout)
            if self.closed:
                return 0
            take = max(0, min(n, self.capacity()))
            self.started += take
            return take

    def set_version(self, version: int) -> None:
        """Called by the learner once the sampler holds the weights of `version`."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


def staleness_histogram(step: int, versions: list[int]) -> dict[str, int]:
    """{"0": n0, "1": n1, ...}: how many trajectories of a batch consumed at `step` were 0, 1, ... versions old."""
    counts = Counter(step - v for v in versions)
    return {str(k): counts[k] for k in sorted(counts)}
