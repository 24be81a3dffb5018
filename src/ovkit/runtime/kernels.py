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

from typing import Any

import torch

from ovkit.choices import KERNELS, liger_installed  # noqa: F401 (re-exported: one definition, torch-free)
from ovkit.choices import LIGER_INSTALL as INSTALL  # noqa: F401
from ovkit.choices import check_kernels as check_option  # noqa: F401


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
    # optional: the package (or this name in it) may be missing; imported only where it is used
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = getattr(model.config, "model_type", None)
    patched = model_type in MODEL_TYPE_TO_APPLY_LIGER_FN
    if patched:
        # the loss is ovkit's (from the last hidden state): Liger's loss patches of the model's forward stay off
        _apply_liger_kernel_to_instance(
            model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
        )
    return {
        "kernels": "liger",
        "model_type": model_type,
        "patched": ["rope", "rms_norm", "swiglu"] if patched else [],
        "fused_linear_cross_entropy": True,
        **({} if patched else {"note": f"Liger-Kernel has no patches for {model_type}"}),
    }
