"""Metrics go to a Logger; where they end up (console line, metrics.jsonl, experiment trackers, nowhere) is decided
once, when the Logger is built, so the training loop never branches on logging. metrics.jsonl is always written.

The console line is one dense, readable line per step (nanochat's style), formatted by the loop's own function:
    step 00042 | loss 2.3100 | lr 1.00e-05 | tok/s 5400 | pad 3% | 3.1m                 (supervised)
    step 00042 | reward 0.410 | acc 0.31 | len 12.0 | clip 0.020 | ... | 25.3 samples/s   (RL)
    eval  step 00040 | reward 0.410 | accuracy 0.31 | loss 2.1034 | 3.2s                 (a step that evaluated)
above a tqdm bar with the ETA over the run's steps. The last evaluation also reaches the run's summary (`held_out`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ovkit.errors import OvkitError

# metrics.jsonl and the trackers name a metric as TRL (and the HF Trainer) does where they log the same quantity, so
# dashboards and scripts carry over; ovkit's own metrics go under "ovkit/". The loops and the console line keep
# the short internal names.
TRL_NAMES = {
    "lr": "learning_rate",
    "tokens": "num_tokens",
    "pg_loss": "loss",
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "reward/format": "rewards/format/mean",
    "reward/format_std": "rewards/format/std",
    "task_reward/mean": "rewards/task/mean",
    "task_reward/std": "rewards/task/std",
    "length/mean": "completions/mean_length",
    "length/min": "completions/min_length",
    "length/max": "completions/max_length",
    "length/terminated_mean": "completions/mean_terminated_length",
    "length/terminated_min": "completions/min_terminated_length",
    "length/terminated_max": "completions/max_terminated_length",
    "length/truncated_frac": "completions/clipped_ratio",
    "clip/low_frac": "clip_ratio/low_mean",
    "clip/high_frac": "clip_ratio/high_mean",
    "clip/frac": "clip_ratio/region_mean",
    "clip/low_min": "clip_ratio/low_min",  # over processes (ovkit.rl.loop.combine), as TRL gathers them
    "clip/high_max": "clip_ratio/high_max",
    "mismatch/delta_logp_mean": "sampling/sampling_logp_difference/mean",
    "mismatch/delta_logp_max": "sampling/sampling_logp_difference/max",
    "is_weight/min": "sampling/importance_sampling_ratio/min",
    "is_weight/mean": "sampling/importance_sampling_ratio/mean",
    "is_weight/max": "sampling/importance_sampling_ratio/max",
}
SAME_IN_TRL = frozenset({"loss", "grad_norm", "epoch", "entropy", "kl", "frac_reward_zero_std"})
# Held-out metrics (ovkit.evaluate.during) keep their name: TRL's eval_loss, eval_reward show as eval/loss, eval/reward.
EVAL_PREFIX = "eval/"


def public_name(key: str) -> str:
    """The name a metric is written under (metrics.jsonl, trackers)."""
    return TRL_NAMES.get(key) or (key if key in SAME_IN_TRL or key.startswith(EVAL_PREFIX) else f"ovkit/{key}")


def public(metrics: dict[str, Any]) -> dict[str, Any]:
    return {public_name(k): v for k, v in metrics.items()}


def tracker_tag(name: str) -> str:
    """A public name as TRL's runs show it in TensorBoard, W&B and Trackio: transformers' Trainer writes its logs
    under train/ (eval_* under eval/; `rewrite_logs` in transformers.integrations), so train/loss,
    train/rewards/task/mean, and ovkit's own beside them as train/ovkit/..."""
    return name if name.startswith(EVAL_PREFIX) else f"train/{name}"


def eval_line(step: int, metrics: dict[str, Any]) -> str | None:
    """The console line of a step that evaluated on --eval-data (ovkit.evaluate.during), beside its step line:
    `eval  step 00040 | reward 0.410 | accuracy 0.31 | loss 2.1034 | 3.2s`; None for a step that did not."""
    found = {k.removeprefix(EVAL_PREFIX): v for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}
    if not found:
        return None
    return " | ".join([f"eval  step {step:05d}", *_held_out_parts(found)])


def _held_out_parts(found: dict[str, Any], *, runtime: bool = True) -> list[str]:
    formats = {"reward": "reward {:.3f}", "accuracy": "accuracy {:.2f}", "loss": "loss {:.4f}"}
    if runtime:
        formats["runtime"] = "{:.1f}s"
    return [f.format(found[k]) for k, f in formats.items() if isinstance(found.get(k), (int, float))]


