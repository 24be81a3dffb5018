"""The CPU proxies of the training runtime's GPU costs, measured on this checkout (or any other, via PYTHONPATH):

1. attention forward calls in one optimiser step of `ovkit sft --batch-size 16` on the instruct split of the tiny
   default (4 LLM layers, a 4-block ViT): transformers' per-image vision attention made 68;
2. peak resident memory of `ovkit align` on packed rows of 4,096 tokens with the tiny model's vocabulary padded to
   Qwen2.5's 151,936 (2 steps, one row per step): the [tokens x vocab] fp32 logits and their gradient made 8.95 GB;
3. peak resident memory of one `ovkit rl-train` step of that model (4 prompts x 8 completions, 64 new tokens, the
   default micro-batch and staleness): 7.0 GB.

    python bench/runtime_proxies.py                       # this checkout
    PYTHONPATH=/path/to/other/src python bench/runtime_proxies.py --work /tmp/proxies   # another one, same inputs

Each measurement runs the command in a child process of its own (its peak RSS from getrusage).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _result

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
VOCAB = 151936


def ovkit(*args, env=ENV) -> None:
    subprocess.run([sys.executable, "-m", "ovkit", *map(str, args), "--quiet"], check=True, env=env)


def prepare(work: Path) -> None:
    """The synthetic corpus (scale 0.25), the tiny model, and a copy of it with the vocabulary padded to 151,936."""
    if not (work / "data" / "ovkit.json").is_file():
        ovkit("synth", "--out", work / "data", "--scale", "0.25", "--seed", "0")
    if not (work / "tiny" / "ovkit.json").is_file():
        ovkit("init-model", "--preset", "tiny", "--corpus", work / "data", "--out", work / "tiny")
    if not (work / "tiny-151936" / "config.json").is_file():
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(work / "tiny")
        model.resize_token_embeddings(VOCAB)
        model.save_pretrained(work / "tiny-151936")
        AutoProcessor.from_pretrained(work / "tiny").save_pretrained(work / "tiny-151936")
    if not (work / "plan-4096" / "ovkit.json").is_file():
        ovkit(
            "pack",
            work / "data" / "pretrain",
            "--model",
            work / "tiny",
            "--max-len",
            "4096",
            "--out",
            work / "plan-4096",
        )


COUNT = r"""
import sys, torch
from torch.profiler import ProfilerActivity, profile
from ovkit.cli import main
sys.argv = ["ovkit", *sys.argv[1:]]
with profile(activities=[ProfilerActivity.CPU]) as prof:
    try:
        main()
    except SystemExit:
        pass
counts = {e.key: e.count for e in prof.key_averages()}
print("COUNT", counts.get("aten::scaled_dot_product_attention", 0))
"""


def attention_calls(work: Path) -> int:
    out = work / "sft-count"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            COUNT,
            "sft",
            str(work / "data" / "instruct"),
            "--model",
            str(work / "tiny"),
            "--out",
            str(out),
            "--batch-size",
            "16",
            "--max-steps",
            "1",
            "--precision",
            "fp32",
            "--overwrite",
            "--quiet",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    return int([x for x in run.stdout.splitlines() if x.startswith("COUNT")][-1].split()[1])


PEAK = r"""
import resource, sys
from ovkit.cli import main
sys.argv = ["ovkit", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    if e.code:
        raise
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def align_peak_rss(work: Path) -> float:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK,
            "align",
            str(work / "data" / "pretrain"),
            "--plan",
            str(work / "plan-4096"),
            "--model",
            str(work / "tiny-151936"),
            "--out",
            str(work / "align-151936"),
            "--batch-size",
            "1",
            "--max-steps",
            "2",
            "--precision",
            "fp32",
            "--trainable",
            "projector",
            "--trainable",
            "llm",
            "--overwrite",
            "--quiet",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    return int([x for x in run.stdout.splitlines() if x.startswith("PEAK")][-1].split()[1]) / 1e9


def rl_peak_rss(work: Path, staleness: int) -> float:
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK,
            "rl-train",
            str(work / "data" / "rl"),
            "--model",
            str(work / "tiny-151936"),
            "--out",
            str(work / f"rl-151936-{staleness}"),
            "--prompts-per-step",
            "4",
            "--group-size",
            "8",
            "--max-new-tokens",
            "64",
            "--max-steps",
            "1",
            "--max-staleness",
            str(staleness),
            "--reward-workers",
            "1",
            "--overwrite",
            "--quiet",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    return int([x for x in run.stdout.splitlines() if x.startswith("PEAK")][-1].split()[1]) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, help="keep inputs here (reused by a later run on another checkout)")
    p.add_argument("--only", choices=["calls", "memory", "rl"], help="one measurement")
    args = p.parse_args()
    import torch

    import ovkit

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prepare(work)
        result = {"ovkit": str(Path(ovkit.__file__).parent), "torch": torch.__version__}
        if args.only in (None, "calls"):
            result["attention_calls_per_step"] = attention_calls(
                work
            )  # SDPA forward calls (fp32, sdpa: no eager attention)
        if args.only in (None, "memory"):
            result["align_4096_vocab151936_peak_rss_gb"] = round(align_peak_rss(work), 2)
        if args.only in (None, "rl"):
            for staleness in (0, 4):  # synchronous (the sampler is the learner) and the default asynchronous mode
                result[f"rl_step_vocab151936_staleness{staleness}_peak_rss_gb"] = round(rl_peak_rss(work, staleness), 2)
        _result.table(
            "runtime_proxies",
            f"CPU proxies of the training runtime's GPU costs (ovkit {result['ovkit']}, torch {result['torch']})",
            [{"measure": k, "value": v} for k, v in result.items() if k not in ("ovkit", "torch")],
        )


if __name__ == "__main__":
    main()
