"""Plain helpers that several test modules share: the small tables, images and configs the tiny-model tests build on,
and readers of what a run writes. No tests here and no fixtures: the fixtures built from these live in conftest.py.

Test modules import these by name (`from helpers import make_rows`): pytest puts tests/ on sys.path, as it does for
scripted_policy.py and fake_vllm.py. A test module imports from here, never from another test module.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread: tiny matrices on a shared 2-core box run several times faster than with two.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def torchrun(n: int, *args, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node n ARGS` (gloo on CPU), captured as text; ARGS as `-m ovkit ...` or a
    script path and its arguments."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *map(str, args)],
        env=ENV if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _bench_module(name: str):
    """bench/NAME.py, imported once under its own name (the benchmarks import it the same way, with bench/ on their
    path), so a test and a benchmark measure with the same instrument."""
    if name not in sys.modules:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The host-sync counter and the optimiser-step boundary: measuring tools, not ovkit's (they patch torch.Tensor
# methods while counting), so they live beside the benchmarks that report the counts.
SyncCounter = _bench_module("_syncs").SyncCounter
OptimizerSteps = _bench_module("_syncs").OptimizerSteps


# ------------------------------------------------------------------------------- supervised training (ovkit.train)


def micro_spec(layers: int = 1):
    """The smallest architecture the tests build (32 wide, 2 heads, one KV head; `layers` text and vision layers),
    from which build_tiny makes the model of a corpus."""
    from ovkit.models.tiny import TinySpec

    return TinySpec(
        hidden_size=32,
        num_layers=layers,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        mrope_section=(2, 3, 3),
        vision_hidden_size=32,
        vision_depth=layers,
        vision_heads=2,
        vision_intermediate_size=64,
    )


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """torch's intra-op threads set to `n` inside the block. Sums over a tensor run in an order that depends on the
    thread count, so a result compared bit for bit, or a training run whose outcome a test checks, must be made with
    a fixed count: a module fixture is built before the function fixture `one_thread` applies, with whatever count
    the test process has then."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def dies_at_first_checkpoint(monkeypatch):
    """Inside the block a learner writes its first checkpoint, then dies there (KeyboardInterrupt, as a kill at that
    point would); Runtime.save_checkpoint is itself again after the block."""
    from ovkit.runtime import Runtime

    save = Runtime.save_checkpoint

    def save_then_die(self, *args, **kwargs):
        save(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Runtime, "save_checkpoint", save_then_die)
    try:
        yield
    finally:
        monkeypatch.setattr(Runtime, "save_checkpoint", save)


def interrupted_then_resumed(monkeypatch, make_cfg, train):
    """Train `make_cfg(resume=False)` until its first checkpoint (every 2 steps), die there, then train
    `make_cfg(resume=True)` to the end; returns the resumed run's result."""
    import pytest

    with dies_at_first_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):
        train(make_cfg(resume=False))
    res = train(make_cfg(resume=True))
    assert res.metrics["resumed_from"].endswith("step-000002")
    return res


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Count / colour questions about squares, some answers padded with extra words so lengths differ."""
    from PIL import Image, ImageDraw

    from ovkit.data.schema import image_cell

    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        colour, count = rng.choice(sorted(colours)), rng.randint(1, 3)
        img = Image.new("RGB", (56 + 28 * (i % 2), 56), "white")
        draw = ImageDraw.Draw(img)
        for k in range(count):
            draw.rectangle([4 + 16 * k, 4, 16 + 16 * k, 20], fill=colours[colour])
        question, answer = ("What colour are the squares?", colour) if i % 2 else ("How many squares?", str(count))
        rows.append(
            {
                "id": f"s{i}",
                "images": [image_cell(img)],
                "messages": [
                    {"role": "user", "content": "<image>\n" + question},
                    {"role": "assistant", "content": f"<answer>{answer}</answer>" + " and so on" * (i % 3)},
                ],
                "source": "test/squares",
            }
        )
    return rows


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The saved tensors (transformers saves Qwen2.5-VL under its original names: visual.*, model.*, lm_head)."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def config(cls_name: str, assets: Path, out: Path, **kw):
    """`ovkit.train.<cls_name>` on the `assets` fixture's model and table: batch 4, 3 steps, fp32, quiet."""
    from ovkit import train

    opts = dict(
        data=assets / "data", model=assets / "model", out=out, batch_size=4, max_steps=3, precision="fp32", quiet=True
    )
    opts.update(kw)
    return getattr(train, cls_name)(**opts)


def sft_runtime(cfg, trajectory=None):
    """The Runtime `ovkit.train.loop.train` builds for `cfg` (its run and option groups)."""
    from ovkit.runs import LearnerRun
    from ovkit.runtime import Runtime
    from ovkit.train.config import SMALLER, TRAJECTORY

    run = LearnerRun.of(cfg, cfg.stage, TRAJECTORY if trajectory is None else trajectory, smaller=SMALLER)
    groups = (cfg.loading, cfg.optimiser, cfg.compute, cfg.lora, cfg.checkpoints, cfg.trackers)
    return Runtime(run, *groups, cfg.load_in_4bit)


