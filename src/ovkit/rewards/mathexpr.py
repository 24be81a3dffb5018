"""Math answers: math-verify (gold first), then a numeric / normalised-string fallback.

math-verify can be driven into very long computations by model output (`9^9^9^9`, `10!!!!!!`), and its own timeouts
use SIGALRM, which only works in a main thread and derives from BaseException. So its timeouts are switched off here
(parsing_timeout=None, timeout_seconds=None) and this scorer is always run in a killable worker process
(ovkit.rewards.pool) that enforces a hard wall-clock limit.
"""

from __future__ import annotations

import logging
import re

from ovkit.rewards.base import Reward
from ovkit.rewards.extract import extract_answer
from ovkit.rewards.number import last_number

MAX_MATH_CHARS = 2_000  # an answer expression longer than this is not a final answer
_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\$|\s+|\\displaystyle|\\text\{\s*\}")
_NUMERIC = re.compile(r"^[-−+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?%?$")


def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, StringExtractionConfig

    # The released extraction configs: letters (multiple choice inside math), LaTeX, plain expressions.
    return [StringExtractionConfig(), LatexExtractionConfig(), ExprExtractionConfig()]


def _verify(gold_text: str, pred_text: str) -> bool:
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that timeouts are off
    configs = _configs()
    gold = parse(gold_text, extraction_config=configs, parsing_timeout=None) or parse(
        f"${gold_text}$", extraction_config=configs, parsing_timeout=None
    )
    # The prediction is wrapped in $...$ so LaTeX without delimiters ("\frac{1}{2}") is found as well.
    pred = parse(f"${pred_text}$", extraction_config=configs, parsing_timeout=None) or parse(
        pred_text, extraction_config=configs, parsing_timeout=None
    )
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _fallback(gold_text: str, pred_text: str) -> bool:
    """The released symbolic fallback compared values rounded to 2 decimals; this one does that for plain numbers
    (no SymPy `parse_expr`, which evaluates Python) and otherwise compares LaTeX with spacing and $ removed."""
    gold_plain, pred_plain = _LATEX_NOISE.sub("", gold_text), _LATEX_NOISE.sub("", pred_text)
    if gold_plain and gold_plain == pred_plain:
        return True
    if _NUMERIC.match(gold_plain) and _NUMERIC.match(pred_plain):
        gold_value, pred_value = last_number(gold_plain), last_number(pred_plain)
        if gold_value is not None and pred_value is not None:
            try:
                return round(gold_value, 2) == round(pred_value, 2)
            except ArithmeticError:  # beyond Decimal's precision: not a rounding question any more
                return gold_value == pred_value
    return False


def math(completion: str, answer: str, *, strict: bool = False) -> Reward:
    """1 if math-verify finds the answer equivalent to the gold (or the fallback matches), else 0."""
    pred = extract_answer(completion, strict=strict)
    if not pred or len(pred) > MAX_MATH_CHARS:
        return Reward(0.0, {"correct": False, "verified": False})
    try:
        verified = _verify(answer, pred)
    except Exception:  # math-verify / SymPy raise many types on odd input; the answer then is not verified
        verified = False
    ok = verified or _fallback(answer, pred)
    return Reward(float(ok), {"correct": ok, "verified": verified})
