"""Rollouts: RL prompts encoded once, groups of completions sampled and scored, and the asynchronous producer.

A *group* is one prompt's `group_size` completions, the unit GRPO normalises over and the unit of admission control.
Every group carries the sampler version that generated it (`version`) and its position in the prompt stream
(`index`), which makes the prompt order (and so a resumed run) a function of the seed and the step alone.
"""

from __future__ import annotations

import json
import math
import queue
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ovkit.errors import OvkitError


@dataclass
class Prompt:
    """One RL row, encoded with its stage instruction."""

    id: str
    encoded: Any  # ovkit.models.encode.Encoded (prompt + generation prompt)
    answer: str
    answer_type: str | None
    source: str
    category: str
    reward_kwargs: Any = None  # dict or None
    images: list = field(default_factory=list)  # PIL images (vLLM re-processes them; HF uses `encoded`)
    image_cells: list = field(default_factory=list)  # the row's `images` cells, for rollout tables


@dataclass
class Group:
    prompt: Prompt
    index: int  # position in the prompt stream (0, 1, ...)
    version: int  # sampler version that generated it
    completions: list  # list[ovkit.generate.Completion]
    task_rewards: list[float] = field(default_factory=list)
    format_rewards: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # what GRPO optimises: task and format mixed
    parts: list[dict] = field(default_factory=list)


def cap_pixels(image: Any, max_pixels: int | None) -> Any:
    """Downscale (keeping the aspect ratio) so that width * height <= max_pixels (the recipe caps at 512 x 512)."""
    if not max_pixels or image.width * image.height <= max_pixels:
        return image
    f = math.sqrt(max_pixels / (image.width * image.height))
    return image.resize((max(1, int(image.width * f)), max(1, int(image.height * f))))


def _reward_kwargs(value: Any, rid: str) -> Any:
    if value is None or value == "" or isinstance(value, dict):
        return value or None
    try:
        return json.loads(value)
    except (TypeError, ValueError) as e:
        raise OvkitError(f"row {rid!r}, column 'reward_kwargs': not JSON ({e})") from None


def encode_prompts(table: Any, processor: Any, *, mode: str, system: bool, max_pixels: int | None = None, extra: str = "", tools: Any = None) -> list[Prompt]:
    """Encode every row of an RL sample table: the stage instruction appended (ovkit.prompts), then `extra` (an
    environment's instruction, e.g. the zoom tool's syntax), images capped; `tools`: an environment's tool schemas
    for the chat template."""
    from ovkit.models.encode import decode_images, encode_prompt
    from ovkit.prompts import with_instruction

    rows = table.to_pylist()
    if rows and "answer" not in rows[0]:
        raise OvkitError("the RL data has no 'answer' column: rl-curate / rl-train need verifiable answers")
    out = []
    for row in rows:
        messages = [m for m in row["messages"] if m["role"] != "assistant"]
        images = [cap_pixels(im, max_pixels) for im in decode_images(row.get("images"))]
        encoded = encode_prompt(processor, with_extra(with_instruction(messages, mode, system=system), extra), images, tools=tools)
        out.append(
            Prompt(
                id=str(row["id"]),
                encoded=encoded,
                answer=str(row.get("answer") or ""),
                answer_type=row.get("answer_type"),
                source=str(row.get("source") or ""),
                category=str(row.get("category") or "none"),
                reward_kwargs=_reward_kwargs(row.get("reward_kwargs"), str(row["id"])),
                images=images,
                image_cells=list(row.get("images") or []),
            )
        )
    return out


def with_extra(messages: list[dict[str, Any]], extra: str) -> list[dict[str, Any]]:
    """`extra` appended to the last user turn (on its own line)."""
    if not extra:
        return messages
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = f"{m['content']}\n{extra}"
            break
    return out


def score_groups(groups: Sequence[Group], *, mode: str, format_weight: float, workers: int = 2, timeout: float = 10.0) -> None:
    """Fill each group's rewards: the task reward from ovkit.rewards (scorer by answer_type / source; `parts` has
    `accuracy` and the `format` reward of the stage's mode), mixed as (1 - format_weight) * task + format_weight *
    format for GRPO."""
    from ovkit.rewards import score_batch
    from ovkit.rl.multiturn import episode_reward

    items = [
        {
            "completion": c.text,
            "answer": g.prompt.answer,
            "answer_type": g.prompt.answer_type,
            "source": g.prompt.source,
            "reward_kwargs": g.prompt.reward_kwargs,
            "prompt_type": mode,
            "id": g.prompt.id,
        }
        for g in groups
        for c in g.completions
    ]
    scored = iter(score_batch(items, workers=workers, timeout=timeout))
    for g in groups:
        g.task_rewards, g.format_rewards, g.rewards, g.parts = [], [], [], []
        for c in g.completions:
            task = next(scored)
            fmt = float(task.parts.get("format", 0.0))
            reward, parts = episode_reward(float(task.reward), dict(task.parts), c)  # multi-turn: x the env's scale
            g.task_rewards.append(reward)
            g.format_rewards.append(float(fmt))
            g.rewards.append((1.0 - format_weight) * reward + format_weight * fmt)
            g.parts.append(parts)


