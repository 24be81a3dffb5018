"""Text read from an image: normalised Levenshtein similarity, ANLS-style (0 below the threshold)."""

from __future__ import annotations

import re

import Levenshtein

from ovkit.rewards.base import Reward, alternatives
from ovkit.rewards.extract import extract_answer

_SPACES = re.compile(r"\s+")
# Edit distance is quadratic: texts are compared on their first MAX_OCR_CHARS characters (OCR answers are words or
# lines; a page-long answer is still compared on its first 20,000 characters).
MAX_OCR_CHARS = 20_000


def similarity(a: str, b: str) -> float:
    """1 - Levenshtein(a, b) / max(len): 1 for equal strings (two empty strings included)."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - Levenshtein.distance(a, b) / longest


def _bounded_similarity(a: str, b: str, threshold: float) -> float:
    """similarity(), skipping the edit distance when the length ratio alone puts it below the threshold."""
    longest = max(len(a), len(b))
    if longest and min(len(a), len(b)) / longest < threshold:
        return min(len(a), len(b)) / longest  # an upper bound; the reward is 0 either way
    return similarity(a, b)


def _normalise(text: str) -> str:
    return _SPACES.sub(" ", text).strip().lower()[:MAX_OCR_CHARS]


def ocr(completion: str, answer: str, *, threshold: float = 0.5, strict: bool = False) -> Reward:
    """Best similarity over the gold alternatives (lower-cased, spaces collapsed); 0 when below `threshold`."""
    pred = extract_answer(completion, strict=strict)
    if pred is None:
        return Reward(0.0, {"similarity": 0.0})
    pred = _normalise(pred)
    best = max(_bounded_similarity(pred, _normalise(gold), threshold) for gold in alternatives(answer))
    return Reward(best if best >= threshold else 0.0, {"similarity": best})
