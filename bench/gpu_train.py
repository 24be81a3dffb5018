"""Benchmark: ovkit's training runtime (padded and packed) against a plain PyTorch loop and TRL's SFTTrainer, on the
same model and the same samples, at the same precision policy and with activation checkpointing on for every run:
tokens/s, MFU, peak memory and bytes per parameter (weights + gradients + optimiser state), as ratios to the plain loop.

Runs, each in a fresh process (so peak memory is its own), full fine-tuning of one model:

  ovkit padded   ovkit.train on length-bucketed padded micro-batches of --batch-size samples x --grad-accum
  ovkit packed   ovkit.train on packed rows of --tokens-per-row (`ovkit pack --max-len`), one row per micro-batch,
                 as many rows per optimiser step as give about the padded runs' tokens per step
  plain          a plain PyTorch loop on exactly ovkit's padded micro-batches: model(**batch).loss, fused AdamW,
                 model.gradient_checkpointing_enable()
  trl            TRL's SFTTrainer on the same samples in TRL's VLM format, the same micro-batch and accumulation,
                 gradient_checkpointing=True in its config

--policy says how every run holds its weights (the same policy for all, so bytes per parameter differ only by what
each optimiser keeps; the table prints them beside peak memory):

  mixed   (CUDA default) fp32 weights or masters, bf16 compute: ovkit --precision bf16-mixed (bf16 weights + fp32
          masters, 18 B/param with adamw_torch_fused); the plain loop fp32 weights under torch.autocast(bf16) (16 B);
          TRL given the model path, fp32 weights with bf16=True (its default, autocast; 16 B)
  bf16    pure bf16 weights: ovkit --precision bf16-true (8 B/param with adamw_torch_fused, 10 with --optim
          adamw_bf16); the plain loop and TRL on bf16 weights (8 B: torch's AdamW keeps bf16 moments)
  fp32    (CPU default) everything in fp32 (16 B)

--optim and --activation-checkpointing pass through to the ovkit runs (`full` by default). The peers have only HF's
whole-block checkpointing: they run it unless --activation-checkpointing off turns it off for every run.
--optimizer-in-backward runs ovkit's optimiser steps inside backward (with --max-grad-norm 0, which it needs; it also
needs one micro-batch per step: --grad-accum 1 for ovkit padded, and a --tokens-per-row that holds a step's tokens for
ovkit packed); the peers keep their whole-model step and clipping.

Defaults on CUDA, chosen from the measured arithmetic in BENCHMARKS.md ("Memory per parameter", "Activation memory
per token") so that every run completes on one 80 GB card (74.5 GiB) with the random-init 2.2B `qwen2.5-vl-2b`
(2,210M parameters; 28 decoder layers of hidden 1,536, 32 ViT blocks of 1,280, vocabulary 151,936):

  - weights + gradients + AdamW: 18 B/param under ovkit's bf16-mixed = 37.0 GiB (the peers: 16 B = 32.9 GiB), which
    leaves ~37 GiB for activations and the loss head;
  - ovkit packed, one row of 16,384 tokens (16k per step) with `full` checkpointing: 3,072 B/token/layer x 28
    layers x 16,384 = 1.3 GiB, the ViT's 32 blocks x 2,560 B x 4 patches per visual token (~4k visual tokens) =
    1.3 GiB, the chunked head 3 kB/token = 0.05 GiB, plus one block recomputed in backward (1.6 GiB decoder layer,
    ~0.5 GiB ViT block): ~5 GiB, about 42 GiB in all;
  - the plain loop and TRL compute the loss the Hugging Face way: [tokens x 151,936] logits in bf16, their fp32
    upcast, log-softmax and its gradient, ~2.4 MB per token (9 GiB at 4,000 tokens), plus under autocast the bf16
    copies of the weights kept for backward (4.1 GiB). The plain loop measured 79.2 GB (pure bf16, 8 B/param,
    checkpointing on) at 8 samples of ~1,000 tokens on an H100 (2026-11-26), ~40 GB above this same arithmetic
    (17.7 + 19.4 + ~2 GB): so the padded micro-batch is 4 samples (~4,000 tokens: 33 + 9 + 4 + ~1 GiB, plus that
    unexplained margin halved, ~19 GiB: ~66 GiB of 74.5), accumulated 4 times;
  - every run so trains ~16,000 tokens per optimiser step: padded 4 x 4 samples of ~1,000 tokens, packed 1 row of
    16,384 (at the 96-99% fill `ovkit pack` reaches), the ">= 16k tokens per step" a 2B run at the recipe's size needs.

Defaults on CPU stay quick: the tiny model, 224-pixel images (64 visual tokens), fp32, 8 samples x 1, 1,024-token rows.

Samples: a LLaVA-like length mix: one image per sample (--image-size, 448: 256 visual tokens with Qwen's 14-pixel
patches and 2x2 merge) and a caption of lognormal length (median --text-tokens words), seeded. tokens/s counts
non-padding tokens (text + image tokens) over the steps after --warmup; MFU = 6 x (LLM parameters x sequence tokens
+ ViT parameters x patches) / time / the device's dense bf16 peak (CUDA only); peak memory is
torch.cuda.max_memory_allocated on CUDA and the process's peak RSS growth on CPU; B/param is measured after the first
optimiser step (ovkit: ovkit.json `runtime.bytes_per_param`; the peers: ovkit.runtime.optim.bytes_per_param over their
model and optimiser, the same count).

    python bench/gpu_train.py                                  # CPU: the tiny model (a few minutes)
    python bench/gpu_train.py --preset qwen2.5-vl-2b           # GPU: random-init 2.2B (ovkit init-model --random-init)
    python bench/gpu_train.py --model DIR --policy bf16 --optim adamw_bf16 --runs ovkit-packed,plain
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
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _result  # noqa: E402
from _workers import find_key as _find  # noqa: E402
from _workers import report_result, run_workers

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RUNS = ("ovkit-padded", "ovkit-packed", "plain", "trl")
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16
# --policy -> (ovkit --precision, the peers' weight dtype, the peers' autocast)
POLICIES = {
    "mixed": ("bf16-mixed", "float32", True),
    "bf16": ("bf16-true", "bfloat16", False),
    "fp32": ("fp32", "float32", False),
}


def parse_args(argv=None) -> argparse.Namespace:
    import torch

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model directory (default: built from --preset)")
    p.add_argument(
        "--preset",
        default="qwen2.5-vl-2b" if cuda else "tiny",
        help="tiny, or a random-init preset (qwen2.5-vl-2b, -3b, -7b)",
    )
    p.add_argument("--rows", type=int, default=512 if cuda else 192, help="samples")
    p.add_argument(
        "--image-size", type=int, default=448 if cuda else 224, help="image side in pixels (448: 256 visual tokens)"
    )
    p.add_argument("--text-tokens", type=int, default=120, help="median caption length in words")
    p.add_argument(
        "--batch-size",
        type=int,
        default=4 if cuda else 8,
        help="samples per padded micro-batch (ovkit padded, plain, TRL)",
    )
    p.add_argument("--grad-accum", type=int, default=4 if cuda else 1, help="padded micro-batches per optimiser step")
    p.add_argument(
        "--tokens-per-row",
        type=int,
        default=16384 if cuda else 1024,
        help="packed row capacity (one row per micro-batch)",
    )
    p.add_argument("--steps", type=int, default=12 if cuda else 8, help="optimiser steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps not measured")
    p.add_argument(
        "--policy",
        choices=tuple(POLICIES),
        default="mixed" if cuda else "fp32",
        help="precision policy of every run (docstring)",
    )
    p.add_argument(
        "--optim",
        default="adamw_torch_fused",
        help="ovkit --optim (adamw_torch_fused, adamw_torch, adamw_8bit, adamw_bf16)",
    )
    p.add_argument(
        "--activation-checkpointing",
        default="full",
        help="ovkit --activation-checkpointing; `off` turns the peers' off too",
    )
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="ovkit --optimizer-in-backward (and --max-grad-norm 0); needs one micro-batch per step",
    )
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--out", type=Path, help="keep the work directory here")
    p.add_argument("--json", type=Path, help="also write the results here (the GPU suite's summary reads it)")
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
            x, y, r = (
                rng.randrange(args.image_size),
                rng.randrange(args.image_size),
                rng.randint(8, args.image_size // 6),
            )
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.randrange(256) for _ in range(3)))
        n = max(4, int(rng.lognormvariate(0, 0.6) * args.text_tokens))
        caption = " ".join(rng.choice(words) for _ in range(n))
        rows.append(
            {
                "id": f"r{i}",
                "images": [image_cell(img)],
                "source": "bench/caption",
                "category": "caption",
                "messages": [
                    {"role": "user", "content": "<image>\nDescribe the image."},
                    {"role": "assistant", "content": caption},
                ],
            }
        )
    write_samples(samples_table(rows), out)


def ovkit_cli(*args) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)


def make_model(args, work: Path) -> Path:
    if args.model is not None:
        return args.model
    if (work / "model" / "config.json").is_file():  # --out kept from an earlier run
        return work / "model"
    if args.preset == "tiny":
        ovkit_cli("init-model", "--preset", "tiny", "--corpus", work / "data", "--out", work / "model")
    else:
        ovkit_cli(
            "init-model", "--preset", args.preset, "--random-init", "--dtype", "bfloat16", "--out", work / "model"
        )
    return work / "model"


# ---- the runs (each in its own process) ---------------------------------------------------------------------------


def _peak_memory(base_rss: int) -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024


def _padded_steps(spec: dict, processor) -> list[list[dict]]:
    """ovkit's padded micro-batches of the first `steps` optimiser steps (the same for ovkit padded and the plain
    loop)."""
    from ovkit.train.data import SampleSource, Schedule

    source = SampleSource(Path(spec["data"]), processor, max_len=1 << 20)
    schedule = Schedule(tuple(source.lengths), spec["batch_size"], spec["grad_accum"], 1, 0)
    pad = processor.tokenizer.pad_token_id
    return [
        [source.collate([source[i] for i in m], pad) for m in micro]
        for _, _, micro in schedule.steps(0, spec["steps"], 0)
    ]


def run_ovkit(spec: dict, packed: bool) -> dict:
    from ovkit.train import SFTConfig, train

    if packed:  # one row per micro-batch, as many rows per step as give the padded runs' tokens per step
        opts = dict(plan=Path(spec["plan"]), batch_size=1, grad_accum=spec["pack_rows"])
    else:
        opts = dict(batch_size=spec["batch_size"], grad_accum=spec["grad_accum"])
    out = Path(spec["work"]) / ("ovkit-packed" if packed else "ovkit-padded")
    train(
        SFTConfig(
            data=Path(spec["data"]),
            model=Path(spec["model"]),
            out=out,
            max_steps=spec["steps"],
            lr=1e-5,
            warmup_ratio=0.0,
            precision=spec["precision"],
            optim=spec["optim"],
            activation_checkpointing=spec["activation_checkpointing"],
            optimizer_in_backward=spec["optimizer_in_backward"],
            max_grad_norm=0.0 if spec["optimizer_in_backward"] else 1.0,
            quiet=True,
            overwrite=True,
            max_len=1 << 20,
            **opts,
        )
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][spec["warmup"] :]
    record = json.loads((out / "ovkit.json").read_text())
    bpp = _find(record, "bytes_per_param") or {}
    ckpt = _find(record, "activation_checkpointing") or {}
    return {
        "tokens": sum(r["ovkit/tok_per_s"] * r["ovkit/step_s"] for r in rows),
        "seconds": sum(r["ovkit/step_s"] for r in rows),
        "steps": len(rows),
        "tokens_per_step": statistics.mean(r["ovkit/tok_per_s"] * r["ovkit/step_s"] for r in rows),
        "bytes_per_param": bpp.get("total"),
        "checkpointing": ckpt.get("mode") if isinstance(ckpt, dict) else ckpt,
    }


# What a plain loop passes to model(**batch): the padded batch as a processor makes it, the loss from labels.
PLAIN_INPUTS = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def run_plain(spec: dict) -> dict:
    import torch

    from ovkit.models import load
    from ovkit.runtime.optim import bytes_per_param

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, processor = load(Path(spec["model"]), dtype=getattr(torch, spec["peer_dtype"]))
    model.to(device).train()
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if spec["peer_autocast"] else nullcontext
    steps = _padded_steps(spec, processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, eps=1e-5, fused=True)
    times, tokens, bpp = [], [], None
    for k, micro in enumerate(steps):
        n = sum(int(b.pop("num_tokens")) for b in micro)
        t = time.perf_counter()
        for batch in micro:
            batch = {key: v.to(device, non_blocking=True) for key, v in batch.items() if key in PLAIN_INPUTS}
            with autocast():
                loss = model(**batch, use_cache=False).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if bpp is None:
            bpp = bytes_per_param(model.parameters(), optimizer)["total"]
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if k >= spec["warmup"]:
            times.append(time.perf_counter() - t)
            tokens.append(n)
    return {
        "tokens": sum(tokens),
        "seconds": sum(times),
        "steps": len(times),
        "tokens_per_step": statistics.mean(tokens),
        "bytes_per_param": bpp,
        "checkpointing": "full (HF)" if spec["checkpointing"] else "off",
    }


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ovkit.runtime.optim import bytes_per_param

    cuda = torch.cuda.is_available()
    model = AutoModelForImageTextToText.from_pretrained(spec["model"], dtype=getattr(torch, spec["peer_dtype"]))
    processor = AutoProcessor.from_pretrained(spec["model"])
    train = load_dataset(str(spec["trl_data"]), split="train")
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(int(kw["attention_mask"].sum())), with_kwargs=True)
    times: list[float] = []
    bpp: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if not bpp:  # after the step, before zero_grad: the same count as ovkit's
                bpp.append(bytes_per_param(model.parameters(), optimizer)["total"])

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    # bf16=True is TRL's autocast: over fp32 weights (--policy mixed, its default given a path) or bf16 ones (--policy
    # bf16)
    cfg = SFTConfig(
        output_dir=str(Path(spec["work"]) / "trl"),
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"],
        learning_rate=1e-5,
        use_cpu=not cuda,
        bf16=spec["precision"] != "fp32",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        max_length=None,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=spec["checkpointing"],
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    SFTTrainer(model=model, args=cfg, train_dataset=train, processing_class=processor, callbacks=[Timer()]).train()
    w, a = spec["warmup"], spec["grad_accum"]
    per_step = [sum(seen[i : i + a]) for i in range(0, len(seen), a)]
    return {
        "tokens": sum(per_step[w:]),
        "seconds": sum(times[w:]),
        "steps": len(times) - w,
        "tokens_per_step": statistics.mean(per_step[w:]),
        "bytes_per_param": bpp[0] if bpp else None,
        "checkpointing": "full (HF)" if spec["checkpointing"] else "off",
    }


def worker(name: str, spec_path: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run = {
        "ovkit-padded": lambda: run_ovkit(spec, False),
        "ovkit-packed": lambda: run_ovkit(spec, True),
        "plain": lambda: run_plain(spec),
        "trl": lambda: run_trl(spec),
    }[name]
    result = run()
    result["peak_bytes"] = _peak_memory(base)
    report_result(result)


# ---- the report --------------------------------------------------------------------------------------------------


def model_flops_per_token(model_dir: Path) -> tuple[float, float, str]:
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
    precision, peer_dtype, peer_autocast = POLICIES[args.policy]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        make_data(args, work / "data")
        model = make_model(args, work)
        ovkit_cli(
            "pack",
            work / "data",
            "--model",
            model,
            "--max-len",
            args.tokens_per_row,
            "--out",
            work / "plan",
            "--overwrite",
        )
        if "trl" in runs:
            ovkit_cli("convert", work / "data", "--to", "trl", "--out", work / "trl", "--overwrite")
        stats = json.loads((work / "plan" / "stats.json").read_text())
        mean_len = stats["tokens"] / stats["samples"]
        pack_rows = max(1, round(args.batch_size * args.grad_accum * mean_len / args.tokens_per_row))
        spec = {
            "work": str(work),
            "data": str(work / "data"),
            "model": str(model),
            "plan": str(work / "plan"),
            "trl_data": str(work / "trl"),
            "batch_size": args.batch_size,
            "grad_accum": args.grad_accum,
            "pack_rows": pack_rows,
            "steps": args.steps,
            "warmup": args.warmup,
            "precision": precision,
            "optim": args.optim,
            "activation_checkpointing": args.activation_checkpointing,
            "optimizer_in_backward": args.optimizer_in_backward,
            "checkpointing": args.activation_checkpointing != "off",
            "peer_dtype": peer_dtype,
            "peer_autocast": peer_autocast,
        }
        results = run_workers(__file__, runs, spec, work)
        llm, vit, device = model_flops_per_token(model)
    report(args, results, stats, mean_len, pack_rows, llm, vit, device, spec)


def report(
    args, results: dict, stats: dict, mean_len: float, pack_rows: int, llm: int, vit: int, device: str, spec: dict
) -> None:
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    visual = (args.image_size // 28) ** 2  # visual tokens per image: 14-pixel patches, 2x2 merge (4 patches each)
    print(
        f"device: {device}; model: {(llm + vit) / 1e6:.1f}M parameters (ViT {vit / 1e6:.1f}M); {stats['samples']} "
        f"samples, "
        f"mean {mean_len:.0f} tokens; padded {args.batch_size} x {args.grad_accum} samples per step; packed "
        f"{pack_rows} x "
        f"{args.tokens_per_row}; {args.steps} steps, {args.warmup} not measured; policy {args.policy} (ovkit "
        f"--precision "
        f"{spec['precision']} --optim {args.optim} --activation-checkpointing {args.activation_checkpointing}"
        f"{' --optimizer-in-backward --max-grad-norm 0' if args.optimizer_in_backward else ''}; peers "
        f"{spec['peer_dtype']} weights{' under bf16 autocast' if spec['peer_autocast'] else ''})"
    )
    base = results.get("plain")
    rows, table = [], []
    for name, r in results.items():
        tps = r["tokens"] / max(r["seconds"], 1e-9)
        flops = 6 * (llm * tps + vit * 4 * tps * visual / mean_len)
        mfu = 100 * flops / (peak * 1e12) if peak else None
        table.append(
            {
                "run": name,
                "tok/step": r["tokens_per_step"],
                "tokens/s": tps,
                "vs plain": tps / (base["tokens"] / base["seconds"]) if base else None,
                "MFU %": mfu,
                "peak GB": r["peak_bytes"] / 1e9,
                "vs plain peak": r["peak_bytes"] / base["peak_bytes"] if base and base["peak_bytes"] > 0 else None,
                "B/param": r.get("bytes_per_param"),
                "checkpointing": r.get("checkpointing"),
            }
        )
        rows.append({"run": name, "tokens_per_s": tps, "mfu": mfu, **r})
    for name in RUNS:
        if name not in results and name in args.runs.split(","):
            table.append({"run": name, "checkpointing": "failed (see stderr: out of memory?)"})
    _result.table(
        "gpu_train",
        f"training runtime on {device}, policy {args.policy}: ovkit against a plain loop and TRL's SFTTrainer",
        table,
        columns=["run", "tok/step", "tokens/s", "vs plain", "MFU %", "peak GB", "vs plain peak", "B/param"]
        + ["checkpointing"],
        formats={"tok/step": ".0f", "tokens/s": ".0f", "vs plain": ".2f", "MFU %": ".1f", "peak GB": ".2f"}
        | {"vs plain peak": ".2f", "B/param": ".2f"},
    )
    if "ovkit-packed" in results and "ovkit-padded" in results:
        a, b = results["ovkit-packed"], results["ovkit-padded"]
        print(f"packed / padded tokens/s: {(a['tokens'] / a['seconds']) / (b['tokens'] / b['seconds']):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "policy": args.policy, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
