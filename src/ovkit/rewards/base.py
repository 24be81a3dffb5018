"""The value every scorer returns, and the small parsers of the `answer` column that several scorers share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ovkit.errors import OvkitError

# Model output is untrusted: every scorer looks at no more than this many characters of a completion, so a
# pathological completion costs a bounded amount of work (the released SVG reward skipped code >= 50,000 chars).
MAX_COMPLETION_CHARS = 100_000


@dataclass
class Reward:
    """A reward in [0, 1] and the named parts it was made from (e.g. `iou`, `format`, `timeout`)."""

    reward: float
    parts: dict[str, Any] = field(default_factory=dict)


def clip01(x: float) -> float:
    """Clamp to [0, 1]; NaN (e.g. SSIM of two constant images in some libraries) counts as 0."""
    if x != x:
        return 0.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else float(x)


def gold_json(answer: str, what: str) -> Any:
    """The `answer` column of a structured type is JSON text; a malformed gold answer is a data error."""
    try:
        return json.loads(answer)
    except (TypeError, ValueError) as e:
        raise OvkitError(
            f"column 'answer': expected JSON {what}, got {str(answer)[:80]!r} ({e}); fix the data"
        ) from None


def alternatives(answer: str) -> list[str]:
    """Gold answers: a JSON list of strings means "any of these" (the released RL data stores `answer` as a list)."""
    text = answer.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            value = json.loads(text)
        except ValueError:
            return [answer]
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return value
    return [answer]
