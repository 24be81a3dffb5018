"""Benchmark: `ovkit rl-train` (synchronous and asynchronous, HF engine and vLLM) against TRL's GRPOTrainer on the
same model and prompts, like for like: each pair at the same precision policy. samples/s, peak memory, bytes per
parameter and where the memory goes, printed as ratios to TRL at the same policy.

Every run is a fresh process (peak memory is its own): the same prompts (the synthetic RL split, answer-only
instruction), group size, completion length, prompts per step, steps, learning rate, clip 0.2 / 0.28, no KL,
token-mean loss, one optimiser step per batch, the same reward code (ovkit.rewards).

  trl-mixed          TRL at its own default: fp32 weights (what it loads from a model path), bf16=True (autocast), 16
                     B/param
  ovkit-mixed        --precision bf16-mixed (bf16 weights, fp32 masters and AdamW state: 18 B/param), --max-staleness 0
  ovkit-mixed-async  the same, --max-staleness 2 (a rollout thread samples the next batch on its own bf16 copy)
  trl-bf16           TRL given bf16 weights, bf16=True: pure bf16, torch AdamW with bf16 moments (8 B/param)
  ovkit-bf16         --precision bf16-true --optim adamw_bf16 (Kahan-compensated bf16 AdamW: 10 B/param), sync
  ovkit-bf16-async   the same, --max-staleness 2
  ovkit-vllm         bf16-mixed, --engine vllm (colocated), sync; CUDA with vLLM installed

On CPU every policy runs as named (bf16 autocast and bf16 weights work there, slowly), on the tiny model.

Where the memory goes (CUDA; n/a on CPU, where only the process's peak RSS is known): the bench wraps the phase
boundaries and reads torch.cuda.memory_allocated / max_memory_allocated around them, with nothing changed in ovkit or
TRL: `weights` = allocated once the model is on the device (ovkit: Runtime.load_model; TRL: after the trainer is
built); `sampler copy` = what building the rollout engine added (ovkit's async copy; 0 when the sampler is the
learner); `optimiser` = what stays allocated after the first optimiser step (AdamW state, fp32 masters); `generate`
= the peak above the entry level inside model.generate (KV cache, logits, sampling); `learner` = the peak above the
entry level of the gradient pass (ovkit: rl.update.train_step; TRL: training_step less its nested generation):
activations, logits or the chunked head, gradients. In async runs generation overlaps the learner, so their
generate and learner peaks hold each other's memory: read them from the sync runs.

Defaults on CUDA, one 80 GB card: the random-init 2.2B `qwen2.5-vl-2b`, 4 steps x 4 prompts x 8 completions,
<= 64 new tokens, learner micro-batch 8 (measured there on 2026-11-26: ovkit sync 46.5 GB, async 51.2 GB, TRL on
bf16 weights 18.3 GB; TRL at 16 B/param adds 17.7 GB of fp32 weights and moments to that: ~36 GB). Activation
checkpointing is off for every run (the sequences are short; `--activation-checkpointing full` turns it on for both
sides: ovkit's option, TRL's gradient_checkpointing).

    python bench/gpu_grpo.py                      # CPU: the tiny model, a few minutes
    python bench/gpu_grpo.py --preset qwen2.5-vl-2b --runs trl-mixed,ovkit-mixed,trl-bf16,ovkit-bf16
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _result  # noqa: E402
from _workers import find_key as _find  # noqa: E402
from _workers import report_result, run_workers

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# run -> (side, policy, ovkit staleness, ovkit engine)
RUNS = {
    "trl-mixed": ("trl", "mixed", None, None),
    "ovkit-mixed": ("ovkit", "mixed", 0, "hf"),
    "ovkit-mixed-async": ("ovkit", "mixed", 2, "hf"),
    "trl-bf16": ("trl", "bf16", None, None),
    "ovkit-bf16": ("ovkit", "bf16", 0, "hf"),
    "ovkit-bf16-async": ("ovkit", "bf16", 2, "hf"),
    "ovkit-vllm": ("ovkit", "mixed", 0, "vllm"),
}
PHASES = ("weights", "sampler copy", "optimiser", "generate", "learner")


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: built from --preset)")
    p.add_argument("--preset", default="qwen2.5-vl-2b" if cuda else "tiny")
    p.add_argument("--data", type=Path, help="RL prompts (default: `ovkit synth --scale 0.25`'s rl split)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64 if cuda else 24)
    p.add_argument(
        "--micro-batch-size", type=int, default=8 if cuda else 32, help="ovkit's learner micro-batch (trajectories)"
    )
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument(
        "--bf16-optim",
        default="adamw_bf16",
        help="ovkit --optim of the bf16 runs (adamw_bf16, adamw_8bit, adamw_torch_fused)",
    )
    p.add_argument(
        "--activation-checkpointing",
        default="off",
        help="ovkit's option; anything but `off` turns TRL's gradient_checkpointing on",
    )
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--out", type=Path, help="keep the work directory here")
    p.add_argument("--json", type=Path, help="also write the results here (the GPU suite's summary reads it)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- where the memory goes -----------------------------------------------------------------------------------------


class MemoryPhases:
    """CUDA memory per phase, from torch.cuda's allocator counters around wrapped functions. A phase's peak is the
    highest allocation above its entry level while it runs, nested phases excluded (the peak counter is read and
    reset at every boundary; the overall peak is kept here). Nothing on CPU."""

    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda.is_available()
        self.torch = torch
        self.stack: list[tuple[str, int]] = []
        self.peaks: dict[str, int] = {}
        self.marks: dict[str, int] = {}
        self.overall = 0
        self.lock = threading.Lock()

    def _fold(self) -> int:
        peak = self.torch.cuda.max_memory_allocated()
        self.overall = max(self.overall, peak)
        self.torch.cuda.reset_peak_memory_stats()
        return peak

    def allocated(self) -> int:
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    def mark(self, name: str, value: int) -> None:
        if self.cuda and name not in self.marks:
            self.marks[name] = value

    def wrap(self, owner: object, attr: str, phase: str, after=None) -> None:
        """Make owner.attr a phase; after(result, entry_allocated) runs once, on its first return."""
        fn = getattr(owner, attr, None)
        if fn is None or not self.cuda:
            return
        tracker, first = self, [True]

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with tracker.lock:
                if tracker.stack:  # the enclosing phase's segment so far
                    name, base = tracker.stack[-1]
                    tracker.peaks[name] = max(tracker.peaks.get(name, 0), tracker._fold() - base)
                else:
                    tracker._fold()
                entry = tracker.allocated()
                tracker.stack.append((phase, entry))
            try:
                result = fn(*args, **kwargs)
            finally:
                with tracker.lock:
                    tracker.stack.pop()
                    tracker.peaks[phase] = max(tracker.peaks.get(phase, 0), tracker._fold() - entry)
                    if tracker.stack:  # the enclosing phase resumes from here
                        name, _ = tracker.stack[-1]
                        tracker.stack[-1] = (name, tracker.allocated())
            if after is not None and first[0]:
                first[0] = False
                after(result, entry)
            return result

        setattr(owner, attr, wrapped)

    def peak(self) -> int:
        return max(self.overall, self.torch.cuda.max_memory_allocated()) if self.cuda else 0

    def report(self) -> dict[str, int] | None:
        if not self.cuda:
            return None
        return {**self.marks, "generate": self.peaks.get("generate", 0), "learner": self.peaks.get("learner", 0)}


# ---- the runs (each in its own process) ---------------------------------------------------------------------------


def run_ovkit(spec: dict, policy: str, staleness: int, engine: str, mem: MemoryPhases) -> dict:
    from transformers.generation.utils import GenerationMixin

    import ovkit.rl.loop as loop
    from ovkit.rl.config import RLTrainConfig
    from ovkit.runtime import Runtime

    batch = spec["prompts_per_step"] * spec["group_size"]
    precision, optim = ("bf16-mixed", "adamw_torch_fused") if policy == "mixed" else ("bf16-true", spec["bf16_optim"])
    mem.wrap(Runtime, "load_model", "load", after=lambda r, e: mem.mark("weights", mem.allocated()))
    mem.wrap(loop, "_rollouts", "rollouts", after=lambda r, e: mem.mark("sampler copy", mem.allocated() - e))
    mem.wrap(GenerationMixin, "generate", "generate")
    mem.wrap(loop, "train_step", "learner", after=lambda r, e: mem.mark("optimiser", mem.allocated() - e))
    out = Path(spec["work"]) / f"ovkit-{policy}-{engine}-{staleness}"
    cfg = RLTrainConfig(
        data=[Path(spec["data"])],
        model=Path(spec["model"]),
        out=out,
        stage=1,
        prompts_per_step=spec["prompts_per_step"],
        group_size=spec["group_size"],
        max_new_tokens=spec["max_new_tokens"],
        max_steps=spec["steps"],
        lr=spec["lr"],
        warmup_ratio=0.0,
        max_staleness=staleness,
        engine=engine,
        system_prompt=False,
        micro_batch_size=min(batch, spec["micro_batch_size"]),
        rollout_batch_size=batch,
        save_every=0,
        overwrite=True,
        quiet=True,
        precision=precision,
        optim=optim,
        reward_workers=2,
        activation_checkpointing=spec["activation_checkpointing"],
    )
    summary = loop.train_rl(cfg)
    bpp = _find(json.loads((out / "ovkit.json").read_text()), "bytes_per_param") or {}
    return {
        "samples": summary["samples"],
        "seconds": summary["elapsed_s"],
        "bytes_per_param": bpp.get("total"),
        "policy": f"{precision} / {optim}",
    }  # the training loop (TRL: trainer.train())


def run_trl(spec: dict, policy: str, mem: MemoryPhases) -> dict:
    import torch
    from grpo import task_reward, trl_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from transformers.generation.utils import GenerationMixin
    from trl import GRPOConfig, GRPOTrainer

    from ovkit.runtime.optim import bytes_per_param

    cuda = torch.cuda.is_available()
    batch = spec["prompts_per_step"] * spec["group_size"]
    bpp: list[float] = []

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            mem.mark("_step", mem.allocated())

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if not bpp:  # after the step, before zero_grad: the same count as ovkit's
                bpp.append(bytes_per_param(model.parameters(), optimizer)["total"])

        def on_step_end(self, args, state, control, **kw):
            if mem.cuda:
                mem.mark("optimiser", mem.allocated() - mem.marks["_step"])

    # bf16=True is TRL's autocast, over fp32 weights (its default given a model path) or over bf16 ones
    config = GRPOConfig(
        output_dir=str(Path(spec["work"]) / f"trl-{policy}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=spec["group_size"],
        max_completion_length=spec["max_new_tokens"],
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        adam_epsilon=1e-5,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_cpu=not cuda,
        bf16=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=spec["activation_checkpointing"] != "off",
    )
    dtype = torch.float32 if policy == "mixed" else torch.bfloat16
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=dtype)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[task_reward],
        args=config,
        train_dataset=trl_dataset(Path(spec["data"])),
        processing_class=AutoProcessor.from_pretrained(spec["model"]),
        callbacks=[Measure()],
    )
    mem.mark("weights", mem.allocated())
    mem.mark("sampler copy", 0)  # TRL samples from the learner's own weights
    mem.wrap(GenerationMixin, "generate", "generate")
    mem.wrap(type(trainer), "training_step", "learner")
    t0 = time.perf_counter()
    trainer.train()
    return {
        "samples": spec["steps"] * batch,
        "seconds": time.perf_counter() - t0,
        "bytes_per_param": bpp[0] if bpp else None,
        "policy": f"{'fp32 weights' if policy == 'mixed' else 'bf16 weights'}, bf16 autocast / adamw_torch",
    }


def worker(name: str, spec_path: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    mem = MemoryPhases()
    side, policy, staleness, engine = RUNS[name]
    result = run_trl(spec, policy, mem) if side == "trl" else run_ovkit(spec, policy, staleness, engine, mem)
    result["peak_bytes"] = (
        mem.peak() if mem.cuda else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    )
    phases = mem.report()
    result["phases"] = {k: phases.get(k) for k in PHASES} if phases else None
    report_result(result)


# ---- the report --------------------------------------------------------------------------------------------------


def ovkit_cli(*args) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)


def prepare(args, work: Path) -> tuple[Path, Path]:
    """(prompts, model): the given ones, or the synthetic RL split and a model built from --preset."""
    data = args.data
    if data is None:
        if not (work / "synth" / "ovkit.json").is_file():
            ovkit_cli("synth", "--out", work / "synth", "--scale", "0.25")
        data = work / "synth" / "rl"
    model = args.model
    if model is None:
        model = work / "model"
        if not (model / "config.json").is_file():
            if args.preset == "tiny":
                ovkit_cli("init-model", "--preset", "tiny", "--corpus", work / "synth", "--out", model)
            else:
                ovkit_cli("init-model", "--preset", args.preset, "--random-init", "--dtype", "bfloat16", "--out", model)
    return data, model


def main() -> None:
    import torch

    args = parse_args()
    if args.worker:
        return worker(args.worker, args.spec)
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        sys.exit(f"--runs: unknown {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    if "ovkit-vllm" in runs and not (torch.cuda.is_available() and importlib.util.find_spec("vllm")):
        print("ovkit-vllm needs CUDA and vLLM: skipped", file=sys.stderr)
        runs.remove("ovkit-vllm")
    if importlib.util.find_spec("trl") is None:
        print("trl is not installed (pip install -e '.[bench]'): its runs are skipped", file=sys.stderr)
        runs = [r for r in runs if RUNS[r][0] != "trl"]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data, model = prepare(args, work)
        spec = {
            "work": str(work),
            "data": str(data),
            "model": str(model),
            "steps": args.steps,
            "lr": args.lr,
            "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "micro_batch_size": args.micro_batch_size,
            "bf16_optim": args.bf16_optim,
            "activation_checkpointing": args.activation_checkpointing,
        }
        results = run_workers(__file__, runs, spec, work)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report(args, device, model, runs, results)


def report(args, device: str, model: Path, runs: list[str], results: dict) -> None:
    gb = lambda b: b / 1e9 if b is not None else None  # noqa: E731
    print(
        f"device: {device}; model {model}; {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} "
        f"completions, "
        f"<= {args.max_new_tokens} new tokens; ovkit micro-batch {args.micro_batch_size}; checkpointing "
        f"{args.activation_checkpointing}"
    )
    table = []
    for name in runs:
        r = results.get(name)
        if r is None:
            table.append({"run": name, "policy": "failed (stderr above: out of memory?)"})
            continue
        base = results.get(f"trl-{RUNS[name][1]}")  # TRL at the same policy
        sps = r["samples"] / r["seconds"]
        table.append(
            {
                "run": name,
                "samples/s": sps,
                "vs trl": sps / (base["samples"] / base["seconds"]) if base else None,
                "peak GB": gb(r["peak_bytes"]),
                "vs trl peak": r["peak_bytes"] / base["peak_bytes"] if base and base["peak_bytes"] > 0 else None,
                "B/param": r.get("bytes_per_param"),
                "policy": r["policy"],
            }
        )
    _result.table(
        "gpu_grpo",
        f"GRPO on {device}: ovkit rl-train against TRL's GRPOTrainer at the same precision policy",
        table,
        columns=["run", "samples/s", "vs trl", "peak GB", "vs trl peak", "B/param", "policy"],
        formats={"samples/s": ".2f", "vs trl": ".2f", "peak GB": ".2f", "vs trl peak": ".2f", "B/param": ".2f"},
    )
    _result.table(
        "gpu_grpo",
        "where the memory goes, GB (weights, sampler copy, optimiser: allocated; generate, learner: peak above entry; "
        "n/a on CPU: no allocator counters, peak is the process RSS growth)",
        [{"run": name, **{p: gb((r.get("phases") or {}).get(p)) for p in PHASES}} for name, r in results.items()],
        formats=dict.fromkeys(PHASES, ".2f"),
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "runs": {k: {**v, "samples_per_s": v["samples"] / v["seconds"]} for k, v in results.items()},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
