"""Benchmark: ovkit's training runtime (padded and packed) against a plain PyTorch loop and TRL's SFTTrainer, on the
same model and the same samples: tokens/s, MFU and peak memory, printed as ratios to the plain loop.

Runs, each in a fresh process (so peak memory is its own), full fine-tuning of one model:

  ovkit padded   ovkit.train on length-bucketed padded batches of --batch-size samples
  ovkit packed   ovkit.train on packed rows (`ovkit pack --max-len --tokens-per-row`), as many rows per step as
                 give about the padded run's tokens per step
  plain          a plain PyTorch loop on exactly ovkit's padded batches: model(**batch).loss, fused AdamW; the
                 weights in --plain-dtype (pure bf16 on CUDA, as the issue's reference; fp32 on CPU)
  trl            TRL's SFTTrainer (bf16 on CUDA) on the same samples in TRL's VLM format, batch --batch-size

Samples: a LLaVA-like length mix: one image per sample (--image-size, 448: 256 visual tokens with Qwen's 14-pixel
patches and 2x2 merge) and a caption of lognormal length (median --text-tokens), seeded. tokens/s counts
non-padding tokens (text + image tokens) over the steps after --warmup; MFU = 6 x (LLM parameters x sequence tokens
+ ViT parameters x patches) / time / the device's dense bf16 peak (CUDA only); peak memory is
torch.cuda.max_memory_allocated on CUDA and the process's peak RSS growth on CPU.

    python bench/gpu_train.py                                  # CPU: the tiny model (a few minutes)
    python bench/gpu_train.py --preset qwen2.5-vl-2b           # GPU: random-init 2.2B (ovkit init-model --random-init)
    python bench/gpu_train.py --model DIR --runs ovkit-packed,plain
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _workers import report_result, run_workers  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUNS = ("ovkit-padded", "ovkit-packed", "plain", "trl")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: built from --preset)")
    p.add_argument("--preset", default="qwen2.5-vl-2b" if cuda else "tiny", help="tiny, or a random-init preset (qwen2.5-vl-2b, -3b, -7b)")
    p.add_argument("--rows", type=int, default=1024 if cuda else 192, help="samples")
    p.add_argument("--image-size", type=int, default=448 if cuda else 224, help="image side in pixels (448: 256 visual tokens)")
    p.add_argument("--text-tokens", type=int, default=120, help="median caption length in words")
    p.add_argument("--batch-size", type=int, default=32 if cuda else 8, help="samples per padded step (and TRL's batch)")
    p.add_argument("--tokens-per-row", type=int, default=16384 if cuda else 1024, help="packed row capacity")
    p.add_argument("--steps", type=int, default=20 if cuda else 8, help="optimiser steps per run")
    p.add_argument("--warmup", type=int, default=3 if cuda else 2, help="steps not measured")
    p.add_argument("--precision", default="auto", help="ovkit --precision (auto: bf16-mixed on CUDA)")
    p.add_argument("--plain-dtype", default="bfloat16" if cuda else "float32", help="the plain loop's weights")
    p.add_argument("--gradient-checkpointing", action="store_true", help="ovkit and plain: activation checkpointing")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--out", type=Path, help="keep the work directory here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- inputs ------------------------------------------------------------------------------------------------------


def make_data(args, out: Path) -> None:
    """--rows captioning samples: one image (a few coloured shapes) and a lognormal-length caption."""
    from PIL import Image, ImageDraw

    from ovkit.data import image_cell, samples_table, write_samples

    rng = random.Random(0)
    words = "a red blue green circle square triangle on the left right of near large small image shows".split()
    rows = []
    for i in range(args.rows):
        img = Image.new("RGB", (args.image_size, args.image_size), "white")
        draw = ImageDraw.Draw(img)
        for _ in range(rng.randint(1, 5)):
            x, y, r = rng.randrange(args.image_size), rng.randrange(args.image_size), rng.randint(8, args.image_size // 6)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.randrange(256) for _ in range(3)))
        n = max(4, int(rng.lognormvariate(0, 0.6) * args.text_tokens))
        caption = " ".join(rng.choice(words) for _ in range(n))
        rows.append({"id": f"r{i}", "images": [image_cell(img)], "source": "bench/caption", "category": "caption",
                     "messages": [{"role": "user", "content": "<image>\nDescribe the image."}, {"role": "assistant", "content": caption}]})
    write_samples(samples_table(rows), out)


def ovkit_cli(*args) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)


def make_model(args, work: Path) -> Path:
    if args.model is not None:
        return args.model
    if args.preset == "tiny":
        ovkit_cli("init-model", "--preset", "tiny", "--corpus", work / "data", "--out", work / "model")
    else:
        ovkit_cli("init-model", "--preset", args.preset, "--random-init", "--out", work / "model")
    return work / "model"


# ---- the runs (each in its own process) ---------------------------------------------------------------------------


def _peak_memory(base_rss: int) -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024


def _padded_batches(spec: dict, processor):
    """ovkit's padded micro-batches for the first `steps` steps (the same for ovkit padded and the plain loop)."""
    from ovkit.train.data import SampleSource, Schedule

    source = SampleSource(Path(spec["data"]), processor, max_len=1 << 20)
    schedule = Schedule(tuple(source.lengths), spec["batch_size"], 1, 1, 0)
    pad = processor.tokenizer.pad_token_id
    return [source.collate([source[i] for i in micro[0]], pad) for _, _, micro in schedule.steps(0, spec["steps"], 0)]


