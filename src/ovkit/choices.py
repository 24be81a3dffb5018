"""The values the runtime options accept (precision, attention, optimiser, checkpointing, kernels, RL corrections,
samplers) and their checks, without torch: a leaf every config and `ovkit.options` can import.

A config is built, and refused, before anything heavy is imported, so `ovkit sft DATA --precision bf17` answers in
a fraction of a second instead of after torch and transformers load. The modules that act on these options
(precision, optim, attention, checkpointing, kernels, engines; rl.correction, rl.loss; evaluate.during) import torch and
re-export
what is here, so each name has one definition.
"""

from __future__ import annotations

import importlib.util
import re

from ovkit.errors import OvkitError

# --attn-implementation (ovkit.models.attention)
ATTENTION = ("auto", "sdpa", "flash_attention_2", "flex_attention", "eager")

# --precision (ovkit.models.precision). One meaning per spelling: `bf16` is HF Trainer's --bf16 (bf16 compute,
# fp32 master weights). `bfloat16` once meant bf16-true here (torch_dtype=bfloat16) beside `bf16` meaning
# bf16-mixed, so it is refused with both choices named rather than silently changing meaning; no shipped
# config used it.
PRECISIONS = ("auto", "fp32", "bf16-mixed", "bf16-true")
PRECISION_ALIASES = {"32": "fp32", "32-true": "fp32", "float32": "fp32", "bf16": "bf16-mixed"}
AMBIGUOUS = {"bfloat16": ("bf16-mixed", "bf16-true")}


def canonical_precision(name: str) -> str:
    if str(name) in AMBIGUOUS:
        mixed, true = AMBIGUOUS[str(name)]
        raise OvkitError(
            f"--precision {name} is ambiguous: say {mixed} (bf16 compute, fp32 master weights; what bf16 and HF "
            f"Trainer's "
            f"--bf16 mean) or {true} (bf16 weights, gradients and optimiser state; torch_dtype=bfloat16)"
        )
    name = PRECISION_ALIASES.get(str(name), str(name))
    if name not in PRECISIONS:
        choices = ", ".join([*PRECISIONS, *(f"{a} (= {b})" for a, b in PRECISION_ALIASES.items())])
        raise OvkitError(f"--precision must be one of {choices}; got {name!r}")
    return name


# --optim (ovkit.runtime.optim's table of optimiser x precision)
OPTIMS = ("adamw_torch_fused", "adamw_torch", "adamw_8bit", "adamw_bf16")


def check_optim(optim: str, precision: str) -> str:
    """Validate `--optim` against the (canonical) `--precision` and return the precision to use: `adamw_bf16` keeps
    bf16 weights, so `auto` means bf16-true with it and fp32 / bf16-mixed are refused (ovkit.runtime.optim)."""
    if optim not in OPTIMS:
        raise OvkitError(f"--optim must be one of {', '.join(OPTIMS)}; got {optim!r}")
    if optim == "adamw_bf16":
        if precision == "auto":
            return "bf16-true"
        if precision != "bf16-true":
            raise OvkitError(
                f"--optim adamw_bf16 trains bf16 weights with Kahan-compensated updates: use it with --precision "
                f"bf16-true (or auto), "
                f"not --precision {precision} (for fp32 weights or fp32 master weights use --optim adamw_torch_fused)"
            )
    return precision


# --activation-checkpointing (ovkit.runtime.checkpointing)
CHECKPOINTING_MODES = ("auto", "off", "full", "mlp", "every-K")


def canonical_checkpointing(mode: str) -> str:
    """The mode's canonical spelling; ValueError for anything else."""
    text = str(mode).strip().lower()
    if text in ("auto", "off", "full", "mlp"):
        return text
    m = re.fullmatch(r"every-(\d+)", text)
    if m and int(m.group(1)) >= 1:
        return "full" if int(m.group(1)) == 1 else f"every-{int(m.group(1))}"
    raise ValueError(f"must be one of auto, off, full, mlp, every-K (K >= 1), got {mode!r}")


def check_checkpointing(mode: str, gradient_checkpointing: bool = False) -> str:
    """The config-time check of --activation-checkpointing (and --gradient-checkpointing, which means full)."""
    try:
        mode = canonical_checkpointing(mode)
    except ValueError as e:
        raise OvkitError(f"--activation-checkpointing {e}") from None
    if gradient_checkpointing:
        if mode not in ("auto", "full"):
            raise OvkitError(
                f"--gradient-checkpointing means --activation-checkpointing full; drop one of them (got {mode})"
            )
        mode = "full"
    return mode


