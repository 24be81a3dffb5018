"""LoRA adapters (peft) for every learner: align, midtrain, sft and rl-train (`--lora-r N`).

With `--lora-r` > 0 the model's attention and MLP projections inside the selected trainable groups (`--trainable`)
get low-rank adapters (peft's `inject_adapter_in_model`: LoRA layers replace those Linear modules in place, so the
model stays the transformers model every other part of ovkit knows); the adapters train, the base weights do not,
and the projector keeps training in full when it is selected (it is small, and newly initialised at stage 0). What
trains in full is the adapter's `modules_to_save` (peft's name for it), so OUT/adapter/ is the whole update.
Adapter targets per architecture (`--lora-targets` overrides with regular expressions over module names):

    Qwen2.5-VL / Qwen3-VL    language model q/k/v/o_proj, gate/up/down_proj; ViT blocks attn.qkv, attn.proj, mlp.*
    LLaVA(-OneVision), SmolVLM  language model as above; vision tower q/k/v_proj, out_proj, fc1, fc2

Outputs: the merged model at OUT's root (base + scale * B A, computed out of place: loadable with
AutoModelForImageTextToText like any other stage's output), and the adapter alone in OUT/adapter/
(`peft.PeftModel.from_pretrained(base, OUT/adapter)` gives the weights at OUT's root: the adapters plus the modules
trained in full; adapter_config.json names the base by its absolute path, or its Hub id). The RL sampler samples
from the adapted model (the learner itself, its copy with the adapters, or vLLM given the merged weights).

QLoRA (`--load-in-4bit` with `--lora-r`): the language model's Linear weights load as 4-bit NF4 with double
quantisation (bitsandbytes, through transformers' BitsAndBytesConfig; the vision tower, the projector and the output
head stay in full precision), peft's `prepare_model_for_kbit_training` readies the rest, and the adapters train on
top in the compute dtype. The merged model at OUT's root is the dequantised base + scale * B A in full precision (a
plain checkpoint, no quantisation config), so later stages and vLLM load it like any other; the adapter in
OUT/adapter/ applies to the 4-bit base as to the full one. bitsandbytes runs 4-bit on CPU as well as CUDA
(`pip install bitsandbytes`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ovkit.errors import OvkitError
from ovkit.models.groups import group_of

# Linear modules that get adapters, by the last part of their name (the projections of attention and MLP blocks).
LINEAR_TARGETS = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv|proj|out_proj|fc1|fc2|linear_fc1|linear_fc2)$"
)
ADAPTER = "default"


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()  # regular expressions over module names; empty: the per-architecture default


def target_modules(model: Any, trainable: Iterable[str], spec: LoraSpec) -> list[str]:
    """Names of the Linear modules to adapt: inside the trainable selection, not the projector, and matching the
    default projections (or `spec.targets`)."""
    selected = set(trainable)
    patterns = [re.compile(p) for p in spec.targets]
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or f"{name}.weight" not in selected:
            continue
        if patterns:
            if any(p.search(name) for p in patterns):
                found.append(name)
        elif LINEAR_TARGETS.search(name) and group_of(f"{name}.weight") in ("llm", "vision"):
            found.append(name)
    if not found:
        raise OvkitError(
            f"--lora-r {spec.r}: no Linear module of {type(model).__name__} to adapt in the --trainable selection"
            + (f" matching --lora-targets {list(spec.targets)}" if spec.targets else "")
            + "; train the llm or vision group, or name modules with --lora-targets"
        )
    return found


def apply(model: Any, trainable: list[str], spec: LoraSpec) -> tuple[int, int]:
    """Inject adapters into `model` in place and set what trains: the adapters, and the projector parameters of the
    selection. Returns (trainable, total) parameter counts."""
    # optional: the package (or this name in it) may be missing; imported only where it is used
    from peft import LoraConfig, inject_adapter_in_model

    targets = target_modules(model, trainable, spec)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    full = {n for n in trainable if group_of(n) == "projector"}
    # Set after injection: given to inject_adapter_in_model it would wrap them (ModulesToSaveWrapper) and rename their
    # parameters, which the merged save and every other part of ovkit read by their transformers names.
    config.modules_to_save = modules_to_save(model, full) or None
    model._ovkit_lora_config = config
    n_train = n_total = 0
    for name, p in model.named_parameters():
        train = "lora_" in name or name in full
        p.requires_grad_(train)
        shape = getattr(getattr(p, "quant_state", None), "shape", None)  # a 4-bit weight: its packed storage is smaller
        n_total += 0 if "lora_" in name else (int(torch.Size(shape).numel()) if shape is not None else p.numel())
        n_train += p.numel() if train else 0
    return n_train, n_total


def modules_to_save(model: Any, full: set[str]) -> list[str]:
    """The smallest modules that together hold the parameters in `full` (trained in full beside the adapters) and
    nothing else: peft's `modules_to_save`, so the adapter directory carries them and base + adapter equals the merged
    model (the whole `model.visual.merger` when the projector trains, not each of its Linear layers)."""
    params = [n for n, _ in model.named_parameters()]
    found: list[str] = []
    for name in params:
        if name not in full or any(name.startswith(f"{m}.") for m in found):
            continue
        parts = name.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            if all(n in full for n in params if n.startswith(f"{prefix}.")):
                found.append(prefix)
                break
    return found


def base_model_name(model: Any) -> str | None:
    """The base model as adapter_config.json names it: a local directory's absolute path (the path as typed would
    only resolve from where the run started), else the Hub id."""
    name = getattr(model.config, "_name_or_path", None)
    if name and Path(name).expanduser().exists():
        return str(Path(name).expanduser().resolve())
    return name or None


# Modules never quantised: the vision tower, the projector and the output head (by the names of the supported
# architectures), so only the language model's Linear layers are 4-bit, as in QLoRA. transformers 5 reads these as
# regular expressions matched from the start of a module's name (or as its suffix), transformers 4 as substrings.
_KEEP = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector")
NOT_QUANTISED = [*_KEEP, *(r"(?:.*\.)?" + name for name in _KEEP), "lm_head"]


def four_bit_config(compute_dtype: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for QLoRA: NF4 weights, double quantisation, compute in `compute_dtype`."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise OvkitError("--load-in-4bit needs bitsandbytes: pip install bitsandbytes") from None
    # heavy: transformers loads on first use, not at CLI start or in config checks
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        llm_int8_skip_modules=NOT_QUANTISED,
    )


def prepare_four_bit(model: Any, gradient_checkpointing: bool) -> None:
    """peft's preparation of a k-bit model for adapter training (norms and the other full-precision weights in fp32,
    input gradients enabled for checkpointing); every parameter frozen until `apply` picks what trains."""
    # optional: the package (or this name in it) may be missing; imported only where it is used
    from peft import prepare_model_for_kbit_training

    prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)


def _dequantised(module: Any) -> torch.Tensor | None:
    """The full-precision weight of a bitsandbytes 4-bit Linear, None for any other module."""
    weight = getattr(module, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None:
        return None
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight.data, state).to(state.dtype)


def plain(model: Any) -> Any:
    """What saves the merged weights: `model` itself, or for a 4-bit base the same architecture without its
    quantisation config (on the meta device: save_pretrained is given the weights), so the checkpoint is a plain one."""
    if getattr(model.config, "quantization_config", None) is None:
        return model

    config = copy.deepcopy(model.config)
    del config.quantization_config
    with torch.device("meta"):  # eager: ovkit's own attention functions are registered at runtime, not saved
        return type(model)._from_config(config, attn_implementation="eager")


def has_lora(model: Any) -> bool:
    return getattr(model, "_ovkit_lora_config", None) is not None


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers under their own (non-peft) names, each adapted Linear's weight
    replaced by base + delta, computed out of place (the model and its adapters are untouched)."""
    # optional: the package (or this name in it) may be missing; imported only where it is used
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    four_bit = {
        name.replace(".base_layer", ""): w for name, m in model.named_modules() if (w := _dequantised(m)) is not None
    }
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        name = name.replace(".base_layer.", ".")
        module, _, leaf = name.rpartition(".weight")
        if module in four_bit and leaf:  # a 4-bit weight's quantisation state (weight.absmax, weight.quant_map, ...)
            continue
        out[name] = tensor if leaf else four_bit.get(module, tensor)
    with torch.no_grad():
        for name, module in lora_modules.items():
            base = four_bit.get(name, module.get_base_layer().weight)
            out[f"{name}.weight"] = (base + module.get_delta_weight(ADAPTER).to(base.dtype)).detach()
    return out


def save_adapter(model: Any, out: Path) -> None:
    """OUT/adapter/: adapter_model.safetensors + adapter_config.json, loadable with peft.PeftModel.from_pretrained."""
    # optional: the package (or this name in it) may be missing; imported only where it is used
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # PeftModel wraps the base as base_model.model: its adapter files name weights under that prefix
    state = {
        f"base_model.model.{k}": v.detach().contiguous().cpu()
        for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()
    }
    config = model._ovkit_lora_config
    # peft saves a modules_to_save module's weights under its own name (without modules_to_save.<adapter>), and
    # PeftModel.from_pretrained maps them back onto its copy of the module
    saved = tuple(f"{m}." for m in config.modules_to_save or ())
    for name, p in model.named_parameters():
        if name.startswith(saved):
            state[f"base_model.model.{name}"] = p.detach().float().contiguous().cpu()
    save_file(state, str(out / "adapter_model.safetensors"))
    config.base_model_name_or_path = base_model_name(model)
    config.save_pretrained(str(out))
