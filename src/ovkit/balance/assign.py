"""Assigning concepts to images by matching concept strings in captions (`--method text`), and what both ways share:
the concepts file, batching, index lists. The embedding way (`--method embed`, LLaVA-OneVision-1.5's: top-K by
CLIP-family similarity) is ovkit.balance.embed, which needs torch; this module does not, so balance's inputs are
checked before torch loads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ovkit.errors import OvkitError


def read_concepts(path: Path) -> list[str]:
    """One concept per line; blank lines and `#` comments ignored; duplicates are an error (they split counts)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise OvkitError(f"cannot read concepts file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise OvkitError(
            f"file {path}: not UTF-8 text (byte {e.start}); a concepts file has one concept per line"
        ) from None
    concepts, seen = [], {}
    for n, line in enumerate(lines, 1):
        c = line.strip()
        if not c or c.startswith("#"):
            continue
        if c in seen:
            raise OvkitError(f"file {path}, line {n}: concept {c!r} repeats line {seen[c]}")
        seen[c] = n
        concepts.append(c)
    if not concepts:
        raise OvkitError(f"file {path}: no concepts")
    return concepts


# ---- text matching ------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[\u3400-\u9fff]")


def _tokens(text: str) -> list[str]:
    # Latin words (English plurals folded: "two red squares" matches "red square"), and each CJK character on its
    # own (Chinese has no spaces between words).
    return [_singular(t) for t in _TOKEN.findall(text.lower())]


def _singular(w: str) -> str:
    if len(w) <= 3 or not w.endswith("s") or w.endswith("ss"):
        return w
    if w.endswith(("sses", "xes", "shes", "ches", "zes")):
        return w[:-2]
    return w[:-1]


@dataclass
class TextMatcher:
    """Whole-word (or whole-character for CJK) substring matching of concepts in text, linear in the text length."""

    index: dict[tuple[str, ...], int]
    max_len: int

    @classmethod
    def build(cls, concepts: Sequence[str]) -> TextMatcher:
        index: dict[tuple[str, ...], int] = {}
        for i, c in enumerate(concepts):
            toks = tuple(_tokens(c))
            if toks and toks not in index:
                index[toks] = i
        return cls(index, max((len(t) for t in index), default=1))

    def match(self, text: str) -> list[int]:
        toks = _tokens(text)
        found: dict[int, None] = {}
        for start in range(len(toks)):
            for n in range(1, min(self.max_len, len(toks) - start) + 1):
                i = self.index.get(tuple(toks[start : start + n]))
                if i is not None:
                    found.setdefault(i)
        return list(found)


# ---- encoders ------------------------------------------------------------------------------------------------------


def batched(items: Iterable, n: int) -> Iterator[list]:
    batch = []
    for x in items:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def as_index_lists(idx: np.ndarray) -> list[list[int]]:
    return [list(map(int, r)) for r in idx]
