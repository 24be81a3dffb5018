"""How good a caption is without a judge model: the share of an image's ground-truth concepts it mentions.

The synthetic corpus (and any data with a `concepts` column: a JSON list of concept strings per row) says which
concepts each image shows. A caption's concept recall is the fraction of them it names. Concepts are English
phrases, so recall is measured on English captions only: a concept counts as mentioned when its words appear in
order as whole words, case-insensitively, the last word also in a plural form ("yellow square" is mentioned by
"two yellow squares"). Nothing else is read into the caption (a caption that names every concept of the vocabulary
would score 1: recall, not precision, which is why this compares two captioners on the same images rather than
grading one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")


def has_cjk(text: str | None) -> bool:
    return bool(text) and _CJK.search(text) is not None


@lru_cache(maxsize=4096)
def concept_pattern(concept: str) -> re.Pattern:
    parts = [re.escape(w) for w in concept.lower().split()]
    parts[-1] += r"(?:s|es)?"
    return re.compile(r"(?<!\w)" + r"\s+".join(parts) + r"(?!\w)")


def parse_concepts(cell: Any) -> list[str] | None:
    """A `concepts` cell (JSON list of strings, or a list) -> the concepts; None when the row has no usable ground
    truth (null, not JSON, not a list of non-empty strings, or empty)."""
    if cell is None:
        return None
    if isinstance(cell, str):
        try:
            cell = json.loads(cell)
        except json.JSONDecodeError:
            return None
    if not isinstance(cell, list) or not cell or not all(isinstance(c, str) and c.strip() for c in cell):
        return None
    return list(dict.fromkeys(cell))


def concept_recall(caption: str | None, concepts: Sequence[str]) -> float:
    """Fraction of `concepts` the caption mentions (0.0 for an empty caption)."""
    text = (caption or "").lower()
    return sum(1 for c in concepts if concept_pattern(c).search(text)) / len(concepts)


def mean_recall(pairs: Iterable[tuple[str | None, Sequence[str]]]) -> tuple[float | None, int]:
    """Mean per-caption concept recall over (caption, concepts) pairs, and how many there were (None if none)."""
    scores = [concept_recall(caption, concepts) for caption, concepts in pairs]
    return (sum(scores) / len(scores) if scores else None), len(scores)
