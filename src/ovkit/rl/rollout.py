"""RL's rollout producers: synchronous (max_staleness 0) and asynchronous with bounded staleness.

Both hand the learner `prompts_per_step` scored groups per step (ovkit.rollouts.groups); the asynchronous one samples
ahead on its own thread under admission control (ovkit.rl.staleness). Under several processes each has its own
producer for its share: process r of N takes the groups at stream positions r, r + N, r + 2N, ... (local group k
is global group k * N + r), so the N processes of a step together sample exactly the groups one process would.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ovkit.rl.staleness import StalenessController
from ovkit.rollouts.groups import Group, Sampling, generate_groups
from ovkit.rollouts.prompts import Prompt


class SyncRollouts:
    """max_staleness = 0: each step's batch is generated at the learner's current version, in the caller's thread."""

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Prompt],
        groups_per_step: int,
        sampling: Sampling,
        score: Callable,
        rank: int = 0,
        world: int = 1,
    ):
        self.engine, self.prompts, self.per_step, self.sampling, self.score = (
            engine,
            prompts,
            groups_per_step,
            sampling,
            score,
        )
        self.rank, self.world = rank, world
        self.version = 0

    def start(self, version: int) -> None:
        self.version = version

    def next_batch(self, step: int) -> list[Group]:
        indices = [k * self.world + self.rank for k in range(step * self.per_step, (step + 1) * self.per_step)]
        groups = generate_groups(self.engine, self.prompts, indices, self.version, self.sampling)
        self.score(groups)
        return groups

    def sync(self, model: Any, version: int) -> None:
        self.engine.update_weights(model)
        self.version = version

    def stop(self) -> None:
        pass


class AsyncRollouts:
    """max_staleness > 0: a rollout thread samples ahead with its own sampler copy, under admission control.

    The sampler's weights are swapped under `lock`, so a generate call always sees one version, and the version
    tag is read under the same lock. Groups enter a FIFO queue in the order they were admitted, which is what makes
    the admission bound hold at consumption (ovkit.rl.staleness).
    """

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Prompt],
        groups_per_step: int,
        sampling: Sampling,
        score: Callable,
        max_staleness: int,
        groups_per_call: int,
        rank: int = 0,
        world: int = 1,
    ):

        self.engine, self.prompts, self.per_step, self.sampling, self.score = (
            engine,
            prompts,
            groups_per_step,
            sampling,
            score,
        )
        self.rank, self.world = rank, world
        self.max_staleness = max_staleness
        self.groups_per_call = max(1, groups_per_call)
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.controller = StalenessController(max_staleness, groups_per_step)
        self.version = 0
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, version: int) -> None:

        self.version = version
        self.controller = StalenessController(self.max_staleness, self.per_step, version)
        self.threads_before = torch.get_num_threads()
        if not torch.cuda.is_available() and self.threads_before > 1:
            # Two workers now run torch ops at once (this thread and the learner): each gets half of the cores.
            # Oversubscribed OpenMP teams spin against each other and can be 10x slower than one thread each.
            torch.set_num_threads(max(1, self.threads_before // 2))
        self.thread = threading.Thread(target=self._run, name="ovkit-rollout", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        next_index = self.controller.started  # groups are admitted (and so consumed) in stream order
        try:
            while True:
                n = self.controller.acquire(self.groups_per_call)
                if n == 0:
                    return
                first, next_index = next_index, next_index + n
                with self.lock:
                    version = self.version
                    indices = [k * self.world + self.rank for k in range(first, first + n)]
                    groups = generate_groups(self.engine, self.prompts, indices, version, self.sampling)
                self.score(groups)
                for g in groups:
                    self.queue.put(g)
        except BaseException as e:  # noqa: BLE001 -- handed to the learner, which re-raises it
            self.error = e
            self.queue.put(None)

    def next_batch(self, step: int) -> list[Group]:
        batch = []
        while len(batch) < self.per_step:
            g = self.queue.get()
            if g is None:
                raise self.error if self.error is not None else RuntimeError("the rollout thread stopped")
            batch.append(g)
        return batch

    def sync(self, model: Any, version: int) -> None:
        with self.lock:
            self.engine.update_weights(model)
            self.version = version
        self.controller.set_version(version)

    def stop(self) -> None:
        self.controller.close()
        if self.thread is not None:
            self.thread.join(timeout=60)  # a daemon: an in-flight generate call never blocks the exit for long
            torch.set_num_threads(self.threads_before)
