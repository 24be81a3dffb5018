"""The rollout table: one row per sampled trajectory, written by eval (`--save-logprobs`) and rl-train, read by
rl-train and mismatch-report. Token-in/token-out: the learner re-scores exactly `prompt_ids + response_ids`, never
a re-tokenised text (issue trackers of TRL, verl and OpenRLHF, "decode-then-re-encode token drift").

| column | arrow type | meaning |
|---|---|---|
| `prompt_id` | string | the `id` of the prompt row |
| `group` | int64 | trajectories sampled for the same prompt in the same step share a group (GRPO's group) |
| `version` | int64 | policy version (weight-sync count / step) of the sampler that produced it; 0 for eval |
| `prompt_ids` | list<int32> | prompt token ids as the model saw them (image placeholders expanded) |
| `response_ids` | list<int32> | every token after the prompt: sampled tokens and, in multi-turn rollouts, the tokens of
later user turns/observations |
| `loss_mask` | list<int8> | per response token: 1 = sampled by the policy (trained on), 0 = environment/observation
token |
| `behave_logprobs` | list<float32> | per response token: the sampler's log-prob (after temperature/top-p); 0 where
loss_mask is 0 |
| `reward` | float64 | the trajectory's reward in [0, 1] |
| `reward_parts` | string (JSON) | the reward's named parts (accuracy, format, iou, timeout, ...) |
| `finish_reason` | string | stop / length (multi-turn: of the last turn; `abort`/`error` when an environment failed) |
| `turns` | int32 | assistant turns in the trajectory (1 for single-turn) |
| `category`, `source`, `answer`, `answer_type` | string | copied from the prompt row |

Optional columns: `completion` (string, the decoded response), `images` (the prompt row's images, then any images
an environment returned, same type as the sample table, so mismatch-report can re-run the learner on multimodal
prompts without the dataset), and for multi-turn rollouts `turn_ids` (list<int32>, one per response token: its
assistant turn, 0 = first; observation tokens carry the turn before them) and `termination` (string: completed,
env_done, max_turns, truncated, env_error). Any other column is kept.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ovkit.data.io import parquet_files, read_table
from ovkit.data.parts import write_table
from ovkit.data.schema import IMAGE, compatible, image_problem
from ovkit.errors import OvkitError, where

ROLLOUT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("group", pa.int64()),
        ("version", pa.int64()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behave_logprobs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("reward_parts", pa.string()),
        ("finish_reason", pa.string()),
        ("turns", pa.int32()),
        ("category", pa.string()),
        ("source", pa.string()),
        ("answer", pa.string()),
        ("answer_type", pa.string()),
    ]
)
OPTIONAL_COLUMNS: dict[str, pa.DataType] = {
    "completion": pa.string(),
    "images": pa.list_(IMAGE),
    "turn_ids": pa.list_(pa.int32()),  # multi-turn: each response token's assistant turn (observations: the one before)
    "termination": pa.string(),  # multi-turn: completed | env_done | max_turns | truncated | env_error
}
FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})
TERMINATIONS = ("completed", "env_done", "max_turns", "truncated", "env_error")  # as ovkit.rollouts.episodes
ROLLOUTS_FILE = "rollouts.parquet"


def rollouts_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Build a rollout table from dicts with the schema's keys (`reward_parts` may be a dict; `loss_mask` defaults to
    all ones, `turns` to 1, `version` to 0). Checks every row (`check_rollouts`)."""
    rows = [_defaults(r) for r in rows]
    names = [f.name for f in ROLLOUT_SCHEMA]
    extra = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in names]
    columns = {f.name: pa.array([r.get(f.name) for r in rows], type=f.type) for f in ROLLOUT_SCHEMA}
    for k in extra:
        columns[k] = pa.array([r.get(k) for r in rows], type=OPTIONAL_COLUMNS.get(k))
    table = pa.table(columns) if rows else ROLLOUT_SCHEMA.empty_table()
    check_rollouts(table)
    return table


def _defaults(row: Mapping[str, Any]) -> dict[str, Any]:
    r = dict(row)
    n = len(r.get("response_ids") or [])
    r.setdefault("loss_mask", [1] * n)
    r.setdefault("version", 0)
    r.setdefault("turns", 1)
    if not isinstance(r.get("reward_parts"), (str, type(None))):
        r["reward_parts"] = json.dumps(r["reward_parts"], sort_keys=True, default=_plain)
    return r


def _plain(v: Any) -> Any:
    return float(v) if hasattr(v, "__float__") else str(v)


