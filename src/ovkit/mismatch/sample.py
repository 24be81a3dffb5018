"""Rollouts from a chosen sampler configuration, for `mismatch-report --generate DATA --sampler ...`.

Each sampler samples the same prompts with the same seed from the learner's weights, computed differently:

| sampler | what samples | how |
|---|---|---|
| `fp32` | the learner model itself, in float32 | `HFEngine(dtype="float32")`: KV-cached, left-padded batched decoding |
| `bf16`, `fp16` | a copy cast to bfloat16 / float16 | `HFEngine(dtype=...)` (fp16 wants a GPU) |
| `int8` | an int8 copy: dynamic W8A8 on CPU (Yao et al.'s INT8 rollouts), weight-only on GPU | `HFEngine(quant="int8")`
|
| `fp8` | weight-only fp8 (e4m3, per output channel) on any device | `HFEngine(quant="fp8")` (ovkit.generate.quant) |
| `int4` | 4-bit weights (group-wise symmetric, 64 per scale) on any device: a larger, honest gap |
`HFEngine(quant="int4")` (ovkit.generate.quant) |
| `vllm` | vLLM on the model directory, in the checkpoint's dtype | `VLLMEngine` (`pip install 'ovkit[vllm]'`; on
a CPU, vLLM's CPU build: `make setup-vllm`) |
| `vllm-fp32`, `vllm-bf16` | vLLM's kernels in float32 / bfloat16 on the same weights | `VLLMEngine(dtype=...)`: the
gap a real RL sampler opens against the learner |

Even `fp32` is not bit-identical to the learner: batched, cached decoding sums in another order than one
teacher-forced pass, which is the floor every other sampler is compared against. Prompts are encoded as rl-train
encodes them (`ovkit.rollouts.prompts.encode_prompts`: stage instruction, optional system prompt, pixel cap), scored
with
the rewards library, and written in the rollout schema with the prompt images (`ovkit.rollouts.table`).
"""

from __future__ import annotations

from typing import Any

from ovkit.errors import OvkitError

SAMPLERS = {
    "fp32": {"precision": "fp32"},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
    "int8": {"quant": "int8"},
    "fp8": {"quant": "fp8"},
    "int4": {"quant": "int4"},
    "vllm": {},
    "vllm-fp32": {"dtype": "float32"},
    "vllm-bf16": {"dtype": "bfloat16"},
}
ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "hf": "fp32"}


def canonical_sampler(name: str) -> str:
    name = ALIASES.get(str(name).strip().lower(), str(name).strip().lower())
    if name not in SAMPLERS:
        raise OvkitError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")
    return name


def make_sampler(name: str, model: Any, processor: Any, *, model_dir: Any, batch_size: int, seed: int, quiet: bool):
    from ovkit.generate.engines import build_engine

    if name.startswith("vllm"):
        precision = {"vllm-fp32": "fp32", "vllm-bf16": "bf16"}.get(name)
        return build_engine(
            "vllm", model_dir=model_dir, processor=processor, precision=precision, seed=seed, progress=not quiet
        )
    return build_engine(
        "hf", model=model, processor=processor, batch_size=batch_size, progress=not quiet, **SAMPLERS[name]
    )


def generate_rollouts(
    engine: Any,
    prompts: list,
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    prompt_mode: str,
    episodes: Any = None,
) -> Any:
    """`n` scored completions per prompt -> a rollout table (with the prompt images); multi-turn trajectories with
    `episodes` (an ovkit.rollouts.episodes.EpisodeRunner over `engine`). Every sampler draws a prompt's completions
    from the same streams (keyed by its id: ovkit.rollouts.sample), so the samplers' rollouts pair up."""
    from ovkit.rollouts.groups import Group, groups_table, score_groups
    from ovkit.rollouts.sample import sample

    outs = sample(
        engine,
        prompts,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        episodes=episodes,
    )
    groups = [Group(p, i, 0, list(cs)) for i, (p, cs) in enumerate(zip(prompts, outs))]
    score_groups(groups, mode=prompt_mode, format_weight=0.0, workers=1)
    return groups_table(groups, with_images=True, tokenizer=getattr(engine, "tokenizer", None))