def prompt_order(n_prompts: int, index: int, seed: int) -> int:
    """Which prompt the `index`-th group uses: epoch e = index // n is a fresh permutation seeded by (seed, e)."""
    epoch, pos = divmod(index, n_prompts)
    order = list(range(n_prompts))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[pos]


@dataclass
class Sampling:
    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    episodes: Any = None  # an ovkit.rl.multiturn.EpisodeRunner: multi-turn rollouts with an environment


def generate_groups(engine: Any, prompts: Sequence[Prompt], indices: Sequence[int], version: int, s: Sampling) -> list[Group]:
    """Sample `group_size` completions for the prompts at stream positions `indices` (one generate call, or one
    multi-turn rollout of all of them)."""
    chosen = [prompts[prompt_order(len(prompts), k, s.seed)] for k in indices]
    if s.episodes is not None:
        outs = s.episodes.run(chosen, n=s.group_size, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed * 7919 + indices[0])
        return [Group(p, k, version, list(cs)) for p, k, cs in zip(chosen, indices, outs)]
    outs = engine.generate(
        [p.encoded for p in chosen],
        n=s.group_size,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed * 7919 + indices[0],
        images=[p.images for p in chosen],
    )
    return [Group(p, k, version, list(cs)) for p, k, cs in zip(chosen, indices, outs)]


class SyncRollouts:
    """max_staleness = 0: each step's batch is generated at the learner's current version, in the caller's thread."""

    def __init__(self, engine: Any, prompts: Sequence[Prompt], groups_per_step: int, sampling: Sampling, score: Callable):
        self.engine, self.prompts, self.per_step, self.sampling, self.score = engine, prompts, groups_per_step, sampling, score
        self.version = 0

    def start(self, version: int) -> None:
        self.version = version

    def next_batch(self, step: int) -> list[Group]:
        indices = list(range(step * self.per_step, (step + 1) * self.per_step))
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

    def __init__(self, engine: Any, prompts: Sequence[Prompt], groups_per_step: int, sampling: Sampling, score: Callable, max_staleness: int, groups_per_call: int):
        from ovkit.rl.staleness import StalenessController

        self.engine, self.prompts, self.per_step, self.sampling, self.score = engine, prompts, groups_per_step, sampling, score
        self.max_staleness = max_staleness
        self.groups_per_call = max(1, groups_per_call)
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue()
        self.controller = StalenessController(max_staleness, groups_per_step)
        self.version = 0
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def start(self, version: int) -> None:
        from ovkit.rl.staleness import StalenessController

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
                    groups = generate_groups(self.engine, self.prompts, list(range(first, first + n)), version, self.sampling)
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


def groups_table(groups: Sequence[Group], *, with_images: bool = False, tokenizer: Any = None) -> Any:
    """The rollout table (ovkit.generate.rollouts: one row per trajectory) that mismatch-report reads. `reward` is
    the task reward; `reward_parts` add accuracy, format and the scorer's parts. Multi-turn trajectories add
    `turn_ids` and `termination`, their `completion` is the whole transcript (with `tokenizer`), and the `images`
    column (the prompt's images, then the observations') is always written when an environment returned images."""
    from ovkit.data import image_cell
    from ovkit.generate.rollouts import rollouts_table
    from ovkit.rl.multiturn import transcript

    multiturn = any(c.termination is not None for g in groups for c in g.completions)
    with_images = with_images or any(c.images for g in groups for c in g.completions)
    rows = []
    for g in groups:
        for k, c in enumerate(g.completions):
            row = {
                "prompt_id": g.prompt.id,
                "group": g.index,
                "version": g.version,
                "prompt_ids": list(g.prompt.encoded.input_ids),
                "response_ids": list(c.token_ids),
                "loss_mask": c.mask,
                "turns": c.turns,
                "behave_logprobs": [float(x) for x in c.logprobs],
                "reward": float(g.task_rewards[k]),
                "reward_parts": {**g.parts[k], "optimised": g.rewards[k]},
                "finish_reason": c.finish_reason,
                "category": g.prompt.category,
                "source": g.prompt.source,
                "answer": g.prompt.answer,
                "answer_type": g.prompt.answer_type,
                "completion": c.text,
            }
            if multiturn:
                row["turn_ids"] = list(c.turn_ids or [0] * len(c.token_ids))
                row["termination"] = c.termination or "completed"
                if tokenizer is not None:
                    row["completion"] = transcript(tokenizer, c.token_ids)
            if with_images:
                row["images"] = list(g.prompt.image_cells) + [image_cell(im) for im in c.images]
            rows.append(row)
    return rollouts_table(rows)
