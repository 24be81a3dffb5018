"""Multi-turn rollouts: the model acts, an environment (ovkit.envs) answers, its observation is appended with loss
mask 0, until the model finishes, the environment says done, or a turn / token budget runs out.

The design is slime's unified VLM/LLM multi-turn rollout (002 in the references), and it guards against the
failures users of peer systems report (anchors.md section 9):

- Token-in/token-out. The context is a list of token ids: the model's own tokens are appended exactly as sampled,
  never decoded and re-encoded (which drifts: a decoded-then-retokenised turn can split differently).
- Observation tokens are the delta of the chat template against a fixed dummy conversation (slime's trick):
  render `DUMMY` and `DUMMY + [observation]` and keep the tokens after the dummy assistant turn's end-of-turn token,
  so the template's system prompt / tool preamble is never repeated per turn. The template text between an
  end-of-turn token and the next turn (Qwen's "\\n") is part of the delta, so the context is exactly what the template
  renders for the whole conversation. Observation tokens get loss mask 0 and no log-prob.
- Images of later turns are processed when they arrive (capped to --max-pixels like the prompt's) and really
  placed in the context: their placeholder tokens are expanded, their per-token values (Qwen-VL's
  `mm_token_type_ids`) kept, and their processor outputs kept per turn and concatenated once per key at the end
  (`merge_mm`) for the learner; the next turn's generate call needs them whole, so the context re-merges only when a
  new image arrives. Image placeholder tokens are never sampled (`suppress_ids`): the next turn would read them as
  images.
- Every turn is length-checked: generation stops at the token budget (`max_response_tokens`, everything after the
  prompt) and the model's context length; an observation that does not fit ends the trajectory as `truncated`.
- An environment call that raises or hangs is retried up to `env_retries` times, each call limited to
  `env_timeout` seconds, and then ends the trajectory as `env_error`, so a rollout always finishes.

Termination reasons: completed (the environment took the response as final), env_done (the environment ended the
episode for its own reason), max_turns, truncated (a turn hit max_new_tokens or a budget), env_error.
"""

from __future__ import annotations

import inspect
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ovkit.data.schema import IMAGE_TOKEN
from ovkit.envs import REASONS, load_env, parse_env_args
from ovkit.errors import OvkitError
from ovkit.generate import Completion
from ovkit.models.encode import Encoded, encode_messages, merge_mm, multimodal_token_ids, placeholder_ids
from ovkit.options import MultiTurnOptions
from ovkit.rollouts.prompts import cap_pixels
from ovkit.rollouts.sample import prompt_seed
from ovkit.rollouts.table import TERMINATIONS  # completed, env_done, max_turns, truncated, env_error

DUMMY = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]


@dataclass
class MultiTurn:
    """How multi-turn rollouts run (the `--env`, `--max-turns`, ... options of rl-train, rl-curate and eval)."""

    env: Any  # ovkit.envs.EnvSpec
    max_turns: int = 3  # assistant turns at most
    max_response_tokens: int | None = None  # budget for all tokens after the prompt, sampled + observation
    max_context: int | None = None  # prompt + response tokens at most (None: the model's max_position_embeddings)
    env_retries: int = 2  # extra tries of a failed environment call, per call
    env_timeout: float = 30.0  # seconds per environment call
    env_workers: int = 16  # environment calls of one turn that run at once (threads)
    max_pixels: int | None = 512 * 512  # observation images are capped like the prompt's
    mode: str = "answer"  # the prompt mode, for environments that score answers (ovkit.envs.VerifierEnv)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise OvkitError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.max_response_tokens is not None and self.max_response_tokens < 1:
            raise OvkitError(f"--max-response-tokens must be >= 1, got {self.max_response_tokens}")
        if self.env_retries < 0 or self.env_timeout <= 0:
            raise OvkitError("need --env-retries >= 0 and --env-timeout > 0")


# ------------------------------------------------------------------------------------------------ observations