def run_ovkit(spec: dict, packed: bool) -> dict:
    from ovkit.train import SFTConfig, train

    opts = dict(plan=Path(spec["plan"]), batch_size=spec["pack_batch"]) if packed else dict(batch_size=spec["batch_size"])
    out = Path(spec["work"]) / ("ovkit-packed" if packed else "ovkit-padded")
    train(SFTConfig(data=Path(spec["data"]), model=Path(spec["model"]), out=out, max_steps=spec["steps"], lr=1e-5, warmup_ratio=0.0,
                    precision=spec["precision"], gradient_checkpointing=spec["gradient_checkpointing"], quiet=True, max_len=1 << 20, **opts))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][spec["warmup"]:]
    seconds = sum(r["ovkit/step_s"] for r in rows)
    return {"tokens": sum(r["ovkit/tok_per_s"] * r["ovkit/step_s"] for r in rows), "seconds": seconds, "steps": len(rows),
            "tokens_per_step": statistics.mean(r["ovkit/tok_per_s"] * r["ovkit/step_s"] for r in rows)}


# What a plain loop passes to model(**batch): the padded batch as a processor makes it, the loss from labels.
PLAIN_INPUTS = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def run_plain(spec: dict) -> dict:
    import torch

    from ovkit.models import load

    dtype = getattr(torch, spec["plain_dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, processor = load(Path(spec["model"]), dtype=dtype)
    model.to(device).train()
    if spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = _padded_batches(spec, processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-5, fused=True)
    times, tokens = [], []
    for k, batch in enumerate(batches):
        n = int(batch.pop("num_tokens"))
        batch = {key: v.to(device) for key, v in batch.items() if key in PLAIN_INPUTS}
        t = time.perf_counter()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if k >= spec["warmup"]:
            times.append(time.perf_counter() - t)
            tokens.append(n)
    return {"tokens": sum(tokens), "seconds": sum(times), "steps": len(times), "tokens_per_step": statistics.mean(tokens)}


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=torch.bfloat16 if cuda else torch.float32)
    processor = AutoProcessor.from_pretrained(spec["model"])
    train = load_dataset(str(spec["trl_data"]), split="train")
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(int(kw["attention_mask"].sum())), with_kwargs=True)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    cfg = SFTConfig(
        output_dir=str(Path(spec["work"]) / "trl"), max_steps=spec["steps"], per_device_train_batch_size=spec["batch_size"],
        learning_rate=1e-5, use_cpu=not cuda, bf16=cuda, report_to=[], save_strategy="no", logging_strategy="no",
        max_length=None, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=spec["gradient_checkpointing"],
    )  # fmt: skip
    SFTTrainer(model=model, args=cfg, train_dataset=train, processing_class=processor, callbacks=[Timer()]).train()
    w = spec["warmup"]
    return {"tokens": sum(seen[w:]), "seconds": sum(times[w:]), "steps": len(times) - w, "tokens_per_step": statistics.mean(seen[w:])}


