"""Where a training run lives, and how it is saved and resumed.

    OUT.partial/                     the run while it is going (a stable name, so --resume finds it)
      metrics.jsonl                  one JSON object per step
      tensorboard/                   with --report-to tensorboard
      checkpoints/step-000200/       every --save-every steps; the newest --keep-checkpoints are kept
        model.safetensors, config.json, processor/tokenizer files   save_pretrained: loadable as a model
        state/                       accelerate save_state: optimiser, lr schedule, model, RNG of every process
        trainer_state.json           step, epoch, tokens, elapsed time, world size
        ovkit.json                   provenance; written last, so a checkpoint without it is incomplete
    OUT/                             at the end: OUT.partial + the final model at its root, config.yaml, ovkit.json

A checkpoint is written as `checkpoints/.step-N.tmp` and renamed, so a killed run leaves either a whole checkpoint
or a temp dir that is ignored. The data position needs no saving: the sample order is a function of (seed, step)
(ovkit.train.data.Schedule), so resuming at step N replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from ovkit import __version__
from ovkit.config import to_plain
from ovkit.errors import OvkitError
from ovkit.runs import write_json

CHECKPOINTS = "checkpoints"
STATE = "state"
TRAINER_STATE = "trainer_state.json"
PROVENANCE = "ovkit.json"

# Options that shape the trajectory: a resumed run must use the same values (others, e.g. --save-every, may change).
TRAJECTORY = (
    "data", "model", "plan", "trainable", "freeze_vision", "lr", "min_lr", "warmup_ratio", "weight_decay",
    "max_grad_norm", "batch_size", "grad_accum", "max_steps", "epochs", "max_len", "precision", "seed",
)


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


def check_resumable(cfg, ckpt: Path, processes: int) -> dict[str, Any]:
    """The checkpoint's trainer state, after checking that this run continues the same trajectory."""
    saved = json.loads((ckpt / PROVENANCE).read_text())["config"]
    now = to_plain(cfg)
    changed = [k for k in TRAJECTORY if saved.get(k.replace("_", "-")) != now.get(k.replace("_", "-"))]
    if changed:
        diffs = ", ".join(f"--{k.replace('_', '-')} {saved.get(k.replace('_', '-'))!r} -> {now.get(k.replace('_', '-'))!r}" for k in changed)
        raise OvkitError(f"--resume: {ckpt} was trained with different options ({diffs}); use the same ones, or --overwrite to start over")
    state = json.loads((ckpt / TRAINER_STATE).read_text())
    if state["processes"] != processes:
        raise OvkitError(f"--resume: {ckpt} ran on {state['processes']} processes, this run has {processes}; the global batch would change")
    return state


def save_model(accelerator, model, processor, out: Path) -> None:
    """save_pretrained of the unwrapped model (gathered from every process under FSDP/DeepSpeed) and the processor."""
    state_dict = accelerator.get_state_dict(model)  # collective: every process must call it
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(out, state_dict=state_dict, safe_serialization=True)
        processor.save_pretrained(out)


def save_checkpoint(accelerator, model, processor, cfg, run_dir: Path, trainer_state: dict[str, Any], keep: int) -> Path:
    step = trainer_state["step"]
    final = step_dir(run_dir, step)
    tmp = final.parent / f".{final.name}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    # Pickle, not safetensors: the state is ovkit's own, and safetensors refuses tied weights (embeddings = lm_head).
    accelerator.save_state(str(tmp / STATE), safe_serialization=False)
    save_model(accelerator, model, processor, tmp)
    if accelerator.is_main_process:
        write_json(tmp / TRAINER_STATE, trainer_state)
        write_json(tmp / PROVENANCE, provenance(cfg, trainer_state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def provenance(cfg, trainer_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "command": cfg.stage,
        "ovkit_version": __version__,
        "config": to_plain(cfg),
        "parent": {"path": str(cfg.model)},
        "step": trainer_state["step"],
        "seed": cfg.seed,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "metrics": trainer_state.get("last", {}),
    }
