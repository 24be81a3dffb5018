"""Generation engines shared by eval, rl-curate, rl-train, caption and mismatch-report.

Two engines with one interface:

- `HFEngine(model, processor)`: transformers `generate` on left-padded batches; runs everywhere (CPU included), can
  sample in a lower precision than the learner (`dtype`) or from an int8 copy (`quant="int8"`) to reproduce
  sampler/learner mismatch on a laptop.
- `VLLMEngine(path)`: a colocated `vllm.LLM` (GPU only; `pip install ovkit[vllm]`).

`engine.generate(prompts, n=..., max_new_tokens=..., temperature=..., top_p=..., seed=...)` takes encoded prompts
(`ovkit.models.encode.encode_prompt`) and returns, per prompt, `n` `Completion`s whose `logprobs` are the log-probs
of the sampled tokens under the distribution actually sampled from (after temperature and top-p). Temperature 0 is
greedy decoding; its logprobs are those of the model's own (temperature 1, untruncated) distribution.
`engine.update_weights(model)` copies a learner's weights into the sampler (RL weight sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]  # the sampled tokens, the stop token (eos / <|im_end|>) included when finish_reason is stop
    text: str  # the decoded tokens without the stop token and special tokens
    logprobs: list[float] = field(default_factory=list)  # one per token_ids entry, under the sampled distribution
    finish_reason: str = "length"  # "stop": a stop token ended it; "length": max_new_tokens did


ENGINES = ("hf", "vllm")


def make_engine(name: str, model_or_path: Any, processor: Any = None, **kw: Any):
    """`hf`: `model_or_path` is a loaded model (with its `processor`) or a model directory; `vllm`: a model directory
    (or a loaded model, whose `name_or_path` is used). Extra keywords go to the engine's constructor."""
    from ovkit.errors import OvkitError

    if name == "hf":
        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            from ovkit.models import load

            model_or_path, processor = load(model_or_path)
        return HFEngine(model_or_path, processor, **kw)
    if name == "vllm":
        path = model_or_path if not hasattr(model_or_path, "config") else model_or_path.config.name_or_path
        return VLLMEngine(path, processor=processor, **kw)
    raise OvkitError(f"--engine must be one of {', '.join(ENGINES)}, got {name!r}")


# Imported after Completion is defined: the engines return Completions.
from ovkit.generate.hf import HFEngine, sampling_logprobs  # noqa: E402
from ovkit.generate.vllm import VLLMEngine  # noqa: E402  (imports vllm itself only when constructed)

__all__ = ["Completion", "ENGINES", "HFEngine", "VLLMEngine", "make_engine", "sampling_logprobs"]