def held_out(metrics_jsonl: Path) -> dict[str, Any]:
    """`{"eval": {"step": N, "reward": ..., "accuracy": ..., "loss": ..., "reward/<category>": ...}}`: the last
    evaluation of the run (--eval-data; its last step evaluates), read from metrics.jsonl, so a resumed run reports
    it too, for ovkit.json's metrics, the command's summary line and the model card; {} without one."""
    path = Path(metrics_jsonl)
    last: dict[str, Any] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            found = {k.removeprefix(EVAL_PREFIX): v for k, v in row.items() if k.startswith(EVAL_PREFIX)}
            if found:
                last = {"step": row["step"], **found}
    return {"eval": last} if last else {}


def held_out_note(metrics: dict[str, Any]) -> str:
    """`; held-out at step 40: reward 0.410, accuracy 0.31, loss 2.1034` for a summary line ('' without one)."""
    found = metrics.get("eval") or {}
    parts = _held_out_parts(found, runtime=False)
    return f"; held-out at step {found['step']}: {', '.join(parts)}" if found and parts else ""


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class ConsoleSink:
    """The step line on stderr, above a tqdm bar (with ETA) over the total steps."""

    def __init__(self, total: int, start: int, *, desc: str, line: Callable[[int, dict[str, Any]], str]):
        # heavy: tqdm loads on first use, not at CLI start or in config checks
        from tqdm import tqdm

        self.line = line
        self.bar = tqdm(total=total, initial=start, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=False)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.bar.write(self.line(step, metrics), file=sys.stderr)
        held = eval_line(step, metrics)
        if held is not None:
            self.bar.write(held, file=sys.stderr)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class JsonlSink:
    """One JSON object per step appended to metrics.jsonl. On resume, lines after the checkpoint's step are dropped
    first, so the file holds every step exactly once."""

    def __init__(self, path: Path, *, resume_step: int = 0):
        self.path = Path(path)
        if self.path.exists():
            kept = [
                ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step
            ]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self.fh = open(self.path, "a", buffering=1)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        self.fh.write(json.dumps({"step": step, **public(metrics)}) + "\n")

    def close(self) -> None:
        self.fh.close()


TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}  # name -> package


def check_trackers(names: list[str]) -> None:
    """Each --report-to name is one of TRACKERS and its package is installed (else a message saying what to install)."""

    for name in names:
        if name not in TRACKERS:
            raise OvkitError(f"--report-to must be one of {', '.join(TRACKERS)} (or none), got {name!r}")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise OvkitError(
                f"--report-to {name}: the {TRACKERS[name]} package is not installed (pip install {TRACKERS[name]})"
            )


class TrackerSink:
    """accelerate's experiment trackers (TensorBoard, Weights & Biases, MLflow, Trackio), as the HF Trainer and TRL use
    them, under metrics.jsonl's names with the Trainer's train/ prefix (`tracker_tag`). Offline by default where the
    tracker allows: TensorBoard writes OUT.partial/trackers/, MLflow a file store in OUT.partial/mlruns (unless
    MLFLOW_TRACKING_URI is set), W&B into OUT.partial/wandb (WANDB_MODE=offline keeps it off the network), Trackio a
    local project."""

    def __init__(self, accelerator, run_dir: Path, *, project: str, config: dict[str, Any]):

        os.environ.setdefault("MLFLOW_TRACKING_URI", (Path(run_dir) / "mlruns").resolve().as_uri())
        self.accelerator = accelerator
        # hyper-parameters as the trackers take them: scalars and strings (lists and None as their JSON text)
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in config.items()}
        accelerator.init_trackers(project, config=hparams, init_kwargs={"wandb": {"dir": str(run_dir)}})

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = {
            tracker_tag(k): v
            for k, v in public(metrics).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self.accelerator.log(scalars, step=step)

    def close(self) -> None:
        self.accelerator.end_training()


class Logger:
    """Fans metrics out to sinks. Processes other than the main one get no sinks."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for s in self.sinks:
            s.write(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def make_logger(
    run_dir: Path,
    *,
    main: bool,
    quiet: bool,
    total: int,
    start: int,
    desc: str,
    line: Callable[[int, dict[str, Any]], str],
    trackers: Sink | None = None,
) -> Logger:
    if not main:
        return Logger([])
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step=start)]
    if trackers is not None:
        sinks.append(trackers)
    if not quiet:
        sinks.append(ConsoleSink(total, start, desc=desc, line=line))
    return Logger(sinks)
