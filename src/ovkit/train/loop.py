"""The one training engine behind `ovkit align`, `ovkit midtrain` and `ovkit sft`.

Runs as a plain command (one process, CPU or one GPU) and under `accelerate launch` / `torchrun` (DDP, FSDP or
DeepSpeed through the accelerate config). Mixed precision is bf16 autocast over fp32 master weights.

Loss normalisation. The loss of an optimiser step is the mean over *target tokens of the whole global batch*:
    loss = sum over every micro-batch of every process of (sum of token NLLs) / (target tokens in the global batch)
Each micro-batch backpropagates its token-NLL sum divided by that global count (times the process count, because
DDP averages gradients over processes). A mean of per-micro-batch means would weight a token of a short micro-batch
more than one of a long micro-batch, so batch 1 x accumulation 4 would not equal batch 4 x accumulation 1; with this
rule it does (tests/test_train.py checks it).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ovkit.errors import OvkitError
from ovkit.models.encode import IGNORE
from ovkit.models.groups import set_trainable, trainable_names
from ovkit.runs import Stage, is_complete, write_json
from ovkit.train.checkpoint import STATE, TRAINER_STATE, check_resumable, latest_checkpoint, save_checkpoint, save_model
from ovkit.train.config import ADAM_EPS, TrainConfig
from ovkit.train.data import PackedSource, SampleSource, Schedule, real_tokens, target_tokens, total_steps
from ovkit.train.log import make_logger

# Keys of a batch that are for the loss or for bookkeeping, not model inputs.
NOT_MODEL_INPUTS = ("labels", "num_tokens")


@dataclass
class Result:
    status: str  # "done" (this process wrote OUT), "skipped" (OUT was complete), "worker" (not the main process)
    metrics: dict[str, Any] = field(default_factory=dict)


def train(cfg: TrainConfig) -> Result:
    """Train cfg.model on cfg.data and write cfg.out (see ovkit.train.checkpoint for the layout)."""
    if is_complete(cfg.out) and not cfg.overwrite:
        return Result("skipped")
    accelerator = _accelerator(cfg)
    stage = Stage(cfg.stage, cfg, cfg.out, inputs=[*cfg.data, *([cfg.plan] if cfg.plan else [])], overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model)
    resume_from = _prepare_run_dir(cfg, accelerator)

    from accelerate.utils import set_seed
    from transformers.utils import logging as hf_logging

    set_seed(cfg.seed, device_specific=True)
    hf_logging.disable_progress_bar()  # weight loading/saving bars would break up the step lines
    model, processor = _load(cfg)
    names = trainable_names(model, cfg.trainable, freeze_vision=cfg.freeze_vision)
    n_trainable, n_total = set_trainable(model, names)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    source = _source(cfg, processor, model)
    schedule = Schedule(tuple(source.lengths), cfg.batch_size, cfg.grad_accum, accelerator.num_processes, cfg.seed)
    if schedule.steps_per_epoch == 0:
        raise OvkitError(
            f"DATA has {len(source)} usable {'packs' if source.kind == 'packed' else 'samples'}, fewer than one global batch "
            f"({schedule.global_batch} = --batch-size x --grad-accum x processes); lower them"
        )
    n_steps = total_steps(cfg.max_steps, cfg.epochs, schedule.steps_per_epoch)

    pad_id = _pad_id(processor, model)
    optimizer = _adamw(model, cfg, fused=accelerator.distributed_type.value in ("NO", "MULTI_CPU", "MULTI_GPU"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, n_steps, cfg))
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "processes": accelerator.num_processes}
    if resume_from is not None:
        state = check_resumable(cfg, resume_from, accelerator.num_processes)
        accelerator.load_state(str(resume_from / STATE))

    logger = make_logger(cfg.partial, main=accelerator.is_main_process, quiet=cfg.quiet, report_to=cfg.report_to, total=n_steps, start=state["step"], desc=cfg.stage)
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter() - state["elapsed_s"]
    model.train()
    try:
        for step, epoch, micro in schedule.steps(state["step"], n_steps, accelerator.process_index):
            t_step = time.perf_counter()
            batches = [source.collate([source[i] for i in mb], pad_id) for mb in micro]
            loss, grad_norm, n_target, n_real, n_positions = _step(accelerator, model, batches, params, cfg.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - t_step
            state.update(step=step, tokens=state["tokens"] + n_real, elapsed_s=time.perf_counter() - t0)
            metrics = {
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tok_per_s": n_real / max(step_s, 1e-9),
                "step_s": step_s,
                "pad_frac": 1 - n_real / max(n_positions, 1),
                "target_tokens": n_target,
                "tokens": state["tokens"],
                "epoch": epoch,
                "elapsed_s": state["elapsed_s"],
            }
            logger.log(step, metrics)
            state.setdefault("first_loss", loss)
            state["last"] = {"loss": loss, "lr": lr}
            if cfg.save_every and step % cfg.save_every == 0 and step < n_steps:
                save_checkpoint(accelerator, model, processor, cfg, cfg.partial, state, cfg.keep_checkpoints)
    finally:
        logger.close()

    save_model(accelerator, model, processor, cfg.partial)
    summary = {
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
        "global_batch": schedule.global_batch,
        "processes": accelerator.num_processes,
        "resumed_from": str(resume_from) if resume_from else None,
    }
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return Result("worker", summary)
    write_json(cfg.partial / TRAINER_STATE, state)
    with stage:  # OUT.partial becomes the stage's temp dir; the Stage writes config.yaml + ovkit.json and renames
        stage.metrics.update(summary)
        stage.path.rmdir()
        os.replace(cfg.partial, stage.path)
    return Result("done", summary)


def _step(accelerator, model, batches: list[dict[str, Any]], params, max_grad_norm: float):
    """Forward/backward over this process's micro-batches of one global batch, normalised by the target tokens of
    the whole global batch (module docstring), then gradient clipping. Returns the step's loss, the gradient norm
    before clipping and the global counts of target, non-padding and all tokens."""
    local = [sum(target_tokens(b) for b in batches), sum(real_tokens(b) for b in batches), sum(b["input_ids"].numel() for b in batches)]
    n_target, n_real, n_positions = (int(x) for x in accelerator.reduce(torch.tensor(local, device=accelerator.device), "sum"))
    scale = accelerator.num_processes / max(n_target, 1)  # DDP averages gradients over processes
    nll_sum = torch.zeros((), device=accelerator.device)
    for j, batch in enumerate(batches):
        sync = j == len(batches) - 1  # gradients are all-reduced once, after the last micro-batch
        with contextlib.nullcontext() if sync else accelerator.no_sync(model), accelerator.autocast():
            nll = token_nll_sum(model, batch, accelerator.device)
        accelerator.backward(nll * scale)
        nll_sum += nll.detach().float()
    grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm) if max_grad_norm > 0 else _grad_norm(params)
    loss = float(accelerator.reduce(nll_sum, "sum")) / max(n_target, 1)
    return loss, float(grad_norm), n_target, n_real, n_positions


def token_nll_sum(model, batch: dict[str, Any], device) -> torch.Tensor:
    """Sum of next-token NLLs over the target tokens of one micro-batch (labels are IGNORE elsewhere)."""
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"].to(device)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def lr_factor(step: int, n_steps: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak lr for 0-based `step`: linear warmup over warmup_ratio of the steps (at least one step
    when the ratio is > 0), then cosine from lr to min_lr at the last step."""
    warmup = math.ceil(cfg.warmup_ratio * n_steps) if cfg.warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    decay = max(n_steps - warmup - 1, 1)
    progress = min((step - warmup) / decay, 1.0)
    floor = cfg.min_lr / cfg.lr
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _adamw(model, cfg: TrainConfig, *, fused: bool) -> torch.optim.Optimizer:
    """AdamW, eps 1e-5 (the recipe's); weight decay on matrices only -- biases, norms and 1-D parameters are not
    decayed (the usual Megatron/HF convention)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # The fused kernel (CPU and CUDA) is ~4x faster than the per-tensor loop on small models and is what
    # transformers' Trainer uses by default; kept to plain/DDP runs (FSDP and DeepSpeed bring their own sharding).
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=cfg.lr, eps=ADAM_EPS, betas=(0.9, 0.999), fused=True)
        except (RuntimeError, ValueError):  # a device or dtype the fused kernel does not support
            pass
    return torch.optim.AdamW(groups, lr=cfg.lr, eps=ADAM_EPS, betas=(0.9, 0.999))


def _grad_norm(params) -> torch.Tensor:
    norms = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    cuda = torch.cuda.is_available()
    if cfg.precision == "auto":
        mixed = "bf16" if cuda and torch.cuda.is_bf16_supported() else "no"
    else:
        mixed = "bf16" if cfg.precision == "bf16" else "no"
    # find_unused_parameters: a text-only micro-batch leaves the vision tower without gradients on that process.
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    # accelerate keeps one mixed-precision setting per process; forget the previous run's (train() may be called
    # again in the same process, e.g. by tests and bench/train.py). The process group (PartialState) is kept.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return Accelerator(cpu=not cuda, mixed_precision=mixed, kwargs_handlers=[ddp])


def _prepare_run_dir(cfg: TrainConfig, accelerator) -> Path | None:
    """Make OUT.partial ready; return the checkpoint to resume from (or None)."""
    run_dir = cfg.partial
    ckpt = latest_checkpoint(run_dir) if run_dir.exists() else None
    if run_dir.exists() and not cfg.resume and not cfg.overwrite:
        at = f"its last checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint yet"
        raise OvkitError(f"{run_dir} holds an unfinished run ({at}); pass --resume to continue it or --overwrite to start over")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if run_dir.exists() and (cfg.overwrite or ckpt is None):
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    return None if cfg.overwrite else ckpt


def _load(cfg: TrainConfig):
    from ovkit.models import load

    return load(cfg.model, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)


def _source(cfg: TrainConfig, processor, model):
    if cfg.plan is not None:
        return PackedSource(cfg.plan, cfg.data[0], processor, model, max_len=cfg.max_len)
    return SampleSource(cfg.data, processor, max_len=cfg.max_len, quiet=cfg.quiet)


def _pad_id(processor, model) -> int:
    tokenizer = getattr(processor, "tokenizer", processor)
    for pid in (tokenizer.pad_token_id, getattr(model.config, "pad_token_id", None), tokenizer.eos_token_id):
        if pid is not None:
            return int(pid)
    return 0
