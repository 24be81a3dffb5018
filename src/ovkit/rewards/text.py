"""Exact-match scorers: multiple choice, boolean, string (`any`) and critic. Cheap: they run in the caller's process."""

from __future__ import annotations

import re

from ovkit.rewards.base import Reward, alternatives
from ovkit.rewards.extract import extract_answer

_SPACES = re.compile(r"\s+")
_TRUE = frozenset({"yes", "true", "y", "correct", "right"})
_FALSE = frozenset({"no", "false", "n", "incorrect", "wrong"})


def _choice_letter(text: str) -> str:
    """Released rule: strip, strip `.()`, first character upper-cased ("(b)." -> "B"), with one change: that
    character must be a letter standing alone, i.e. not followed by another letter ("B. a red cat" -> "B", but
    "ares" -> no choice). The released rule read any word as the option of its first letter, so a model that wrote
    "ares" scored every "A" row (the synthetic eval's science column measured exactly that)."""
    s = text.strip().strip(".()")
    if not s or not s[0].isalpha() or (len(s) > 1 and s[1].isalpha()):
        return ""
    return s[0].upper()


def multiple_choice(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """1 if the first character of the answer (after stripping spaces and `.()`) is the gold letter."""
    pred = extract_answer(completion, strict=strict)
    letter = _choice_letter(pred) if pred else ""
    # The gold letter is normalised like the prediction, so "(B)" or "b" in the data still means B.
    ok = bool(letter) and any(letter == _choice_letter(gold) for gold in alternatives(answer))
    return Reward(float(ok), {"correct": ok})


def _normalise(text: str) -> str:
    return _SPACES.sub(" ", text).strip().lower()


def _yes_no(text: str) -> bool | None:
    words = _normalise(text).strip(".!?").split(" ")
    word = words[0].strip(".,!?:;\"'") if words else ""
    return True if word in _TRUE else False if word in _FALSE else None


def boolean(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """1 if prediction and gold are both yes/true or both no/false (first word, case-insensitive)."""
    pred = extract_answer(completion, strict=strict)
    pred_value = _yes_no(pred) if pred else None
    gold = _yes_no(answer)
    ok = pred_value is not None and pred_value == gold
    return Reward(float(ok), {"correct": ok})


def _loose(text: str) -> str:
    return _normalise(text).rstrip(".!?。")


def string(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """1 if the answer equals a gold string, ignoring case, runs of whitespace and a trailing full stop."""
    pred = extract_answer(completion, strict=strict)
    ok = pred is not None and any(_loose(pred) == _loose(gold) for gold in alternatives(answer))
    return Reward(float(ok), {"correct": ok})


def critic(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """Released rule: exact match of the stripped answer (a critic's verdict is case-sensitive text)."""
    pred = extract_answer(completion, strict=strict)
    ok = pred is not None and pred.strip() == answer.strip()
    return Reward(float(ok), {"correct": ok})