# --kernels (ovkit.runtime.kernels)
KERNELS = ("auto", "liger", "torch")
LIGER_INSTALL = "pip install 'ovkit[liger]' (liger-kernel)"


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def check_kernels(kernels: str, use_liger_kernel: bool = False, cuda: bool | None = None) -> str:
    """The config-time check of --kernels (and --use-liger-kernel, which means liger): the name, and for liger a
    CUDA device and the package (only then is torch imported, to ask for the device)."""
    kernels = str(kernels).strip().lower()
    if kernels not in KERNELS:
        raise OvkitError(f"--kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    if use_liger_kernel:
        if kernels not in ("auto", "liger"):
            raise OvkitError(f"--use-liger-kernel means --kernels liger; drop one of them (got --kernels {kernels})")
        kernels = "liger"
    if kernels == "liger":
        if cuda is None:
            # heavy: torch loads on first use, not at CLI start or in config checks
            import torch

            cuda = torch.cuda.is_available()
        if not cuda:
            raise OvkitError(
                "--kernels liger needs a CUDA device (Liger-Kernel's kernels are Triton); use --kernels torch or "
                "auto on CPU"
            )
        if not liger_installed():
            raise OvkitError(
                f"--kernels liger: liger-kernel is not installed ({LIGER_INSTALL}); or use --kernels torch"
            )
    return kernels


# A quantised sampler's weights (rl-train --sampler-quant; ovkit.generate.hf quantises the copy it samples from).
QUANTS = ("int8", "fp8", "int4")

# A sampler's own precision (rl-train --sampler-precision, mismatch-report's samplers): the dtype of its weights
# (ovkit.generate.engines).
SAMPLER_PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
SAMPLER_ALIASES = {
    "float32": "fp32",
    "32": "fp32",
    "bfloat16": "bf16",
    "bf16-true": "bf16",
    "bf16-mixed": "bf16",
    "float16": "fp16",
    "16": "fp16",
}


def sampler_dtype(name: str | None) -> str | None:
    """The torch dtype name for a sampler precision (None: the model's own)."""
    if name is None:
        return None
    key = SAMPLER_ALIASES.get(str(name), str(name))
    if key not in SAMPLER_PRECISIONS:
        raise OvkitError(f"--sampler-precision must be one of {', '.join(SAMPLER_PRECISIONS)}, got {name!r}")
    return SAMPLER_PRECISIONS[key]


# rl-train --correction (ovkit.rl.correction) ...
CORRECTIONS = ("none", "token-tis", "seq-tis", "token-mis", "seq-mis", "geo-rs")
# ... verl's option values (`rollout_is`, `rollout_rs`) and preset names, accepted for --correction.
VERL_ALIASES = {
    "token": "token-tis",
    "sequence": "seq-tis",
    "token_tis": "token-tis",
    "tis": "token-tis",
    "seq_tis": "seq-tis",
    "sequence_tis": "seq-tis",
    "token_k1": "token-mis",
    "token_mis": "token-mis",
    "seq_sum_k1": "seq-mis",
    "seq_mis": "seq-mis",
    "sequence_mis": "seq-mis",
    "seq_mean_k1": "geo-rs",
    "geo_rs": "geo-rs",
    "geometric": "geo-rs",
}


def canonical_correction(name: str) -> str:
    """Our name for a correction mode, given ours or verl's."""
    name = str(name).strip().lower()
    mode = VERL_ALIASES.get(name, name.replace("_", "-"))
    if mode not in CORRECTIONS:
        raise ValueError(
            f"unknown correction {name!r}; choose one of {', '.join(CORRECTIONS)} (verl names: "
            f"{', '.join(VERL_ALIASES)})"
        )
    return mode


# rl-train --loss-agg and --kl-estimator (ovkit.rl.loss)
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
# rl-train's loss menu under TRL's names (ovkit.rl.loss, ovkit.rl.advantages); the first of each is today's loss
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "cispo", "sapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence-token")
SCALE_REWARDS = ("group", "batch", "none")
# rl-train --prox-logp: how decoupled PPO gets pi_prox (AReaL's prox_logp_method; ovkit.rl.proximal), today's first
PROX_LOGP = ("recompute", "loglinear")
# What a loss type fixes beyond its surrogate, as option values (the papers' definitions; TRL's loss_type): Dr. GRPO
# divides by a constant instead of the lengths and does not scale by the group's std; DAPO averages over every token
# of the step. grpo, cispo and sapo aggregate as --loss-agg says. Here, torch-free, for rl-train's option checks.
PRESCRIBED = {
    "dr_grpo": {"loss_agg": "seq-mean-token-sum-norm", "scale_rewards": "none"},
    "dapo": {"loss_agg": "token-mean"},
}
