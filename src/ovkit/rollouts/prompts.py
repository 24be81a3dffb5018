"""RL and eval prompts: a sample-table row encoded once with its stage instruction, images capped.

Used by rl-curate, rl-train, eval (and eval while training) and mismatch-report: every command that samples from
prompts with verifiable answers encodes them the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ovkit.errors import OvkitError

# The category of a row without one: eval's task name for those rows and rl-train's / rl-curate's key for their
# rewards, so a held-out score and an RL metric of such rows carry one name ("none" read as the `--prompt none` mode,
# and as a category someone could have named so).
UNCATEGORIZED = "uncategorized"


@dataclass
class Prompt:
    """One RL row, encoded with its stage instruction."""

    id: str
    encoded: Any  # ovkit.models.encode.Encoded (prompt + generation prompt)
    answer: str
    answer_type: str | None
    source: str
    category: str
    reward_kwargs: Any = None  # dict or None
    images: list = field(default_factory=list)  # PIL images (vLLM re-processes them; HF uses `encoded`)
    image_cells: list = field(default_factory=list)  # the row's `images` cells, for rollout tables
    messages: list = field(default_factory=list)  # the turns as the model is asked them (instruction, system prompt)


def cap_pixels(image: Any, max_pixels: int | None) -> Any:
    """Downscale (keeping the aspect ratio) so that width * height <= max_pixels (the recipe caps at 512 x 512)."""
    if not max_pixels or image.width * image.height <= max_pixels:
        return image
    f = math.sqrt(max_pixels / (image.width * image.height))
    return image.resize((max(1, int(image.width * f)), max(1, int(image.height * f))))


def _reward_kwargs(value: Any, rid: str) -> Any:
    if value is None or value == "" or isinstance(value, dict):
        return value or None
    try:
        return json.loads(value)
    except (TypeError, ValueError) as e:
        raise OvkitError(f"row {rid!r}, column 'reward_kwargs': not JSON ({e})") from None


def encode_prompts(
    table: Any,
    processor: Any,
    *,
    mode: str | Sequence[str],
    system: bool,
    max_pixels: int | None = None,
    extra: str = "",
    tools: Any = None,
    progress: bool = False,
) -> list[Prompt]:
    """Encode every row of an RL or eval sample table (a pyarrow table or a list of row dicts): trailing assistant
    turns dropped (a gold answer must not be asked back; earlier turns of a conversation stay as its context), the stage
    instruction of `mode`
    (one for every row, or one per row: eval's `--prompt auto`) appended (ovkit.prompts), then `extra` (an
    environment's instruction, e.g. the zoom tool's syntax), the system prompt with `system`, images capped at
    `max_pixels`; `tools`: an environment's tool schemas for the chat template."""
    from tqdm.auto import tqdm

    rows = table.to_pylist() if hasattr(table, "to_pylist") else list(table)
    if rows and "answer" not in rows[0]:
        raise OvkitError("the RL data has no 'answer' column: rl-curate / rl-train need verifiable answers")
    modes = [mode] * len(rows) if isinstance(mode, str) else list(mode)
    if len(modes) != len(rows):
        raise ValueError(f"mode: {len(modes)} for {len(rows)} rows")
    bar = tqdm(rows, desc="encode", unit="row", leave=False, disable=not progress)
    return [
        encode_row(row, processor, mode=m, system=system, max_pixels=max_pixels, extra=extra, tools=tools)
        for row, m in zip(bar, modes)
    ]


def encode_row(
    row: dict[str, Any],
    processor: Any,
    *,
    mode: str,
    system: bool,
    max_pixels: int | None = None,
    extra: str = "",
    tools: Any = None,
) -> Prompt:
    """One row as a Prompt (`encode_prompts`)."""
    from ovkit.models.encode import decode_images, encode_prompt
    from ovkit.prompts import with_instruction

    rid = str(row["id"])
    asked = list(row["messages"])
    while asked and asked[-1]["role"] == "assistant":  # the gold answer is not asked back; earlier turns are context
        asked.pop()
    messages = with_extra(with_instruction(asked, mode, system=system), extra)
    images = [cap_pixels(im, max_pixels) for im in decode_images(row.get("images"))]
    return Prompt(
        id=rid,
        encoded=encode_prompt(processor, messages, images, tools=tools),
        answer=str(row.get("answer") or ""),
        answer_type=row.get("answer_type"),
        source=str(row.get("source") or ""),
        category=str(row.get("category") or UNCATEGORIZED),
        reward_kwargs=_reward_kwargs(row.get("reward_kwargs"), rid),
        images=images,
        image_cells=list(row.get("images") or []),
        messages=messages,
    )


def with_extra(messages: list[dict[str, Any]], extra: str) -> list[dict[str, Any]]:
    """`extra` appended to the last user turn (on its own line)."""
    if not extra:
        return messages
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user":
            m["content"] = f"{m['content']}\n{extra}"
            break
    return out


def categories_of(table) -> list[str | None]:
    """Each row's category (None for every row of a table without the column)."""
    return table.column("category").to_pylist() if "category" in table.column_names else [None] * table.num_rows


def limit_per_category(table, limit: int | None):
    """The first `limit` rows of each category, in their original order (all rows when limit is None)."""
    import pyarrow as pa

    if limit is None:
        return table
    seen: dict[str, int] = {}
    keep = []
    for i, cat in enumerate(categories_of(table)):
        seen[cat] = seen.get(cat, 0) + 1
        if seen[cat] <= limit:
            keep.append(i)
    return table.take(pa.array(keep, pa.int64()))