class ObservationEncoder:
    """Observation messages -> the tokens appended to a context (the delta against a dummy conversation)."""

    def __init__(self, processor: Any, stop_ids: Sequence[int], tools: Sequence[dict] | None = None):

        self.processor, self.tools = processor, tools
        base = encode_messages(processor, DUMMY, [], generation_prompt=False, tools=tools).input_ids
        ends = [i for i, t in enumerate(base) if t in set(stop_ids)]
        if not ends:
            raise OvkitError(
                f"the chat template of {type(processor).__name__} writes no end-of-turn token after an assistant "
                f"turn; multi-turn rollouts need one"
            )
        self.trim = ends[-1] + 1  # everything up to and including the dummy assistant turn's end-of-turn token
        self.prefix = base[: self.trim]
        self.end_of_turn = base[ends[-1]]

    def encode(self, message: dict[str, Any], images: Sequence[Any]) -> Any:
        """An Encoded holding only the observation turn and the next generation prompt."""

        role = str(message.get("role", "user"))
        full = encode_messages(
            self.processor,
            [*DUMMY, {"role": role, "content": str(message.get("content", ""))}],
            images,
            generation_prompt=True,
            tools=self.tools,
        )
        if full.input_ids[: self.trim] != self.prefix:
            raise OvkitError(
                f"the chat template renders the conversation before a {role!r} observation differently from the "
                f"conversation alone; the observation cannot be appended as a delta"
            )
        ids = full.input_ids[self.trim :]
        return Encoded(
            input_ids=ids,
            labels=[-100] * len(ids),
            mm=full.mm,
            per_token={k: v[self.trim :] for k, v in full.per_token.items()},
        )


# ------------------------------------------------------------------------------------------------ one trajectory


@dataclass
class Episode:
    """One trajectory being rolled out: the prompt and everything after it."""

    prompt: Any  # ovkit.rollouts.prompts.Prompt
    env: Any
    seed: int = 0  # the prompt's seed (ovkit.rollouts.sample.prompt_seed)
    sample: int = 0  # which of the prompt's n trajectories: turn t draws from prompt_seed(seed, (sample, t))
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    per_token: dict[str, list[int]] = field(default_factory=dict)
    mm_parts: list[dict[str, Any]] = field(default_factory=list)
    images: list = field(default_factory=list)
    turn_texts: list[str] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = "length"
    termination: str | None = None
    reward_scale: float = 1.0
    _context_mm: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.per_token = {k: [] for k in self.prompt.encoded.per_token}

    def append(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        mask: int,
        turn: int,
        per_token: dict[str, Sequence[int]] | None = None,
    ) -> None:
        n = len(ids)
        self.token_ids += list(ids)
        self.logprobs += list(logprobs) if mask else [0.0] * n
        self.loss_mask += [mask] * n
        self.turn_ids += [turn] * n
        per_token = per_token or {}
        for k in set(self.per_token) | set(per_token):
            if k not in self.per_token:
                self.per_token[k] = [0] * (len(self.token_ids) - n)
            self.per_token[k] += [int(v) for v in per_token[k]] if k in per_token else [0] * n

    def add_images(self, mm: dict[str, Any], images: Sequence[Any]) -> None:
        if mm:
            self.mm_parts.append(mm)
            self._context_mm = None
        self.images += list(images)

    def context(self) -> Any:
        """The whole context as an Encoded prompt for the next turn's generation."""

        enc = self.prompt.encoded
        if self._context_mm is None:
            self._context_mm = merge_mm([enc.mm, *self.mm_parts]) if self.mm_parts else dict(enc.mm)
        per_token = {k: list(enc.per_token.get(k, [0] * enc.length)) + v for k, v in self.per_token.items()}
        ids = list(enc.input_ids) + self.token_ids
        return Encoded(input_ids=ids, labels=[-100] * len(ids), mm=self._context_mm, per_token=per_token)

    def completion(self) -> Any:

        return Completion(
            token_ids=self.token_ids,
            text=self.turn_texts[-1] if self.turn_texts else "",
            logprobs=self.logprobs,
            finish_reason="error" if self.termination == "env_error" else self.finish_reason,
            loss_mask=self.loss_mask,
            turn_ids=self.turn_ids,
            turns=self.turns,
            termination=self.termination,
            per_token=self.per_token if any(any(v) for v in self.per_token.values()) else {},
            mm=merge_mm(self.mm_parts),
            images=self.images,
            reward_scale=self.reward_scale,
            turn_texts=self.turn_texts,
        )


