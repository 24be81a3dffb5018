"""Offline packing: measure every sample with the model's processor, pack globally, train on packed rows.

- `ovkit pack` (plan.py): lengths (lengths.py) -> best-fit-decreasing (binpack.py) -> PLAN/plan.parquet,
  stats.json (stats.py), fill.png.
- Training input (packed.py): `PackedDataset(plan_dir, data, processor, model_or_config)` yields packed rows that
  `model(**item)` takes directly (batch dim 1): per-sample positions (3D rope for the Qwen-VL family), attention
  that never crosses samples, labels only on each sample's last assistant turn. `collate_packed(items)` batches
  them; `packed_row_stats(item, capacity)` gives the numbers to log. See packed.py for the exact item layout.
"""

from typing import Any

# Names -> defining module, imported on first use: `ovkit pack` and the benchmark need numpy, not torch.
_EXPORTS = {
    "best_fit_decreasing": "binpack",
    "first_fit_decreasing": "binpack",
    "PackConfig": "plan",
    "build_plan": "plan",
    "plan_stats": "plan",
    "read_plan": "plan",
    "PackedDataset": "packed",
    "PackLayout": "packed",
    "collate_packed": "packed",
    "cu_seqlens": "packed",
    "pack_encoded": "packed",
    "packed_row_stats": "packed",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ovkit.pack' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"ovkit.pack.{_EXPORTS[name]}"), name)
