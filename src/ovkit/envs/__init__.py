"""Interaction environments for multi-turn rollouts (rl-train, rl-curate, eval with `--env`).

The model acts, the environment answers, and its answer (text and images) is appended to the context as a new turn
that is read but never trained on (loss mask 0), until the model finishes, the environment says done, or a turn or
token budget runs out (the loop: `ovkit.rollouts.episodes`; the design: slime's unified VLM/LLM multi-turn RL, 002 in
the references). An environment is any object with:

    reset() -> None                                   called once before the first turn
    step(response_text) -> (observation, done, info)  the model's turn (decoded, stop token removed)
    format_observation(observation) -> message        {"role": "user", "content": "text with <image> markers",
                                                       "images": [PIL images, one per marker]}
    close() -> None                                   optional, called when the trajectory ends

`info` may carry `"reason"`: "completed" (the default: the model's response was its final one) or "env_done" (the
environment stopped the episode for its own reason, e.g. out of attempts), and `"reward_scale"` (multiplies the
trajectory's task reward; e.g. a discount per extra turn). The class may define `instruction`, a line appended to
the prompt's last user turn so the model knows what it can do (e.g. the zoom tool's syntax), and `tools`, function
schemas passed to the chat template (`apply_chat_template(..., tools=...)`), which renders them once, in the
prompt's preamble; observations then use the template's roles (e.g. "tool") without repeating it.

Environments are built per trajectory by a factory `factory(task, **env_args)`, where `task` is a dict of the RL
row: id, images (PIL, capped as the model sees them), answer, answer_type, source, category, reward_kwargs, mode.
`--env` takes a name of ENVIRONMENTS or an import path `package.module:factory` (a class is a factory).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ovkit.envs.verifier import VerifierEnv
from ovkit.envs.zoom import ZoomEnv
from ovkit.errors import OvkitError

ENVIRONMENTS: dict[str, Callable[..., Any]] = {
    "zoom": ZoomEnv,
    "verifier": VerifierEnv,
}
REASONS = ("completed", "env_done")  # the termination reasons an environment may give in info["reason"]


@dataclass
class EnvSpec:
    """A resolved `--env`: how to build one environment per trajectory."""

    name: str
    factory: Callable[..., Any]
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def instruction(self) -> str:
        return str(getattr(self.factory, "instruction", "") or "")

    @property
    def tools(self) -> list[dict] | None:
        """Tool schemas (OpenAI / HF function format) the chat template renders into the prompt, if the class has
        any."""
        tools = getattr(self.factory, "tools", None)
        return list(tools) if tools else None

    def build(self, task: dict[str, Any]) -> Any:
        try:
            env = self.factory(task, **self.args)
        except TypeError as e:
            raise OvkitError(f"--env {self.name}: cannot build it with --env-arg {self.args or '{}'} ({e})") from None
        missing = [m for m in ("reset", "step", "format_observation") if not callable(getattr(env, m, None))]
        if missing:
            raise OvkitError(f"--env {self.name}: the environment has no {', '.join(missing)} method (see ovkit.envs)")
        return env


def load_env(spec: str, args: dict[str, Any] | None = None) -> EnvSpec:
    """`zoom`, `verifier`, or `package.module:factory` -> EnvSpec (the import is checked now, not mid-run)."""
    if spec in ENVIRONMENTS:
        return EnvSpec(spec, ENVIRONMENTS[spec], dict(args or {}))
    if ":" not in spec:
        raise OvkitError(
            f"--env {spec!r}: not one of {', '.join(ENVIRONMENTS)} and not an import path package.module:factory"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise OvkitError(f"--env {spec!r}: cannot import {module_name!r} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise OvkitError(f"--env {spec!r}: {module_name} has no callable {attr!r}")
    return EnvSpec(spec, factory, dict(args or {}))


def parse_env_args(items: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """`--env-arg key=value` (repeatable; values parsed as YAML scalars: 3 -> int, 0.9 -> float, true -> bool), or a
    mapping from a --config file."""
    import yaml

    if not items:
        return {}
    if isinstance(items, dict):
        return dict(items)
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise OvkitError(f"--env-arg {item!r}: expected key=value")
        out[key.strip().replace("-", "_")] = yaml.safe_load(value) if value.strip() else ""
    return out


__all__ = ["ENVIRONMENTS", "EnvSpec", "REASONS", "VerifierEnv", "ZoomEnv", "load_env", "parse_env_args"]
