"""The training runtime: one object owns what every learner needs around its loop.

`ovkit align | midtrain | sft` (ovkit.train.loop) and `ovkit rl-train` (ovkit.rl.loop) are two loops
(nanochat-style); everything around them is here, once:

    rt = Runtime(LearnerRun.of(cfg, ...), cfg.loading, cfg.optimiser, ...)  # accelerator, device, precision, seed
    rt.check_run_dir()                                          # OUT.partial: fresh, or the checkpoint to resume
    model, processor = rt.load_model(cfg.model)                 # attention and --kernels set, on the device, fp32
    optimizer, scheduler = rt.optimizer(model, lr=..., weight_decay=..., schedule=...)   # --optim; casts to bf16 if
                                                                                           asked
    rt.checkpointing(model, tokens=...)                         # --activation-checkpointing (auto resolved here)
    rt.compile(model)                                           # --compile: each block, inside its checkpointing
    scorer, optimizer = rt.prepare(model, optimizer, scheduler) # TokenScorer (loss in forward) under accelerate
    state = rt.resume(state)                                    # trajectory options checked, state loaded
    logger = rt.logger(total, state["step"], console=line_fn)
    ... the loop: rt.autocast(), rt.backward(loss), rt.clip(params, optimizer, max_norm), optimizer.step(),
        rt.measure(params, optimizer) (bytes per parameter, once), rt.save_checkpoint(...)
    return rt.finish(model, processor, state, summary)          # final model, ovkit.json, OUT.partial -> OUT

Run directory while training, and at the end (both loops):

    OUT.partial/                     the run while it is going (a stable name, so --resume finds it)
      metrics.jsonl                  one JSON object per step
      trackers/, mlruns/, wandb/     with --report-to tensorboard | mlflow | wandb (accelerate's trackers)
      checkpoints/step-000200/       every --save-every steps; the newest --keep-checkpoints are kept
        model.safetensors, config.json, processor files   save_pretrained: loadable as a model
        state/                       accelerate save_state: model, optimiser (with fp32 master weights), lr
                                     schedule, RNG of every process; sharded under FSDP
        ovkit_state.json             step, tokens/samples, elapsed time, world size
        manifest.json                size and CRC32 of every file above (ovkit.runtime.integrity)
        ovkit.json                   provenance, with the fingerprint of every input (DATA, --plan, --model) that
                                     --resume checks; written last, so a checkpoint without it is incomplete
      checkpoints/step-000300.diverged/   a checkpoint holding weights that went on to diverge, set aside
      diverged.json                  after a divergence stop (ovkit.runtime.guard): the step, and what --resume may
                                     change from a checkpoint before it (--lr, --min-lr, --vision-lr, --max-grad-norm)
      .ovkit-writing                 the mark that says ovkit made this directory (ovkit.runs.claim)
    OUT/                             at the end: OUT.partial + the final model at its root, config.yaml, ovkit.json
    OUT.lock                         held by the running process (ovkit.faults: one writer per output), then removed

A checkpoint is written as `checkpoints/.step-N.tmp`, given a `manifest.json` (sizes and checksums), fsynced and
renamed, so a killed run or a crashed machine leaves either a whole checkpoint or a temp dir that is ignored; --resume
checks the newest against its manifest and falls back to the one before when it is damaged (ovkit.runtime.integrity).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ovkit import __version__, faults
from ovkit.config import option_default, to_plain, to_plain_values
from ovkit.errors import OutOfMemory, OvkitError
from ovkit.faults import hold
from ovkit.files import PROVENANCE, mark, write_json
from ovkit.launch import engine_warning, requested_engine
from ovkit.models import attention as attn
from ovkit.models import load, lora
from ovkit.models import precision as prec
from ovkit.options import Checkpoints, Compute, Lora, ModelLoading, Optimiser, Trackers
from ovkit.runs import LearnerRun, Stage, claim, input_print
from ovkit.runtime import checkpointing as ac
from ovkit.runtime import compiling, integrity
from ovkit.runtime import kernels as kern
from ovkit.runtime.guard import NonFiniteSteps, StepGuard
from ovkit.runtime.log import Logger, TrackerSink, check_trackers, held_out, make_logger
from ovkit.runtime.loss import TokenScorer
from ovkit.runtime.optim import OptimizerInBackward, adamw, bytes_per_param, clip_grad_norm, master_pairs

CHECKPOINTS = "checkpoints"
STATE = "state"
RUN_STATE = "ovkit_state.json"
DIVERGED = "diverged.json"
# What a --resume from a checkpoint before a divergence may change (the step size; the rest of the trajectory stays).
DIVERGENCE_FIXES = ("lr", "min_lr", "vision_lr", "max_grad_norm")


@dataclass
class Result:
    status: str  # "done" (this process wrote OUT), "skipped" (OUT was complete), "worker" (not the main process)
    metrics: dict[str, Any] = field(default_factory=dict)


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if re.fullmatch(r"step-\d+", p.name) and (p / PROVENANCE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


class Runtime:
    """One learner run: see the module docstring. The entry point hands it the run (ovkit.runs.LearnerRun: where it
    writes, what it read, what a resume must keep) and the option groups it acts on: how the model loads, the
    optimiser's implementation, memory and speed, LoRA, checkpoints and trackers; `four_bit` is --load-in-4bit (the
    supervised stages')."""

    def __init__(
        self,
        run: LearnerRun,
        loading: ModelLoading,
        optimiser: Optimiser,
        compute: Compute,
        adapters: Lora,
        checkpoints: Checkpoints,
        trackers: Trackers,
        four_bit: bool = False,
        *,
        parent: Path | None = None,
    ):
        # heavy: accelerate loads on first use, not at CLI start or in config checks
        from accelerate import Accelerator, PartialState
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedDataParallelKwargs, set_seed
        from transformers.utils import logging as hf_logging

        self.run, self.command, self.trajectory = run, run.command, run.trajectory
        self.loading, self.compute, self.adapters, self.checkpoints = loading, compute, adapters, checkpoints
        self.in_backward, self.four_bit = optimiser.optimizer_in_backward, four_bit
        self.parent = Path(parent if parent is not None else run.model)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.precision = prec.resolve(loading.precision, device)
        # Master weights need the gradients to themselves; DDP all-reduces the parameters' .grad and FSDP/DeepSpeed
        # bring their own mixed-precision policy: those runs use accelerate's bf16 (autocast / the engine's policy).
        # (cpu=True: on a CPU box, the process group torchrun set up is gloo's; without it accelerate sees one process)
        distributed = PartialState(cpu=device.type == "cpu").distributed_type.value not in ("NO",)
        # One writer per output (ovkit.faults): the main process holds OUT.lock until finish(), before it reads the run
        # directory; a second run exits 2 naming this one.
        self.lock = hold(run.out, run.command) if PartialState().is_main_process else None
        # --optim adamw_8bit keeps its 8-bit state over the weights themselves: bf16-mixed is autocast over fp32 weights
        # with it (transformers' Trainer's bf16 + adamw_8bit), not fp32 masters (ovkit.runtime.optim's table).
        self.optim = optimiser.optim
        autocast = distributed or self.optim == "adamw_8bit"
        self.master_weights = self.precision.master_weights and not autocast
        mixed = "bf16" if self.precision.name == "bf16-mixed" and autocast else "no"
        # find_unused_parameters: a text-only micro-batch leaves the vision tower without gradients on that process.
        ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
        AcceleratorState._reset_state()  # a second run in one process (tests, benchmarks) sets its own precision
        # heavy: accelerate loads on first use, not at CLI start or in config checks
        from accelerate.utils import ProjectConfiguration

        self.report_to = report_to = list(trackers.report_to)
        check_trackers(report_to)
        project = ProjectConfiguration(project_dir=str(self.run_dir), logging_dir=str(self.run_dir / "trackers"))
        self.accelerator = Accelerator(
            cpu=device.type == "cpu",
            mixed_precision=mixed,
            kwargs_handlers=[ddp],
            log_with=report_to or None,
            project_config=project,
        )
        self.device = self.accelerator.device
        if self.in_backward and self.distributed != "NO":
            if self.lock is not None:
                self.lock.release()
            raise OvkitError(
                f"--optimizer-in-backward needs one process ({self.processes} under {self.distributed}): DDP, FSDP "
                f"and DeepSpeed reduce the gradients after each parameter's step would already have run; run a plain "
                f"single-process command, or drop --optimizer-in-backward"
            )

        self.requested_distributed = requested_engine()  # an FSDP / DeepSpeed config accelerate could not honour here
        warning = engine_warning(self.accelerator.distributed_type.value)
        if warning and self.accelerator.is_main_process:
            print(warning, file=sys.stderr)
        self.attention = attn.resolve(loading.attn_implementation, self.device, train=True)
        set_seed(run.seed, device_specific=True)
        hf_logging.disable_progress_bar()  # weight loading/saving bars would break up the step lines
        self.resume_from: Path | None = None
        self.inputs = run.inputs  # {path: the option it came from}
        self.input_prints: list[dict[str, Any]] = []  # their fingerprints, in every checkpoint: --resume checks them
        self.scheduler = self._optimizer = None
        self.bytes_per_param: dict[str, Any] | None = None  # measured after the first optimiser step (rt.measure)
        self.activation_checkpointing: dict[str, Any] = {"mode": "off", "why": "not applied"}
        self.kernel_choice, why = kern.resolve(compute.kernels, self.device)
        self.kernels: dict[str, Any] = {
            "kernels": self.kernel_choice,
            "requested": compute.kernels,
            "why": why,
        }
        self.compiled: dict[str, Any] = {"enabled": False}
        self.checkpoint_bytes: int | None = None  # the estimate check_space makes, named when a save fails
        # which optimiser steps are applied (ovkit.runtime.guard), for every loop and every process alike
        self.guard = StepGuard(
            checkpoints.max_nonfinite_steps, command=run.command, main=self.accelerator.is_main_process
        )

    # -- facts ------------------------------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return self.run.partial

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def processes(self) -> int:
        return self.accelerator.num_processes

    @property
    def distributed(self) -> str:
        """What ran: accelerate's distributed_type (NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED, ...)."""
        return self.accelerator.distributed_type.value

    @property
    def sharded(self) -> bool:
        """FSDP or DeepSpeed: each process holds a shard of the parameters, so code that reads the model's weights
        outside its forward (a sampler, a generate loop of uneven length per process) cannot use them as they are."""
        return self.distributed in ("FSDP", "DEEPSPEED")

    def info(self) -> dict[str, Any]:
        """What ran: recorded in ovkit.json (`runtime`)."""
        return {
            "device": str(self.device),
            "processes": self.processes,
            "distributed": self.accelerator.distributed_type.value,  # what ran
            **({"requested_distributed": self.requested_distributed} if self.requested_distributed else {}),
            "precision": {**self.precision.as_dict(), "master_weights": self.master_weights},
            "attention": self.attention.as_dict(),
            "optim": self.optim,
            **({"bytes_per_param": self.bytes_per_param} if self.bytes_per_param else {}),
            "activation_checkpointing": self.activation_checkpointing,
            "kernels": self.kernels,
            "compile": compiling.report(self.compiled),
        }

    # -- run directory and resume ----------------------------------------------------------------------------------

    def check_run_dir(self) -> Path | None:
        """The checkpoint to resume from (None: start fresh); an unfinished OUT.partial needs --resume or
        --overwrite. Nothing is written: `make_run_dir` does that, once the inputs have been checked. OUT and
        OUT.partial must be ovkit's (ovkit.runs.claim), and a resumed run's inputs what its checkpoint trained on."""
        run_dir = self.run_dir
        claim(self.run.out, partial=run_dir)  # a path ovkit did not write: exit 2, before any model loads
        self.input_prints = [f for f in map(input_print, self.inputs) if f is not None]
        if not run_dir.exists() or self.run.overwrite:
            return None
        ckpt = latest_checkpoint(run_dir)
        if not self.checkpoints.resume:
            at = f"its last checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint yet"
            raise OvkitError(
                f"{run_dir} holds an unfinished run ({at}); pass --resume to continue it or --overwrite to start over"
            )
        self.resume_from = ckpt = self._sound_checkpoint(run_dir)
        if ckpt is not None:
            self._check_inputs_unchanged(ckpt)
        return ckpt

    def _check_inputs_unchanged(self, ckpt: Path) -> None:
        """Resume is exact or refused: exit 2 when an input's contents differ from the fingerprint `ckpt` recorded
        (the same path with other data in it: a different path is already a changed option)."""
        saved = json.loads((ckpt / PROVENANCE).read_text()).get("inputs")
        if saved is None:
            if self.is_main:
                print(
                    f"warning: --resume: {ckpt} records no input fingerprints (written by an earlier ovkit); "
                    f"its inputs are assumed unchanged",
                    file=sys.stderr,
                )
            return
        now = {p["path"]: p for p in self.input_prints}
        for old in saved:
            new = now.get(old.get("path"))
            if new is None or all(old.get(k) == new.get(k) for k in ("files", "bytes", "sha256")):
                continue
            role = self.inputs.get(Path(old["path"]), "input")
            raise OvkitError(
                f"--resume: {role} {old['path']} changed since {ckpt} was written ({_print_note(old)} then, "
                f"{_print_note(new)} now), so the run would not continue the trajectory it began; put back what it "
                f"held, or run with --overwrite (instead of --resume) to start over on what it holds now"
            )

    def _sound_checkpoint(self, run_dir: Path) -> Path | None:
        """The newest checkpoint that matches its manifest (ovkit.runtime.integrity). A damaged one is moved aside to
        `step-N.damaged` (so --keep-checkpoints never prunes the sound ones in its favour) with a warning naming it;
        with checkpoints but none sound, exit 2. The main process decides, the others follow."""
        found, why = list_checkpoints(run_dir), None
        choice: Path | None = None
        if self.is_main:
            for ckpt in reversed(found):
                why = integrity.damage(ckpt, last=PROVENANCE)
                if why is None:
                    choice = ckpt
                    break
                aside = ckpt.with_name(f"{ckpt.name}.damaged")
                shutil.rmtree(aside, ignore_errors=True)
                ckpt.rename(aside)
                print(
                    f"warning: --resume: checkpoint {ckpt} is damaged ({why}); moved it to {aside.name}, resuming "
                    f"from the one before",
                    file=sys.stderr,
                )
        if self.processes > 1:
            # heavy: accelerate loads on first use, not at CLI start or in config checks
            from accelerate.utils import broadcast_object_list

            choice, why = broadcast_object_list([choice, why], from_process=0)
        if found and choice is None:
            raise OvkitError(
                f"--resume: every checkpoint of {run_dir} is damaged (the last one checked: {why}); "
                f"--overwrite starts over"
            )
        return choice

    def check_space(
        self, model: Any, *, n_steps: int, save_every: int, keep: int, extra: int = 0, what: str = ""
    ) -> None:
        """Before the run directory is made: exit 2 when a rough size of what the run will write does not fit in the
        free space of OUT's filesystem. A checkpoint holds the model in fp32 (model.safetensors) and in its training
        dtype (the state), the AdamW moments of the trainable parameters (2 x element; 8-bit: 2 bytes) and their fp32
        masters when kept; up to keep + 1 of them exist at once (the newest is written before the oldest is pruned);
        the final model is fp32 again. `extra`: more bytes the loop writes (rollout tables), described by `what`."""
        if not self.is_main:
            return
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        element = 2 if self.precision.name == "bf16-true" else 4
        moments = 2 if self.optim == "adamw_8bit" else 2 * element
        self.checkpoint_bytes = total * (4 + element) + trainable * (moments + (4 if self.master_weights else 0))
        done = int(self.resume_from.name.split("-")[1]) if self.resume_from else 0
        saves = len(range(done + save_every, n_steps, save_every)) if save_every else 0
        have = len(list_checkpoints(self.run_dir)) if self.resume_from else 0
        new = min(saves, max(1, keep + 1 - have))
        needed = self.checkpoint_bytes * new + total * 4 + extra
        if self.resume_from is None and self.run_dir.exists():  # make_run_dir empties it first
            needed -= sum(f.stat().st_size for f in self.run_dir.rglob("*") if f.is_file())
        described = (
            f"{new} checkpoint{'s' if new != 1 else ''} of about {faults.size(self.checkpoint_bytes)} and "
            f"the final model{what}"
        )
        faults.check_space(self.run.out, needed, described)

    def make_run_dir(self) -> None:
        """OUT.partial, emptied unless the run resumes from it."""
        self.accelerator.wait_for_everyone()
        if self.is_main:
            if self.run_dir.exists() and self.resume_from is None:
                shutil.rmtree(self.run_dir)  # ovkit's: check_run_dir claimed it
            self.run_dir.mkdir(parents=True, exist_ok=True)
            mark(self.run_dir, self.command)
        self.accelerator.wait_for_everyone()

    def resume(self, state: dict[str, Any]) -> dict[str, Any]:
        """`state` for a fresh run; for a resumed one the checkpoint's, after checking that the run continues the same
        trajectory (same options, same process count), with model, optimiser, schedule and RNG restored. The loop
        comes next, inside `faults.deferred_signals()`: there a SIGINT/SIGTERM waits for the step boundary
        (`stop_if_asked`)."""
        ckpt = self.resume_from
        if ckpt is None:
            return {**state, "processes": self.processes}
        saved = json.loads((ckpt / PROVENANCE).read_text())["config"]
        now = to_plain(self.run.config)
        # an option the checkpoint's config does not name did not exist when it was written: it ran as the default
        defaults = to_plain_values({k: option_default(type(self.run.config), k) for k in self.trajectory})
        loosened = self._after_divergence(ckpt)
        keys = [k.replace("_", "-") for k in self.trajectory if k not in loosened]
        changed = [k for k in keys if saved.get(k, defaults[k]) != now.get(k)]
        if changed:
            diffs = ", ".join(f"--{k} {saved.get(k, defaults[k])!r} -> {now.get(k)!r}" for k in changed)
            raise OvkitError(
                f"--resume: {ckpt} was trained with different options ({diffs}); use the same ones, or --overwrite "
                f"to start over"
            )
        lowered = [
            f"--{k} {saved.get(k)!r} -> {now.get(k)!r}"
            for k in (k.replace("_", "-") for k in loosened)
            if saved.get(k) != now.get(k)
        ]
        if lowered and self.is_main:
            print(f"note: --resume from {ckpt.name}, before the divergence: {', '.join(lowered)}", file=sys.stderr)
        loaded = json.loads((ckpt / RUN_STATE).read_text())
        if loaded.get("processes", 1) != self.processes:
            raise OvkitError(
                f"--resume: {ckpt} ran on {loaded['processes']} processes, this run has {self.processes}; the "
                f"global batch would change"
            )
        try:
            self.accelerator.load_state(str(ckpt / STATE))
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # a damage the manifest could not see (a checkpoint from before manifests)
            raise OvkitError(
                f"--resume: {ckpt / STATE} could not be loaded ({type(e).__name__}: {str(e)[:300]}); move "
                f"{ckpt.name} aside to resume from the checkpoint before it, or --overwrite to start "
                f"over"
            ) from e
        if self.scheduler is not None:
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": a replay, on purpose
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(loaded["step"]):
                    self.scheduler.step()
        self.guard.last_applied = loaded["step"]
        return loaded

    def _after_divergence(self, ckpt: Path) -> tuple[str, ...]:
        """The options a resume from `ckpt` may change: DIVERGENCE_FIXES when the run stopped diverging after it
        (OUT.partial/diverged.json, written by `diverged`), else none."""
        marker = self.run_dir / DIVERGED
        if not marker.is_file():
            return ()
        stopped = json.loads(marker.read_text())["step"]
        return tuple(k for k in DIVERGENCE_FIXES if k in self.trajectory) if _step_of(ckpt) < stopped else ()

    # -- model and optimiser ---------------------------------------------------------------------------------------

    def load_model(self, path: Path) -> tuple[Any, Any]:
        """(model, processor) from `path`, in fp32 (the optimiser decides the compute dtype), with the attention
        implementation applied, on this process's device."""

        quant = lora.four_bit_config(self.precision.dtype) if self.four_bit else None
        model, processor = load(
            path,
            dtype=torch.float32,
            trust_remote_code=self.loading.trust_remote_code,
            quantization_config=quant,
            device=self.device if quant is not None else None,
        )
        self.attention = attn.apply(model, self.attention)
        self.kernels = {**self.kernels, **kern.apply(model, self.kernel_choice)}
        return (model if quant is not None else model.to(self.device)), processor

    def optimizer(
        self,
        model: Any,
        *,
        lr: float,
        weight_decay: float,
        schedule: Callable[[int], float],
        lrs: dict[int, float] | None = None,
    ):
        """The --optim AdamW over the trainable parameters and a LambdaLR `schedule` (multiplier of lr per 0-based
        step). With bf16-mixed (single process, not adamw_8bit) the model's floating parameters become bf16 and the
        optimiser keeps fp32 masters; with bf16-true they become bf16 and so does the optimiser state (8-bit with
        adamw_8bit, Kahan-compensated with adamw_bf16). --optimizer-in-backward: the same optimiser, one per
        parameter, stepped from backward (OptimizerInBackward)."""
        params = [p for p in model.parameters() if p.requires_grad]
        kw = dict(lr=lr, weight_decay=weight_decay, lrs=lrs, optim=self.optim)

        def build(**extra: Any) -> torch.optim.Optimizer:
            if self.in_backward:
                return OptimizerInBackward(params, lambda p: adamw([p], **kw, **extra))
            return adamw(params, **kw, **extra)

        if self.master_weights or self.precision.name == "bf16-true":
            masters = build(master_weights=True) if self.master_weights else None  # fp32 copies, made before the cast
            for p in model.parameters():  # parameters only: buffers (rotary inv_freq) stay fp32
                if p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
            optimizer = masters or build(fused=self._fused_ok())
        else:
            optimizer = build(fused=self._fused_ok())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return optimizer, scheduler

    def checkpointing(self, model: Any, tokens: int) -> str:
        """Apply --activation-checkpointing to the bare model and turn its KV cache off for training. `auto` is
        decided here, once weights and the optimiser are in place: on CUDA, the estimated activations of a micro-batch
        of `tokens` tokens against the free memory less the gradients and AdamW moments still to come
        (ovkit.runtime.checkpointing.choose). The mode and why go into ovkit.json
        (`runtime.activation_checkpointing`)."""
        asked = self.compute.activation_checkpointing
        needed = free = None
        if asked == "auto" and self.device.type == "cuda":
            element = 2 if self.precision.dtype == torch.bfloat16 else 4
            needed = ac.activation_bytes(model, tokens, element_bytes=element)
            free = ac.free_cuda_bytes(self.device) - ac.optimiser_bytes(
                model,
                state_element_bytes=2 if self.precision.name == "bf16-true" else 4,
                gradients=not self.in_backward,
            )
        mode, why = ac.choose(asked, self.device, needed, free)
        blocks = ac.apply(model, mode)
        model.config.use_cache = False
        self.activation_checkpointing = {
            "mode": mode,
            "requested": asked,
            "why": why,
            "blocks": len(blocks),
            "tokens_per_micro_batch": tokens,
            "estimated_activation_bytes": needed,
            "free_bytes": free,
        }
        return mode

    def compile(self, model: Any) -> None:
        """--compile: torch.compile each decoder layer and vision block (ovkit.runtime.compiling), inside the block's
        checkpoint when `checkpointing` wraps it (ovkit.runtime.wrappers fixes that order); the counts go into
        ovkit.json."""
        if self.compute.compile:
            self.compiled = compiling.apply(model)

    def _fused_ok(self) -> bool:
        # The fused kernel for plain and DDP runs; FSDP and DeepSpeed bring their own sharded optimiser steps.
        return self.accelerator.distributed_type.value in ("NO", "MULTI_CPU", "MULTI_GPU")

    def prepare(self, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        """(scorer, optimizer) ready for the loop: the model inside a TokenScorer (its forward computes the chunked
        loss or log-probs), both through accelerate; the scheduler is replayed to the step on resume."""
        scorer, optimizer = self.accelerator.prepare(
            TokenScorer(model, fused_ce=self.kernel_choice == "liger"), optimizer
        )
        # The schedule is not saved with the state: it is a function of the step (resume() replays it), so every
        # state file loads with torch.load(weights_only=True) and no pickled object is ever unpickled.
        self.scheduler, self._optimizer = scheduler, optimizer
        return scorer, optimizer

    def unwrap(self, scorer: Any) -> Any:
        """The bare transformers model inside a prepared scorer."""
        return self.accelerator.unwrap_model(scorer).model

    # -- the loop --------------------------------------------------------------------------------------------------

    def autocast(self):
        return self.accelerator.autocast() if self.accelerator.mixed_precision != "no" else nullcontext()

    def no_sync(self, scorer: Any, sync: bool):
        """Gradients are all-reduced once per optimiser step: skip it on all but the last micro-batch."""
        return nullcontext() if sync else self.accelerator.no_sync(scorer)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def clip(self, params: list[torch.nn.Parameter], optimizer: Any, max_norm: float) -> float:
        return clip_grad_norm(optimizer, params, max_norm, self.accelerator)

    def measure(self, params: list[torch.nn.Parameter], optimizer: Any) -> None:
        """Bytes per trainable parameter (weights, gradients, masters, optimiser state: ovkit.runtime.optim), measured
        once, between the first optimiser step and zero_grad; recorded in ovkit.json's `runtime`."""
        if self.bytes_per_param is None:
            self.bytes_per_param = bytes_per_param(params, optimizer)

    def logger(self, total: int, start: int, *, console: Callable[[int, dict], str], desc: str) -> Logger:
        trackers = None
        if self.report_to:
            trackers = TrackerSink(
                self.accelerator, self.run_dir, project=f"ovkit-{self.command}", config=to_plain(self.run.config)
            )
        return make_logger(
            self.run_dir,
            main=self.is_main,
            quiet=self.run.quiet,
            total=total,
            start=start,
            desc=desc,
            line=console,
            trackers=trackers,
        )

    # -- checkpoints and the end -----------------------------------------------------------------------------------

    def save_model(self, scorer: Any, processor: Any, out: Path) -> None:
        """save_pretrained of the model (gathered from every process under FSDP/DeepSpeed) and the processor, in the
        precision it was loaded in (fp32: the learner's truth is the fp32 master copy when there is one)."""
        state_dict = self.accelerator.get_state_dict(scorer)  # collective: every process must call it
        if not self.is_main:
            return
        model = self.unwrap(scorer)
        if lora.has_lora(model):  # the merged model at OUT's root, the adapter beside it
            state_dict = lora.merged_state_dict(model)
            lora.save_adapter(model, Path(out) / "adapter")
        else:
            state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
            masters = _master_values(self._optimizer, model)
            state_dict = {k: masters.get(k, v) for k, v in state_dict.items()}
        state_dict = {k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}
        lora.plain(model).save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(out)

    def lora(self, model: Any, trainable: list[str]) -> tuple[int, int] | None:
        """Adapters instead of full fine-tuning when --lora-r > 0 (ovkit.models.lora); (trainable, total) counts."""
        r = self.adapters.lora_r
        if not r:
            return None
        if self.accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
            raise OvkitError(
                "--lora-r with FSDP or DeepSpeed is not supported here; use DDP (plain accelerate launch / torchrun)"
            )
        adapters = self.adapters
        spec = lora.LoraSpec(
            r=r, alpha=adapters.lora_alpha, dropout=adapters.lora_dropout, targets=tuple(adapters.lora_targets or ())
        )
        if self.four_bit:
            # --activation-checkpointing does the recomputing (non-reentrant: no input gradients needed), not peft
            lora.prepare_four_bit(model, gradient_checkpointing=False)
        return lora.apply(model, trainable, spec)

    def save_checkpoint(self, scorer: Any, processor: Any, state: dict[str, Any], keep: int) -> Path:
        self.check_weights(scorer, state)
        final = step_dir(self.run_dir, state["step"])
        tmp = final.parent / f".{final.name}.tmp"
        try:
            self._write_checkpoint(scorer, processor, state, tmp)
        except Exception as e:  # disk full or not writable: this one goes, the last complete one stays for --resume
            failure = self.write_failure(e, tmp)
            if failure is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise failure from e
        if self.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            integrity.fsync(final.parent)
            for old in list_checkpoints(self.run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.accelerator.wait_for_everyone()
        return final

    def _write_checkpoint(self, scorer: Any, processor: Any, state: dict[str, Any], tmp: Path) -> None:
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.accelerator.wait_for_everyone()
        # Pickle, not safetensors: the state is ovkit's own, and safetensors refuses tied weights (embeddings =
        # lm_head).
        self.accelerator.save_state(str(tmp / STATE), safe_serialization=False)
        self.save_model(scorer, processor, tmp)
        self.accelerator.wait_for_everyone()  # every process's RNG file is written before the directory is renamed
        if self.is_main:
            write_json(tmp / RUN_STATE, state)
            integrity.write_manifest(tmp, last=PROVENANCE)  # sizes and checksums, checked by --resume
            write_json(tmp / PROVENANCE, self.provenance(state))
            integrity.fsync_tree(tmp)  # on disk before the name says complete: a crash never leaves a damaged step-N

    def write_failure(self, e: BaseException, path: Path, *, saving: bool = True) -> OvkitError | None:
        """The one line for a write the machine refused (ovkit.faults.write_failure), naming the checkpoint --resume
        continues from; None when `e` is something else. `saving`: `e` came from a save, not from the loop at large."""
        ckpt = latest_checkpoint(self.run_dir)
        then = (
            f"then run the same command with --resume: it continues from {ckpt}"
            if ckpt
            else "no checkpoint was written yet: then run the same command with --overwrite"
        )
        return faults.write_failure(
            e, path, needed=self.checkpoint_bytes, then=then, saving=saving, within=self.run_dir
        )

    def stop_if_asked(self, scorer: Any, processor: Any, state: dict[str, Any], keep: int, n_steps: int) -> None:
        """At a step boundary: when a SIGINT/SIGTERM came during the step (ovkit.faults), write a checkpoint (unless
        this step's is written) and raise Interrupted, whose message says how to continue. Every process stops at the
        same step: a scheduler signals each at its own moment, so the request is summed over processes (one scalar
        all-reduce per step, only when there are several)."""
        signum = faults.asked() or 0
        if self.processes > 1:
            asked = self.accelerator.reduce(torch.tensor([signum], device=self.device), "sum").item()
            signum = signum or (int(signal.SIGTERM) if asked else 0)
        if not signum or state["step"] >= n_steps:  # the last step: finishing is the quickest way to stop
            return
        ckpt = step_dir(self.run_dir, state["step"])
        if not (ckpt / PROVENANCE).is_file():
            self.save_checkpoint(scorer, processor, state, keep)
        name = signal.Signals(signum).name
        raise faults.Interrupted(
            signum,
            f"{self.command}: stopped by {name} after step {state['step']} of "
            f"{n_steps}; its checkpoint is "
            f"{ckpt}; run the same command with --resume to continue",
        )

    def out_of_memory(self, e: BaseException, state: dict[str, Any]) -> OutOfMemory:
        """The one message for a CUDA OOM during the loop (raise it from the loop's except): the stage, the step, the
        tokens per micro-batch, peak and total memory, what needs less, and the checkpoint --resume continues from."""
        smaller = self.run.smaller
        options = [
            smaller[0],
            "--activation-checkpointing full",
            "--precision bf16-true or --optim adamw_8bit",
            *smaller[1:],
        ]
        tokens = self.activation_checkpointing.get("tokens_per_micro_batch")
        ckpt = latest_checkpoint(self.run_dir)
        after = (
            f"--resume continues from {ckpt}"
            if ckpt
            else "no checkpoint was written yet: the run starts over with --overwrite"
        )
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        return OutOfMemory(
            f"{self.command}: out of GPU memory at step {state['step'] + 1}"
            f"{f' ({tokens} tokens per micro-batch, padded)' if tokens else ''}{faults.memory_note()}; lower it with "
            f"{', '.join(options)}; {after} (options that change the trajectory need --overwrite) "
            f"[{reason}]"
        )

    def diverged(self, e: NonFiniteSteps) -> OvkitError:
        """The one message for a run that diverged (raise it from the loop's except): the step, its loss and gradient
        norm, the options that usually cause it, and the checkpoint --resume continues from. The checkpoints that hold
        the weights the non-finite steps came from (written at or after the last applied step) are set aside as
        `step-N.diverged`, so --resume takes the newest one before them, and may lower --lr from there."""
        step, loss, norm = e.streak[-1]
        if e.in_backward:
            what = (
                "--optimizer-in-backward applied each parameter's update inside backward, before the step could be "
                "checked, so the run stops at the first one"
            )
        else:
            first = e.streak[0][0]
            span = f"step {step}" if len(e.streak) == 1 else f"steps {first}-{step}"
            what = f"{span}, {len(e.streak)} in a row (--max-nonfinite-steps {self.guard.limit}), were not applied"
        return self._stop_diverged(
            f"diverged at step {step}: loss {loss:.4g}, grad norm {norm:.4g}; {what}", step, e.last_applied
        )

    def _stop_diverged(self, what: str, step: int, last_good: int) -> OvkitError:
        aside = []
        if self.is_main:
            for ckpt in list_checkpoints(self.run_dir):
                if _step_of(ckpt) >= last_good:
                    target = ckpt.with_name(f"{ckpt.name}.diverged")
                    shutil.rmtree(target, ignore_errors=True)
                    ckpt.rename(target)
                    aside.append(target.name)
            write_json(
                self.run_dir / DIVERGED, {"step": step, "last_applied": last_good, "may_change": DIVERGENCE_FIXES}
            )
        lr = self.run.lr
        name = self.precision.name
        causes = (
            f"the usual causes are too high a learning rate (--lr {lr if lr is None else format(lr, 'g')}) and too "
            f"low a precision (--precision {name}"
            f"{'' if name == 'fp32' else '; bf16-mixed or fp32 hold more'})"
        )
        moved = f"; {', '.join(aside)} (the weights that diverged) set aside" if aside else ""
        ckpt = latest_checkpoint(self.run_dir) if self.is_main else None
        then = (
            f"run the same command with --resume and a lower --lr to continue from {ckpt}, or --overwrite to start over"
            if ckpt
            else "no checkpoint from before it: run the same command with --overwrite and a lower --lr"
        )
        return OvkitError(f"{self.command}: {what}; {causes}{moved}; {then}; OUT was not written")

    def check_weights(self, scorer: Any, state: dict[str, Any]) -> None:
        """Before weights are saved (a checkpoint, the final model): every trainable weight, and its fp32 master, is
        finite, or the run stops as a diverged one (nothing non-finite is ever saved or marked complete). One read
        per save, summed over processes."""
        model = self.unwrap(scorer)
        tensors = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
        tensors += [m for _, m in master_pairs(self._optimizer)]
        if not tensors:
            return
        bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).sum()
        if self.processes > 1:
            bad = self.accelerator.reduce(bad.to(self.device), "sum")
        if not bad.item():
            return
        names = [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
        named = f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""
        step = state["step"]
        raise self._stop_diverged(
            f"the weights after step {step} are not finite{named}, though every step's loss and gradient norm were; "
            f"they were not saved",
            step,
            self.guard.last_applied,
        )

    def provenance(self, state: dict[str, Any]) -> dict[str, Any]:
        return {
            "command": self.command,
            "ovkit_version": __version__,
            "config": to_plain(self.run.config),
            "parent": {"path": str(self.parent)},
            "inputs": self.input_prints,
            "step": state["step"],
            "seed": self.run.seed,
            "runtime": self.info(),
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "metrics": state.get("last", {}),
        }

    def finish(
        self, scorer: Any, processor: Any, state: dict[str, Any], summary: dict[str, Any], *, inputs: Sequence[Path]
    ) -> Result:
        """Save the final model into OUT.partial and, on the main process once every process is done, turn it into
        OUT (config.yaml and ovkit.json with `summary` and the runtime)."""
        self.check_weights(scorer, state)
        try:
            self.save_model(scorer, processor, self.run_dir)
        except Exception as e:  # disk full: the checkpoints stay; --resume saves the final model again
            failure = self.write_failure(e, self.run_dir)
            if failure is None:
                raise
            raise failure from e
        self.accelerator.wait_for_everyone()
        if not self.is_main:
            return Result("worker", summary)
        summary = {**summary, **held_out(self.run_dir / "metrics.jsonl")}  # the last --eval-data evaluation
        write_json(self.run_dir / RUN_STATE, state)
        stage = Stage(
            self.command,
            self.run.config,
            self.run.out,
            inputs=inputs,
            overwrite=self.run.overwrite,
            seed=self.run.seed,
            parent=self.parent,
        )
        marker = self.run_dir / DIVERGED
        diverged = json.loads(marker.read_text()) if marker.is_file() else None
        marker.unlink(missing_ok=True)
        with stage:  # OUT.partial becomes the stage's temp dir; the Stage writes config.yaml + ovkit.json and renames
            stage.metrics.update(summary)
            stage.extra["runtime"] = self.info()
            if diverged:  # this run resumed from before a divergence (with a lower --lr, usually)
                stage.extra["diverged_before"] = diverged
            stage.restore_to = self.run_dir  # a failure from here on moves the run back: --resume finds its checkpoints
            stage.adopt(self.run_dir)
        self.lock.release()
        return Result("done", summary)


def _step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("-")[1])


def _print_note(p: dict[str, Any]) -> str:
    return f"{p.get('files')} files, {p.get('bytes')} bytes, content hash {p.get('sha256')}"


def _master_values(optimizer: Any, model: Any) -> dict[str, torch.Tensor]:
    """The fp32 master copy of each parameter, by name, when the optimiser keeps one (else empty)."""

    by_id = {id(p): m for p, m in master_pairs(optimizer)}
    return {n: by_id[id(p)] for n, p in model.named_parameters() if id(p) in by_id}