def pack_plan(cli, root: Path, max_len: int) -> tuple[Path, int]:
    """`ovkit pack` of root/data for root/model at `max_len` (made once per root and length): (plan dir, packs)."""
    import pyarrow.parquet as pq

    plan = root / f"plan-{max_len}"
    if not plan.exists():
        code, _, err = cli(
            "pack", root / "data", "--model", root / "model", "--max-len", str(max_len), "--out", plan, "--quiet"
        )
        assert code == 0, err
    return plan, len(set(pq.read_table(plan / "plan.parquet").column("pack").to_pylist()))


# ------------------------------------------------------------------------------------------------ RL (ovkit.rl)

RL_COLOURS = {"red": (220, 40, 40), "blue": (40, 60, 220), "green": (40, 170, 60)}

# `ovkit rl-train` flags for a run of seconds on the tiny model: 2 prompts x 4 samples of 6 tokens a step.
TINY = [
    "--prompts-per-step",
    "2",
    "--group-size",
    "4",
    "--max-new-tokens",
    "6",
    "--lr",
    "1e-3",
    "--warmup-ratio",
    "0",
    "--no-system-prompt",
    "--rollout-batch-size",
    "16",
    "--micro-batch-size",
    "8",
    "--reward-workers",
    "1",
]


def rl_image(n: int, colour: str):
    """`n` squares of `colour` on a 56x56 white image."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (56, 56), "white")
    draw = ImageDraw.Draw(img)
    for k in range(n):
        x, y = 4 + (k % 2) * 26, 4 + (k // 2) * 26
        draw.rectangle([x, y, x + 20, y + 20], fill=RL_COLOURS[colour])
    return img


def rl_rows() -> list[dict]:
    """Six counting prompts with numeric answers, categories alternating counting / math."""
    from ovkit.data import image_cell

    rows = []
    for i, (n, colour) in enumerate([(1, "red"), (2, "blue"), (3, "green"), (4, "red"), (2, "green"), (1, "blue")]):
        rows.append(
            {
                "id": f"count-{i}",
                "images": [image_cell(rl_image(n, colour))],
                "messages": [{"role": "user", "content": "<image>\nHow many squares are there?"}],
                "source": "test/count",
                "category": "counting" if i % 2 == 0 else "math",
                "answer": str(n),
                "answer_type": "number",
            }
        )
    return rows


def rl_cfg(model, data, out, **kw):
    """An `RLTrainConfig` of the `TINY` flags' size (synchronous, no system prompt), `kw` overriding."""
    from ovkit.rl.config import RLTrainConfig

    base = dict(
        data=[data],
        model=model,
        out=out,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=6,
        lr=1e-3,
        warmup_ratio=0.0,
        weight_decay=0.0,
        system_prompt=False,
        max_staleness=0,
        micro_batch_size=8,
        reward_workers=1,
    )
    return RLTrainConfig(**{**base, **kw})


def rl_groups(model, processor, data, cfg, rewards):
    """Groups of 4 samples for the first two prompts of `data`, their rewards set to `rewards` (one list per group)."""
    from ovkit.data import read_samples
    from ovkit.generate import HFEngine
    from ovkit.rollouts.groups import Sampling, generate_groups
    from ovkit.rollouts.prompts import encode_prompts

    prompts = encode_prompts(read_samples(data).table, processor, mode="answer", system=False)
    groups = generate_groups(HFEngine(model, processor), prompts, [0, 1], 0, Sampling(4, 6, seed=1))
    for g, r in zip(groups, rewards):
        g.task_rewards, g.rewards, g.format_rewards, g.parts = list(r), list(r), [0.0] * 4, [{"accuracy": x} for x in r]
    return groups


# ---------------------------------------------------------------------------- the RL learner, plain and shared-prefix


def logprobs_and_grads(model, batch, plans):
    """Log-probs and entropies [N, T-1] over `plans`, and every parameter's gradient of a fixed random weighting of
    the log-probs (sum over the plans' micro-batches, as the learner accumulates them)."""
    from ovkit.rollouts.trajectories import sequence_logprobs

    torch.manual_seed(1)
    weights = torch.randn(batch.mask.shape)
    logp, ent = torch.zeros(batch.mask.shape), torch.zeros(batch.mask.shape)
    model.zero_grad(set_to_none=True)
    for plan in plans:
        lp, e, width = sequence_logprobs(model, batch, plan.rows, 1.0, entropy=True, plan=plan)
        (lp * weights[plan.row_index, : width - 1]).sum().backward()
        logp[plan.row_index, : width - 1], ent[plan.row_index, : width - 1] = lp.detach(), e
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logp, ent, grads


def assert_same_learner(plain, shared):
    """Two `logprobs_and_grads` results agree: log-probs and entropies to 1e-5, each gradient to 1e-4 of its largest
    entry, the vision tower's included."""
    logp, ent, grads = plain
    torch.testing.assert_close(shared[0], logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1], ent, rtol=0, atol=1e-5)
    assert shared[2].keys() == grads.keys() and any("visual" in n for n in grads)  # the tower trained in both
    for name, g in grads.items():
        scale = g.abs().max().clamp(min=1e-6)
        assert (shared[2][name] - g).abs().max() <= 1e-4 * scale, name