def task_of(prompt: Any, mode: str) -> dict[str, Any]:
    """What an environment factory gets: the RL row as the model sees it."""
    return {
        "id": prompt.id,
        "images": list(prompt.images),
        "answer": prompt.answer,
        "answer_type": prompt.answer_type,
        "source": prompt.source,
        "category": prompt.category,
        "reward_kwargs": prompt.reward_kwargs,
        "mode": mode,
    }


# ------------------------------------------------------------------------------------------------ environment calls


class EnvFailure(Exception):
    pass


def call_env(fn: Callable, *args: Any, timeout: float, retries: int) -> Any:
    """fn(*args) with `timeout` s per try and `retries` extra tries; EnvFailure when every try fails."""
    (result,) = call_env_all([(fn, args)], timeout=timeout, retries=retries)
    if isinstance(result, EnvFailure):
        raise result
    return result


def call_env_all(
    calls: Sequence[tuple[Callable, tuple]], *, timeout: float, retries: int, workers: int = 16
) -> list[Any]:
    """Every fn(*args) in its own worker thread, at most `workers` at once, `timeout` s per try, `retries` extra
    tries of the calls that raised or timed out; a call that never succeeded returns an EnvFailure (not raised).
    The environments of different trajectories are different objects, so their calls run concurrently (a slow tool
    costs one timeout per turn, not one per trajectory). A hung call's thread cannot be killed from Python: it is
    abandoned (a daemon) and the trajectory moves on."""
    results: list[Any] = [None] * len(calls)
    errors: list[list[str]] = [[] for _ in calls]
    pending = list(range(len(calls)))
    for _ in range(retries + 1):
        failed = []
        for first in range(0, len(pending), max(1, workers)):
            chunk = pending[first : first + max(1, workers)]
            boxes = {i: {} for i in chunk}
            threads = {
                i: threading.Thread(target=_into, args=(boxes[i], *calls[i]), name="ovkit-env", daemon=True)
                for i in chunk
            }
            for t in threads.values():
                t.start()
            deadline = time.monotonic() + timeout
            for i in chunk:
                threads[i].join(max(0.0, deadline - time.monotonic()))
                if threads[i].is_alive():
                    errors[i].append(f"timed out after {timeout:g} s")
                elif "error" in boxes[i]:
                    err = boxes[i]["error"]
                    errors[i].append(f"{type(err).__name__}: {err}")
                else:
                    results[i] = boxes[i].get("value")
                    continue
                failed.append(i)
        pending = failed
        if not pending:
            break
    for i in pending:
        results[i] = EnvFailure("; ".join(errors[i]))
    return results


def _into(box: dict[str, Any], fn: Callable, args: tuple) -> None:
    try:
        box["value"] = fn(*args)
    except BaseException as e:  # noqa: BLE001 -- reported as the environment's failure
        box["error"] = e


# ------------------------------------------------------------------------------------------------ the loop


