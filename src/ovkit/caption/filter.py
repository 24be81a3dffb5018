"""The caption filter LLaVA-OneVision-1.5 released with its recaptioned data (in its public repository).

A caption is rejected when it is a refusal ("i'm sorry", "i cannot", ...), when it holds a run of 8 identical
consecutive words (the degenerate loop a captioner falls into), or when it is shorter than 50 or longer than 3500
characters. The three numbers are options (`CaptionFilter`); the rules are the released ones, with three additions:
Chinese refusals are refusals too; since Chinese is written without spaces, each CJK character counts as a word for
the repetition rule; and a caption without a single word (only punctuation, symbols or control characters, which
an untrained captioner writes and which the length bound alone lets through when it is lowered) is empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Matched case-insensitively anywhere in the caption (curly apostrophes normalised first). The English phrases are
# the ones captioners open refusals with; the Chinese ones are their translations.
REFUSALS = (
    "i'm sorry",
    "i am sorry",
    "i apologize",
    "i cannot",
    "i can't",
    "i'm unable",
    "i am unable",
    "as an ai",
    "抱歉",
    "对不起",
    "我无法",
    "我不能",
)

_CJK = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[{_CJK}]|[^\s{_CJK}]+")
_PUNCT = "\"'`.,;:!?()[]{}<>-_*#/\\|~，。、；：！？（）【】《》“”‘’…"


def words(text: str) -> list[str]:
    """Words as the repetition rule sees them: whitespace-separated, lower-cased, stripped of surrounding
    punctuation ("Circle," == "circle"); every CJK character is a word; tokens without a letter or digit
    (punctuation, symbols, control characters) are not words."""
    out = []
    for w in _WORD.findall(text):
        w = w.strip(_PUNCT).lower()
        if any(ch.isalnum() for ch in w):
            out.append(w)
    return out


def longest_run(text: str) -> tuple[str | None, int]:
    """The word repeated most often in a row, and how many times (("", 0) for no words)."""
    best, best_n, prev, n = None, 0, None, 0
    for w in words(text):
        n = n + 1 if w == prev else 1
        prev = w
        if n > best_n:
            best, best_n = w, n
    return best, best_n


def refusal(text: str) -> str | None:
    """The refusal phrase the caption contains, or None."""
    low = text.lower().replace("\u2019", "'")
    return next((p for p in REFUSALS if p in low), None)


@dataclass(frozen=True)
class CaptionFilter:
    """The released filter with its bounds as options."""

    min_chars: int = 50  # shorter captions are rejected (characters, after stripping surrounding whitespace)
    max_chars: int = 3500  # longer captions are rejected
    repeat_limit: int = 8  # a run of this many identical consecutive words rejects the caption

    def problem(self, text: str | None) -> str | None:
        """Why the caption is rejected ("rule: detail"), or None when it passes."""
        text = (text or "").strip()
        if not text:
            return "empty: the captioner wrote nothing"
        if not words(text):
            return "empty: no words, only punctuation or symbols"
        phrase = refusal(text)
        if phrase is not None:
            return f"refusal: contains {phrase!r}"
        word, n = longest_run(text)
        if n >= self.repeat_limit:
            return f"repetition: {word!r} {n} times in a row (--repeat-limit {self.repeat_limit})"
        if len(text) < self.min_chars:
            return f"too short: {len(text)} characters (--min-chars {self.min_chars})"
        if len(text) > self.max_chars:
            return f"too long: {len(text)} characters (--max-chars {self.max_chars})"
        return None


def rule(reason: str) -> str:
    """The rule name of a `CaptionFilter.problem` reason ("too short: 12 ..." -> "too short")."""
    return reason.split(":", 1)[0]
