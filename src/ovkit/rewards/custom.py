"""The user's own reward functions, `--reward-funcs PATH.py:NAME[:WEIGHT]`, called the way TRL calls them.

A reward function is a module-level callable in a Python file of the user's:

    def brevity(prompts, completions, answer, **kwargs):
        return [-len(c[0]["content"]) / 100 for c in completions]

It receives TRL's arguments: `prompts` (each a list of chat messages, as the model was asked), `completions` (each
`[{"role": "assistant", "content": text}]`: ovkit's prompts are conversational, so TRL passes completions that way
too) and the row's columns as keyword arguments, one list entry per completion (`id`, `answer`, `answer_type`,
`source`, `category`, `reward_kwargs`). It returns one float per completion; None means "does not apply" (NaN in the
metrics, 0 in the optimised reward, as TRL's nansum counts it).

Each call runs in the reward worker pool of the built-in sandboxed scorers (ovkit.rewards.pool) with the same hard
limits: a wall-clock timeout per completion (the call scores 0 with `timeout` set), an address-space cap (MemoryError
scores 0), a worker killed from outside is replaced and the item retried once. An exception in the function stops
the command with exit 2 naming the file, the function and the row. The function is the user's own code, so it is not
put in the seccomp/bwrap sandbox that model-written code gets: it may read files it needs (a reference list, a
tokenizer). It is called with one completion at a time, so the time limit is per completion and a crash loses one
item; a function that needs the whole group (a rank among siblings) is not expressible this way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.rewards.base import Reward
from ovkit.rewards.pool import shared_pool

OPTION = "--reward-funcs"
RESERVED = ("task", "format")  # rewards/task/*, rewards/format/*: the verifiable reward and the format reward
COLUMNS = ("id", "answer", "answer_type", "source", "category", "reward_kwargs")  # what a function receives


@dataclass(frozen=True)
class RewardFunc:
    """One `PATH.py:NAME[:WEIGHT]`: the file (absolute), the function's name in it, its weight in the reward."""

    path: Path
    name: str
    weight: float = 1.0

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.name}" + ("" if self.weight == 1.0 else f":{self.weight:g}")


def parse(text: str) -> RewardFunc:
    """`PATH.py:NAME` or `PATH.py:NAME:WEIGHT` -> RewardFunc; the file must exist (`load` checks the function)."""
    head, sep, tail = str(text).rpartition(".py:")
    if not sep or not head:
        raise OvkitError(f"{OPTION}: expected PATH.py:NAME or PATH.py:NAME:WEIGHT, got {text!r}")
    name, _, weight_text = tail.partition(":")
    if not name.isidentifier():
        raise OvkitError(f"{OPTION}: {name!r} in {text!r} is not a Python function name")
    try:
        weight = float(weight_text) if weight_text else 1.0
    except ValueError:
        raise OvkitError(f"{OPTION}: the weight {weight_text!r} in {text!r} is not a number") from None
    if not math.isfinite(weight):
        raise OvkitError(f"{OPTION}: the weight in {text!r} must be finite")
    path = Path(head + ".py").expanduser().resolve()
    if not path.is_file():
        raise OvkitError(f"{OPTION}: {path}: no such file (from {text!r})")
    return RewardFunc(path, name, weight)


