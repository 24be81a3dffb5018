"""`ovkit rl-train`: GRPO with AReaL's decoupled PPO, bounded-staleness asynchronous rollouts, and mismatch corrections.

One step (as in LLaVA-OneVision-1.5-RL's trains/grpo.py):

    groups          = rollouts.next_batch(step)        prompts_per_step groups of group_size scored completions,
                                                       each tagged with the sampler version that generated it
    metrics         = train_step(...)                  advantages, proximal log-probs, corrections, decoupled PPO
                                                       (ovkit.rl.update)
    rollouts.sync(model, step + 1)                     the sampler gets the new weights; admission control moves on

Everything around the loop (device, precision, attention, loading, optimiser, run directory, resume, checkpoints,
logging, the end) is the shared runtime's, exactly as for `ovkit sft` (ovkit.runtime, which also documents the run
directory). With --save-rollouts, OUT/rollouts/step-N.parquet holds every step's trajectories.

Several processes (`torchrun --nproc_per_node N -m ovkit rl-train ...` or `accelerate launch`): each samples and
scores its share of the step's groups (ovkit.rl.rollout; each group seeded by its stream position, so the shares
together are the groups one process samples), the learner is data-parallel (DDP through accelerate,
or FSDP with an accelerate config) and normalises the loss by the global token counts, so a step over N processes
is the single-process step over the same groups; metrics are combined across processes (means of means, maxima
of maxima, histograms summed) and written, with the rollouts and the final model, by the main process once every
process has finished.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from functools import partial
from typing import Any

import pyarrow as pa
import torch

from ovkit import faults
from ovkit.data import count_rows, read_samples, write_table
from ovkit.errors import OvkitError
from ovkit.evaluate.during import evaluator
from ovkit.generate import close_engine
from ovkit.generate.engines import build_engine, device
from ovkit.models import attention as attn
from ovkit.models import pad_token_id
from ovkit.models import precision as prec
from ovkit.models.groups import set_trainable, trainable_names
from ovkit.pack.packed import PackLayout
from ovkit.progress import honours_quiet
from ovkit.rewards.custom import parse_all
from ovkit.rl.config import SMALLER, TRAJECTORY, RLTrainConfig
from ovkit.rl.metrics import console_line, dynamic_sampling_metrics, rollout_metrics
from ovkit.rl.rollout import AsyncRollouts, SyncRollouts
from ovkit.rl.sftmix import sft_mixer
from ovkit.rl.shaping import score_with_overlong
from ovkit.rl.update import train_step
from ovkit.rollouts.episodes import env_instruction, env_tools, make_runner
from ovkit.rollouts.groups import Group, Sampling, groups_table, score_groups
from ovkit.rollouts.prompts import encode_prompts
from ovkit.runs import LearnerRun, finished
from ovkit.runtime import Runtime
from ovkit.runtime.heap import large_blocks_off_heap
from ovkit.runtime.optim import constant_factor
from ovkit.runtime.tail import Tail

# A rollout table's row per token at most: token id, sampler log-prob, loss mask (before parquet's compression).
ROLLOUT_BYTES_PER_TOKEN = 9


@honours_quiet
def train_rl(cfg: RLTrainConfig) -> dict[str, Any] | None:
    """Run GRPO and write cfg.out; None when cfg.out is already complete (skipped)."""
    if finished(cfg.out, cfg, cfg.overwrite):  # exits 2 if OUT was made with other options
        return None
    # The sampler shuts down after the run's last collective (the final save): vLLM's shutdown also ends the process
    # group it joined, which a multi-process learner shares.
    with ExitStack() as owned:
        return _train_rl(cfg, owned)


def _train_rl(cfg: RLTrainConfig, owned: ExitStack) -> dict[str, Any]:
    files = {f.path: "--reward-funcs" for f in parse_all(cfg.reward_funcs)}  # their code shapes the trajectory
    run = LearnerRun.of(cfg, "rl-train", TRAJECTORY, smaller=SMALLER, others=files)
    rt = Runtime(run, cfg.loading, cfg.optimiser, cfg.compute, cfg.lora, cfg.checkpoints, cfg.trackers)
    if cfg.shared_prefix == "on":  # before the model loads with it (the reference model's too)
        rt.attention = attn.for_shared_prefix(rt.attention)
    rt.check_run_dir()
    large_blocks_off_heap()  # the sampler's vocabulary-sized temporaries go back to the system (ovkit.runtime.heap)
    tables = _tables(cfg)  # every row checked (answers included) before the model loads
    model, processor = rt.load_model(cfg.model)
    params = trainable(model, cfg, rt)
    prompts = _prompts(cfg, tables, processor)
    _check_processes(cfg, rt)
    layout = PackLayout.for_model(model)  # the learner's micro-batch layout (rope index, vision tower), built once
    pad_id = pad_token_id(processor, model)
    # --sft-coef: the SFT tables read and checked before any write (ovkit.rl.sftmix)
    sft = sft_mixer(
        cfg.sft_mix,
        processor,
        layout,
        pad_id,
        seed=cfg.seed,
        micro_batch_size=cfg.micro_batch_size,
        rank=rt.accelerator.process_index,
        world=rt.processes,
    )
    warn_few_prompts(cfg, len(prompts), rt.is_main)
    n_steps = total_steps(cfg, len(prompts))
    longest = max(p.encoded.length for p in prompts) + (cfg.max_response_tokens or cfg.max_new_tokens)
    _check_space(cfg, rt, model, n_steps, longest)
    evaluate = evaluator(
        cfg.eval_during,
        cfg.seed,
        rt,
        processor,
        n_steps,
        prompt=cfg.mode,
        loss=False,
        batch_size=cfg.rollout_batch_size,
    )  # --eval-data
    rt.make_run_dir()  # only now: bad inputs leave nothing behind
    schedule = lambda s: constant_factor(s, n_steps, cfg.warmup_ratio)  # noqa: E731
    optimizer, scheduler = rt.optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, schedule=schedule)
    rt.checkpointing(model, tokens=cfg.micro_batch_size * longest)  # before the sampler copies it
    rt.compile(model)  # inside each checkpoint; the sampler's generation (KV cache) and its deep copy run eager
    scorer, optimizer = rt.prepare(model, optimizer, scheduler)
    state = rt.resume({"step": 0, "elapsed_s": 0.0, "samples": 0, "tokens": 0})  # a resumed run's weights: `model`
    with faults.deferred_signals():  # a SIGINT/SIGTERM now waits for the step's end
        ref_model = _reference(rt, cfg) if cfg.kl_coef else None
        rollouts = _rollouts(cfg, model, processor, prompts, rt.accelerator.process_index, rt.processes)
        owned.callback(close_engine, rollouts.engine)
        logger = rt.logger(n_steps, state["step"], console=console_line, desc=f"rl-train stage {cfg.stage}")
        tail = Tail(rt, scorer, processor, logger, evaluate, n_steps, cfg.save_every, cfg.keep_checkpoints)
        corr, update = cfg.correction_config(), cfg.update_options()
        t_start = time.perf_counter() - state["elapsed_s"]
        scorer.eval()  # no dropout: the proximal pass and the gradient pass are the same function
        rollouts.start(state["step"])
        with tail.running(state), ExitStack() as running:
            running.callback(rollouts.stop)
            for step in range(state["step"], n_steps):
                t = [time.perf_counter()]  # rollout, train, sync: each phase's end
                groups = rollouts.next_batch(step)
                t.append(time.perf_counter())
                metrics = train_step(
                    scorer,
                    optimizer,
                    params,
                    groups,
                    step,
                    pad_id,
                    corr,
                    ref_model,
                    update,
                    rt=rt,
                    layout=layout,
                    sft=sft,
                )
                metrics["lr"] = scheduler.get_last_lr()[0]
                scheduler.step()
                t.append(time.perf_counter())
                rollouts.sync(model, step + 1)
                t.append(time.perf_counter())
                if cfg.save_rollouts:
                    _save_rollouts(rt, step + 1, groups, processor)
                n = sum(len(g.completions) for g in groups) * rt.processes
                state.update(step=step + 1, samples=state["samples"] + n, elapsed_s=time.perf_counter() - t_start)
                metrics = tail.log(step + 1, _step_metrics(cfg, rt, state, groups, metrics, t, n, len(prompts)))
                state["last"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                tail.end_step(step + 1, state)
    return rt.finish(
        scorer, processor, state, _summary(cfg, rt, state, n_steps), inputs=[*cfg.data, *(cfg.sft_data or [])]
    ).metrics


def _check_processes(cfg: RLTrainConfig, rt: Runtime) -> None:
    """Options that do not fit the process layout: an unequal share of prompts, the HF engine on sharded weights."""
    if cfg.prompts_per_step % rt.processes:
        raise OvkitError(
            f"--prompts-per-step {cfg.prompts_per_step} must be a multiple of the {rt.processes} processes (each "
            f"samples an equal share)"
        )
    if rt.sharded and cfg.engine == "hf":
        # The HF engine samples from the learner's parameters (or a copy made from them): under FSDP/DeepSpeed each
        # process holds a shard, and each would decode another number of steps (one collective per forward).
        raise OvkitError(
            f"--engine hf under {rt.distributed}: the HF engine samples from the learner's "
            "own weights, which this engine shards across processes; use --engine vllm (colocated, weights gathered "
            "every step) or --engine vllm-server, or DDP (accelerate launch without an FSDP/DeepSpeed config, torchrun)"
        )


def _check_space(cfg: RLTrainConfig, rt: Runtime, model, n_steps: int, longest: int) -> None:
    """The disk, before any write: checkpoints, the final model and, with --save-rollouts, the rollout tables."""
    rollout_bytes = (
        n_steps * cfg.prompts_per_step * cfg.group_size * longest * ROLLOUT_BYTES_PER_TOKEN if cfg.save_rollouts else 0
    )
    rt.check_space(
        model,
        n_steps=n_steps,
        save_every=cfg.save_every,
        keep=cfg.keep_checkpoints,
        extra=rollout_bytes,
        what=", --save-rollouts tables" if cfg.save_rollouts else "",
    )


def _step_metrics(cfg: RLTrainConfig, rt: Runtime, state, groups, metrics, t: list, n: int, n_prompts: int) -> dict:
    """The step's metrics (`metrics`: the update's and its lr) with the rollouts', every process's combined; the
    run's token count in `state` moved on. `t`: the step's start and its rollout, train and sync phases' ends; `n`:
    the step's samples, every process's."""
    lr, step = metrics.pop("lr"), state["step"]
    metrics = combine(
        rt,
        {
            **rollout_metrics(groups),
            **(dynamic_sampling_metrics(groups) if cfg.dynamic_sampling else {}),
            **metrics,
            "step_tokens": step_tokens(groups),
            "lr": lr,
            "version": step,
            "time/rollout": t[1] - t[0],
            "time/train": t[2] - t[1],
            "time/sync": t[3] - t[2],
            "samples_per_s": n / max(t[3] - t[0], 1e-9),
            "samples": state["samples"],
            "elapsed_s": state["elapsed_s"],
        },
    )
    state["tokens"] = state.get("tokens", 0) + metrics.pop("step_tokens")  # a checkpoint of an older ovkit has none
    # TRL's names: num_tokens (prompt + completion, cumulative), epoch (passes over DATA, fractional)
    metrics.update(tokens=state["tokens"], epoch=step * cfg.prompts_per_step / n_prompts)
    return metrics


def step_tokens(groups: Sequence[Group]) -> int:
    """Prompt and completion tokens of every trajectory, as TRL's num_tokens counts them (its attention mask)."""
    return sum(g.prompt.encoded.length + len(c.token_ids) for g in groups for c in g.completions)


