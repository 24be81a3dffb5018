"""Benchmark: `ovkit rl-train` (synchronous and asynchronous, HF engine and vLLM) against TRL's GRPOTrainer on the
same model and prompts: samples/s and peak memory, printed as ratios to TRL.

Every run is a fresh process (peak memory is its own): the same prompts (the synthetic RL split, answer-only
instruction), group size, completion length, prompts per step, steps, learning rate, clip 0.2 / 0.28, no KL,
token-mean loss, one optimiser step per batch, the same reward code (ovkit.rewards). On CUDA the model is a
random-init 2.2B Qwen2.5-VL (`init-model --preset qwen2.5-vl-2b --random-init`) in bf16 (ovkit: bf16-mixed; TRL:
bf16); on CPU the tiny model in fp32. samples/s counts trajectories trained per second of the training loop
(ovkit: the steps' wall time; TRL: trainer.train(); model loading and setup excluded for both); peak memory is torch.cuda.max_memory_allocated on CUDA and the peak RSS growth on CPU.

  ovkit sync         --max-staleness 0, --engine hf (the sampler is the learner's weights)
  ovkit async        --max-staleness 2, --engine hf (a rollout thread samples the next batch on its own copy)
  ovkit vllm         --max-staleness 0, --engine vllm (colocated; CUDA with vLLM installed)
  trl                GRPOTrainer, generation with transformers (use_vllm=False)

    python bench/gpu_grpo.py                      # CPU: the tiny model, a few minutes
    python bench/gpu_grpo.py --preset qwen2.5-vl-2b --steps 4 --prompts-per-step 4 --group-size 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _workers import report_result, run_workers  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUNS = ("ovkit-sync", "ovkit-async", "ovkit-vllm", "trl")


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
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--out", type=Path, help="keep the work directory here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_ovkit(spec: dict, staleness: int, engine: str) -> dict:
    import torch

    from ovkit.rl.config import RLTrainConfig
    from ovkit.rl.loop import train_rl

    cuda = torch.cuda.is_available()
    batch = spec["prompts_per_step"] * spec["group_size"]
    cfg = RLTrainConfig(
        data=[Path(spec["data"])], model=Path(spec["model"]), out=Path(spec["work"]) / f"ovkit-{engine}-{staleness}", stage=1,
        prompts_per_step=spec["prompts_per_step"], group_size=spec["group_size"], max_new_tokens=spec["max_new_tokens"],
        max_steps=spec["steps"], lr=spec["lr"], warmup_ratio=0.0, max_staleness=staleness, engine=engine, system_prompt=False,
        micro_batch_size=min(batch, 8 if cuda else batch), rollout_batch_size=batch, save_every=0, overwrite=True, quiet=True,
        precision="bf16-mixed" if cuda else "fp32", reward_workers=2,
    )  # fmt: skip
    summary = train_rl(cfg)
    return {"samples": summary["samples"], "seconds": summary["elapsed_s"]}  # the training loop (TRL: trainer.train())


def run_trl(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import GRPOConfig, GRPOTrainer

    from grpo import task_reward, trl_dataset

    cuda = torch.cuda.is_available()
    batch = spec["prompts_per_step"] * spec["group_size"]
    config = GRPOConfig(
        output_dir=str(Path(spec["work"]) / "trl"), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=spec["group_size"], max_completion_length=spec["max_new_tokens"],
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01,
        adam_epsilon=1e-5, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", num_iterations=1, temperature=1.0, top_p=1.0, top_k=0, use_cpu=not cuda, bf16=cuda,
        logging_steps=1, save_strategy="no", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[task_reward], args=config, train_dataset=trl_dataset(Path(spec["data"])),
                          processing_class=AutoProcessor.from_pretrained(spec["model"]))  # fmt: skip
    t0 = time.perf_counter()
    trainer.train()
    return {"samples": spec["steps"] * batch, "seconds": time.perf_counter() - t0}


def worker(name: str, spec_path: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    run = {"ovkit-sync": lambda: run_ovkit(spec, 0, "hf"), "ovkit-async": lambda: run_ovkit(spec, 2, "hf"),
           "ovkit-vllm": lambda: run_ovkit(spec, 0, "vllm"), "trl": lambda: run_trl(spec)}[name]
    result = run()
    result["peak_bytes"] = int(torch.cuda.max_memory_allocated()) if cuda else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    report_result(result)


def ovkit_cli(*args) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)


def main() -> None:
    import torch

    args = parse_args()
    if args.worker:
        return worker(args.worker, args.spec)
    runs = [r for r in args.runs.split(",") if r]
    if "ovkit-vllm" in runs and not (torch.cuda.is_available() and importlib.util.find_spec("vllm")):
        print("ovkit-vllm needs CUDA and vLLM: skipped", file=sys.stderr)
        runs.remove("ovkit-vllm")
    if "trl" in runs and importlib.util.find_spec("trl") is None:
        print("trl is not installed (pip install -e '.[bench]'): skipped", file=sys.stderr)
        runs.remove("trl")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
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
        spec = {"work": str(work), "data": str(data), "model": str(model), "steps": args.steps, "lr": args.lr,
                "prompts_per_step": args.prompts_per_step, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens}
        results = run_workers(__file__, runs, spec, work)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device: {device}; model {model}; {args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} completions, "
          f"<= {args.max_new_tokens} new tokens")
    base = results.get("trl")
    print(f"{'run':<13}{'samples/s':>11}{'vs trl':>8}{'peak GB':>9}{'vs trl':>8}")
    for name, r in results.items():
        sps = r["samples"] / r["seconds"]
        ratio = f"{sps / (base['samples'] / base['seconds']):.2f}x" if base else "-"
        mem = f"{r['peak_bytes'] / base['peak_bytes']:.2f}x" if base and base["peak_bytes"] > 0 else "-"
        print(f"{name:<13}{sps:>11.2f}{ratio:>8}{r['peak_bytes'] / 1e9:>9.2f}{mem:>8}")


if __name__ == "__main__":
    main()
