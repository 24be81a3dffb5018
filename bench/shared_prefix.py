"""rl-train's learner with each group's prompt forwarded once (`--shared-prefix on`, ovkit.rollouts.shared) against one
row per trajectory (`off`), in one process on the same weights and the same groups.

The tiny model (ovkit's embedded default architecture, random weights: the cost does not depend on them) as rl-train
loads its learner (fp32, ovkit's varlen attention), 2 prompts per step, each with one image of --sizes pixels (84x84:
9 visual tokens; 448x448: 256) and the ~20-token counting question, G completions of 16 tokens (the issue's shape:
"256 + ~40 prompt tokens, 16-token answers"), half of each group rewarded. One micro-batch per group (micro-batch
size G), one optimiser step per step. Per G and image size:

- learner s/step: `ovkit.rl.update.learn` (the gradient pass with its fused proximal log-probs, the loss, backward,
  clipping, AdamW), median of --steps steps after one warm-up, the two learners alternating step by step;
- host s/step: `prepare_step` (trajectories, advantages, micro-batch plans with rope positions and vision layout);
- tokens: the language model's input tokens per step, and ViT passes (images through the tower);
- saved MiB: the activations autograd keeps for the backward of one micro-batch (saved_tensors_hooks, by storage,
  weights left out; ovkit.runtime.checkpointing.saved_bytes): the CPU proxy of a GPU's peak activation memory;
- |d loss|, |d w|: the step's loss and the largest weight difference after the first step, shared against plain.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/shared_prefix.py [--groups 4 8 16] [--sizes 84 448] [--steps 3]

On a GPU (the GPU suite, bench/gpu_suite.sh): `--model DIR` (the random-init qwen2.5-vl-2b the suite builds) on CUDA in
bf16; both learners then use the one model under SGD at lr 0 (two copies with AdamW states would not leave room for
the plain learner's activations), `|d w|` is not measured, and `peak GB` is torch.cuda's peak allocation during
`learn` (weights included) in place of the saved-activation proxy.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _result  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS = 2
ANSWER = 16


def _model(work: Path, path: Path | None, device: str):
    import torch

    from ovkit.models import attention as attn
    from ovkit.models import load
    from ovkit.models.tiny import build_tiny

    if path is None:
        texts = ["How many squares are there?", "<answer>3</answer>", "<think>count the squares</think>"] * 20
        path = build_tiny(work / "model", texts, seed=0)
    model, processor = load(path)
    # rl-train's learner attention on this device with --shared-prefix on (both learners use it: one model)
    attn.apply(model, attn.for_shared_prefix(attn.resolve("auto", device, train=True)))
    if device == "cuda":
        model = model.to(device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    return model.eval(), processor


def _groups(processor, size: int, group: int, seed: int):
    """PROMPTS groups of `group` completions of ANSWER ordinary tokens, one image of size x size per prompt."""
    import random

    from PIL import Image, ImageDraw

    from ovkit.data import image_cell, samples_table
    from ovkit.generate import Completion
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.prompts import encode_prompts

    rows = []
    for i in range(PROMPTS):
        img = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(img).rectangle([size // 8, size // 8, size // 2, size // 2 + i], fill=(200, 30, 30))
        rows.append(
            {
                "id": f"p{i}",
                "images": [image_cell(img)],
                "messages": [{"role": "user", "content": "<image>\nHow many squares are there? Count them."}],
                "source": "bench/count",
                "category": "counting",
                "answer": "1",
                "answer_type": "number",
            }
        )
    prompts = encode_prompts(samples_table(rows), processor, mode="answer", system=False)
    words = processor.tokenizer("the squares are red and blue count one two three four", add_special_tokens=False)
    vocab = sorted(set(words["input_ids"]))
    rng = random.Random(seed)
    groups = []
    for k, p in enumerate(prompts):
        completions = [
            Completion([rng.choice(vocab) for _ in range(ANSWER)], "", [-1.0] * ANSWER) for _ in range(group)
        ]
        rewards = [float(j % 2) for j in range(group)]
        groups.append(Group(p, k, 0, completions, task_rewards=rewards, rewards=rewards))
    return groups


def _learner(model, share: bool, group: int, tmp: Path):
    import torch

    from ovkit.rl.config import RLTrainConfig
    from ovkit.runtime.optim import adamw

    cfg = RLTrainConfig(
        data=[tmp],
        model=tmp,
        out=tmp / "unused",
        prompts_per_step=PROMPTS,
        group_size=group,
        micro_batch_size=group,
        max_new_tokens=ANSWER,
        max_staleness=0,
        shared_prefix="on" if share else "off",
    )
    params = [p for p in model.parameters() if p.requires_grad]
    if next(model.parameters()).is_cuda:  # one model for both learners: weights that do not move (module docstring)
        return cfg, params, torch.optim.SGD(params, lr=0.0)
    return cfg, params, adamw(params, lr=1e-4, weight_decay=0.0)


def _saved_mib(model, sb) -> float:
    """Activation bytes kept for the backward of the step's first micro-batch."""
    from ovkit.rollouts.trajectories import sequence_logprobs
    from ovkit.runtime.checkpointing import saved_bytes

    plan = sb.minibatches[0][0]
    n, _ = saved_bytes(lambda: sequence_logprobs(model, sb.traj, plan.rows, 1.0, plan=plan), exclude=model)
    return n / (1 << 20)