def parse_all(texts: Sequence[str] | None) -> list[RewardFunc]:
    """Every spec parsed and its function loaded once here, so a typo fails before any model loads; two functions
    of one name would share a metric name and are refused."""
    funcs = [parse(t) for t in texts or []]
    names = [f.name for f in funcs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise OvkitError(f"{OPTION}: two reward functions named {', '.join(twice)}; their metrics would share a name")
    taken = sorted(set(names) & set(RESERVED))
    if taken:
        raise OvkitError(
            f"{OPTION}: a reward function named {', '.join(taken)} would share its metrics (rewards/NAME/mean) with "
            f"ovkit's own {' and '.join(RESERVED)} rewards; rename it"
        )
    for f in funcs:
        load(f.path, f.name)
    return funcs


_LOADED: dict[tuple[str, float], Any] = {}  # (path, mtime) -> module: one import per process and file version


def load(path: Path, name: str) -> Callable[..., Any]:
    """The function `name` of the file at `path`, imported once per process (a changed file is imported anew)."""
    key = (str(path), path.stat().st_mtime)
    module = _LOADED.get(key)
    if module is None:
        module_name = "ovkit_reward_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise OvkitError(f"{OPTION}: {path}: not a Python file that can be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling inside the user's module look themselves up
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(module_name, None)
            raise OvkitError(f"{OPTION}: importing {path} failed: {type(e).__name__}: {e}") from None
        _LOADED[key] = module
    func = getattr(module, name, None)
    if not callable(func):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise OvkitError(f"{OPTION}: {path} has no function {name!r} (functions in it: {', '.join(found) or 'none'})")
    params = inspect.signature(func).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise OvkitError(
            f"{OPTION}: {path}:{name} must accept **kwargs (TRL's signature: prompts, completions, **kwargs), so "
            "that the row's columns can reach it"
        )
    return func


def call(completion: str, answer: str, *, path: str, name: str, prompt: list, columns: dict[str, Any]) -> Reward:
    """One completion scored by one user function (in a pool worker): TRL's arguments, lists of one."""
    func = load(Path(path), name)
    kwargs = {k: [v] for k, v in columns.items()}
    try:
        values = func(prompts=[prompt], completions=[[{"role": "assistant", "content": completion}]], **kwargs)
    except MemoryError:
        raise  # the pool's memory cap: the item scores 0 and the worker is replaced
    except Exception as e:
        raise OvkitError(f"reward function {path}:{name} raised {type(e).__name__}: {e}") from None
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        raise OvkitError(
            f"reward function {path}:{name} returned {values!r:.80}; expected a list with one float per completion"
        )
    value = values[0]
    if value is None:
        return Reward(math.nan, {})
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise OvkitError(f"reward function {path}:{name} returned {value!r:.80}, not a float or None") from None
    return Reward(value, {})


def score(
    funcs: Sequence[RewardFunc],
    items: Sequence[Mapping[str, Any]],
    *,
    workers: int = 2,
    timeout: float = 10.0,
) -> list[dict[str, float]]:
    """{function name: value} for each item (an item: `completion`, `messages` (the prompt as asked) and the
    `COLUMNS`), every call in the worker pool. A timed-out, out-of-memory or crashed call scores 0 and says so under
    `<name>/timeout` (TRL has no such case: its functions run in the trainer's own process)."""
    if not funcs or not items:
        return [{} for _ in items]
    tasks = [
        (
            call,
            str(item.get("completion") or ""),
            "",
            {
                "path": str(f.path),
                "name": f.name,
                "prompt": list(item.get("messages") or []),
                "columns": {c: item.get(c) for c in COLUMNS},
            },
        )
        for item in items
        for f in funcs
    ]
    results = shared_pool().run(tasks, workers=max(1, workers), timeout=timeout)
    out: list[dict[str, float]] = []
    for i, item in enumerate(items):
        values: dict[str, float] = {}
        for j, f in enumerate(funcs):
            r = results[i * len(funcs) + j]
            if isinstance(r, OvkitError):
                where = f"row {item['id']!r}" if item.get("id") is not None else f"row index {i}"
                raise OvkitError(f"{where}: {r}") from None
            if isinstance(r, BaseException):
                raise r
            failed = [k for k in ("timeout", "memory", "crashed") if r.parts.get(k)]
            values[f.name] = 0.0 if failed else float(r.reward)
            if failed:
                values[f"{f.name}/{failed[0]}"] = 1.0
        out.append(values)
    return out


def weighted(funcs: Sequence[RewardFunc], values: Mapping[str, float]) -> float:
    """sum_i weight_i * value_i, a None/NaN value counting 0 (TRL's nansum over reward functions)."""
    return sum(f.weight * values[f.name] for f in funcs if not math.isnan(values[f.name]))
