"""Groups of completions: sampled for a prompt, scored with the reward library, written as a rollout table.

A *group* is one prompt's `group_size` completions, the unit GRPO normalises over and the unit of admission control.
Every group carries the sampler version that generated it (`version`) and its position in the prompt stream
(`index`), which makes the prompt order (and so a resumed run) a function of the seed and the step alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ovkit.data import image_cell
from ovkit.rewards import custom, score_batch
from ovkit.rewards.custom import RewardFunc
from ovkit.rollouts.episodes import episode_reward, transcript
from ovkit.rollouts.prompts import Prompt
from ovkit.rollouts.table import rollouts_table


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
    draws: int = 1  # groups its slot of the step drew (dynamic sampling draws again for a tied group; ovkit.rl.rollout)


def score_groups(
    groups: Sequence[Group],
    *,
    mode: str,
    format_weight: float,
    workers: int = 2,
    timeout: float = 10.0,
    funcs: Sequence[RewardFunc] = (),
) -> None:
    """Fill each group's rewards: the task reward from ovkit.rewards (scorer by answer_type / source; `parts` has
    `accuracy` and the `format` reward of the stage's mode), mixed as (1 - format_weight) * task + format_weight *
    format for GRPO, plus the weighted values of the user's reward functions (`funcs`, ovkit.rewards.custom), which
    `parts["funcs"]` keeps by name."""

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
    if funcs:  # the user's functions also see the prompt as asked and the row's category (TRL: every column)
        owners = (g for g in groups for _ in g.completions)
        for item, g in zip(items, owners):
            item.update(category=g.prompt.category, messages=g.prompt.messages)
        extra = iter(custom.score(funcs, items, workers=workers, timeout=timeout))
    for g in groups:
        g.task_rewards, g.format_rewards, g.rewards, g.parts = [], [], [], []
        for c in g.completions:
            task = next(scored)
            fmt = float(task.parts.get("format", 0.0))
            reward, parts = episode_reward(float(task.reward), dict(task.parts), c)  # multi-turn: x the env's scale
            mixed = (1.0 - format_weight) * reward + format_weight * fmt
            if funcs:
                parts["funcs"] = next(extra)
                mixed += custom.weighted(funcs, parts["funcs"])
            g.task_rewards.append(reward)
            g.format_rewards.append(float(fmt))
            g.rewards.append(mixed)
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
    episodes: Any = None  # an ovkit.rollouts.episodes.EpisodeRunner: multi-turn rollouts with an environment


def generate_groups(
    engine: Any, prompts: Sequence[Prompt], indices: Sequence[int], version: int, s: Sampling
) -> list[Group]:
    """Sample `group_size` completions for the prompts at stream positions `indices` (ovkit.rollouts.sample, single-
    or multi-turn). A group's key is its stream position, not its prompt (a row comes back every epoch and must draw
    anew) nor its place in the call, so the groups of a step split over N processes get the completions one process
    samples."""
    from ovkit.rollouts.sample import sample

    chosen = [prompts[prompt_order(len(prompts), k, s.seed)] for k in indices]
    outs = sample(
        engine,
        chosen,
        n=s.group_size,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        keys=list(indices),
        episodes=s.episodes,
    )
    return [Group(p, k, version, list(cs)) for p, k, cs in zip(chosen, indices, outs)]


def groups_table(groups: Sequence[Group], *, with_images: bool = False, tokenizer: Any = None) -> Any:
    """The rollout table (ovkit.rollouts.table: one row per trajectory) that mismatch-report reads. `reward` is
    the task reward; `reward_parts` add accuracy, format and the scorer's parts. Multi-turn trajectories add
    `turn_ids` and `termination`, their `completion` is the whole transcript (with `tokenizer`), and the `images`
    column (the prompt's images, then the observations') is always written when an environment returned images."""

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
