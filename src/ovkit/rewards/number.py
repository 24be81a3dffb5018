"""Numeric answers compared as numbers: "3.0" == "3", "-2" != "2", "1,234" == 1234, "three" == 3.

The released rule took the last `[0-9.]+` match and compared strings, which drops minus signs and fails "3.0" vs "3".
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from ovkit.errors import OvkitError
from ovkit.rewards.base import Reward
from ovkit.rewards.extract import extract_answer

_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15, "sixteen": 16,
    "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50,
    "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90,
}  # fmt: skip
_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}
_WORD = "(?:" + "|".join(sorted([*_UNITS, *_SCALES], key=len, reverse=True)) + ")"
# A run of number words ("twenty-one", "one hundred and five"); "and" only between two number words.
_WORDS = re.compile(rf"\b{_WORD}(?:(?:[\s-]+and[\s-]+|[\s-]+){_WORD})*\b", re.IGNORECASE)
# A minus sign counts only where it cannot be a hyphen or a range ("3-4" is 3 and 4); thousands separators need
# groups of exactly three digits ("1,234" is one number, "1,2,3" is three).
_DIGITS = re.compile(
    r"(?:(?<![A-Za-z0-9_.)\]])(?P<sign>[-−+]))?(?<![A-Za-z0-9_.])"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?![\d])(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)


def _words_value(run: str) -> int:
    total, current = 0, 0
    for word in re.split(r"[\s-]+", run.lower()):
        if word == "and":
            continue
        if word in _UNITS:
            current += _UNITS[word]
        elif word == "hundred":
            current = max(current, 1) * 100
        else:
            total += max(current, 1) * _SCALES[word]
            current = 0
    return total + current


def last_number(text: str) -> Decimal | None:
    """The number that ends last in the text, written in digits or in English words."""
    best: tuple[int, Decimal] | None = None
    for m in _DIGITS.finditer(text):
        try:
            value = Decimal(m.group("num").replace(",", ""))
        except InvalidOperation:
            continue
        if m.group("sign") in ("-", "−"):
            value = -value
        if best is None or m.end() > best[0]:
            best = (m.end(), value)
    for m in _WORDS.finditer(text):
        if best is None or m.end() > best[0]:
            best = (m.end(), Decimal(_words_value(m.group(0))))
    return None if best is None else best[1]


def number(completion: str, answer: str, *, rel_tol: float = 0.0, strict: bool = False) -> Reward:
    """1 if the last number of the answer equals the gold number (within `rel_tol`, e.g. 0.05 for ChartQA)."""
    gold = last_number(answer)
    if gold is None:
        raise OvkitError(f"column 'answer': expected a number for answer_type 'number', got {answer[:80]!r}")
    pred_text = extract_answer(completion, strict=strict)
    pred = last_number(pred_text) if pred_text else None
    if pred is None:
        return Reward(0.0, {"correct": False, "parsed": False})
    ok = pred == gold if rel_tol <= 0 else abs(pred - gold) <= Decimal(str(rel_tol)) * abs(gold)
    return Reward(float(ok), {"correct": bool(ok), "parsed": True})
