"""Evaluation while training (`--eval-data`, `--eval-every N` on align, midtrain, sft and rl-train): TRL's
`eval_strategy="steps"`, the HF Trainer's `eval_steps`.

Every N optimiser steps and after the last one, the model being trained scores the held-out rows:

- `eval/reward`, `eval/accuracy` and `eval/reward/<category>`, `eval/accuracy/<category>`: the numbers
  `ovkit eval --prompt MODE --seed SEED` reports for the model of that step (`summary.json`'s `overall`,
  `accuracy` and `categories`), through the same pieces: rows as `ovkit.evaluate.run.load_rows` reads them
  (`--eval-limit`
  per category), prompts as `ovkit eval` asks them (ovkit.rollouts.prompts.encode_prompts), per-category token budgets
  (`token_budgets`), greedy
  generation with the HF engine on the learner's own weights (no copy), the rewards library's scorers. Rows that
  have a gold `answer`; a supervised held-out set without one gets the loss only.
- `eval/loss` (supervised stages): the token-mean NLL of the held-out targets, computed as the training loss is
  (the prepared TokenScorer, the same chunked head and autocast), without gradients. The target of a row is its
  last assistant turn (an SFT-style row); a prompt-only eval row (synth's `val/`, `eval/`) is asked with the
  answer-mode instruction and its target is `<answer>ANSWER</answer>`, the form the instruct split trains on.

Under a launcher each process evaluates its share of the rows (`ovkit.launch.share`; row i is sampled from its own
seed, as `ovkit eval` does) and the results are gathered, so N processes log what one logs. That holds for data
parallelism (DDP: each process holds the whole model). Under FSDP or DeepSpeed, which shard the weights, `--eval-data`
is refused at start: the greedy generate reads the learner's weights outside its forward and would run another number
of collectives on each process; evaluate the checkpoints (model directories) with `ovkit eval` instead.

Evaluation is run control: it does not change the trajectory. The model is put in eval mode and back to each
module's own mode, nothing gets a gradient, and the torch / CUDA / Python / NumPy random states are restored
afterwards, so the losses and weights of a run are bit-identical with and without it (tests/test_eval_during.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ovkit.data.io import read_samples
from ovkit.errors import OvkitError
from ovkit.evaluate.metrics import summarize
from ovkit.evaluate.run import UNCATEGORIZED, Scoring, make_records, score_rows, token_budgets
from ovkit.generate import HFEngine
from ovkit.launch import gather, share
from ovkit.models import pad_token_id
from ovkit.models.encode import decode_images, encode_sample
from ovkit.models.precompute import model_inputs, on_device
from ovkit.options import EvalDuring
from ovkit.pack.batches import collate_padded, target_tokens
from ovkit.pack.packed import PackLayout
from ovkit.prompts import with_instruction

PREFIX = "eval/"  # TRL's / the Trainer's eval metrics as trackers show them (eval_loss -> eval/loss)


def never(step: int, scorer: Any) -> dict[str, float]:
    return {}


def evaluator(
    options: EvalDuring,
    seed: int,
    rt: Any,
    processor: Any,
    n_steps: int,
    *,
    prompt: str,
    loss: bool,
    batch_size: int,
) -> Callable[[int, Any], dict[str, float]]:
    """`evaluate(step, scorer)`: the eval metrics at the steps that are due (every `--eval-every`, and `n_steps`),
    else {}; the loops merge them into the step's metrics. Without `--eval-data`, always {}."""
    if not options.eval_data:
        return never
    if getattr(rt, "sharded", False):
        # Generation reads the learner's own weights, which FSDP/DeepSpeed shard, and each process would run another
        # number of forwards (collectives per forward): refused at start rather than a hang or shard-shaped weights.
        raise OvkitError(
            f"--eval-data under {rt.distributed}: evaluation while training reads the learner's "
            "weights directly, which this engine shards across processes; train with DDP (accelerate launch without "
            "an FSDP/DeepSpeed config, or torchrun), or evaluate the checkpoints afterwards (--save-every N, then "
            "`ovkit eval` on each OUT.partial/checkpoints/step-N, a model directory)"
        )
    held_out = HeldOut(
        options.eval_data,
        processor,
        rt.accelerator.unwrap_model,
        rt,
        prompt=prompt,
        loss=loss,
        limit=options.eval_limit,
        max_new_tokens=options.eval_max_new_tokens,
        batch_size=batch_size,
        seed=seed,
    )

    def evaluate(step: int, scorer: Any) -> dict[str, float]:
        if step != n_steps and not (options.eval_every and step % options.eval_every == 0):
            return {}
        return held_out(scorer)

    return evaluate


