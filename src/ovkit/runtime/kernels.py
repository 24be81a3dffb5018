"""`--kernels {auto,liger,torch}`: Liger-Kernel's fused Triton kernels for the learner, or PyTorch's own ops.

    torch   PyTorch ops throughout; the supervised loss is ovkit's chunked head (ovkit.runtime.loss), which never
            materialises [tokens x vocabulary] logits
    liger   Liger-Kernel (`pip install 'ovkit[liger]'`, CUDA only: Triton kernels) patches the model in place through
            its per-architecture entry point (`liger_kernel.transformers._apply_liger_kernel_to_instance`, the
            call TRL's `use_liger_kernel` makes): RMSNorm, SwiGLU MLP and rotary embedding (Qwen2.5-VL: the
            multimodal RoPE) of the language model and, where Liger patches it, the vision tower; and the supervised
            loss uses its fused linear cross-entropy (the head and the cross-entropy in one kernel, chunked like
            ovkit's, without the logits) in place of the chunked head. The model's own loss path is not patched:
            ovkit computes the loss from the last hidden state. RL's token log-probs keep the chunked head (Liger's
            fused loss returns a reduced loss, not per-token log-probs)
    auto    liger on CUDA when liger-kernel is installed, else torch

`--use-liger-kernel` (TRL/HF's spelling) means `--kernels liger`. What was applied is in ovkit.json
(`runtime.kernels`). Liger's patches swap classes in the transformers modelling module of the architecture, so
they also affect models built later in the same process; a learner process builds the one model it trains.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from ovkit.errors import OvkitError

KERNELS = ("auto", "liger", "torch")
INSTALL = "pip install 'ovkit[liger]' (liger-kernel)"


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def check_option(kernels: str, use_liger_kernel: bool = False, cuda: bool | None = None) -> str:
    """The config-time check of --kernels (and --use-liger-kernel, which means liger): the name, and for liger a
    CUDA device and the package."""
    kernels = str(kernels).strip().lower()
    if kernels not in KERNELS:
        raise OvkitError(f"--kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if use_liger_kernel:
        if kernels not in ("auto", "liger"):
            raise OvkitError(f"--use-liger-kernel means --kernels liger; drop one of them (got --kernels {kernels})")
        kernels = "liger"
    if kernels == "liger":
        cuda = torch.cuda.is_available() if cuda is None else cuda
        if not cuda:
            raise OvkitError("--kernels liger needs a CUDA device (Liger-Kernel's kernels are Triton); use --kernels torch or auto on CPU")
        if not liger_installed():
            raise OvkitError(f"--kernels liger: liger-kernel is not installed ({INSTALL}); or use --kernels torch")
    return kernels


def resolve(kernels: str, device: torch.device) -> tuple[str, str]:
    """(liger | torch, why) for the option's value on `device`."""
    if kernels == "torch":
        return "torch", "asked for"
    if kernels == "liger":
        return "liger", "asked for"
    if device.type != "cuda":
        return "torch", f"auto: {device.type} (Liger-Kernel's Triton kernels need CUDA)"
    if not liger_installed():
        return "torch", f"auto: liger-kernel is not installed ({INSTALL})"
    return "liger", "auto: cuda with liger-kernel installed"


def apply(model: Any, choice: str) -> dict[str, Any]:
    """Patch `model` in place for `choice`; what was applied, for ovkit.json."""
    if choice != "liger":
        return {"kernels": "torch", "fused_linear_cross_entropy": False}
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model.config, "model_type", None)
    patched = model_type in MODEL_TYPE_TO_APPLY_LIGER_FN
    if patched:
        # the loss is ovkit's (from the last hidden state): Liger's loss patches of the model's forward stay off
        _apply_liger_kernel_to_instance(model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    return {"kernels": "liger", "model_type": model_type, "patched": ["rope", "rms_norm", "swiglu"] if patched else [],
            "fused_linear_cross_entropy": True, **({} if patched else {"note": f"Liger-Kernel has no patches for {model_type}"})}  # fmt: skip
