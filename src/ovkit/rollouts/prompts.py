"""RL and eval prompts: a sample-table row encoded once with its stage instruction, images capped.

Used by rl-curate, rl-train, eval and mismatch-report: every command that samples from prompts with verifiable
answers encodes them the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ovkit.errors import OvkitError


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
    mode: str,
    system: bool,
    max_pixels: int | None = None,
    extra: str = "",
    tools: Any = None,
) -> list[Prompt]:
    """Encode every row of an RL sample table: the stage instruction appended (ovkit.prompts), then `extra` (an
    environment's instruction, e.g. the zoom tool's syntax), images capped; `tools`: an environment's tool schemas
    for the chat template."""
    from ovkit.models.encode import decode_images, encode_prompt
    from ovkit.prompts import with_instruction

    rows = table.to_pylist()
    if rows and "answer" not in rows[0]:
        raise OvkitError("the RL data has no 'answer' column: rl-curate / rl-train need verifiable answers")
    out = []
    for row in rows:
        messages = [m for m in row["messages"] if m["role"] != "assistant"]
        images = [cap_pixels(im, max_pixels) for im in decode_images(row.get("images"))]
        encoded = encode_prompt(
            processor, with_extra(with_instruction(messages, mode, system=system), extra), images, tools=tools
        )
        out.append(
            Prompt(
                id=str(row["id"]),
                encoded=encoded,
                answer=str(row.get("answer") or ""),
                answer_type=row.get("answer_type"),
                source=str(row.get("source") or ""),
                category=str(row.get("category") or "none"),
                reward_kwargs=_reward_kwargs(row.get("reward_kwargs"), str(row["id"])),
                images=images,
                image_cells=list(row.get("images") or []),
            )
        )
    return out


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