def worker(name: str, spec_path: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = {"ovkit-padded": lambda: run_ovkit(spec, False), "ovkit-packed": lambda: run_ovkit(spec, True),
           "plain": lambda: run_plain(spec), "trl": lambda: run_trl(spec)}[name]
    result = run()
    result["peak_bytes"] = _peak_memory(base)
    report_result(result)


# ---- the report --------------------------------------------------------------------------------------------------


def model_flops_per_token(model_dir: Path, spec: dict) -> tuple[float, float, str]:
    """(LLM parameters, ViT parameters, device name) for MFU."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    vit = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    llm = sum(p.numel() for p in model.parameters()) - vit
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return llm, vit, name


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args.worker, args.spec)
    runs = [r for r in args.runs.split(",") if r]
    if "trl" in runs:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed (pip install -e '.[bench]'): skipping the trl run", file=sys.stderr)
            runs.remove("trl")
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        make_data(args, work / "data")
        model = make_model(args, work)
        ovkit_cli("pack", work / "data", "--model", model, "--max-len", args.tokens_per_row, "--out", work / "plan")
        if "trl" in runs:
            ovkit_cli("convert", work / "data", "--to", "trl", "--out", work / "trl")
        stats = json.loads((work / "plan" / "stats.json").read_text())
        mean_len = stats["tokens"] / stats["samples"]
        pack_batch = max(1, round(args.batch_size * mean_len / args.tokens_per_row))
        spec = {"work": str(work), "data": str(work / "data"), "model": str(model), "plan": str(work / "plan"),
                "trl_data": str(work / "trl"), "batch_size": args.batch_size, "pack_batch": pack_batch, "steps": args.steps,
                "warmup": args.warmup, "precision": args.precision, "plain_dtype": args.plain_dtype,
                "gradient_checkpointing": args.gradient_checkpointing}
        results = run_workers(__file__, runs, spec, work)
        llm, vit, device = model_flops_per_token(model, spec)
    report(args, results, stats, mean_len, pack_batch, llm, vit, device)


def report(args, results: dict, stats: dict, mean_len: float, pack_batch: int, llm: int, vit: int, device: str) -> None:
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    visual = (args.image_size // 28) ** 2  # visual tokens per image: 14-pixel patches, 2x2 merge (4 patches each)
    print(f"device: {device}; model: {(llm + vit) / 1e6:.1f}M parameters (ViT {vit / 1e6:.1f}M); {stats['samples']} samples, "
          f"mean {mean_len:.0f} tokens; padded batch {args.batch_size}; packed {pack_batch} x {args.tokens_per_row}; "
          f"{args.steps} steps, {args.warmup} not measured; ovkit --precision {args.precision}, plain {args.plain_dtype}")
    base = results.get("plain")
    print(f"{'run':<14}{'tok/step':>10}{'tokens/s':>11}{'vs plain':>10}{'MFU':>8}{'peak GB':>9}{'vs plain':>10}")
    for name, r in results.items():
        tps = r["tokens"] / max(r["seconds"], 1e-9)
        flops = 6 * (llm * tps + vit * 4 * tps * visual / mean_len)
        mfu = f"{100 * flops / (peak * 1e12):.1f}%" if peak else "-"
        ratio = f"{tps / (base['tokens'] / base['seconds']):.2f}x" if base else "-"
        mem = f"{r['peak_bytes'] / base['peak_bytes']:.2f}x" if base and base["peak_bytes"] > 0 else "-"
        print(f"{name:<14}{r['tokens_per_step']:>10.0f}{tps:>11.0f}{ratio:>10}{mfu:>8}{r['peak_bytes'] / 1e9:>9.2f}{mem:>10}")
    if "ovkit-packed" in results and "ovkit-padded" in results:
        a, b = results["ovkit-packed"], results["ovkit-padded"]
        print(f"packed / padded tokens/s: {(a['tokens'] / a['seconds']) / (b['tokens'] / b['seconds']):.2f}x")


if __name__ == "__main__":
    main()
