"""Verifiable rewards shared by eval, rl-curate and rl-train (reference: docs/rewards.md).

One table maps a scorer name to a function `(completion, answer, **reward_kwargs) -> Reward`; a row's `answer_type`
picks the scorer (the LLaVA-OV-1.5-RL names are aliases), or, for data without one, a `source_map` of source tags
(ROLL's `tag_included`). To plug in a scorer, add it to SCORERS (and its name to SANDBOXED if it must run in a
killable worker process: it then has to be a module-level function).

    score(completion, answer, answer_type, source, reward_kwargs, prompt_type="answer") -> Reward(reward, parts)
    score_batch(items, workers=2, timeout=10.0) -> list[Reward]
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

from ovkit.errors import OvkitError
from ovkit.rewards import boxes, codeexec, markup, mathexpr, number, ocr, text
from ovkit.rewards.base import Reward, alternatives
from ovkit.rewards.extract import extract_answer
from ovkit.rewards.formatting import format_reward, format_scorer, prompt_mode
from ovkit.rewards.pool import shared_pool, shutdown

__all__ = [
    "ALIASES",
    "SANDBOXED",
    "SCORERS",
    "Reward",
    "check_gold",
    "extract_answer",
    "format_reward",
    "resolve_scorer",
    "score",
    "score_batch",
    "shutdown",
]

SCORERS: dict[str, Callable[..., Reward]] = {
    "multiple_choice": text.multiple_choice,
    "math": mathexpr.math,
    "number": number.number,
    "bbox": boxes.bbox,
    "detection": boxes.detection,
    "ocr": ocr.ocr,
    "boolean": text.boolean,
    "string": text.string,
    "critic": text.critic,
    "html": markup.html,
    "svg": markup.svg,
    "code": codeexec.code,
    "format": format_scorer,
}

# LLaVA-OV-1.5-RL `answer_type` values, its reward module names, and ROLL's detection domain.
ALIASES: dict[str, str] = {
    "multiple-choice": "multiple_choice",
    "multiplechoice": "multiple_choice",
    "math-expressions": "math",
    "html-code": "html",
    "htmlcode": "html",
    "svg-code": "svg",
    "svgcode": "svg",
    "general-code": "code",
    "generalcode": "code",
    "ocrtext": "ocr",
    "any": "string",
    "string_matching": "string",
    "bool": "boolean",
    "cv_detection": "detection",
}

# Scorers that run untrusted or unbounded work (SymPy, cairosvg, model-written code) go to killable worker processes;
# the others are linear-time in a capped input and run in the caller's thread, paying no process overhead.
SANDBOXED: set[str] = {"math", "svg", "code"}

DEFAULT_TIMEOUT = 10.0
RESERVED_KWARGS = ("format_weight",)  # consumed by score() itself, not passed to the scorer


def resolve_scorer(
    answer_type: str | None, source: str | None = None, source_map: Mapping[str, str] | None = None
) -> str:
    """Canonical scorer name for a row: its `answer_type` (name or alias, case-insensitive); for a row without one,
    the scorer of the longest `source_map` tag contained in its `source` (ROLL's `tag_included` rule)."""
    if answer_type is not None and str(answer_type).strip():
        key = str(answer_type).strip()
        for candidate in (key, key.lower()):
            if candidate in SCORERS:
                return candidate
            if candidate in ALIASES:
                return ALIASES[candidate]
        known = sorted({*SCORERS, *ALIASES})
        raise OvkitError(f"column 'answer_type': unknown scorer {answer_type!r}; known: {', '.join(known)}")
    tags = [tag for tag in (source_map or {}) if source and tag in source]
    if tags:
        tag = max(tags, key=len)  # the most specific tag wins; ties go to the first in the map
        return resolve_scorer(source_map[tag])  # type: ignore[index]
    raise OvkitError(
        f"column 'answer_type' is empty and source {source!r} matches no tag of the source map "
        f"({', '.join(source_map or {}) or 'none given'}); set answer_type or add a tag"
    )


def _kwargs(reward_kwargs: dict | str | None) -> dict[str, Any]:
    if reward_kwargs is None or (isinstance(reward_kwargs, str) and not reward_kwargs.strip()):
        return {}
    if isinstance(reward_kwargs, str):
        try:
            reward_kwargs = json.loads(reward_kwargs)
        except ValueError as e:
            raise OvkitError(f"column 'reward_kwargs': not JSON ({e}): {reward_kwargs[:80]!r}") from None
    if not isinstance(reward_kwargs, Mapping):
        raise OvkitError(f"column 'reward_kwargs': expected a JSON object, got {reward_kwargs!r:.80}")
    return dict(reward_kwargs)


@functools.cache
def _accepted(func: Callable) -> frozenset[str] | None:
    """Keyword names a scorer takes beyond (completion, answer); None if it takes any (**kwargs)."""
    params = list(inspect.signature(func).parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params[2:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))


def _prepare(item: Mapping[str, Any], source_map: Mapping[str, str] | None) -> tuple:
    name = resolve_scorer(item.get("answer_type"), item.get("source"), source_map)
    func = SCORERS[name]
    mode = prompt_mode(item.get("prompt_type"))
    kwargs = _kwargs(item.get("reward_kwargs"))
    format_weight = kwargs.pop("format_weight", 0.0)
    if not isinstance(format_weight, (int, float)) or not 0 <= format_weight <= 1:
        raise OvkitError(f"column 'reward_kwargs': format_weight must be a number in [0, 1], got {format_weight!r}")
    if name == "format":
        kwargs.setdefault("mode", mode)
    accepted = _accepted(func)
    unknown = sorted(set(kwargs) - accepted) if accepted is not None else []
    if unknown:
        takes = ", ".join(sorted(accepted | set(RESERVED_KWARGS)))  # type: ignore[operator]
        raise OvkitError(f"column 'reward_kwargs': scorer {name!r} takes no {', '.join(unknown)}; it takes {takes}")
    answer = item.get("answer")
    if name != "format" and not isinstance(answer, str):
        raise OvkitError(f"column 'answer': expected a string for scorer {name!r}, got {answer!r:.80}")
    completion = item.get("completion") or ""
    return name, func, completion, answer or "", kwargs, mode, float(format_weight)


def check_gold(item: Mapping[str, Any], source_map: Mapping[str, str] | None = None) -> None:
    """Raise OvkitError, its message starting with the column at fault, when a row's gold answer cannot be scored:
    a null, unknown or unmappable answer_type, a null, empty or non-string answer, bad reward_kwargs, or an answer
    its scorer cannot read. Read-time check of RL and eval tables (ovkit.data.schema), before any model loads: the
    in-process scorers are run against an empty completion, since each reads (and checks) its gold answer and its
    kwargs first; the sandboxed ones only have their cheap gold parsers run (math-verify and SVG rendering are not)."""
    if item.get("answer_type") is None and not source_map:
        known = ", ".join(sorted({*SCORERS, *ALIASES}))
        raise OvkitError(
            f"column 'answer_type': is null; RL and eval rows name the scorer of their answer (known: {known})"
        )
    if (
        item.get("answer") is None
        and resolve_scorer(item.get("answer_type"), item.get("source"), source_map) != "format"
    ):
        raise OvkitError("column 'answer': the gold answer is null")
    name, func, _, answer, kwargs, _, _ = _prepare({**item, "completion": ""}, source_map)
    if name != "format" and not answer.strip():
        raise OvkitError(f"column 'answer': the gold answer is empty, so no completion can score for {name!r}")
    if name in SANDBOXED:
        if name == "code":
            codeexec._tests(answer)  # the gold test cases, parsed as the scorer does
        return
    try:
        func("", answer, **kwargs)
    except (TypeError, ValueError) as e:  # a reward_kwargs value of the wrong type reaches the scorer's arithmetic
        raise OvkitError(f"column 'reward_kwargs': scorer {name!r} cannot use them ({type(e).__name__}: {e})") from None
    unreadable = {
        "boolean": text._yes_no(answer) is None,
        "multiple_choice": not any(text._choice_letter(a) for a in alternatives(answer)),
    }
    if unreadable.get(name):
        raise OvkitError(
            f"column 'answer': {answer[:80]!r} is not a gold answer for {name!r} (expected "
            f"{'yes/no' if name == 'boolean' else 'a choice letter'})"
        )


def _finish(raw: Reward, completion: str, mode: str, format_weight: float) -> Reward:
    """Add the format reward and the common parts; a timeout scores 0 whatever the format."""
    fmt = format_reward(completion, mode).reward
    timed_out = bool(raw.parts.get("timeout", False))
    accuracy = 0.0 if timed_out else min(1.0, max(0.0, float(raw.reward)))
    reward = 0.0 if timed_out else (1.0 - format_weight) * accuracy + format_weight * fmt
    return Reward(reward, {**raw.parts, "accuracy": accuracy, "format": fmt, "timeout": timed_out})


def _where(index: int, item: Mapping[str, Any]) -> str:
    return f"row {item['id']!r} (index {index})" if item.get("id") is not None else f"row index {index}"


def score_batch(
    items: list[Mapping[str, Any]],
    *,
    workers: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    source_map: Mapping[str, str] | None = None,
) -> list[Reward]:
    """Score many rows: each item has completion, answer, answer_type, source, and optionally reward_kwargs,
    prompt_type and id. Cheap scorers run here; SANDBOXED ones in up to `workers` processes, `timeout` s each."""
    prepared = []
    for i, item in enumerate(items):
        try:
            prepared.append(_prepare(item, source_map))
        except OvkitError as e:
            raise OvkitError(f"{_where(i, item)}: {e}") from None
    results: list[Reward | BaseException | None] = [None] * len(items)
    remote = [i for i, p in enumerate(prepared) if p[0] in SANDBOXED]
    for i, (name, func, completion, answer, kwargs, _, _) in enumerate(prepared):
        if name not in SANDBOXED:
            try:
                results[i] = func(completion, answer, **kwargs)
            except OvkitError as e:
                results[i] = e
    if remote:
        tasks = [prepared[i][1:5] for i in remote]
        for i, result in zip(remote, shared_pool().run(tasks, workers=max(1, workers), timeout=timeout)):
            results[i] = result
    out = []
    for i, (result, p) in enumerate(zip(results, prepared)):
        if isinstance(result, OvkitError):
            raise OvkitError(f"{_where(i, items[i])}: {result}") from None
        if isinstance(result, BaseException):
            raise result
        out.append(_finish(result, p[2], p[5], p[6]))  # type: ignore[arg-type]
    return out


def score(
    completion: str,
    answer: str,
    answer_type: str | None = None,
    source: str | None = None,
    reward_kwargs: dict | str | None = None,
    *,
    prompt_type: str = "answer",
    timeout: float | None = None,
    source_map: Mapping[str, str] | None = None,
) -> Reward:
    """Score one completion against its gold answer; `reward_kwargs` may be the JSON text of the column."""
    item = {
        "completion": completion,
        "answer": answer,
        "answer_type": answer_type,
        "source": source,
        "reward_kwargs": reward_kwargs,
        "prompt_type": prompt_type,
    }
    return score_batch(
        [item], workers=1, timeout=DEFAULT_TIMEOUT if timeout is None else timeout, source_map=source_map
    )[0]
