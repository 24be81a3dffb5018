"""Shaping what a step trains: the overlong length penalty and truncation mask (DAPO), and the top-entropy tokens
(Wang et al. 2025, "Beyond the 80/20 Rule").

    overlong_penalty    reward + 0 up to max_len - buffer, then linearly down to -penalty_factor at max_len
    truncated           a completion that max_new_tokens (or a multi-turn budget) cut off
    high_entropy_mask   tokens whose entropy is >= the step's (1 - quantile) quantile
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def overlong_penalty(lengths: Sequence[int], max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> list[float]:
    """The soft overlong punishment of each completion length, to add to its reward (DAPO's Eq. 13; verl's
    `overlong_buffer.{len,penalty_factor}`, TRL's `get_soft_overlong_punishment` with a factor of 1):

        0                                                    length <= max_len - buffer_len
        -(length - (max_len - buffer_len)) / buffer_len * penalty_factor   within the last buffer_len tokens
        -penalty_factor                                      length > max_len (as DAPO; verl never sees one)
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"the overlong buffer must be within (0, max_len = {max_len}] tokens, got {buffer_len}")
    start = max_len - buffer_len
    return [-min(max(n - start, 0) / buffer_len, 1.0) * penalty_factor for n in lengths]


def score_with_overlong(
    groups: Sequence[Any], score: Callable[[Sequence[Any]], None], max_len: int, buffer_len: int, factor: float
) -> None:
    """`score` the groups, then add each completion's `overlong_penalty` (of its token count) to the reward GRPO
    optimises, before advantages and any group filter see it; the penalty is kept in the completion's parts
    (`overlong_penalty`, for the metrics and the rollout table). The task reward is left as scored."""
    score(groups)
    for g in groups:
        penalties = overlong_penalty([len(c.token_ids) for c in g.completions], max_len, buffer_len, factor)
        g.rewards = [r + p for r, p in zip(g.rewards, penalties)]
        for parts, p in zip(g.parts, penalties):
            parts["overlong_penalty"] = p


def truncated(finish_reason: str, termination: str | None = None) -> bool:
    """Whether a completion was cut off rather than finished: a multi-turn episode by its termination ("truncated":
    a turn hit max_new_tokens or a budget), a single-turn one by its finish reason ("length"). TRL's
    `mask_truncated_completions` trains nothing on these (DAPO: their reward is noise about the answer)."""
    return termination == "truncated" if termination is not None else finish_reason == "length"


def mask_truncated(mask: torch.Tensor, is_truncated: Sequence[bool]) -> torch.Tensor:
    """The response mask [N, T] without the rows of truncated trajectories, which then train nothing."""
    keep = torch.tensor([not t for t in is_truncated], dtype=torch.bool, device=mask.device)
    return mask & keep[:, None]


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy at or above which a token is among the top `quantile` of `entropies` (the 1-d entropies of every
    response token of the step, of every process): their (1 - quantile) quantile, interpolated linearly as
    `torch.quantile` (TRL's `get_high_entropy_mask`), which refuses inputs above 2**24 values; a sort has no limit.
    quantile 1 keeps every token, 0 only the highest-entropy ones. No tokens: +inf (nothing is kept)."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"the top-entropy quantile must be within [0, 1], got {quantile}")
    if entropies.numel() == 0:
        return entropies.new_full((), float("inf"))
    values = entropies.flatten().sort().values
    pos = (1.0 - quantile) * (values.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, values.numel() - 1)
    return torch.lerp(values[lo], values[hi], pos - lo)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """The response tokens whose entropy is >= the step's `threshold` (`entropy_threshold`): computed once per step
    over the whole step, so a micro-batch's tokens are the ones the whole batch would choose."""
    return (entropy >= threshold) & mask.bool()