def learner_plans(batch, layout, micro, share):
    """The learner's micro-batches of `batch`, `micro` trajectories each: shared-prefix rows or a row each."""
    from ovkit.rollouts import shared
    from ovkit.rollouts.trajectories import chunks

    if share:
        return [
            shared.micro_batch(batch, idx, layout) for idx in chunks(shared.by_prompt(batch, range(batch.size)), micro)
        ]
    return [batch.micro_batch(idx, layout) for idx in chunks(batch.by_length(range(batch.size)), micro)]


# ---------------------------------------------------------------------------- generation (ovkit.generate)


def marked_image(w=84, h=84, colour=(200, 30, 30)):
    """A plain image with a diagonal stroke, so images differ beyond their colour."""
    from PIL import Image

    img = Image.new("RGB", (w, h), colour)
    for x in range(10, 30):
        img.putpixel((x, x), (255 - colour[0], 255, 0))
    return img


# The images of the `spread_prompts` fixture's four prompts, in order (vLLM takes them beside the token ids).
PROMPT_IMAGES = [
    [marked_image()],
    [],
    [marked_image(168, 84, (0, 90, 200)), marked_image()],
    [marked_image(colour=(20, 200, 20))],
]


# ------------------------------------------------------------------------------------ eval (ovkit.evaluate)

EVAL_TEXTS = [
    "How many circles? <answer>3</answer>",
    "Where is the red circle? [10, 10, 30, 30]",
    "cat moon A B C",
] * 20
EVAL_BOX = {"coords": "pixel", "image_size": [84, 84]}

# (id, category, source, question, answer, answer_type, reward_kwargs, forced completion, expected reward)
EVAL_ROWS = [
    ("c0", "counting", "synth/counting", "Q-c0 how many?", "3", "number", None, "<answer>3</answer>", 1.0),
    ("c1", "counting", "other/counting", "Q-c1 how many?", "2", "number", None, "<answer>5</answer>", 0.0),
    ("s0", "spatial", "synth/spatial", "Q-s0 where? A. B. C.", "B", "multiple_choice", None, "<answer>B</answer>", 1.0),
    ("s1", "spatial", "synth/spatial", "Q-s1 where? A. B. C.", "A", "multiple_choice", None, "<answer>A</answer>", 1.0),
    ("s2", "spatial", "synth/spatial", "Q-s2 where? A. B. C.", "C", "multiple_choice", None, "I do not know", 0.0),
    (
        "g0",
        "grounding",
        "synth/grounding",
        "Q-g0 box?",
        "[10, 10, 30, 30]",
        "bbox",
        EVAL_BOX,
        "<answer>[10, 10, 20, 30]</answer>",
        0.5,
    ),
    (
        "g1",
        "grounding",
        "synth/grounding",
        "Q-g1 box?",
        "[10, 10, 30, 30]",
        "bbox",
        EVAL_BOX,
        "<answer>[10, 10, 20, 20]</answer>",
        0.25,
    ),
    ("o0", None, "synth/ocr", "Q-o0 read it", "cat moon", "ocr", None, "<answer>cat moon</answer>", 1.0),
]


def eval_image(colour=(200, 30, 30)):
    from PIL import Image

    return Image.new("RGB", (84, 84), colour)


# ---------------------------------------------------------------------------- data (ovkit.data, ovkit convert)


def png(color=(255, 0, 0), size=(16, 12)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def jpeg(color=(0, 0, 255), size=(20, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="JPEG")
    return buf.getvalue()


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False))
    return path


def many_llava(tmp_path, n: int) -> Path:
    """`n` LLaVA-JSON records over the `llava_images` fixture's files."""
    return write_json(
        tmp_path / "many.json",
        [
            {
                "id": f"r{i}",
                "image": "c.png" if i % 3 else "coco/a.png",
                "conversations": [{"from": "human", "value": f"<image>\nQ{i}"}, {"from": "gpt", "value": f"A{i}"}],
            }
            for i in range(n)
        ],
    )


def bomb_png(width=100_000, height=100_000):
    """A valid PNG header declaring a huge canvas, in a few hundred bytes."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    )


def truncated_jpeg():
    """Cut in its entropy-coded data: the header parses, only decoding the picture finds the end missing."""
    from PIL import Image

    noise = Image.frombytes("RGB", (56, 56), random.Random(0).randbytes(56 * 56 * 3))
    buf = io.BytesIO()
    noise.save(buf, "JPEG", quality=95)
    return buf.getvalue()[:-300]


def teacher_forced_logits(model, prompt, response):
    """Logits that predicted each response token, from one forward pass over prompt + response."""
    import torch

    inputs = prompt.model_inputs(labels=False)
    ids = torch.tensor([prompt.input_ids + response])
    inputs["input_ids"] = ids
    inputs["attention_mask"] = torch.ones_like(ids)
    for k, v in prompt.per_token.items():
        inputs[k] = torch.tensor([v + [0] * len(response)])
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    return logits[prompt.length - 1 : -1]