class EpisodeRunner:
    """Runs multi-turn rollouts for a batch of prompts with one engine: every turn is one batched generate call over
    the trajectories still running, then one environment step each."""

    def __init__(self, engine: Any, processor: Any, cfg: MultiTurn, model: Any = None):
        self.engine, self.cfg = engine, cfg
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.stop_ids = set(getattr(engine, "stop_ids", None) or [])
        self.encoder = ObservationEncoder(processor, list(self.stop_ids), tools=cfg.env.tools)
        model = model if model is not None else getattr(engine, "model", None)
        has_config = model is not None and hasattr(model, "config")
        self.suppress = sorted(multimodal_token_ids(model) if has_config else placeholder_ids(processor))
        limits = [
            cfg.max_context,
            _max_positions(model) if has_config else None,
            getattr(engine, "max_model_len", None),
        ]
        self.max_context = cfg.max_context or min((x for x in limits if x), default=None)
        self.failures: list[str] = []  # environment failures of the last run, for the log

    def run(
        self,
        prompts: Sequence[Any],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        seeds: Sequence[int] | None = None,
    ) -> list[list[Any]]:
        """Per prompt, `n` multi-turn trajectories as Completions (token_ids after the prompt, loss_mask, turn_ids).
        `seeds`: one per prompt (default: `prompt_seed(seed, its id)`); every turn of trajectory k draws from its own
        stream (ovkit.rollouts.sample), so a trajectory does not depend on which others share its calls."""
        self.failures = []
        seeds = [prompt_seed(seed, p.id) for p in prompts] if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        episodes = [self._episode(p, s, k) for p, s in zip(prompts, seeds) for k in range(n)]
        starting = [e for e in episodes if e.termination is None]
        for e, result in zip(starting, self._call([(e.env.reset, ()) for e in starting])):
            if isinstance(result, EnvFailure):
                self._fail(e, f"reset: {result}")
        for turn in range(self.cfg.max_turns):
            running = [e for e in episodes if e.termination is None]
            if not running:
                break
            acting = self._generate(running, turn, max_new_tokens, temperature, top_p)
            for e, result in zip(acting, self._call([(e.env.step, (e.turn_texts[-1],)) for e in acting])):
                self._observe(e, turn, result)
        for e in episodes:
            e.termination = e.termination or "max_turns"
        closing = [(e.env.close, ()) for e in episodes if e.env is not None and callable(getattr(e.env, "close", None))]
        call_env_all(closing, timeout=self.cfg.env_timeout, retries=0, workers=self.cfg.env_workers)
        if self.failures:  # the trajectories end as env_error; say why, once per call
            more = f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            print(f"ovkit: warning: environment failed: {self.failures[0]}{more}", file=sys.stderr, flush=True)
        done = [e.completion() for e in episodes]
        return [done[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _episode(self, prompt: Any, seed: int = 0, sample: int = 0) -> Episode:
        """A trajectory with its own environment; a factory that raises ends it as env_error (the rollout goes on)."""
        e = Episode(prompt, None, seed, sample)
        try:
            e.env = self.cfg.env.build(task_of(prompt, self.cfg.mode))
        except OvkitError:
            raise  # bad --env-arg values or an object without the interface: the run cannot work
        except Exception as err:  # noqa: BLE001 -- the environment's failure, reported like a failed step
            self._fail(e, f"build: {type(err).__name__}: {err}")
        return e

    def _call(self, calls: Sequence[tuple[Callable, tuple]]) -> list[Any]:
        return call_env_all(
            calls, timeout=self.cfg.env_timeout, retries=self.cfg.env_retries, workers=self.cfg.env_workers
        )

    def _budget(self, e: Episode) -> int:
        """Tokens the trajectory may still add."""
        left = self.max_context - e.prompt.encoded.length - len(e.token_ids) if self.max_context else 1 << 30
        if self.cfg.max_response_tokens is not None:
            left = min(left, self.cfg.max_response_tokens - len(e.token_ids))
        return left

    def _generate(
        self, running: list[Episode], turn: int, max_new_tokens: int, temperature: float, top_p: float
    ) -> list[Episode]:
        """One assistant turn for every running trajectory; returns those whose turn ended with a stop token."""
        ready = []
        for e in running:
            if self._budget(e) < 1:
                e.termination = "truncated"
            else:
                ready.append(e)
        if not ready:
            return []
        cap = min(max_new_tokens, max(self._budget(e) for e in ready))
        outs = self.engine.generate(
            [e.context() for e in ready],
            n=1,
            max_new_tokens=cap,
            temperature=temperature,
            top_p=top_p,
            seed=turn,
            seeds=[prompt_seed(e.seed, (e.sample, turn)) for e in ready],
            images=[list(e.prompt.images) + e.images for e in ready],
            suppress_ids=self.suppress,
        )
        acting = []
        for e, (c,) in zip(ready, outs):
            allowed = min(max_new_tokens, self._budget(e))
            ids, logprobs, reason = list(c.token_ids), list(c.logprobs), c.finish_reason
            placeholder = next((j for j, t in enumerate(ids) if t in self.suppress), None)
            if placeholder is not None:  # an engine that could not suppress them: the turn ends before it
                ids, reason = ids[:placeholder], "length"
            if len(ids) > allowed:
                ids, reason = ids[:allowed], "length"
            text = c.text if len(ids) == len(c.token_ids) else self._decode(ids)
            e.append(ids, logprobs[: len(ids)], 1, turn)
            e.turns += 1
            e.turn_texts.append(text)
            e.finish_reason = reason
            if reason != "stop":
                e.termination = "truncated"
            else:
                acting.append(e)
        return acting

    def _observe(self, e: Episode, turn: int, result: Any) -> None:
        """The environment's step result on the turn just generated; its observation appended."""
        try:
            if isinstance(result, EnvFailure):
                raise result
            obs, done, info = _unpack(result)
        except EnvFailure as err:
            return self._fail(e, f"step: {err}")
        if "reward_scale" in info:  # a multiplier on a reward in [0, 1]: kept in [0, 1]
            e.reward_scale = min(1.0, max(0.0, float(info["reward_scale"])))
        if done:
            reason = info.get("reason", "completed")
            e.termination = reason if reason in REASONS else "completed"
            return
        if turn + 1 >= self.cfg.max_turns:
            e.termination = "max_turns"
            return
        try:
            message = call_env(
                e.env.format_observation, obs, timeout=self.cfg.env_timeout, retries=self.cfg.env_retries
            )
            delta, images = self._encode(message)
        except (EnvFailure, OvkitError) as err:
            return self._fail(e, f"observation: {err}")
        glue = [] if e.token_ids and e.token_ids[-1] == self.encoder.end_of_turn else [self.encoder.end_of_turn]
        if len(glue) + delta.length > self._budget(e) - 1:  # the observation and at least one sampled token must fit
            e.termination = "truncated"
            return
        per_token = {k: [0] * len(glue) + list(v) for k, v in delta.per_token.items()}
        e.append(glue + delta.input_ids, [], 0, turn, per_token)
        e.add_images(delta.mm, images)

    def _encode(self, message: Any) -> tuple[Any, list]:

        if not isinstance(message, dict) or "content" not in message:
            raise OvkitError(
                f"format_observation must return a dict with role, content and images, got {type(message).__name__}"
            )
        images = [cap_pixels(im.convert("RGB"), self.cfg.max_pixels) for im in message.get("images") or []]
        markers = str(message["content"]).count(IMAGE_TOKEN)
        if markers != len(images):
            raise OvkitError(f"the observation has {markers} {IMAGE_TOKEN} markers and {len(images)} images")
        return self.encoder.encode(message, images), images

    def _fail(self, e: Episode, why: str) -> None:
        e.termination = "env_error"
        self.failures.append(f"{e.prompt.id}: {why}")

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=True)


def _unpack(result: Any) -> tuple[Any, bool, dict]:
    if not isinstance(result, tuple) or len(result) != 3:
        raise EnvFailure(f"step must return (observation, done, info), got {type(result).__name__}")
    obs, done, info = result
    return obs, bool(done), dict(info or {})


def _max_positions(model: Any) -> int | None:
    config = getattr(model, "config", None)
    for cfg in (getattr(config, "text_config", None), config):
        value = getattr(cfg, "max_position_embeddings", None)
        if isinstance(value, int):
            return value
    return None


def episode_reward(reward: float, parts: dict[str, Any], completion: Any) -> tuple[float, dict[str, Any]]:
    """A trajectory's task reward and parts: a multi-turn one's is its last answer's, times the environment's
    `reward_scale`, with turns / termination / reward_scale added to the parts; a single-turn one's is unchanged."""
    if completion.termination is None:
        return reward, parts
    extra = {"turns": completion.turns, "termination": completion.termination, "reward_scale": completion.reward_scale}
    return reward * completion.reward_scale, {**parts, **extra}


PAD_RUN = re.compile(r"(<\|image_pad\|>)+")


def transcript(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The whole response (model turns and observations) as text, special tokens kept, image placeholder runs
    collapsed: what a person reads in the rollout table's `completion` column."""
    return PAD_RUN.sub("<|image_pad|>", tokenizer.decode(list(token_ids), skip_special_tokens=False))


# ------------------------------------------------------------------------------------------------ from the options


def check_env_options(turns: MultiTurnOptions) -> None:
    """Check a stage's multi-turn options (env, env_arg, max_turns, ...): --env is built once here so a bad name,
    import path or argument fails before any model is loaded; --env-arg becomes a mapping."""

    turns.env_arg = parse_env_args(turns.env_arg)
    if turns.env is None:
        if turns.env_arg:
            raise OvkitError("--env-arg needs --env")
        return
    spec = load_env(turns.env, turns.env_arg)
    try:  # the arguments' names, against the factory's signature (their values are the factory's to check)
        inspect.signature(spec.factory).bind({}, **spec.args)
    except TypeError as e:
        raise OvkitError(f"--env {turns.env}: --env-arg {', '.join(spec.args) or '(none)'}: {e}") from None
    except ValueError:
        pass  # a builtin without a signature
    MultiTurn(
        env=None,
        max_turns=turns.max_turns,
        max_response_tokens=turns.max_response_tokens,
        env_retries=turns.env_retries,
        env_timeout=turns.env_timeout,
    )


def env_instruction(turns: MultiTurnOptions) -> str:
    """The prompt line of the environment class (e.g. the zoom syntax), '' without --env."""

    return load_env(turns.env, turns.env_arg).instruction if turns.env else ""


def env_tools(turns: MultiTurnOptions) -> list[dict] | None:
    """The environment class's tool schemas for the chat template, None without --env or without tools."""

    return load_env(turns.env, turns.env_arg).tools if turns.env else None


def make_runner(
    turns: MultiTurnOptions, engine: Any, processor: Any, *, mode: str, max_pixels: int | None, model: Any = None
) -> EpisodeRunner | None:
    """The EpisodeRunner of a stage's multi-turn options with --env, else None (single-turn)."""

    if not turns.env:
        return None
    mt = MultiTurn(
        env=load_env(turns.env, turns.env_arg),
        max_turns=turns.max_turns,
        max_response_tokens=turns.max_response_tokens,
        env_retries=turns.env_retries,
        env_timeout=turns.env_timeout,
        max_pixels=max_pixels,
        mode=mode,
    )
    return EpisodeRunner(engine, processor, mt, model=model)


def turn_stats(completions: Sequence[Any], rewards: Sequence[float]) -> dict[str, Any]:
    """Multi-turn rollouts: turn-count distribution, termination reasons, reward by turn count."""

    n = len(completions)
    turns = [c.turns for c in completions]
    reasons = Counter(c.termination for c in completions)
    out: dict[str, Any] = {
        "turns/mean": sum(turns) / n,
        "turns/max": max(turns),
        "turns/hist": {str(k): v for k, v in sorted(Counter(turns).items())},
        "length/observation_tokens": sum(len(c.token_ids) - sum(c.mask) for c in completions) / n,
    }
    out.update({f"termination/{r}": reasons.get(r, 0) / n for r in TERMINATIONS})
    for t in sorted(set(turns)):
        values = [r for r, k in zip(rewards, turns) if k == t]
        out[f"reward/by_turns/{t}"] = sum(values) / len(values)
    return out
