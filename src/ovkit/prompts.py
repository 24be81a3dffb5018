"""The stage instructions of LLaVA-OneVision-1.5-RL (anchors.md section 1), added by commands, never stored in data.

`answer` is RL stage 1 ("normal", answer-only); `think` is RL stage 2 ("default", chain-of-thought). The synthetic
instruction split uses the same texts so that a model fine-tuned on it answers in the format eval and RL score.
"""

from __future__ import annotations

from typing import Any

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
