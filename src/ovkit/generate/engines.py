"""One builder for every generation engine: eval, caption, rl-curate, mismatch-report and rl-train's sampler.

One device rule (the CUDA device when there is one, else the CPU), one precision vocabulary (ovkit.models.precision
for the model; `fp32 | bf16 | fp16` for a sampler copy, plus `--sampler-quant`), and the attention option of every
other command.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

# A sampler's own precision (rl-train --sampler-precision, mismatch-report's samplers): the dtype of its weights.
from ovkit.choices import SAMPLER_ALIASES, SAMPLER_PRECISIONS, sampler_dtype  # noqa: F401 (re-exported: torch-free)
from ovkit.errors import OvkitError
from ovkit.models import attention, load, locate
from ovkit.models import precision as prec

DEFAULT_SERVER_URL = "http://localhost:8000"  # `vllm serve`'s default address


def device() -> torch.device:
    """The CUDA device when there is one (this process's own under a launcher: cuda:LOCAL_RANK), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}")


def load_for_inference(
    path: Path | str, *, precision: str = "auto", attn_implementation: str = "auto", trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """(model, processor) in eval mode on the device, its weights in the precision's compute dtype, attention set."""
    dev = device()
    model, processor = load(path, dtype=prec.resolve(precision, dev).dtype, trust_remote_code=trust_remote_code)
    attention.apply(model, attention.resolve(attn_implementation, dev))  # (prints the one warning of a fallback)
    return model.to(dev).eval(), processor


def vllm_precision(precision: str) -> str:
    """A --precision name as a vLLM engine takes it: `auto` as ovkit reads it everywhere (bf16 on a GPU with bf16,
    else fp32: the HF engine's and the learner's rule), not as vLLM would (it downcasts an fp32 checkpoint to bf16
    on a CPU too, so `eval --precision auto` would score fp32 with --engine hf and bf16 with --engine vllm)."""
    if precision != "auto":
        return precision
    return "bf16" if prec.resolve("auto", device()).dtype == torch.bfloat16 else "fp32"


def build_engine(
    kind: str,
    *,
    model: Any = None,
    model_dir: Path | str | None = None,
    processor: Any = None,
    precision: str | None = None,
    quant: str | None = None,
    separate: bool = False,
    sleep: bool = False,
    gpu_memory_utilization: float = 0.5,
    batch_size: int = 32,
    seed: int = 0,
    progress: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
    server_url: str | None = None,
    server_timeout: float = 240.0,
) -> Any:
    """A generation engine. `hf`: from a loaded `model` (rl-train's learner: `precision` then names a sampler copy's
    precision, `quant` its quantisation, `separate` an own copy even in the learner's dtype) or from `model_dir` (loaded
    in `precision`); `vllm`: from `model_dir`;
    `vllm-server`: a running vLLM server at `server_url` (ovkit.generate.vllm_server), which serves its own weights.
    `precision` None with `vllm`: vLLM's own choice of dtype (mismatch-report's `vllm` sampler); `auto`: ovkit's."""
    # heavy: an engine module loads transformers (and vLLM or TRL's client when built); a command that imports this
    # builder before reading its inputs reports a bad input without loading them
    from ovkit.generate import HFEngine, VLLMEngine, VLLMServerEngine

    if kind == "hf":
        if model is None:
            if model_dir is None:
                raise ValueError("build_engine('hf') needs a model or a model directory")
            model, processor = load_for_inference(
                model_dir,
                precision=precision or "auto",
                attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
            return HFEngine(model, processor, quant=quant, batch_size=batch_size, progress=progress)
        return HFEngine(
            model,
            processor,
            dtype=sampler_dtype(precision),
            quant=quant,
            separate=separate,
            batch_size=batch_size,
            progress=progress,
        )
    if kind == "vllm":
        if model_dir is None:
            model_dir = model.config.name_or_path
        if processor is None:
            processor = _processor(model_dir, trust_remote_code)
        dtype = sampler_dtype(vllm_precision(precision)) if precision is not None else "auto"
        extra = {"quantization": "fp8"} if quant == "fp8" else {}  # vLLM's online fp8 quantisation of the checkpoint
        return VLLMEngine(
            model_dir,
            processor=processor,
            dtype=dtype,
            seed=seed,
            trust_remote_code=trust_remote_code,
            progress=progress,
            sleep=sleep,
            gpu_memory_utilization=gpu_memory_utilization,
            **extra,
        )
    if kind == "vllm-server":
        if quant is not None:
            raise OvkitError(
                "--engine vllm-server samples with the server's own weights and quantisation (vllm serve "
                "--quantization ...); drop --sampler-quant"
            )
        if processor is None:
            processor = _processor(model_dir or model.config.name_or_path, trust_remote_code)
        return VLLMServerEngine(
            server_url or DEFAULT_SERVER_URL, processor, timeout=server_timeout, seed=seed, progress=progress
        )
    raise OvkitError(f"--engine must be one of hf, vllm, vllm-server, got {kind!r}")


def _processor(model_dir: Path | str, trust_remote_code: bool) -> Any:
    """The processor of a model directory (or Hub id) for an engine that loads the weights itself: checked and
    resolved the way every other model path is (ovkit.models.locate), so a missing directory is one clear error and
    an id is never sent to an offline Hub."""
    from transformers import AutoProcessor  # heavy: only an engine that loads its own weights needs it

    return AutoProcessor.from_pretrained(locate(model_dir, weights=False), trust_remote_code=trust_remote_code)
