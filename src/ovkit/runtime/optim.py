"""The optimiser every learner uses: AdamW with the recipe's eps, weight decay on matrices only, in one of four
implementations (`--optim`, named as transformers' Trainer and EasyR1 name them), and the bytes each trainable
parameter costs with it (`bytes_per_param`, recorded in ovkit.json).

| `--optim` | `--precision fp32` | `bf16-mixed` | `bf16-true` | `auto` |
|---|---|---|---|---|
| `adamw_torch_fused` (default) | fused AdamW, 16 B/param | fp32 masters of bf16 weights (MixedPrecisionAdamW), 18 B |
bf16 AdamW state, 8 B (updates below bf16's resolution are lost) | fp32 on CPU, bf16-mixed on a bf16 GPU |
| `adamw_torch` | the same with torch's foreach kernels | the same, foreach | the same, foreach | as above |
| `adamw_8bit` | bitsandbytes AdamW8bit over fp32 weights, ~10 B | fp32 weights under bf16 autocast (no masters: the
weights are fp32), 8-bit state, ~10 B | 8-bit state over bf16 weights, ~6 B (bf16 drift as above) | as above |
| `adamw_bf16` | refused | refused | bf16 weights, m, v and a Kahan compensation buffer (KahanAdamW), 10 B | implies
bf16-true |

The byte counts are weights + gradients + optimiser state per trainable parameter (bitsandbytes keeps tensors of
fewer than 4,096 elements in 32-bit state, so a tiny model's 8-bit figure is higher). `--optimizer-in-backward`
(OptimizerInBackward) steps each parameter as soon as its gradient is complete and frees that gradient, so the
gradients' column drops to ~0: bf16-true + adamw_bf16 costs 8 B/param, fp32 12, bf16-mixed 14 (the fp32 master's
gradient lives only inside its parameter's step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch

from ovkit.choices import OPTIMS, check_optim  # noqa: F401 (re-exported: one definition, torch-free)
from ovkit.errors import OvkitError

ADAM_EPS = 1e-5  # LLaVA-OneVision-1.5 (and its RL stage)
BETAS = (0.9, 0.999)


def param_groups(
    params: Iterable[torch.nn.Parameter], weight_decay: float, lrs: dict[int, float] | None = None
) -> list[dict[str, Any]]:
    """Weight decay on matrices only: biases, norms and other 1-D parameters are not decayed (Megatron / HF).
    `lrs`: {id(parameter): lr} for parameters with their own learning rate (e.g. the vision encoder's)."""
    params = [p for p in params if p.requires_grad]
    lrs = lrs or {}
    groups = []
    for lr in [None, *sorted(set(lrs.values()))]:
        own = [p for p in params if lrs.get(id(p)) == lr]
        extra = {} if lr is None else {"lr": lr}
        groups += [
            {"params": [p for p in own if p.dim() >= 2], "weight_decay": weight_decay, **extra},
            {"params": [p for p in own if p.dim() < 2], "weight_decay": 0.0, **extra},
        ]
    return [g for g in groups if g["params"]]


def adamw(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    master_weights: bool = False,
    fused: bool = True,
    lrs: dict[int, float] | None = None,
    optim: str = "adamw_torch_fused",
) -> torch.optim.Optimizer:
    """AdamW (eps 1e-5) as `optim` names it (module docstring). `master_weights`: the parameters are bf16 and the
    optimiser keeps fp32 copies (MixedPrecisionAdamW; torch's AdamW only). `fused`: whether the run allows torch's fused
    kernel (CPU and CUDA; ~4x the per-tensor loop on small models, the default of transformers' Trainer); where the
    device or dtype does not support it, the foreach kernel runs instead."""
    groups = param_groups(params, weight_decay, lrs)
    if optim == "adamw_8bit":
        if master_weights:
            raise OvkitError(
                "--optim adamw_8bit keeps no fp32 master weights (bf16-mixed runs it over fp32 weights under autocast)"
            )
        return _adamw_8bit(groups, lr)
    if optim == "adamw_bf16":
        return KahanAdamW(groups, lr=lr, eps=ADAM_EPS, betas=BETAS)
    if optim not in ("adamw_torch_fused", "adamw_torch"):
        raise OvkitError(f"--optim must be one of {', '.join(OPTIMS)}; got {optim!r}")
    cls = MixedPrecisionAdamW if master_weights else torch.optim.AdamW
    if fused and optim == "adamw_torch_fused":
        try:
            return cls(groups, lr=lr, eps=ADAM_EPS, betas=BETAS, fused=True)
        except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not support
            pass
    return cls(groups, lr=lr, eps=ADAM_EPS, betas=BETAS, foreach=True)


def _adamw_8bit(groups: list[dict[str, Any]], lr: float) -> torch.optim.Optimizer:
    """bitsandbytes' block-wise 8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"),
    the optimiser transformers' Trainer runs for `adamw_8bit`; bitsandbytes >= 0.46 runs it on CPU tensors too."""
    try:
        # optional: the package (or this name in it) may be missing; imported only where it is used
        import bitsandbytes as bnb
    except ImportError:
        raise OvkitError(
            "--optim adamw_8bit needs bitsandbytes: pip install 'ovkit[qlora]' (or pip install 'bitsandbytes>=0.46')"
        ) from None
    return bnb.optim.AdamW8bit(groups, lr=lr, eps=ADAM_EPS, betas=BETAS)


class KahanAdamW(torch.optim.Optimizer):
    """AdamW for bf16 weights with bf16 state and Kahan-compensated updates: `--optim adamw_bf16` (EasyR1's name).

    This is torchdistx's AnyPrecisionAdamW (use_kahan_summation=True, bf16 momentum and variance), the optimiser
    EasyR1 runs for `adamw_bf16`: per parameter a bf16 m, v and compensation buffer, so weights + gradients + state
    are 2 + 2 + 2 + 2 + 2 = 10 bytes. A plain bf16 AdamW loses every update smaller than half a unit in the last
    place of the weight (lr 1e-5 times an O(1) Adam step is below bf16's 2^-8 relative resolution); here the update
    is added into the compensation buffer first, the buffer is added into the weight, and what the rounding lost
    stays in the buffer for the next step (Kahan 1965). Rounding is deterministic (no stochastic rounding), so a
    resumed run continues bit for bit without any RNG state. One difference from AnyPrecisionAdamW: the decoupled
    weight decay is part of the compensated update instead of a separate uncompensated `p *= 1 - lr * wd`, which
    bf16 would round away just the same. Every step is a handful of torch._foreach_* ops over each group's tensors.
    """

    def __init__(
        self,
        params: Any,
        *,
        lr: float,
        betas: tuple[float, float] = BETAS,
        eps: float = ADAM_EPS,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    st = self.state[p]
                    st["step"] = torch.tensor(0.0)
                    for name in ("exp_avg", "exp_avg_sq", "compensation"):
                        st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        states = [self.state[p] for p in params]
        grads = [p.grad for p in params]
        m, v, comp = ([s[k] for s in states] for k in ("exp_avg", "exp_avg_sq", "compensation"))
        (beta1, beta2), lr, wd = group["betas"], group["lr"], group["weight_decay"]
        torch._foreach_add_([s["step"] for s in states], 1.0)
        steps = [float(s["step"]) for s in states]  # equal within a group unless a parameter missed a step's gradient
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [math.sqrt(1 - beta2**t) for t in steps])
        torch._foreach_add_(denom, group["eps"])
        # the whole update (Adam step + decoupled decay, as torch's AdamW orders them) goes into the compensation ...
        torch._foreach_addcdiv_(comp, m, denom, [-lr / (1 - beta1**t) for t in steps])
        if wd:
            torch._foreach_add_(comp, params, alpha=-lr * wd)
        # ... which is added into the weight; what rounding to bf16 dropped stays in it (Kahan summation)
        before = torch._foreach_add(params, 0.0)  # a copy (the weights' values before this step)
        torch._foreach_add_(params, comp)
        torch._foreach_sub_(before, params)  # = before - after: exact (Sterbenz), minus what the weight took in
        torch._foreach_add_(comp, before)


def bytes_per_param(params: Iterable[torch.nn.Parameter], optimizer: Any) -> dict[str, Any]:
    """Measured bytes per trainable parameter of weights, gradients, master weights and optimiser state (every tensor
    in optimizer.state), each storage counted once. Call it after an optimiser step and before zero_grad: the state
    exists and the gradients are still there (for MixedPrecisionAdamW on the fp32 masters, the bf16 ones are freed;
    with OptimizerInBackward every gradient was freed in backward, after its parameter's step, and counts 0)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    params = list({id(p): p for p in params if p.requires_grad}.values())
    n = sum(p.numel() for p in params)
    seen: set[tuple[str, int]] = set()

    def nbytes(tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key not in seen and storage.nbytes():
                seen.add(key)
                total += storage.nbytes()
        return total

    own = {id(p) for p in params}
    masters = [q for g in inner.param_groups for q in g["params"] if id(q) not in own]
    optimizers = inner.optimizers if isinstance(inner, OptimizerInBackward) else [inner]
    state = [t for o in optimizers for s in o.state.values() for t in _tensors(s)]
    counts = {
        "weights": nbytes(params),
        "master_weights": nbytes(masters),
        "grads": nbytes([p.grad for p in params] + [q.grad for q in masters]),
        "optimizer_state": nbytes(state),
    }
    out: dict[str, Any] = {k: round(v / max(n, 1), 4) for k, v in counts.items()}
    out["total"] = round(sum(counts.values()) / max(n, 1), 4)
    out["trainable_params"] = n
    return out


def _tensors(obj: Any) -> Iterable[Any]:
    """Every tensor in an optimiser's per-parameter state (bitsandbytes nests some in dicts)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    else:
        yield obj


class MixedPrecisionAdamW(torch.optim.AdamW):
    """AdamW over fp32 master copies of low-precision (bf16) parameters.

    Each bf16 parameter's gradient is added into its fp32 master's `.grad` as soon as it is accumulated (a
    post-accumulate-grad hook) and freed, so gradient accumulation over micro-batches happens in fp32 and no bf16
    gradient outlives its backward. `step` updates the masters and copies them (rounded) into the parameters. The
    masters are part of `state_dict`, so a resumed run continues from the exact fp32 values. Clip with
    `clip_grad_norm_` (the masters hold the gradients). For single-process and FSDP-free runs: under DDP the
    all-reduce reads the parameters' `.grad`, so DDP runs use autocast instead (ovkit.models.precision).
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
        if self.pairs:  # one foreach copy (with the cast), not a kernel per parameter
            torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])
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


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimiser per trainable parameter, stepped inside backward: `--optimizer-in-backward` (torchtune's
    `optimizer_in_bwd`; the PyTorch tutorial "How to save memory by fusing the optimizer step into the backward
    pass"). A post-accumulate-grad hook on each parameter runs its own optimiser's step as soon as the parameter's
    gradient is complete and frees the gradient, so at most a few gradients exist at once instead of all of them:
    8 B/param instead of 10 for bf16-true + adamw_bf16.

    `make(p)` builds each parameter's optimiser with the factory and settings the whole-model one would have (class,
    lr, weight-decay rule, betas, eps, fp32 master or Kahan compensation); every one of them updates a tensor from
    its own gradient and state alone, so the result is the whole-model step's, bit for bit. Exact only where the step
    needs nothing beyond one parameter's gradient and comes once per backward: no clipping (it needs the global norm
    first), no gradient accumulation, one process (DDP/FSDP reduce the gradients after the hook has stepped); the
    configs and Runtime refuse the rest.

    What the loop holds is this façade: `param_groups` are the per-parameter optimisers' own group dicts (so the
    LR scheduler's writes reach them), `step` and `zero_grad` do nothing (the work happened in backward),
    `state_dict` / `load_state_dict` carry every per-parameter state (resume continues bit for bit), and
    `grad_norm()` returns the global L2 norm of the step's gradients, whose squares the hooks summed on the device
    (no host sync per parameter). A MixedPrecisionAdamW's own hook (moving the bf16 gradient into the fp32 master)
    was registered first, so it runs first and the step sees the master's gradient.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], make: Callable[[torch.nn.Parameter], Any]):
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("OptimizerInBackward got no trainable parameters")
        self.optimizers = [make(p) for p in params]
        for o in self.optimizers:
            o.in_backward = True  # its steps are parts of this one (bench/_syncs.py's OptimizerSteps counts steps)
        super().__init__(params, {})
        self.param_groups = self._groups()
        self._squares: torch.Tensor | None = None
        self.hooks = [
            p.register_post_accumulate_grad_hook(partial(self._step_in_backward, o))
            for p, o in zip(params, self.optimizers)
        ]

    def _groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @torch.no_grad()
    def _step_in_backward(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
        for group in optimizer.param_groups:
            for q in group["params"]:  # the parameter itself, or its fp32 master
                if q.grad is not None:
                    square = torch.linalg.vector_norm(q.grad, dtype=torch.float32).square()
                    self._squares = square if self._squares is None else self._squares + square.to(self._squares)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the gradients of the backward since the last call (a device tensor), and a fresh sum."""
        squares, self._squares = self._squares, None
        if squares is None:
            return torch.zeros((), device=self.param_groups[0]["params"][0].device)
        return squares.sqrt()

    def step(self, closure: Callable | None = None):  # every parameter stepped in backward
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:  # every gradient was freed in backward
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"per_parameter": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("per_parameter")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(
                f"the checkpoint's optimiser state is not that of --optimizer-in-backward over {len(self.optimizers)} "
                f"parameters"
            )
        for o, sd in zip(self.optimizers, saved):
            o.load_state_dict(sd)
        self.param_groups = self._groups()  # load_state_dict made new group dicts: the scheduler must see those


def master_pairs(optimizer: Any) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, fp32 master) of every parameter whose optimiser keeps one (MixedPrecisionAdamW), whole-model or
    per parameter (OptimizerInBackward); empty otherwise."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    optimizers = inner.optimizers if isinstance(inner, OptimizerInBackward) else [inner]
    return [pair for o in optimizers if isinstance(o, MixedPrecisionAdamW) for pair in o.pairs]


def clip_grad_norm(
    optimizer: Any, params: list[torch.nn.Parameter], max_norm: float, accelerator: Any = None
) -> torch.Tensor:
    """Clip the gradient (global L2 norm; max_norm 0: measure only) and return its norm before clipping, wherever
    the gradient lives (the fp32 masters, or the parameters, through accelerate under DDP/FSDP). The norm stays a
    device tensor (reading it is a device-to-host sync: the loop reads it with the step's other metrics), and the
    per-tensor norms are one foreach kernel (torch uses foreach only on CUDA unless asked)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    if isinstance(inner, OptimizerInBackward):  # the steps ran in backward; max_norm is 0 (the config refuses more)
        return inner.grad_norm()
    if isinstance(inner, MixedPrecisionAdamW):
        return inner.clip_grad_norm_(max_norm)
    engine = accelerator is not None and (
        accelerator.distributed_type.value not in ("NO", "MULTI_CPU", "MULTI_GPU") or accelerator.scaler is not None
    )
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
