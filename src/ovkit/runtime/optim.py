"""The optimiser every learner uses: AdamW with the recipe's eps, weight decay on matrices only, and fp32 master
weights when the model computes in bf16 (`--precision bf16-mixed`)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Iterable

import torch

ADAM_EPS = 1e-5  # LLaVA-OneVision-1.5 (and its RL stage)
BETAS = (0.9, 0.999)


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float, lrs: dict[int, float] | None = None) -> list[dict[str, Any]]:
    """Weight decay on matrices only: biases, norms and other 1-D parameters are not decayed (Megatron / HF).
    `lrs`: {id(parameter): lr} for parameters with their own learning rate (e.g. the vision encoder's)."""
    params = [p for p in params if p.requires_grad]
    lrs = lrs or {}
    groups = []
    for lr in [None, *sorted(set(lrs.values()))]:
        own = [p for p in params if lrs.get(id(p)) == lr]
        extra = {} if lr is None else {"lr": lr}
        groups += [{"params": [p for p in own if p.dim() >= 2], "weight_decay": weight_decay, **extra}, {"params": [p for p in own if p.dim() < 2], "weight_decay": 0.0, **extra}]
    return [g for g in groups if g["params"]]


def adamw(params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float, master_weights: bool = False, fused: bool = True, lrs: dict[int, float] | None = None) -> torch.optim.Optimizer:
    """AdamW (eps 1e-5). `master_weights`: the parameters are bf16 and the optimiser keeps fp32 copies
    (MixedPrecisionAdamW). `fused`: torch's fused kernel (CPU and CUDA; ~4x the per-tensor loop on small models, the
    default of transformers' Trainer), where the device and dtype allow."""
    groups = param_groups(params, weight_decay, lrs)
    cls = MixedPrecisionAdamW if master_weights else torch.optim.AdamW
    if fused:
        try:
            return cls(groups, lr=lr, eps=ADAM_EPS, betas=BETAS, fused=True)
        except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not support
            pass
    return cls(groups, lr=lr, eps=ADAM_EPS, betas=BETAS)


class MixedPrecisionAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision (bf16) parameters.

    Each bf16 parameter's gradient is added into its fp32 master's `.grad` as soon as it is accumulated (a
    post-accumulate-grad hook) and freed, so gradient accumulation over micro-batches happens in fp32 and no bf16
    gradient outlives its backward. `step` updates the masters and copies them (rounded) into the parameters. The
    masters are part of `state_dict`, so a resumed run continues from the exact fp32 values. Clip with
    `clip_grad_norm_` (the masters hold the gradients). For single-process and FSDP-free runs: under DDP the
    all-reduce reads the parameters' `.grad`, so DDP runs use autocast instead (ovkit.runtime.precision).
    """

    def __init__(self, groups: list[dict[str, Any]], **kw: Any):
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        master_groups = []
        for g in groups:
            masters = []
            for p in g["params"]:
                m = p.detach().to(torch.float32, copy=True).requires_grad_(True)
                self.pairs.append((p, m))
                masters.append(m)
            master_groups.append({**g, "params": masters})
        super().__init__(master_groups, **kw)
        self.hooks = [p.register_post_accumulate_grad_hook(partial(_into_master, m)) for p, m in self.pairs]

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = super().step(closure)
        for p, m in self.pairs:
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p, _ in self.pairs:
            p.grad = None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return _clip([m for _, m in self.pairs], max_norm)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["master_weights"] = [m.detach().clone() for _, m in self.pairs]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        if masters is not None:
            with torch.no_grad():
                for (p, m), saved in zip(self.pairs, masters):
                    m.copy_(saved)
                    p.copy_(saved)


def _into_master(master: torch.Tensor, param: torch.Tensor) -> None:
    if master.grad is None:
        master.grad = param.grad.to(torch.float32)
    else:
        master.grad.add_(param.grad)
    param.grad = None


def clip_grad_norm(optimizer: Any, params: list[torch.nn.Parameter], max_norm: float, accelerator: Any = None) -> torch.Tensor:
    """Clip the gradient (global L2 norm; max_norm 0: measure only) and return its norm before clipping, wherever
    the gradient lives (the fp32 masters, or the parameters, through accelerate under DDP/FSDP). The norm stays a
    device tensor (reading it is a device-to-host sync: the loop reads it with the step's other metrics), and the
    per-tensor norms are one foreach kernel (torch uses foreach only on CUDA unless asked)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    if isinstance(inner, MixedPrecisionAdamW):
        return inner.clip_grad_norm_(max_norm)
    engine = accelerator is not None and (accelerator.distributed_type.value not in ("NO", "MULTI_CPU", "MULTI_GPU") or accelerator.scaler is not None)
    if engine and max_norm > 0:
        return accelerator.clip_grad_norm_(params, max_norm)  # FSDP / DeepSpeed's sharded norm, fp16's unscaling
    return _clip(params, max_norm)


def _clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    grads = [p for p in params if p.grad is not None]
    foreach = bool(grads) and all(p.grad.device.type in ("cpu", "cuda") for p in grads)
    return torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else math.inf, foreach=foreach)


def cosine_factor(step: int, n_steps: int, warmup_ratio: float, min_ratio: float) -> float:
    """Multiplier of the peak lr for 0-based `step`: linear warmup over warmup_ratio of the steps (at least one step
    when the ratio is > 0), then cosine to `min_ratio` at the last step."""
    warmup = math.ceil(warmup_ratio * n_steps) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    decay = max(n_steps - warmup - 1, 1)
    progress = min((step - warmup) / decay, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def constant_factor(step: int, n_steps: int, warmup_ratio: float) -> float:
    """A constant learning rate after a linear warmup over warmup_ratio of the steps (the recipe's RL schedule)."""
    warmup = round(warmup_ratio * n_steps)
    return min(1.0, (step + 1) / warmup) if warmup else 1.0
