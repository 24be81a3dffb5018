"""The training runtime (ovkit.runtime.core: `Runtime`, `Result`, the run-directory layout) and the pieces around it.

Importing this package costs nothing: `Runtime` and the other names of ovkit.runtime.core load torch, so they are
loaded on first use (PEP 562), and a config that only validates option names (ovkit.choices) fails in well
under a second, before torch and transformers import.
"""

from __future__ import annotations

import importlib
from typing import Any

_CORE = frozenset(
    {
        "Runtime",
        "Result",
        "CHECKPOINTS",
        "STATE",
        "RUN_STATE",
        "PROVENANCE",
        "step_dir",
        "list_checkpoints",
        "latest_checkpoint",
    }
)

__all__ = sorted(_CORE)


def __getattr__(name: str) -> Any:
    if name in _CORE:
        return getattr(importlib.import_module("ovkit.runtime.core"), name)
    raise AttributeError(f"module 'ovkit.runtime' has no attribute {name!r}")
