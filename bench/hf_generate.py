"""Benchmark: ovkit's HF engine against plain `model.generate` on the same prompts, tokens generated per second.

The prompts are N rows of the synthetic RL split (images of several sizes, prompts of mixed lengths) encoded with the
answer-only instruction, as rl-train encodes them. Each prompt is sampled `--n` times (a GRPO group), temperature 1,
`--max-new-tokens` tokens at most, fixed seed. Two ways to generate:

  generate   what a user writes: the prompts left-padded into one batch (the processor's tensors), then
             `model.generate(**inputs, do_sample=True, num_return_sequences=n, max_new_tokens=..., top_k=0)`
  ovkit      `HFEngine(model, processor, batch_size=N*n).generate(prompts, n=n, ...)`: the same batch, plus the
             sampled log-probs, stop handling and detokenised Completions that rl-train needs; once with
             `prefill="per-sequence"` (the engine's first design: every sample prefilled and its images encoded on its
             own) and once with the shared prefill (each prompt once, its KV cache copied to its n samples; the default)

tokens/s counts generated tokens up to and including the stop token, per sequence, over wall time (best of
`--repeats`, the ways one after the other in one process); the CPU seconds of that run are printed beside it. Torch runs
`--threads` intra-op threads, 1 by default: on a shared box two OpenMP threads under a load above the core count make
every small op wait for a descheduled thread, and decode-step timings swung ~10x from run to run (the "shared prefill
decodes 9x slower" reading of the first measurement); one thread gives rates that repeat within ~10-20%. Two models: the
tiny default (`ovkit init-model --preset tiny`, 2.5M
parameters, text hidden 192) and a wider random-init model built from the same preset with bigger widths
(`--wide`: text hidden 768, 4 layers, 12 heads, MLP 2048; vision hidden 256; ~40M parameters) so that the numbers are
not all Python overhead. Then a profile of the engine, both ways: where its time goes (vision encoder, prefill, decode
forwards, the sampling processor, detokenisation, the rest of the loop) and host syncs per generated token
(bench/_syncs.py's SyncCounter).

    python bench/hf_generate.py                       # builds synth + the tiny model in a temp dir
    python bench/hf_generate.py --data D/rl --model M --prompts 16 --n 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _result  # noqa: E402
import torch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, help="tiny model directory (default: `ovkit init-model --preset tiny` in a temp dir)"
    )
    p.add_argument("--data", type=Path, help="RL prompts (default: `ovkit synth --scale 0.25` rl split in a temp dir)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="completions per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable timings on a shared box)")
    p.add_argument("--models", default="tiny,wide", help="comma list of tiny, wide")
    p.add_argument(
        "--engine-options",
        default="",
        help="extra HFEngine keyword options, k=v comma list (e.g. prefill=per-sequence)",
    )
    p.add_argument("--no-profile", action="store_true")
    return p.parse_args()


def ovkit_cli(*args) -> None:
    subprocess.run(
        [sys.executable, "-c", "from ovkit.cli import main; main()", *map(str, args), "--quiet"],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def inputs(data: Path | None, model: Path | None, tmp: Path) -> tuple[Path, Path]:
    """The RL prompts and the tiny model: the given ones, or `ovkit synth --scale 0.25` and `init-model --preset tiny`
    built under `tmp`."""
    if data is None:
        ovkit_cli("synth", "--out", tmp / "synth", "--scale", "0.25")
        data = tmp / "synth" / "rl"
    if model is None:
        ovkit_cli("init-model", "--preset", "tiny", "--corpus", data.parent, "--out", tmp / "tiny")
        model = tmp / "tiny"
    return data, model


def wide_model(tiny_dir: Path):
    """A random-init model of the tiny preset's architecture and tokenizer with bigger widths."""
    import dataclasses

    from transformers import Qwen2_5_VLForConditionalGeneration

    from ovkit.models import load
    from ovkit.models.tiny import TINY, tiny_config

    _, processor = load(tiny_dir)
    spec = dataclasses.replace(
        TINY,
        hidden_size=768,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        mrope_section=(16, 8, 8),
        vision_hidden_size=256,
        vision_heads=4,
        vision_intermediate_size=1024,
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(processor.tokenizer, spec)).eval()
    return model, processor


def generated_tokens(new: torch.Tensor, stops: set[int]) -> int:
    """Tokens generated per row up to and including the first stop token (generate pads after it)."""
    total = 0
    for row in new.tolist():
        end = next((j for j, t in enumerate(row) if t in stops), None)
        total += len(row) if end is None else end + 1
    return total


def plain_generate(model, prompts, pad_id, stops, a) -> int:
    from transformers import GenerationConfig

    from ovkit.generate.hf import collate_prompts

    inputs = collate_prompts(prompts, pad_id)  # = processor(text=..., images=..., padding=True) with left padding
    config = GenerationConfig(
        do_sample=True,
        num_return_sequences=a.n,
        max_new_tokens=a.max_new_tokens,
        top_k=0,
        eos_token_id=sorted(stops),
        pad_token_id=pad_id,
    )
    torch.manual_seed(a.seed)
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=config)
    return generated_tokens(out[:, inputs["input_ids"].shape[1] :], stops)


def engine_generate(engine, prompts, a) -> int:
    outs = engine.generate(prompts, n=a.n, max_new_tokens=a.max_new_tokens, temperature=1.0, seed=a.seed)
    return sum(len(c.token_ids) for cs in outs for c in cs)