def _summary(cfg: RLTrainConfig, rt: Runtime, state: dict[str, Any], n_steps: int) -> dict[str, Any]:
    """The run's headline numbers, from the whole metrics.jsonl (a resumed run's included)."""

    path = rt.run_dir / "metrics.jsonl"  # the main process's (the one that writes OUT)
    rows = (
        [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if rt.is_main and path.is_file() else []
    )
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    return {
        "steps": n_steps,
        "stage": cfg.stage,
        "samples": state["samples"],
        "elapsed_s": round(state["elapsed_s"], 2),
        "samples_per_s": round(state["samples"] / max(state["elapsed_s"], 1e-9), 2),
        "first_reward": first.get("reward"),  # metrics.jsonl's names (ovkit.runtime.log.public_name)
        "final_reward": last.get("reward"),
        "final_accuracy": last.get("ovkit/accuracy"),
        "max_staleness_seen": max((r.get("ovkit/staleness/max", 0) for r in rows), default=0),
        "skipped_nonfinite": sum(r.get("ovkit/nonfinite_updates", 0) for r in rows),  # ovkit.runtime.guard
        "resumed_from": str(rt.resume_from) if rt.resume_from else None,
    }


def warn_few_prompts(cfg: RLTrainConfig, n_prompts: int, main: bool = True) -> None:
    """One stderr line when a step needs more groups than DATA has prompts: the stream then runs through the set
    more than once per step (ovkit.rollouts.groups.prompt_order), so the same prompt is several groups of one step."""
    if n_prompts < cfg.prompts_per_step and main:
        print(
            f"warning: DATA has {n_prompts} prompt(s), fewer than --prompts-per-step {cfg.prompts_per_step}: "
            f"prompts repeat "
            f"within a step (each about {cfg.prompts_per_step / n_prompts:.3g} times, as separate groups); "
            f"give more prompts or a --prompts-per-step of at most {n_prompts}",
            file=sys.stderr,
            flush=True,
        )


def total_steps(cfg: RLTrainConfig, n_prompts: int) -> int:
    if cfg.max_steps is not None:
        return cfg.max_steps
    epochs = 30.0 if cfg.epochs is None else cfg.epochs
    return max(1, math.ceil(epochs * n_prompts / cfg.prompts_per_step))


def trainable(model, cfg: RLTrainConfig, rt: Runtime | None = None) -> list[torch.nn.Parameter]:
    """Every parameter (the vision tower too unless --freeze-vision), or adapters on them with --lora-r."""

    names = trainable_names(model, ["all"], freeze_vision=cfg.freeze_vision)
    if rt is None or rt.lora(model, names) is None:
        set_trainable(model, names)
    return [p for p in model.parameters() if p.requires_grad]


def _reference(rt: Runtime, cfg: RLTrainConfig):
    """The initial model for the KL penalty: frozen, in the learner's compute dtype."""
    ref = rt.load_model(cfg.model)[0].requires_grad_(False).eval()
    return ref.to(rt.precision.dtype)


def _tables(cfg: RLTrainConfig) -> list:
    """Every DATA path (several: e.g. the shards of a sharded rl-curate) read and validated; empty tables are
    skipped."""

    return [read_samples(path, answers=True).table for path in cfg.data if count_rows(path) > 0]


def _prompts(cfg: RLTrainConfig, tables: list, processor) -> list:
    """Every row of every DATA table, encoded."""

    prompts = []
    for table in tables:
        prompts += encode_prompts(
            table,
            processor,
            mode=cfg.mode,
            system=cfg.system_prompt,
            max_pixels=cfg.max_pixels,
            extra=env_instruction(cfg.multi_turn),
            tools=env_tools(cfg.multi_turn),
        )
    if not prompts:
        raise OvkitError(
            f"DATA {', '.join(map(str, cfg.data))}: no RL prompts (an rl-curate stage set can be empty when the "
            f"model solves all or none of the prompts)"
        )
    return prompts


def make_sampler(cfg: RLTrainConfig, model, processor):
    """The rollout engine. Asynchronous runs sample from their own copy of the weights (synced every step);
    synchronous ones share the learner's unless --sampler-precision / --sampler-quant asks for a separate copy."""

    if cfg.engine == "vllm-server":  # its own process: weights pushed over NCCL every step
        if cfg.sampler_precision is not None:
            raise OvkitError(
                "--sampler-precision with --engine vllm-server: the server samples in the dtype it was started with "
                "(vllm serve --dtype)"
            )
        return build_engine(
            "vllm-server",
            model=model,
            processor=processor,
            quant=cfg.sampler_quant,
            seed=cfg.seed,
            server_url=cfg.vllm_server_url,
            server_timeout=cfg.vllm_server_timeout,
        )
    # the learner's compute dtype: bf16 under bf16-mixed also where the learner keeps fp32 weights under autocast
    # (DDP, adamw_8bit); what an own sampler copy and vLLM sample in unless --sampler-precision says otherwise
    bf16 = prec.resolve(cfg.precision, device()).dtype == torch.bfloat16
    if cfg.engine == "vllm":
        if cfg.sampler_quant not in (None, "fp8"):
            raise OvkitError(
                f"--sampler-quant {cfg.sampler_quant} with --engine vllm: vLLM quantises a bf16 checkpoint on the "
                f"fly to fp8 only (use --engine hf for int8)"
            )
        # colocated: vLLM sleeps while the learner updates (synchronous runs), weights written in place every step;
        # named dtype always (vLLM's own choice would be bf16 for an fp32 checkpoint, on a CPU too)
        return build_engine(
            "vllm",
            model_dir=cfg.model,
            processor=processor,
            precision=cfg.sampler_precision or ("bf16" if bf16 else "fp32"),
            seed=cfg.seed,
            quant=cfg.sampler_quant,
            sleep=cfg.max_staleness == 0,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        )
    # An own copy (asynchronous runs) is held in the learner's compute dtype: 2 bytes per parameter under bf16, not 4
    own = cfg.sampler_precision or ("bf16" if bf16 else None)
    return build_engine(
        "hf",
        model=model,
        processor=processor,
        precision=own if cfg.max_staleness > 0 else cfg.sampler_precision,
        quant=cfg.sampler_quant,
        separate=cfg.max_staleness > 0,
        batch_size=cfg.rollout_batch_size,
    )


def _rollouts(cfg: RLTrainConfig, model, processor, prompts, rank: int = 0, world: int = 1):

    engine = make_sampler(cfg, model, processor)
    engine.update_weights(model)  # a resumed run's sampler starts from the checkpoint's weights
    episodes = make_runner(cfg.multi_turn, engine, processor, mode=cfg.mode, max_pixels=cfg.max_pixels, model=model)
    sampling = Sampling(cfg.group_size, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed, episodes=episodes)
    score = partial(
        score_groups,
        mode=cfg.mode,
        format_weight=cfg.format_weight,
        workers=cfg.reward_workers,
        funcs=parse_all(cfg.reward_funcs),
    )
    if cfg.overlong_buffer_len:
        score = partial(
            score_with_overlong,
            score=score,
            max_len=cfg.max_new_tokens,
            buffer_len=cfg.overlong_buffer_len,
            factor=cfg.overlong_penalty_factor,
        )
    per_process = cfg.prompts_per_step // world
    draws = cfg.max_num_gen_batches if cfg.dynamic_sampling else 1
    if cfg.max_staleness == 0:
        return SyncRollouts(engine, prompts, per_process, sampling, score, rank=rank, world=world, max_draws=draws)
    return AsyncRollouts(
        engine,
        prompts,
        per_process,
        sampling,
        score,
        cfg.max_staleness,
        groups_per_call=per_process,
        rank=rank,
        world=world,
        max_draws=draws,
    )


def _save_rollouts(rt: Runtime, step: int, groups: Sequence[Group], tokenizer: Any = None) -> None:
    """One table per step, every process's trajectories (gathered to the main process, which writes it)."""

    table = groups_table(groups, tokenizer=getattr(tokenizer, "tokenizer", tokenizer))
    if rt.processes > 1:
        # heavy: accelerate loads on first use, not at CLI start or in config checks
        from accelerate.utils import gather_object

        tables = gather_object([table])
        table = pa.concat_tables(tables, promote_options="default") if rt.is_main else table
    if rt.is_main:
        write_table(table, rt.run_dir / "rollouts" / f"step-{step:06d}.parquet")


COUNTS = (
    "rewards/worker_crashes",
    "rewards/crashed",
    "step_tokens",
    "dynamic_sampling/groups_filtered",
    "dynamic_sampling/unfilled",
)


def combine(rt: Runtime, metrics: dict[str, Any]) -> dict[str, Any]:
    """One process's step metrics combined with every other's: maxima and minima of keys named so, histograms
    and crash counts summed, the rest averaged (every process holds the same number of groups). One process:
    unchanged."""
    if rt.processes == 1:
        return metrics
    # heavy: accelerate loads on first use, not at CLI start or in config checks
    from accelerate.utils import gather_object

    every = gather_object([metrics])
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for m in every for k in m):
        values = [m[key] for m in every if key in m]
        if isinstance(values[0], dict):
            hist: dict[str, Any] = {}
            for v in values:
                for b, c in v.items():
                    hist[b] = hist.get(b, 0) + c
            out[key] = dict(sorted(hist.items(), key=lambda kv: int(kv[0]) if str(kv[0]).lstrip("-").isdigit() else 0))
        elif key in ("samples", "elapsed_s", "lr", "version"):
            out[key] = values[0]
        elif key in COUNTS:  # counts: every process's add up
            out[key] = sum(values)
        elif "max" in key.split("/")[-1]:
            out[key] = max(values)
        elif "min" in key.split("/")[-1]:
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out
