"""The stage instructions of LLaVA-OneVision-1.5-RL (its public repository), added by commands, never stored in data.

`answer` is RL stage 1 ("normal", answer-only); `think` is RL stage 2 ("default", chain-of-thought). The synthetic
instruction split uses the same texts so that a model fine-tuned on it answers in the format eval and RL score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ovkit.errors import OvkitError

SYSTEM_PROMPT = "You are a helpful AI assistant."
ANSWER_PROMPT = "Put ONLY your final answer within <answer></answer>."
THINK_PROMPT = (
    "Think and solve the following question step by step. Please put your thinking and analysis procedure within "
    "<think></think>. Put ONLY your final answer within <answer></answer>."
)
INSTRUCTIONS = {"answer": ANSWER_PROMPT, "think": THINK_PROMPT, "none": ""}

# The released data calls the two modes by these names (`prompt_type` column).
ALIASES = {"normal": "answer", "default": "think"}


def instruction(mode: str) -> str:
    mode = ALIASES.get(mode, mode)
    if mode not in INSTRUCTIONS:
        raise ValueError(f"prompt mode must be one of {', '.join(INSTRUCTIONS)} (or normal/default), got {mode!r}")
    return INSTRUCTIONS[mode]


def with_instruction(messages: list[dict[str, Any]], mode: str, system: bool = False) -> list[dict[str, Any]]:
    """Append the stage instruction to the last user turn (and optionally prepend the system prompt)."""
    text = instruction(mode)
    out = [dict(m) for m in messages]
    if text:
        for m in reversed(out):
            if m["role"] == "user":
                m["content"] = f"{m['content']}\n{text}"
                break
    if system and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return out


# Which RL stage a row belongs to (rl-curate's split; eval's `--prompt auto` asks each row in its stage's mode):
# the released `prompt_type` column if the row has one, else its category.
STAGE2_CATEGORIES = ("math", "chart", "science", "diagram", "svg", "code", "stem", "coding")
PROMPT_TYPE_STAGE = {"normal": 1, "answer": 1, "default": 2, "think": 2}


def stage_of(row: dict[str, Any], stage2_categories: Sequence[str]) -> int:
    """The documented split rule: `prompt_type` if the row has one, else the category."""
    ptype = row.get("prompt_type")
    if ptype:
        if str(ptype).lower() not in PROMPT_TYPE_STAGE:
            raise OvkitError(f"row {row.get('id')!r}, column 'prompt_type': expected normal or default, got {ptype!r}")
        return PROMPT_TYPE_STAGE[str(ptype).lower()]
    return 2 if (row.get("category") or "") in stage2_categories else 1


def mode_of(stage: int, prompt: str) -> str:
    """The instruction a row's rollouts are sampled with: its stage's (auto) or the one asked for."""
    return {1: "answer", 2: "think"}[stage] if prompt == "auto" else ALIASES.get(prompt, prompt)
