"""One precision option for every command, named as Lightning and accelerate users expect.

| `--precision` | weights used in compute | master weights, gradients, optimiser state | per-op casts |
|---|---|---|---|
| `fp32` (`32`, `32-true`) | fp32 | fp32 | none |
| `bf16-mixed` (`bf16`) | bf16 | fp32 master copy, fp32 gradient accumulation, fp32 AdamW state (MixedPrecisionAdamW) |
none |
| `bf16-true` | bf16 | bf16 (pure bf16: half the memory, Lightning's `bf16-true`) | none |
| `auto` | `bf16-mixed` on a CUDA device with bf16, else `fp32` | | |

`bf16-mixed` keeps the model itself in bf16, so a forward pass runs no dtype casts (autocast over fp32 weights re-casts
every weight at every op: 4,381 casts in one profiled step); the optimiser holds the fp32 truth and copies it back
after each step (Micikevicius et al. 2018, "Mixed Precision Training"). Under DDP (gradients are all-reduced from
the bf16 parameters' `.grad`) it is accelerate's bf16 autocast over fp32 weights instead, and under FSDP / DeepSpeed
the engine's own mixed-precision policy (bf16 compute, fp32 sharded master weights): `Precision.engine_policy` says
which. Commands that only generate or score use the weight dtype alone. How each precision combines with the
optimiser (`--optim`: bitsandbytes' 8-bit AdamW, the Kahan-compensated bf16 AdamW) is ovkit.runtime.optim's table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ovkit.choices import AMBIGUOUS, PRECISIONS  # noqa: F401 (re-exported: one definition, torch-free)
from ovkit.choices import PRECISION_ALIASES as ALIASES  # noqa: F401
from ovkit.choices import canonical_precision as canonical  # noqa: F401


@dataclass(frozen=True)
class Precision:
    name: str  # fp32 | bf16-mixed | bf16-true (auto resolved)
    requested: str

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights used in compute."""
        return torch.float32 if self.name == "fp32" else torch.bfloat16

    @property
    def master_weights(self) -> bool:
        return self.name == "bf16-mixed"

    def as_dict(self) -> dict[str, str]:
        return {"requested": self.requested, "used": self.name}


def resolve(requested: str, device: torch.device | str) -> Precision:
    name = canonical(requested)
    device = torch.device(device)
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return Precision("bf16-mixed" if bf16 else "fp32", "auto")
    return Precision(name, requested)
