"""Generation engines shared by eval, rl-curate, rl-train, caption and mismatch-report.

Two engines with one interface:

- `HFEngine(model, processor)`: transformers `generate` on left-padded batches; runs everywhere (CPU included), can
  sample in a lower precision than the learner (`dtype`) or from an int8 or 4-bit-weight copy (`quant="int8"`, `"int4"`)
  to reproduce
  sampler/learner mismatch on a laptop.
- `VLLMEngine(path)`: a colocated `vllm.LLM` (GPU only; `pip install ovkit[vllm]`).

`engine.generate(prompts, n=..., max_new_tokens=..., temperature=..., top_p=..., seed=...)` takes encoded prompts
(`ovkit.models.encode.encode_prompt`) and returns, per prompt, `n` `Completion`s whose `logprobs` are the log-probs
of the sampled tokens under the distribution actually sampled from (after temperature and top-p). Temperature 0 is
greedy decoding; its logprobs are those of the model's own (temperature 1, untruncated) distribution.
`engine.update_weights(model)` copies a learner's weights into the sampler (RL weight sync).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]  # the sampled tokens, the stop token (eos / <|im_end|>) included when finish_reason is stop
    text: str  # the decoded tokens without the stop token and special tokens
    logprobs: list[float] = field(default_factory=list)  # one per token_ids entry, under the sampled distribution
    finish_reason: str = "length"  # "stop": a stop token ended it; "length": max_new_tokens did; "error": an env failed
    # Multi-turn trajectories (ovkit.rollouts.episodes) also hold the environment's observation tokens in `token_ids`:
    loss_mask: list[int] | None = None  # per token: 1 sampled by the policy, 0 observation (log-prob 0); None = all 1
    turn_ids: list[int] | None = None  # per token: the assistant turn it belongs to (observations: the turn before)
    turns: int = 1  # assistant turns
    termination: str | None = None  # completed | env_done | max_turns | truncated | env_error (None: single-turn)
    per_token: dict[str, list[int]] = field(default_factory=dict)  # per-token processor values (mm_token_type_ids)
    mm: dict[str, Any] = field(default_factory=dict)  # processor outputs of the observation images, one tensor per key
    images: list = field(default_factory=list)  # the observation images (PIL), in order
    reward_scale: float = 1.0  # the environment's multiplier on the task reward (e.g. a discount per extra turn)
    turn_texts: list[str] = field(default_factory=list)  # each assistant turn's text (`text` is the last one)

    @property
    def mask(self) -> list[int]:
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.token_ids)


def close_engine(engine: Any) -> None:
    """Shut an engine down (vLLM's worker and the process group it joined); engines with nothing to shut down, a
    caller's own included, need no `close`."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


@contextmanager
def owned(engine: Any) -> Iterator[Any]:
    """`with owned(engine):` closes the engine on the way out (contextlib.closing, for engines without `close` too)."""
    try:
        yield engine
    finally:
        close_engine(engine)


def full_tensor(tensor: Any) -> Any:
    """A parameter as one tensor: an FSDP2 shard (DTensor) gathered from every process (a collective: every process
    calls it, in the same order), anything else as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# Engines that sample from the --model directory itself (eval, caption, rl-curate, mismatch-report) ...
ENGINES = ("hf", "vllm")  # built by ovkit.generate.engines.build_engine
# ... and rl-train's, which can also sample from a running vLLM server that it keeps in sync with the learner.
RL_ENGINES = (*ENGINES, "vllm-server")


# The engines load torch and transformers, so they are imported on first use (PEP 562): a config that checks
# `--engine` against RL_ENGINES stays torch-free.
_ENGINES = {
    "HFEngine": "ovkit.generate.hf",
    "sampling_logprobs": "ovkit.generate.hf",
    "VLLMEngine": "ovkit.generate.vllm",  # imports vllm itself only when constructed
    "VLLMServerEngine": "ovkit.generate.vllm_server",  # imports TRL's client only when constructed
}


def __getattr__(name: str) -> Any:
    if name in _ENGINES:
        return getattr(importlib.import_module(_ENGINES[name]), name)
    raise AttributeError(f"module 'ovkit.generate' has no attribute {name!r}")


__all__ = [
    "Completion",
    "close_engine",
    "owned",
    "ENGINES",
    "RL_ENGINES",
    "HFEngine",
    "VLLMEngine",
    "VLLMServerEngine",
    "sampling_logprobs",
]