def best_rate(fn, repeats: int) -> tuple[float, int, float]:
    """(tokens/s, tokens, CPU seconds) of the fastest of `repeats` runs."""
    best = None
    for _ in range(repeats):
        t, cpu = time.perf_counter(), time.process_time()
        tokens = fn()
        rate, cpu = tokens / (time.perf_counter() - t), time.process_time() - cpu
        best = (rate, tokens, cpu) if best is None or rate > best[0] else best
    return best


@contextmanager
def timed(owner, name: str, times: dict, key):
    """Time every call of `owner.name` into times[key(args, kwargs)]."""
    original = getattr(owner, name)

    @functools.wraps(original)  # generate validates its kwargs against forward's signature
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times[key(args, kwargs)] += time.perf_counter() - t

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        if isinstance(owner, torch.nn.Module):
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def profile(engine, prompts, a) -> None:
    """Where the engine's wall time goes, and host syncs per generated token."""
    from contextlib import ExitStack

    from _syncs import SyncCounter

    from ovkit.generate import hf

    model = engine.model
    times: dict[str, float] = defaultdict(float)

    def forward_kind(args, kwargs):
        ids = kwargs.get("input_ids")
        return "model forward, prefill" if ids is not None and ids.shape[1] > 1 else "model forward, decode steps"

    with ExitStack() as stack:
        stack.enter_context(timed(model, "forward", times, forward_kind))
        stack.enter_context(timed(model.model.visual, "forward", times, lambda *_: "vision encoder"))
        stack.enter_context(
            timed(
                hf._SampledDistribution,
                "__call__",
                times,
                lambda *_: "sampling distribution (temperature, top-p, log-probs)",
            )
        )
        stack.enter_context(timed(hf.HFEngine, "_completion", times, lambda *_: "detokenise + Completion"))
        t = time.perf_counter()
        tokens = engine_generate(engine, prompts, a)
        total = time.perf_counter() - t
    with SyncCounter() as syncs:
        sync_tokens = engine_generate(engine, prompts, a)
    times["model forward, prefill"] -= times["vision encoder"]
    times["model forward, prefill (text; vision below)"] = times.pop("model forward, prefill")
    times["the rest (generate's loop, collate, stop checks, sampling draw)"] = total - sum(times.values())
    print(f"  profile: {total:.3f} s for {tokens} tokens")
    for k, v in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"    {k:<66} {v:7.3f} s  {100 * v / total:5.1f}%")
    print(
        f"  host syncs: {syncs.total} for {sync_tokens} tokens = {syncs.total / max(1, sync_tokens):.2f} per "
        f"generated token"
    )
    for where, count in syncs.where.most_common(6):
        print(f"    {count:6d}  {where}")


def engine_options(text: str) -> dict:
    out = {}
    for part in filter(None, text.split(",")):
        k, v = part.split("=", 1)
        out[k] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def main() -> None:
    a = parse_args()
    torch.set_num_threads(a.threads)
    from ovkit.data import read_table
    from ovkit.generate import HFEngine
    from ovkit.models import load
    from ovkit.rollouts.prompts import encode_prompts

    with tempfile.TemporaryDirectory() as tmp:
        data, model_dir = inputs(a.data, a.model, Path(tmp))
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}; "
            f"{a.prompts} prompts x n={a.n}, max_new_tokens={a.max_new_tokens}, temperature 1, best of {a.repeats}"
        )
        rows: list[dict] = []
        for name in a.models.split(","):
            model, processor = load(model_dir) if name == "tiny" else wide_model(model_dir)
            model.eval()
            table = read_table(data)
            prompts = encode_prompts(table.slice(0, a.prompts), processor, mode="answer", system=False)
            prompts = [p.encoded for p in prompts]
            engine = HFEngine(
                model,
                processor,
                batch_size=a.prompts * a.n,
                **{"prefill": "shared", **engine_options(a.engine_options)},
            )
            before = HFEngine(model, processor, batch_size=a.prompts * a.n, prefill="per-sequence")
            stops = set(engine.stop_ids)
            lengths = sorted(p.length for p in prompts)
            params = sum(p.numel() for p in model.parameters()) / 1e6
            print(
                f"\n{name}: {params:.1f}M parameters, prompt lengths {lengths[0]}-{lengths[-1]} tokens, "
                f"{sum(len(p.mm.get('image_grid_thw', [])) for p in prompts)} images"
            )
            engine_generate(engine, prompts, a)  # warm-up
            runs = {
                "model.generate": lambda: plain_generate(model, prompts, engine.pad_id, stops, a),
                "ovkit hf engine, per-sequence prefill": lambda: engine_generate(before, prompts, a),
                "ovkit hf engine, shared prefill": lambda: engine_generate(engine, prompts, a),
            }
            best = {k: best_rate(fn, a.repeats) for k, fn in runs.items()}
            plain_rate = best["model.generate"][0]
            for k, (rate, tokens, cpu) in best.items():
                print(f"  {k:<38}{rate:8.1f} tokens/s", flush=True)
                rows.append(
                    {
                        "model": name,
                        "way": k,
                        "tokens/s": rate,
                        "tokens": tokens,
                        "CPU s": cpu,
                        "vs model.generate": rate / plain_rate,
                    }
                )
            if not a.no_profile:
                for label, e in (("per-sequence prefill", before), ("shared prefill", engine)):
                    print(f"  {label}:")
                    profile(e, prompts, a)
    _result.table(
        "hf_generate",
        f"tokens/s of {a.prompts} prompts x n={a.n}, <= {a.max_new_tokens} new tokens, best of {a.repeats}, "
        f"{a.threads} thread(s)",
        rows,
        formats={"tokens/s": ".1f", "CPU s": ".2f", "vs model.generate": ".2f"},
    )


if __name__ == "__main__":
    main()
