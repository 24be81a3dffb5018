"""The format reward of the LLaVA-OV-1.5-RL write-up (defined there, unused in its code).

answer mode (stage 1, "Put ONLY your final answer within <answer></answer>."): exactly one answer container, i.e.
one `<answer>...</answer>` pair, or no answer tags and exactly one `\\boxed{...}`.
think mode (stage 2): exactly one `<think>...</think>` block, an answer container after it, and the answer text no
longer than 20% of the completion (so the reasoning lives in the think block, not in the answer).
"""

from __future__ import annotations

from ovkit.errors import OvkitError
from ovkit.rewards.base import Reward
from ovkit.rewards.extract import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, boxed_spans, tail

MAX_ANSWER_FRACTION = 0.2
PROMPT_TYPES = {"answer": "answer", "normal": "answer", "think": "think", "default": "think"}


def prompt_mode(prompt_type: str | None) -> str:
    """`answer` or `think`; the released data's `prompt_type` names (normal = answer-only, default = thinking) too."""
    mode = PROMPT_TYPES.get((prompt_type or "answer").strip().lower())
    if mode is None:
        raise OvkitError(f"prompt_type must be one of {', '.join(PROMPT_TYPES)}, got {prompt_type!r}")
    return mode


def _container(text: str) -> tuple[bool, int]:
    """(exactly one answer container, length of its content)."""
    n_open, n_close = text.count(ANSWER_OPEN), text.count(ANSWER_CLOSE)
    if n_open or n_close:
        start, end = text.find(ANSWER_OPEN), text.find(ANSWER_CLOSE)
        ok = n_open == 1 and n_close == 1 and start < end
        return ok, (end - start - len(ANSWER_OPEN)) if ok else 0
    spans = boxed_spans(text)
    return (len(spans) == 1, spans[0][1] - spans[0][0]) if len(spans) == 1 else (False, 0)


def format_reward(completion: str, mode: str = "answer") -> Reward:
    """1 if the completion has the shape the prompt asked for, else 0; the parts say which check failed."""
    mode = prompt_mode(mode)
    text = tail(completion or "")
    if mode == "answer":
        ok, _ = _container(text)
        return Reward(float(ok), {"container": ok})
    think_ok = text.count(THINK_OPEN) == 1 and text.count(THINK_CLOSE) == 1
    think_end = text.find(THINK_CLOSE)
    think_ok = think_ok and text.find(THINK_OPEN) < think_end
    after = text[think_end + len(THINK_CLOSE) :] if think_ok else text
    container_ok, answer_len = _container(after)
    short_ok = container_ok and answer_len <= MAX_ANSWER_FRACTION * len(text)
    ok = think_ok and container_ok and short_ok
    return Reward(float(ok), {"think": think_ok, "container": container_ok, "short_answer": short_ok})


def format_scorer(completion: str, answer: str, *, mode: str = "answer") -> Reward:
    """The format reward as a scorer (answer_type `format`): the gold answer is ignored."""
    return format_reward(completion, mode)
