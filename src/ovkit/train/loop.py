"""The supervised loop behind `ovkit align`, `ovkit midtrain` and `ovkit sft`.

Everything around the loop (device, precision, attention, loading, optimiser, run directory, resume, checkpoints,
logging, the end) is the shared runtime's (ovkit.runtime); this file is the loop itself. It runs as a plain command
(one process, CPU or one GPU) and under `accelerate launch` / `torchrun` (DDP, FSDP or DeepSpeed through the
accelerate config).

Loss normalisation. The loss of an optimiser step is the mean over *target tokens of the whole global batch*:
    loss = sum over every micro-batch of every process of (sum of token NLLs) / (target tokens in the global batch)
Each micro-batch backpropagates its token-NLL sum divided by that global count (times the process count, because
DDP averages gradients over processes). A mean of per-micro-batch means would weight a token of a short micro-batch
more than one of a long micro-batch, so batch 1 x accumulation 4 would not equal batch 4 x accumulation 1; with this
rule it does (tests/test_train.py checks it). The NLL is computed from the last hidden state in chunks
(ovkit.runtime.loss): no [tokens x vocab] logits tensor exists.

Data. The next step's micro-batches are encoded and collated on a background thread while this step trains, so the
device does not wait on the processor (the order is the Schedule's either way: nothing about it depends on timing).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ovkit import faults
from ovkit.errors import OvkitError
from ovkit.evaluate.during import evaluator
from ovkit.models import pad_token_id
from ovkit.models.groups import group_of, set_trainable, trainable_names
from ovkit.models.precompute import model_inputs, on_device
from ovkit.pack.batches import real_tokens, target_tokens
from ovkit.progress import honours_quiet
from ovkit.runs import LearnerRun, finished
from ovkit.runtime import Result, Runtime
from ovkit.runtime.guard import in_backward
from ovkit.runtime.loss import nll_sum
from ovkit.runtime.optim import cosine_factor
from ovkit.runtime.tail import Tail
from ovkit.train.config import SMALLER, TRAJECTORY, TrainConfig
from ovkit.train.data import PackedSource, SampleSource, Schedule, total_steps


@honours_quiet
def train(cfg: TrainConfig) -> Result:
    """Train cfg.model on cfg.data and write cfg.out (layout: ovkit.runtime)."""
    if finished(cfg.out, cfg, cfg.overwrite):  # exits 2 if OUT was made with other options
        return Result("skipped")
    run = LearnerRun.of(cfg, cfg.stage, TRAJECTORY, smaller=SMALLER, plan=cfg.plan)
    rt = Runtime(
        run, cfg.loading, cfg.optimiser, cfg.compute, cfg.lora, cfg.checkpoints, cfg.trackers, cfg.load_in_4bit
    )
    rt.check_run_dir()
    model, processor = rt.load_model(cfg.model)
    names = trainable_names(model, cfg.trainable, freeze_vision=cfg.freeze_vision)
    sizes = rt.lora(model, names) or set_trainable(model, names)  # (trainable, total) parameters
    source = _source(cfg, processor, model)
    schedule = _schedule(cfg, source, rt.processes)
    n_steps = total_steps(cfg.max_steps, cfg.epochs, schedule.steps_per_epoch)
    rt.check_space(model, n_steps=n_steps, save_every=cfg.save_every, keep=cfg.keep_checkpoints)  # before any write
    evaluate = evaluator(
        cfg.eval_during, cfg.seed, rt, processor, n_steps, prompt="answer", loss=True, batch_size=cfg.batch_size
    )  # --eval-data
    rt.make_run_dir()  # only now: bad inputs leave nothing behind

    pad_id = pad_token_id(processor, model)
    optimizer, scheduler = rt.optimizer(
        model,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        schedule=lambda s: lr_factor(s, n_steps, cfg),
        lrs=vision_lrs(model, cfg.vision_lr),
    )
    rt.checkpointing(model, tokens=cfg.batch_size * max(source.lengths))  # the longest micro-batch, padded
    rt.compile(model)  # each block compiled, inside its checkpoint (ovkit.runtime.wrappers)
    scorer, optimizer = rt.prepare(model, optimizer, scheduler)
    state = rt.resume({"step": 0, "tokens": 0, "elapsed_s": 0.0})
    logger = rt.logger(n_steps, state["step"], console=step_line, desc=cfg.stage)
    tail = Tail(rt, scorer, processor, logger, evaluate, n_steps, cfg.save_every, cfg.keep_checkpoints)
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter() - state["elapsed_s"]
    steps = schedule.steps(state["step"], n_steps, rt.accelerator.process_index)
    scorer.train()
    with faults.deferred_signals(), tail.running(state):  # a SIGINT/SIGTERM now waits for the step's end
        for step, _epoch, batches in _prefetched(steps, source, pad_id, pin=rt.device.type == "cuda"):
            t_step = time.perf_counter()
            nll, n_target, n_real, n_positions = _step(rt, scorer, batches)
            loss, lr, grad_norm, applied = _apply(rt, optimizer, scheduler, params, step, nll, n_target, cfg)
            step_s = time.perf_counter() - t_step
            state.update(step=step, tokens=state["tokens"] + n_real, elapsed_s=time.perf_counter() - t0)
            metrics = {
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "skipped_updates": int(not applied),
                "tok_per_s": n_real / max(step_s, 1e-9),
                "step_s": step_s,
                "pad_frac": 1 - n_real / max(n_positions, 1),
                "target_tokens": n_target,
                "tokens": state["tokens"],
                "epoch": step / schedule.steps_per_epoch,  # epochs done, fractional, as the HF Trainer logs it
                "elapsed_s": state["elapsed_s"],
            }
            tail.log(step, metrics)
            if applied:  # a skipped step's loss describes no weights the run keeps
                state.setdefault("first_loss", loss)
                state["last"] = {"loss": loss, "lr": lr}
            else:
                state["skipped_nonfinite"] = state.get("skipped_nonfinite", 0) + 1
            tail.end_step(step, state)
    summary = _summary(cfg, rt, state, n_steps, source, schedule, sizes)
    return rt.finish(scorer, processor, state, summary, inputs=[*cfg.data, *([cfg.plan] if cfg.plan else [])])


def _schedule(cfg: TrainConfig, source: Any, processes: int) -> Schedule:
    """The order of the micro-batches; at least one global batch of DATA."""
    schedule = Schedule(tuple(source.lengths), cfg.batch_size, cfg.grad_accum, processes, cfg.seed)
    if schedule.steps_per_epoch == 0:
        raise OvkitError(
            f"DATA has {len(source)} usable {'packs' if source.kind == 'packed' else 'samples'}, fewer than one "
            f"global batch "
            f"({schedule.global_batch} = --batch-size x --grad-accum x processes); lower them"
        )
    return schedule


def _apply(rt: Runtime, optimizer, scheduler, params, step: int, nll, n_target: int, cfg: TrainConfig):
    """Clip, read the step's metrics, and take the optimiser step unless the skip guard refuses it; (loss, lr,
    gradient norm, applied)."""
    grad_norm = rt.clip(params, optimizer, cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    # the step's one device-to-host read: its metrics, which the skip guard needs before the optimiser step
    # (ovkit.runtime.guard: a non-finite loss or gradient norm is not applied)
    nll, grad_norm = torch.stack([nll, grad_norm.to(nll.device, torch.float32)]).tolist()
    loss = nll / max(n_target, 1)
    applied = rt.guard.admit(step, loss, grad_norm, in_backward=in_backward(optimizer))
    if applied:
        optimizer.step()
        rt.measure(params, optimizer)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, lr, grad_norm, applied


def _summary(cfg: TrainConfig, rt: Runtime, state, n_steps: int, source, schedule, sizes) -> dict[str, Any]:
    """The run's headline numbers (ovkit.json's metrics)."""
    n_trainable, n_total = sizes
    return {
        "steps": n_steps,
        "first_loss": state.get("first_loss"),
        "final_loss": state.get("last", {}).get("loss"),
        "tokens": state["tokens"],
        "elapsed_s": round(state["elapsed_s"], 2),
        "tok_per_s": round(state["tokens"] / max(state["elapsed_s"], 1e-9), 1),
        "trainable_params": n_trainable,
        "total_params": n_total,
        "inputs": source.kind,
        "items": len(source),
        "skipped_too_long": source.skipped,
        "skipped_nonfinite": state.get("skipped_nonfinite", 0),
        "global_batch": schedule.global_batch,
        "processes": rt.processes,
        "resumed_from": str(rt.resume_from) if rt.resume_from else None,
    }


def _prefetched(
    steps: Iterator, source: Any, pad_id: int, pin: bool = False
) -> Iterator[tuple[int, int, list[dict[str, Any]]]]:
    """(step, epoch, collated micro-batches), the next step's prepared on a background thread during this one. `pin`:
    the batches' tensors in page-locked memory (CUDA), so the step's non-blocking copies to the device really are."""

    def collate(item):
        step, epoch, micro = item
        batches = [source.collate([source[i] for i in mb], pad_id) for mb in micro]
        if pin:
            batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]
        return step, epoch, batches

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ovkit-data") as pool:
        pending = None
        for item in steps:
            ready, pending = pending, pool.submit(collate, item)
            if ready is not None:
                yield ready.result()
        if pending is not None:
            yield pending.result()


def _step(rt: Runtime, scorer, batches: list[dict[str, Any]]):
    """Forward/backward over this process's micro-batches of one global batch, normalised by the target tokens of
    the whole global batch (module docstring). Returns the step's NLL sum (a device tensor: read once, with the
    other metrics, after the optimiser step) and the global counts of target, non-padding and all tokens (host
    values from the collate function; one all-reduce when there are several processes)."""
    acc = rt.accelerator
    counts = [
        sum(target_tokens(b) for b in batches),
        sum(real_tokens(b) for b in batches),
        sum(b["input_ids"].numel() for b in batches),
    ]
    if acc.num_processes > 1:
        counts = acc.reduce(torch.tensor(counts, device=acc.device), "sum").tolist()
    n_target, n_real, n_positions = (int(x) for x in counts)
    scale = acc.num_processes / max(n_target, 1)  # DDP averages gradients over processes
    nll_sum = torch.zeros((), device=acc.device)
    for j, batch in enumerate(batches):
        with rt.no_sync(scorer, sync=j == len(batches) - 1), rt.autocast():
            nll = scorer(
                model_inputs(batch, acc.device),
                labels=on_device(batch["labels"], acc.device),
                target_index=on_device(batch.get("target_index"), acc.device),
            )
        rt.backward(nll * scale)
        nll_sum += nll.detach().float()
    return acc.reduce(nll_sum, "sum") if acc.num_processes > 1 else nll_sum, n_target, n_real, n_positions


def token_nll_sum(model, batch: dict[str, Any], device) -> torch.Tensor:
    """Sum of next-token NLLs over the target tokens of one micro-batch of a bare model (labels IGNORE elsewhere)."""

    return nll_sum(
        model,
        model_inputs(batch, device),
        batch["labels"].to(device),
        index=on_device(batch.get("target_index"), device),
    )


def step_line(step: int, m: dict[str, Any]) -> str:
    return (
        f"step {step:05d} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | tok/s {m['tok_per_s']:.0f} | "
        f"pad {100 * m['pad_frac']:.0f}% | {m['elapsed_s'] / 60:.1f}m"
    )


def vision_lrs(model, vision_lr: float | None) -> dict[int, float]:
    """{id(parameter): lr} for the vision encoder's parameters when --vision-lr is set (the schedule scales it like
    --lr). A randomly initialised encoder trained at the tiny LLM's 1e-3 kept every perception task at chance for
    hundreds of steps; at a tenth of it the same probes learnt 2-3x sooner (LLaVA-OneVision also trains its vision
    tower at a lower rate, mm_vision_tower_lr)."""

    if vision_lr is None:
        return {}
    return {id(p): vision_lr for name, p in model.named_parameters() if group_of(name) == "vision"}


def lr_factor(step: int, n_steps: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for 0-based `step`: linear warmup over warmup_ratio of the steps (at least one step
    when the ratio is > 0), then cosine from lr to min_lr at the last step."""
    return cosine_factor(step, n_steps, cfg.warmup_ratio, cfg.min_lr / cfg.lr)


def _source(cfg: TrainConfig, processor, model):
    if cfg.plan is not None:
        return PackedSource(cfg.plan, cfg.data[0], processor, model, max_len=cfg.max_len)
    return SampleSource(cfg.data, processor, max_len=cfg.max_len, quiet=cfg.quiet, model=model)