def check_rollouts(table: pa.Table, path: Path | str = "<rollouts>") -> None:
    """Every required column with its type, and per row: one mask value and one log-prob per response token."""
    for f in ROLLOUT_SCHEMA:
        if f.name not in table.column_names:
            raise OvkitError(
                f"{where(path, column=f.name)}: required rollout column is missing (columns: "
                f"{', '.join(table.column_names)})"
            )
        got = table.schema.field(f.name).type
        if not got.equals(f.type) and not pa.types.is_null(got):
            raise OvkitError(f"{where(path, 'every row', f.name)}: type is {got}, expected {f.type}")
    ids = table.column("prompt_id").to_pylist()
    resp = table.column("response_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    logps = table.column("behave_logprobs").to_pylist()
    reasons = table.column("finish_reason").to_pylist()
    for i, (rid, r, m, lp, fr) in enumerate(zip(ids, resp, masks, logps, reasons)):
        n = len(r or [])
        if len(m or []) != n:
            raise OvkitError(
                f"{where(path, f'{rid!r} (index {i})', 'loss_mask')}: {len(m or [])} values for {n} response tokens"
            )
        if len(lp or []) != n:
            raise OvkitError(
                f"{where(path, f'{rid!r} (index {i})', 'behave_logprobs')}: {len(lp or [])} values for {n} response "
                f"tokens"
            )
        if fr not in FINISH_REASONS:
            raise OvkitError(
                f"{where(path, f'{rid!r} (index {i})', 'finish_reason')}: {fr!r} is not one of "
                f"{', '.join(sorted(FINISH_REASONS))}"
            )
    if "turn_ids" in table.column_names:
        for i, (rid, r, t) in enumerate(zip(ids, resp, table.column("turn_ids").to_pylist())):
            if t is not None and len(t) != len(r or []):
                raise OvkitError(
                    f"{where(path, f'{rid!r} (index {i})', 'turn_ids')}: {len(t)} values for {len(r or [])} "
                    f"response tokens"
                )
    if "termination" in table.column_names:
        for i, (rid, t) in enumerate(zip(ids, table.column("termination").to_pylist())):
            if t is not None and t not in TERMINATIONS:
                raise OvkitError(
                    f"{where(path, f'{rid!r} (index {i})', 'termination')}: {t!r} is not one of "
                    f"{', '.join(TERMINATIONS)}"
                )


def write_rollouts(rows: pa.Table | Iterable[Mapping[str, Any]], path: Path | str) -> Path:
    """Write a rollout table (or rows) to one parquet file, atomically."""
    table = rows if isinstance(rows, pa.Table) else rollouts_table(rows)
    check_rollouts(table, path)
    return write_table(table, path)


def read_rollouts(path: Path | str, columns: Iterable[str] | None = None, *, vocab_size: int | None = None) -> pa.Table:
    """Read a rollout file, a directory of rollout shards, or a run directory holding `rollouts.parquet`, and check
    what a reader re-runs (`check_rollout_values`: token ids below `vocab_size` when given, finite log-probs,
    decodable images)."""
    path = Path(path)
    if path.is_dir() and (path / ROLLOUTS_FILE).is_file():
        path = path / ROLLOUTS_FILE
    parquet_files(path)  # a clear error for a missing path
    table = read_table(path, columns=list(columns) if columns is not None else None)
    if columns is None or set(ROLLOUT_SCHEMA.names) <= set(columns):
        check_rollouts(table, path)
        check_rollout_values(table, path, vocab_size)
    return table


def check_rollout_values(table: pa.Table, path: Path | str, vocab_size: int | None = None) -> None:
    """The values a reader feeds to a model or a figure: token ids in [0, vocab_size) (an id past the embedding is an
    IndexError deep in the forward pass), finite behaviour log-probs (NaN or inf cannot be a sampled token's), and
    images that decode. Checked when a table is read, not when one is written: a sampler's NaN must not stop a run."""
    ids = table.column("prompt_id").to_pylist()

    def fail(i: int, column: str, reason: str) -> None:
        raise OvkitError(f"{where(path, f'{ids[i]!r} (index {i})', column)}: {reason}")

    for name, typ in OPTIONAL_COLUMNS.items():
        if name in table.column_names and not compatible(table.schema.field(name).type, typ):
            raise OvkitError(
                f"{where(path, 'every row', name)}: type is {table.schema.field(name).type}, expected {typ}"
            )
    for column in ("prompt_ids", "response_ids", "behave_logprobs"):
        if pa.types.is_null(table.schema.field(column).type):
            raise OvkitError(f"{where(path, 'every row', column)}: every value is null")
    empty = pc.fill_null(pc.equal(pc.list_value_length(table.column("prompt_ids")), 0), True)
    if pc.any(empty).as_py():
        fail(pc.index(empty, True).as_py(), "prompt_ids", "no prompt tokens")
    for column in ("prompt_ids", "response_ids"):
        values = pc.list_flatten(table.column(column))
        bad = (
            pc.less(values, 0)
            if vocab_size is None
            else pc.or_(pc.less(values, 0), pc.greater_equal(values, vocab_size))
        )
        if pc.any(bad).as_py():
            k = pc.index(bad, True).as_py()
            row = pc.list_parent_indices(table.column(column))[k].as_py()
            v = values[k].as_py()
            fail(
                row,
                column,
                f"token id {v} is negative"
                if v < 0
                else f"token id {v} is outside the model's vocabulary [0, {vocab_size})",
            )
    logprobs = table.column("behave_logprobs")
    finite = pc.is_finite(pc.list_flatten(logprobs))
    if not pc.all(finite, min_count=0).as_py():
        k = pc.index(finite, False).as_py()
        fail(
            pc.list_parent_indices(logprobs)[k].as_py(),
            "behave_logprobs",
            f"log-prob {pc.list_flatten(logprobs)[k].as_py()} is not finite",
        )
    if "images" in table.column_names:
        checked: set[int] = set()  # a group's rollouts repeat their prompt's images: decode each picture once
        for i, cells in enumerate(table.column("images").to_pylist()):
            for k, cell in enumerate(cells or []):
                key = hash((cell or {}).get("bytes"))
                if key in checked:
                    continue
                problem = image_problem(cell)
                if problem:
                    fail(i, "images", f"image {k}: {problem}")
                checked.add(key)