class HeldOut:
    """The held-out rows, encoded once; calling it with the prepared scorer gives the eval metrics."""

    def __init__(
        self,
        paths: Sequence[Path],
        processor: Any,
        unwrap: Callable[[Any], Any],
        rt: Any,
        *,
        prompt: str,
        loss: bool,
        limit: int | None,
        max_new_tokens: int | None,
        batch_size: int,
        seed: int,
    ):

        self.rt, self.unwrap, self.processor = rt, unwrap, processor
        rows = _read(paths, limit)
        scored = [r for r in rows if r.get("answer") is not None]
        if not loss and len(scored) < len(rows):
            raise OvkitError(
                f"--eval-data {', '.join(map(str, paths))}: rl-train scores eval rows against a gold answer; "
                f"{len(rows) - len(scored)} rows have none"
            )
        for r in scored:
            r["category"] = r.get("category") or UNCATEGORIZED
        self.rows = scored
        self.scoring = Scoring(prompt=prompt, seed=seed)  # `ovkit eval --prompt PROMPT --seed SEED`: greedy, n=1
        self.budgets = token_budgets(scored, processor, prompt, max_new_tokens) if scored else {}
        self.batch_size = batch_size
        self.targets = [_target(r) for r in rows] if loss else []
        self.targets = [t for t in self.targets if t is not None]
        if not self.rows and not self.targets:
            raise OvkitError(
                f"--eval-data {', '.join(map(str, paths))}: no row to evaluate (rows need a gold `answer` or an "
                f"assistant turn)"
            )
        self._encoded: tuple | None = None

    def __call__(self, scorer: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        with _untouched(scorer), torch.no_grad():
            out = {}
            if self.targets:
                out["loss"] = self.loss(scorer)
            if self.rows:
                out.update(self.scores(self.unwrap(scorer).model))
        out["runtime"] = time.perf_counter() - t0
        return {PREFIX + k: v for k, v in out.items()}

    # -- the loss --------------------------------------------------------------------------------------------------

    def loss(self, scorer: Any) -> float:
        """Token-mean NLL over every process's share of the targets (the training loss's function, no gradient)."""

        bare = self.unwrap(
            scorer
        )  # the TokenScorer without DDP's wrapper: no collective per forward, shares may differ
        device = self.rt.accelerator.device
        if self._encoded is None:
            self._encoded = tuple(_encode(self.processor, t) for t in self.targets)
        mine = sorted(share(len(self._encoded)), key=lambda i: self._encoded[i].length)
        layout = PackLayout.for_model(bare.model)
        pad_id = pad_token_id(self.processor, bare.model)
        nll, count = 0.0, 0
        for s in range(0, len(mine), self.batch_size):
            batch = collate_padded([self._encoded[i] for i in mine[s : s + self.batch_size]], pad_id, layout)
            with self.rt.autocast():
                nll += float(
                    bare(
                        model_inputs(batch, device),
                        labels=on_device(batch["labels"], device),
                        target_index=on_device(batch.get("target_index"), device),
                    )
                )
            count += target_tokens(batch)
        every = gather([(nll, count)])
        return sum(n for n, _ in every) / max(sum(c for _, c in every), 1)

    # -- the scores ------------------------------------------------------------------------------------------------

    def scores(self, model: Any) -> dict[str, float]:
        """`ovkit eval`'s overall and per-category mean reward and accuracy for `model` (greedy, its share of rows)."""

        engine = HFEngine(model, self.processor, batch_size=self.batch_size)  # the learner's weights, not a copy
        mine = share(len(self.rows))
        with self.rt.autocast():
            done = score_rows(self.scoring, engine, self.processor, [self.rows[i] for i in mine], self.budgets)
        every = dict(zip((i for part in gather([mine]) for i in part), (r for part in gather([done]) for r in part)))
        scored = [every[i] for i in range(len(self.rows))]
        records = make_records(self.rows, [s[0] for s in scored], [s[2] for s in scored], [s[3] for s in scored])
        summary = summarize(records)
        out = {"reward": summary["overall"]["reward"], "accuracy": summary["overall"]["accuracy"]}
        for category, m in summary["categories"].items():
            out[f"reward/{category}"] = m["reward"]
            out[f"accuracy/{category}"] = m["accuracy"]
        return out


def _read(paths: Sequence[Path], limit: int | None) -> list[dict[str, Any]]:
    """Every row of the eval tables in order, at most `limit` per category (the first ones, as `ovkit eval --limit`)."""

    rows, seen = [], {}
    for path in paths:
        table = read_samples(path, images="header").table
        for row in table.to_pylist():
            key = row.get("category") or ""
            seen[key] = seen.get(key, 0) + 1
            if limit is None or seen[key] <= limit:
                rows.append(row)
    return rows


def _target(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list] | None:
    """(messages ending in the target turn, image cells) of a row, or None when it has no target."""

    messages = list(row["messages"])
    if any(m["role"] == "assistant" for m in messages):
        return messages, row["images"]
    if row.get("answer") is None:
        return None
    return [
        *with_instruction(messages, "answer"),
        {"role": "assistant", "content": f"<answer>{row['answer']}</answer>"},
    ], row["images"]


def _encode(processor: Any, target: tuple[list[dict[str, Any]], list]) -> Any:

    messages, cells = target
    return encode_sample(processor, messages, decode_images(cells))


@contextmanager
def _untouched(module: Any) -> Iterator[None]:
    """Eval mode and fresh random draws inside; every module's own mode and every random state as they were after."""
    modes = [(m, m.training) for m in module.modules()]
    states = (
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        random.getstate(),
        np.random.get_state(),
    )
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state_all(states[1])
        random.setstate(states[2])
        np.random.set_state(states[3])
