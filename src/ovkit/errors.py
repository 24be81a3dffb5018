"""Errors a user can cause. The CLI prints their message and exits with code 2 (3 for OutOfMemory); anything else is a
bug (exit 1)."""

from __future__ import annotations


class OvkitError(Exception):
    """Bad usage or bad input: the message names the file, row and column, and says how to fix it."""

    exit_code = 2


class OutOfMemory(OvkitError):
    """The device ran out of memory: the message names the stage, the step and the options that need less."""

    exit_code = 3


def where(file: object, row: object = None, column: str | None = None) -> str:
    """`file data.parquet, row 'abc' (index 12), column 'messages'` -- the one way errors locate bad input."""
    parts = [f"file {file}"]
    if row is not None:
        parts.append(f"row {row}")
    if column is not None:
        parts.append(f"column '{column}'")
    return ", ".join(parts)
