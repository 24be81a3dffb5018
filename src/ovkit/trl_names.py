"""TRL's GRPOConfig names that rl-train reads with a translation, and those it refuses with what it does instead.

TRL names whose meaning and values are ovkit's own are plain aliases of the option (declared on its field as one of
its flags: `num_generations` is `--group-size`, `beta` is `--kl-coef`), so they work as flags and YAML keys alike.
The names here are the rest of a GRPO YAML a TRL user brings: a value that means an ovkit option with another value
(`bf16: true` is `--precision bf16-mixed`), or a knob whose meaning ovkit does not have, refused with one line on
what ovkit does in its place. `translate` is applied to a config file's keys before they are matched to options, so
every unknown or refused key of a file is reported in one message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Translated:
    """A TRL key whose value says what an ovkit option's value is: `to(value)` -> {option: value}, or {} when the
    value asks for ovkit's default (`bf16: false` with fp32 the default)."""

    to: Callable[[Any], dict[str, Any]]
    doc: str


@dataclass(frozen=True)
class Instead:
    """A TRL key ovkit has no meaning for: refused, saying what ovkit does in its place."""

    text: str


def _flag(value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off", "none", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _precision(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda v: {"precision": name} if _flag(v) else {}


def _use_vllm(value: Any) -> dict[str, Any]:
    return {"engine": "vllm"} if _flag(value) else {"engine": "hf"}


def _vllm_mode(value: Any) -> dict[str, Any]:
    modes = {"colocate": "vllm", "server": "vllm-server"}
    if str(value) not in modes:
        raise ValueError(f"expected colocate or server, got {value!r}")
    return {"engine": modes[str(value)]}


# TRL's vllm_importance_sampling_mode: {token, sequence} x {truncate (TIS), mask (MIS)} -> ovkit's --correction
_IS_MODES = {
    "token_truncate": "token-tis",
    "sequence_truncate": "seq-tis",
    "token_mask": "token-mis",
    "sequence_mask": "seq-mis",
}


def _is_correction(value: Any) -> dict[str, Any]:
    return {} if _flag(value) else {"correction": "none"}


def _is_mode(value: Any) -> dict[str, Any]:
    if str(value) not in _IS_MODES:
        raise ValueError(f"expected one of {', '.join(_IS_MODES)}, got {value!r}")
    return {"correction": _IS_MODES[str(value)]}


def _one_pass(value: Any) -> dict[str, Any]:
    if str(value).strip() == "1":
        return {}
    raise ValueError(
        f"{value!r}: ovkit makes one pass over each step's trajectories (num_iterations 1); --ppo-minibatches N "
        "takes N optimiser steps in that pass, with the decoupled-PPO clip against the sampler's policy"
    )


def _resume(value: Any) -> dict[str, Any]:
    try:
        return {"resume": _flag(value)}
    except ValueError:
        raise ValueError(
            f"ovkit resumes from OUT.partial/ (the unfinished run's own checkpoints): give `resume: true`, not a "
            f"checkpoint path ({value!r})"
        ) from None


# The HF Trainer's keys every TRL config has (SFTConfig, GRPOConfig): align, midtrain, sft and rl-train read them.
TRAINER: dict[str, Translated | Instead] = {
    "bf16": Translated(_precision("bf16-mixed"), "`true`: `--precision bf16-mixed` (HF Trainer's bf16)"),
    "fp16": Instead("ovkit has no fp16 mixed precision; use --precision bf16-mixed (HF Trainer's bf16) or fp32"),
    "resume_from_checkpoint": Translated(_resume, "`true`: `--resume` (from OUT.partial/); a path is refused"),
    "logging_steps": Instead("ovkit logs every step (metrics.jsonl and each --report-to tracker); drop the key"),
    "per_device_eval_batch_size": Instead("evaluation while training runs at the sampler's batch; drop the key"),
}

# GRPOConfig's own keys (TRL 1.16) that rl-train reads with a translation or refuses.
GRPO: dict[str, Translated | Instead] = {
    **TRAINER,
    "use_vllm": Translated(_use_vllm, "`true`: `--engine vllm` (colocated), `false`: `--engine hf`"),
    "vllm_mode": Translated(_vllm_mode, "`colocate`: `--engine vllm`, `server`: `--engine vllm-server`"),
    "vllm_importance_sampling_correction": Translated(
        _is_correction, "`false`: `--correction none`; `true`: the correction `vllm_importance_sampling_mode` names"
    ),
    "vllm_importance_sampling_mode": Translated(
        _is_mode, ", ".join(f"`{k}`: `--correction {v}`" for k, v in _IS_MODES.items())
    ),
    "per_device_train_batch_size": Instead(
        "ovkit counts prompts, not completions: --prompts-per-step P with --group-size G samples P x G completions "
        "per step (one optimiser step, or --ppo-minibatches); --micro-batch-size bounds the memory of one backward"
    ),
    "gradient_accumulation_steps": Instead(
        "an ovkit RL step is one optimiser step over all its trajectories, accumulated over --micro-batch-size "
        "slices; --ppo-minibatches N splits it into N optimiser steps"
    ),
    "num_iterations": Translated(_one_pass, "`1`: what ovkit does (one pass over each step's trajectories)"),
    "steps_per_generation": Instead("--ppo-minibatches N: N optimiser steps per generated batch"),
    "generation_batch_size": Instead(
        "--prompts-per-step x --group-size completions are generated per step, --rollout-batch-size per engine call"
    ),
    "max_prompt_length": Instead(
        "ovkit does not cut prompts (a cut image prompt is not the question asked); cap images with --max-pixels "
        "or drop long rows before rl-curate"
    ),
    "vllm_importance_sampling_clip_min": Instead("--correction-lower (with --correction seq-mis / token-mis)"),
    "vllm_importance_sampling_clip_max": Instead(
        "--correction-threshold (the truncation cap of token-tis / seq-tis, the mask bound of *-mis)"
    ),
    "vllm_importance_sampling_cap": Instead("--correction-threshold (TRL's deprecated name of the IS cap)"),
}


def translate(values: Mapping[str, Any], table: Mapping[str, Translated | Instead]) -> tuple[dict[str, Any], list[str]]:
    """(the values with each translated TRL key replaced by its option, the refusal lines): a translated key and
    the option itself given together is a refusal too (the file says one thing twice)."""
    out = {k: v for k, v in values.items() if k not in table}
    refused: list[str] = []
    for key, value in values.items():
        entry = table.get(key)
        if isinstance(entry, Instead):
            refused.append(f"'{key}' (TRL) is not an ovkit option: {entry.text}")
        elif isinstance(entry, Translated):
            try:
                mapped = entry.to(value)
            except ValueError as e:
                refused.append(f"'{key}' (TRL): {e}")
                continue
            for option, v in mapped.items():
                if option in out and out[option] != v:
                    refused.append(
                        f"'{key}: {value}' (TRL) means {option}: {v}, but the file also says "
                        f"{option}: {out[option]}; keep one"
                    )
                out[option] = v
    return out, refused
