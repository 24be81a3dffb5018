"""RL's rollout producers: synchronous (max_staleness 0) and asynchronous with bounded staleness.

Both hand the learner `prompts_per_step` scored groups per step (ovkit.rollouts.groups); the asynchronous one samples
ahead on its own thread under admission control (ovkit.rl.staleness). Under several processes each has its own
producer for its share: process r of N takes the groups at stream positions r, r + N, r + 2N, ... (local group k
is global group k * N + r), so the N processes of a step together sample exactly the groups one process would.

Dynamic sampling (DAPO; `max_draws` > 1) keeps that property without any exchange between processes: each place of
the step (stream position i) decides alone. A group whose rewards are all equal is dropped and the place draws again,
at stream position `redraw_index(i, d)` for its d-th redraw, until a group carries a signal or the place has drawn
`max_draws` groups (the last stays, and trains nothing). So which groups a step trains is a function of the seed and
the step, whichever process holds the place, and the extra sampling is bounded by max_draws per place.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ovkit.rl.advantages import groups_with_signal
from ovkit.rl.config import MAX_GEN_BATCHES
from ovkit.rl.staleness import StalenessController
from ovkit.rollouts.groups import Group, Sampling, generate_groups
from ovkit.rollouts.prompts import Prompt

# Redraws take stream positions far beyond any run's own (2**40 groups), MAX_GEN_BATCHES apart per place, so they
# never repeat a step's groups or each other, and a resumed run draws them again.
REDRAWS = 2**40


def redraw_index(index: int, draw: int) -> int:
    """The stream position of the `draw`-th redraw (1, 2, ...) of the place at stream position `index`."""
    return REDRAWS + index * MAX_GEN_BATCHES + draw


def draw_groups(
    generate: Callable[[list[int]], list[Group]], score: Callable, indices: Sequence[int], max_draws: int = 1
) -> list[Group]:
    """The scored groups at stream positions `indices`; with `max_draws` > 1, a tied group's place draws again (module
    docstring). `generate(indices)` samples the groups of those positions."""
    groups = generate(list(indices))
    score(groups)
    for draw in range(1, max_draws):
        redo = [j for j, signal in enumerate(groups_with_signal([g.rewards for g in groups])) if not signal]
        if not redo:
            break
        new = generate([redraw_index(indices[j], draw) for j in redo])
        score(new)
        for j, g in zip(redo, new):
            g.draws = draw + 1
            groups[j] = g
    return groups


class SyncRollouts:
    """max_staleness = 0: each step's batch is generated at the learner's current version, in the caller's thread.
    (AsyncRollouts shares its constructor: which prompts this process draws, how they are sampled and scored.)"""

    def __init__(
        self,
        engine: Any,
        prompts: Sequence[Prompt],
        groups_per_step: int,
        sampling: Sampling,
        score: Callable,
        rank: int = 0,
        world: int = 1,
        max_draws: int = 1,
    ):
        self.engine, self.prompts, self.per_step = engine, prompts, groups_per_step
        self.sampling, self.score, self.max_draws = sampling, score, max_draws
        self.rank, self.world = rank, world
        self.version = 0

    def start(self, version: int) -> None:
        self.version = version

    def next_batch(self, step: int) -> list[Group]:
        indices = [k * self.world + self.rank for k in range(step * self.per_step, (step + 1) * self.per_step)]
        generate = lambda idx: generate_groups(self.engine, self.prompts, idx, self.version, self.sampling)  # noqa: E731
        return draw_groups(generate, self.score, indices, self.max_draws)

    def sync(self, model: Any, version: int) -> None:
        self.engine.update_weights(model)
        self.version = version

    def stop(self) -> None:
        pass


class AsyncRollouts(SyncRollouts):
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
        max_draws: int = 1,
    ):
        super().__init__(engine, prompts, groups_per_step, sampling, score, rank, world, max_draws)
        self.max_staleness = max_staleness
        self.groups_per_call = max(1, groups_per_call)
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.controller = StalenessController(max_staleness, groups_per_step)
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
                indices = [k * self.world + self.rank for k in range(first, first + n)]
                # a redraw samples with the version current then, under the lock as any generate call: a place is
                # admitted once, so its redraws are never staler than its admission allows
                groups = draw_groups(self._generate, self.score, indices, self.max_draws)
                for g in groups:
                    self.queue.put(g)
        except BaseException as e:  # noqa: BLE001 -- handed to the learner, which re-raises it
            self.error = e
            self.queue.put(None)

    def _generate(self, indices: list[int]) -> list[Group]:
        with self.lock:
            return generate_groups(self.engine, self.prompts, indices, self.version, self.sampling)

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
