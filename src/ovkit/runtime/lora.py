"""LoRA adapters (peft) for every learner: align, midtrain, sft and rl-train (`--lora-r N`).

With `--lora-r` > 0 the model's attention and MLP projections inside the selected trainable groups (`--trainable`)
get low-rank adapters (peft's `inject_adapter_in_model`: LoRA layers replace those Linear modules in place, so the
model stays the transformers model every other part of ovkit knows); the adapters train, the base weights do not,
and the projector keeps training in full when it is selected (it is small, and newly initialised at stage 0).
Adapter targets per architecture (`--lora-targets` overrides with regular expressions over module names):

    Qwen2.5-VL / Qwen3-VL    language model q/k/v/o_proj, gate/up/down_proj; ViT blocks attn.qkv, attn.proj, mlp.*
    LLaVA(-OneVision), SmolVLM  language model as above; vision tower q/k/v_proj, out_proj, fc1, fc2

Outputs: the merged model at OUT's root (base + scale * B A, computed out of place: loadable with
AutoModelForImageTextToText like any other stage's output), and the adapter alone in OUT/adapter/
(`peft.PeftModel.from_pretrained(base, OUT/adapter)`). The RL sampler samples from the adapted model (the learner
itself, its copy with the adapters, or vLLM given the merged weights).

QLoRA (a 4-bit base) is not provided: it needs bitsandbytes and CUDA, which this code has not been run on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from ovkit.errors import OvkitError
from ovkit.models.groups import group_of

# Linear modules that get adapters, by the last part of their name (the projections of attention and MLP blocks).
LINEAR_TARGETS = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv|proj|out_proj|fc1|fc2|linear_fc1|linear_fc2)$")
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
            + (f" matching --lora-targets {list(spec.targets)}" if spec.targets else "") + "; train the llm or vision group, or name modules with --lora-targets"
        )
    return found


def apply(model: Any, trainable: list[str], spec: LoraSpec) -> tuple[int, int]:
    """Inject adapters into `model` in place and set what trains: the adapters, and the projector parameters of the
    selection. Returns (trainable, total) parameter counts."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = target_modules(model, trainable, spec)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    model._ovkit_lora_config = config
    full = {n for n in trainable if group_of(n) == "projector"}
    n_train = n_total = 0
    for name, p in model.named_parameters():
        train = "lora_" in name or name in full
        p.requires_grad_(train)
        n_total += 0 if "lora_" in name else p.numel()
        n_train += p.numel() if train else 0
    return n_train, n_total


def has_lora(model: Any) -> bool:
    return getattr(model, "_ovkit_lora_config", None) is not None


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers under their own (non-peft) names, each adapted Linear's weight
    replaced by base + delta, computed out of place (the model and its adapters are untouched)."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    with torch.no_grad():
        for name, module in lora_modules.items():
            base = module.get_base_layer().weight
            out[f"{name}.weight"] = (base + module.get_delta_weight(ADAPTER).to(base.dtype)).detach()
    return out


def save_adapter(model: Any, out: Path) -> None:
    """OUT/adapter/: adapter_model.safetensors + adapter_config.json, loadable with peft.PeftModel.from_pretrained."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    # PeftModel wraps the base as base_model.model: its adapter files name weights under that prefix
    state = {f"base_model.model.{k}": v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}
    save_file(state, str(out / "adapter_model.safetensors"))
    config = model._ovkit_lora_config
    config.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
    config.save_pretrained(str(out))
