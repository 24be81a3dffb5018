"""Low-precision samplers that run on any device: weights rounded to a low-precision grid and kept dequantised, so
the sampler computes with the rounding error of a low-bit engine but the ordinary kernels (weight-only quantisation,
the W8A16 / FP8-weight formats of serving engines).

    int8 (CUDA)   per output channel, symmetric: 255 levels scaled by the row's max |w|
    fp8           per output channel: w / s cast to float8_e4m3fn and back, s = the row's max |w| / 448
    int4          per group of 64 inputs of each output row, symmetric: 16 levels (-8..7) scaled by the group's
                  max |w| / 7, as the group-wise W4 formats (GPTQ, AWQ) store them; a gap far larger than int8's

On CPU `int8` is torch's dynamic quantisation instead (int8 weights and activations, ovkit.generate.hf), the INT8
rollouts of Yao et al.; on CUDA that kernel does not exist, and the weight-only rounding here stands in for it.
"""

from __future__ import annotations

from typing import Any

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT4_GROUP = 64  # weights per int4 scale, along the input dimension


@torch.no_grad()
def round_weights(model: Any, kind: str) -> Any:
    """Round every Linear weight of `model` in place (tied weights once) to the `kind` grid; returns `model`."""
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        w = module.weight.data
        if kind == "int4":
            rows, cols = w.shape
            g = torch.nn.functional.pad(w.float(), (0, (-cols) % INT4_GROUP)).reshape(rows, -1, INT4_GROUP)
            step = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.0
            w.copy_(((g / step).round().clamp(-8, 7) * step).reshape(rows, -1)[:, :cols].to(w.dtype))
            continue
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        if kind == "int8":
            q = (w.float() / scale * 127.0).round().clamp(-127, 127) * scale / 127.0
        elif kind == "fp8":
            q = (w.float() / scale * FP8_MAX).to(torch.float8_e4m3fn).float() * scale / FP8_MAX
        else:
            raise ValueError(f"no weight rounding for {kind!r}")
        w.copy_(q.to(w.dtype))
    return model
