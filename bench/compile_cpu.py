"""--compile on the tiny default, on CPU: sft steps/s eager vs compiled after warmup, compile time, graph breaks.

Trains the tiny preset (ovkit.models.tiny.TinySpec: 4 decoder layers, a 4-block ViT, ~2.6M parameters) with `ovkit
sft`'s library entry point twice on the same 64 synthetic rows (84x84 pictures of coloured squares, a count or
colour question each), fp32, batch 8, one intra-op thread: once eager, once with --compile (inductor). Per run:
the median step time over the steps after --warmup (from metrics.jsonl's step_s), the first step's time (which
holds the compilation of the compiled run), and what ovkit.json records under runtime.compile.

    OMP_NUM_THREADS=1 python bench/compile_cpu.py [--steps 40] [--warmup 8]

CPU numbers only: torchtitan's +16% (and Liger-Kernel's speed-ups) are GPU measurements and are not reproduced here.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import _result
import torch


def rows(n: int) -> list[dict]:
    from PIL import Image, ImageDraw

    from ovkit.data.schema import image_cell

    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    rng, out = random.Random(0), []
    for i in range(n):
        colour, count = rng.choice(sorted(colours)), rng.randint(1, 4)
        img = Image.new("RGB", (84, 84), "white")
        draw = ImageDraw.Draw(img)
        for k in range(count):
            draw.rectangle([4 + 20 * k, 30, 22 + 20 * k, 50], fill=colours[colour])
        q, a = ("What colour are the squares?", colour) if i % 2 else ("How many squares?", str(count))
        out.append(
            {
                "id": f"r{i}",
                "images": [image_cell(img)],
                "source": "bench/squares",
                "messages": [
                    {"role": "user", "content": "<image>\n" + q},
                    {"role": "assistant", "content": f"<answer>{a}</answer>" + " ok" * (i % 4)},
                ],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from ovkit.data.parts import write_samples
    from ovkit.data.schema import samples_table
    from ovkit.models.tiny import build_tiny
    from ovkit.train import SFTConfig, train

    root = Path(tempfile.mkdtemp(prefix="ovkit-compile-bench-"))
    data = rows(64)
    write_samples(samples_table(data), root / "data", None)
    build_tiny(root / "model", [m["content"] for r in data for m in r["messages"]] * 4)
    table = []
    for name, compile_ in (("eager", False), ("compiled", True)):
        out = root / name
        train(
            SFTConfig(
                data=[root / "data"],
                model=root / "model",
                out=out,
                batch_size=8,
                max_steps=args.steps,
                precision="fp32",
                lr=1e-3,
                activation_checkpointing="off",
                compile=compile_,
                quiet=True,
            )
        )
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        warm = statistics.median(s["ovkit/step_s"] for s in steps[args.warmup :])
        info = json.loads((out / "ovkit.json").read_text())["runtime"]["compile"]
        print(
            f"{name:9s} first step {steps[0]['ovkit/step_s']:6.2f} s | median step after {args.warmup} "
            f"{warm * 1000:6.1f} ms "
            f"({1 / warm:5.2f} steps/s) | final loss {steps[-1]['loss']:.4f} | compile "
            f"{json.dumps(info)}",
            flush=True,
        )
        table.append(
            {
                "run": name,
                "first step s": steps[0]["ovkit/step_s"],
                "median step ms": warm * 1000,
                "steps/s": 1 / warm,
                "final loss": steps[-1]["loss"],
                "graph breaks": info.get("graph_breaks") if isinstance(info, dict) else None,
            }
        )
    _result.table(
        "compile_cpu",
        f"--compile on the tiny default, CPU, one thread: {args.steps} sft steps, median after {args.warmup}",
        table,
        formats={"first step s": ".2f", "median step ms": ".1f", "steps/s": ".2f", "final loss": ".4f"},
    )


if __name__ == "__main__":
    main()
