"""Benchmark: the ovkit training engine's packed rows against its padded batches, and its step time against a plain
Hugging Face `Trainer` loop on the same batches, on the same data and model in one run.

Runs (same model, same samples, full fine-tuning, fp32, one process):

  padded, random      `ovkit sft` padded batches without length bucketing (each batch padded to its longest)
  padded, bucketed    `ovkit sft` default: batches of similar lengths
  packed              `ovkit sft --plan`: packed rows of `--max-len` tokens (`ovkit pack`), --pack-batch per step
  HF Trainer          transformers.Trainer on exactly the micro-batches of the "padded, bucketed" run

Every ovkit run trains two epochs and is measured on the second only: the padded runs encode every sample before
step 1 and the packed run encodes a pack when first used, so the second epoch is the one where both only train.
tokens/s counts non-padding tokens (text + image tokens) per second of step wall time. HF Trainer times each step
from `on_step_begin` to `on_step_end` over the same number of steps.

    python bench/train.py --data runs/tiny/data/pretrain --model runs/tiny/models/stage0
    python bench/train.py          # no data/model given: `ovkit synth --scale 0.1` and a fresh tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _result

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="sample table; default: the pretrain split of `ovkit synth --scale 0.1`")
    p.add_argument("--model", type=Path, help="model directory; default: a fresh tiny model built on --data")
    p.add_argument("--rows", type=int, default=512, help="samples used (the first N rows of --data)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per padded batch")
    p.add_argument("--max-len", type=int, default=512, help="pack capacity in tokens")
    p.add_argument(
        "--pack-batch", type=int, default=2, help="packs per micro-batch (about --batch-size samples' tokens)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", 0)) or None,
        help="torch threads (default: torch's)",
    )
    p.add_argument("--out", type=Path, help="keep outputs here (default: a temp dir)")
    return p.parse_args()


def ovkit(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True)


def prepare(args, work: Path) -> tuple[Path, Path]:
    """A dataset of the first --rows rows, and the model (given or freshly built)."""
    from ovkit.data.io import read_table
    from ovkit.data.parts import write_table

    data = args.data
    if data is None:
        ovkit("synth", "--out", work / "synth", "--scale", "0.1")
        data = work / "synth" / "pretrain"
    subset = work / "subset"
    table = read_table(data)
    write_table(table.slice(0, min(args.rows, table.num_rows)), subset / "part-00000-of-00001.parquet")
    model = args.model
    if model is None:
        ovkit("init-model", "--preset", "tiny", "--corpus", str(data), "--out", work / "model")
        model = work / "model"
    return subset, model


def run_ovkit(name: str, data: Path, model: Path, out: Path, **opts) -> dict:
    """Train two epochs; tokens/s and step time over the second."""
    from ovkit.train import SFTConfig, train

    train(
        SFTConfig(
            data=data, model=model, out=out, precision="fp32", quiet=True, epochs=2, lr=1e-4, warmup_ratio=0.0, **opts
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in rows if r["epoch"] >= 1]
    step_s = [r["ovkit/step_s"] for r in warm]
    tokens = sum(r["ovkit/tok_per_s"] * r["ovkit/step_s"] for r in warm)
    return {
        "name": name,
        "steps": len(warm),
        "tok_per_s": tokens / sum(step_s),
        "pad_frac": statistics.mean(r["ovkit/pad_frac"] for r in warm),
        "step_s": statistics.median(step_s),
        "final_loss": rows[-1]["loss"],
    }


def hf_trainer_step_times(data: Path, model_dir: Path, batch_size: int, steps: int, work: Path) -> list[float]:
    """transformers.Trainer on the micro-batches the ovkit engine builds for the same config (first `steps`)."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ovkit.models import load
    from ovkit.train.data import SampleSource, Schedule

    model, processor = load(model_dir, dtype=torch.float32)
    source = SampleSource(data, processor, max_len=8192)
    schedule = Schedule(tuple(source.lengths), batch_size, 1, 1, 0)
    pad = processor.tokenizer.pad_token_id
    batches = []
    for _, _, micro in schedule.steps(0, steps, 0):
        b = source.collate([source[i] for i in micro[0]], pad)
        batches.append({k: v for k, v in b.items() if k not in ("num_tokens", "num_targets", "target_index")})

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    args = TrainingArguments(
        output_dir=str(work / "hf"),
        per_device_train_batch_size=1,
        max_steps=len(batches),
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        adam_epsilon=1e-5,
        max_grad_norm=1.0,
        weight_decay=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        remove_unused_columns=False,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(
        model=model, args=args, train_dataset=Batches(), data_collator=lambda xs: xs[0], callbacks=[Timer()]
    ).train()
    return times


def main() -> None:
    args = parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from ovkit.train import data as train_data

    with tempfile.TemporaryDirectory() as tmp:
        work = args.out or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data, model = prepare(args, work)
        ovkit("pack", data, "--model", model, "--max-len", args.max_len, "--out", work / "plan")
        stats = json.loads((work / "plan" / "stats.json").read_text())

        results = []
        window = train_data.CHUNK_BATCHES
        train_data.CHUNK_BATCHES = 1  # a bucketing window of one batch = random batches padded to their longest
        results.append(run_ovkit("padded, random", data, model, work / "padded-random", batch_size=args.batch_size))
        train_data.CHUNK_BATCHES = window
        results.append(run_ovkit("padded, bucketed", data, model, work / "padded-bucketed", batch_size=args.batch_size))
        results.append(
            run_ovkit("packed", data, model, work / "packed", batch_size=args.pack_batch, plan=work / "plan")
        )
        bucketed = results[1]
        hf = hf_trainer_step_times(data, model, args.batch_size, bucketed["steps"], work)

    print(
        f"data: {stats['samples']} samples, {stats['tokens']} tokens (mean {stats['sample_length']['mean']:.0f}); "
        f"{stats['packs']} packs of {args.max_len} (efficiency {stats['efficiency']:.3f}); torch threads "
        f"{torch.get_num_threads()}"
    )
    hf_step = statistics.median(hf)
    rows = [
        {
            "run": r["name"],
            "steps": r["steps"],
            "tokens/s": r["tok_per_s"],
            "pad %": 100 * r["pad_frac"],
            "median step s": r["step_s"],
        }
        for r in results
    ]
    rows.append({"run": "HF Trainer (padded, bucketed batches)", "steps": len(hf), "median step s": hf_step})
    _result.table(
        "train",
        "ovkit sft: packed against padded, and its step against HF Trainer's",
        rows,
        formats={"tokens/s": ".0f", "pad %": ".0f", "median step s": ".3f"},
    )
    print(f"packed / padded random   tokens/s: {results[2]['tok_per_s'] / results[0]['tok_per_s']:.2f}x")
    print(f"packed / padded bucketed tokens/s: {results[2]['tok_per_s'] / results[1]['tok_per_s']:.2f}x")
    print(f"ovkit step / HF Trainer step:      {bucketed['step_s'] / hf_step:.2f}x (median; < 1 means ovkit is faster)")


if __name__ == "__main__":
    main()