def measure(base, processor, size: int, group: int, steps: int, tmp: Path) -> dict:
    import torch

    from ovkit.pack.packed import PackLayout
    from ovkit.rl.update import learn, prepare_step

    layout = PackLayout.for_model(base)
    pad = processor.tokenizer.pad_token_id
    cuda = next(base.parameters()).is_cuda
    runs = {}
    for share in (False, True):
        model = base if cuda else copy.deepcopy(base)
        cfg, params, optimizer = _learner(model, share, group, tmp)
        runs[share] = dict(model=model, cfg=cfg, params=params, opt=optimizer, learn=[], host=[], loss=[])
    for step in range(steps + 1):  # the first is a warm-up
        groups = _groups(processor, size, group, seed=step)
        for share in (False, True):
            r = runs[share]
            t0 = time.perf_counter()
            sb = prepare_step(groups, step, pad, r["model"].config, r["cfg"].update_options(), layout)
            t1 = time.perf_counter()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            metrics = learn(
                r["model"], r["opt"], r["params"], sb, r["cfg"].correction_config(), None, r["cfg"].update_options()
            )
            if cuda:
                torch.cuda.synchronize()
                r["peak"] = max(r.get("peak", 0), torch.cuda.max_memory_allocated())
            t2 = time.perf_counter()
            if step:
                r["host"].append(t1 - t0)
                r["learn"].append(t2 - t1)
            r["loss"].append(metrics["pg_loss"])
            if step == 0:
                r["sb"] = sb
                r["w"] = {n: p.detach().clone() for n, p in r["model"].named_parameters()}
    plain, shared = runs[False], runs[True]
    tokens = {s: sum(p.inputs["input_ids"].numel() for mb in runs[s]["sb"].minibatches for p in mb) for s in runs}
    images = {s: sum(p.inputs["image_grid_thw"].shape[0] for mb in runs[s]["sb"].minibatches for p in mb) for s in runs}
    if cuda:
        memory = {s: runs[s]["peak"] / 1e9 for s in runs}
        dw = float("nan")
    else:
        memory = {s: _saved_mib(runs[s]["model"], runs[s]["sb"]) for s in runs}
        dw = max((shared["w"][n] - w).abs().max().item() for n, w in plain["w"].items())
    unit = "peak GB" if cuda else "saved MiB"
    lp, ls = statistics.median(plain["learn"]), statistics.median(shared["learn"])
    return {
        "image": f"{size}x{size}",
        "G": group,
        "tokens plain": tokens[False],
        "tokens shared": tokens[True],
        "ViT passes plain": images[False],
        "ViT passes shared": images[True],
        "learner s plain": lp,
        "learner s shared": ls,
        "speed-up": lp / ls,
        "host s plain": statistics.median(plain["host"]),
        "host s shared": statistics.median(shared["host"]),
        f"{unit} plain": memory[False],
        f"{unit} shared": memory[True],
        "memory ratio": memory[False] / memory[True],
        "|d loss|": max(abs(a - b) for a, b in zip(plain["loss"], shared["loss"])),
        "|d w| step 1": dw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--sizes", type=int, nargs="+", default=[84, 448])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", type=Path, help="a model directory (default: the tiny model, built here)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base, processor = _model(Path(tmp), args.model, device)
        for size in args.sizes:
            for group in args.groups:
                row = measure(base, processor, size, group, args.steps, Path(tmp))
                plain, shared = row["learner s plain"], row["learner s shared"]
                print(f"{row['image']} G={group}: learner {plain:.3f}s -> {shared:.3f}s", file=sys.stderr, flush=True)
                rows.append(row)
    _result.table(
        "shared_prefix",
        f"learner step, --shared-prefix on against off (one process, same weights and groups; {device})",
        rows,
        formats={
            "learner s plain": ".3f",
            "learner s shared": ".3f",
            "speed-up": ".2f",
            "host s plain": ".3f",
            "host s shared": ".3f",
            "saved MiB plain": ".1f",
            "saved MiB shared": ".1f",
            "peak GB plain": ".2f",
            "peak GB shared": ".2f",
            "memory ratio": ".2f",
            "|d loss|": ".1e",
            "|d w| step 1": ".1e",
        },
    )


if __name__ == "__main__":
    main()
