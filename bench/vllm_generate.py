"""Benchmark: `--engine vllm` against `--engine hf`, tokens generated per second, on the same prompts, in one process.

Run it in the vLLM environment (`make setup-vllm`; on a CPU box that is vLLM's CPU build):

    .venv-vllm/bin/python bench/vllm_generate.py                       # synth + the tiny model in a temp dir
    .venv-vllm/bin/python bench/vllm_generate.py --data D/rl --model M --models tiny,wide --n 4

The prompts are `--prompts` rows of the synthetic RL split (one image each), encoded with the answer-only instruction
as rl-train encodes them; each is sampled `--n` times (a GRPO group), temperature 1, at most `--max-new-tokens`
tokens, fixed seed. Both engines return what rl-train needs (token ids, the sampled log-probs, finish reasons):

  hf     ovkit's HFEngine (one left-padded batch, each prompt prefilled once and its KV cache shared by its n samples)
  vllm   ovkit's VLLMEngine: vllm.LLM in this process, fp32 weights like the HF engine (and bf16 with --bf16)

Two models: the tiny default (2.5M parameters, text hidden 192) and `wide`, the tiny preset's architecture at text
hidden 768, MLP 2048, vision hidden 256 (31.8M parameters, random init; the HF engine bench's wide model), saved to a
directory for vLLM. tokens/s = generated tokens (up to and including the stop token) over wall time, best of
`--repeats` after a warm-up; the ratio is vllm / hf. Threads: torch runs `--threads` intra-op threads for the HF
engine, and vLLM's CPU backend is bound to as many cores (VLLM_CPU_OMP_THREADS_BIND), so both get the same CPUs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import _result
from hf_generate import inputs, wide_model  # the HF engine bench's prompts and wide model (bench/ is on sys.path)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the default is half the machine's memory


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="tiny model directory (default: init-model --preset tiny in a temp dir)")
    p.add_argument("--data", type=Path, help="RL prompts (default: `ovkit synth --scale 0.25` rl split in a temp dir)")
    p.add_argument("--models", default="tiny,wide", help="comma list of tiny, wide")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="completions per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="cores for each engine (1: stable timings on a shared box)")
    p.add_argument("--bf16", action="store_true", help="also time vLLM with bf16 weights")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    return p.parse_args()


def wide_dir(tiny_dir: Path, out: Path) -> Path:
    """The HF engine bench's wide model (bench/hf_generate.py), saved to `out` for vLLM to load."""
    model, processor = wide_model(tiny_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def best_rate(generate, repeats: int) -> tuple[float, int]:
    """(tokens/s, tokens) of the fastest of `repeats` calls, after one warm-up call."""
    generate()
    best = (0.0, 0)
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = generate()
        rate = tokens / (time.perf_counter() - t)
        best = max(best, (rate, tokens))
    return best


def main() -> None:
    a = parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, range(a.threads))))
    import torch

    torch.set_num_threads(a.threads)
    import vllm

    from ovkit.data import read_table
    from ovkit.generate import HFEngine, VLLMEngine
    from ovkit.models import load
    from ovkit.rollouts.prompts import encode_prompts

    with tempfile.TemporaryDirectory() as tmp:
        data, tiny = inputs(a.data, a.model, Path(tmp))
        print(
            f"vllm {vllm.__version__}, torch {torch.__version__}, {a.threads} core(s) each, load average "
            f"{os.getloadavg()[0]:.1f}; {a.prompts} prompts x n={a.n}, max_new_tokens={a.max_new_tokens}, "
            f"temperature 1, best of {a.repeats}"
        )
        rows = []
        for name in a.models.split(","):
            model_dir = tiny if name == "tiny" else wide_dir(tiny, Path(tmp) / name)
            model, processor = load(model_dir)
            model.eval()
            table = read_table(data).slice(0, a.prompts)
            encoded = encode_prompts(table, processor, mode="answer", system=False)
            prompts, images = [p.encoded for p in encoded], [list(p.images) for p in encoded]
            params = sum(p.numel() for p in model.parameters()) / 1e6

            def run(engine, **kw):
                outs = engine.generate(
                    prompts, n=a.n, max_new_tokens=a.max_new_tokens, temperature=1.0, seed=a.seed, **kw
                )
                return sum(len(c.token_ids) for cs in outs for c in cs)

            hf = HFEngine(model, processor, batch_size=a.prompts * a.n)
            results = {"hf (fp32)": best_rate(lambda: run(hf), a.repeats)}
            for dtype in ("float32", "bfloat16") if a.bf16 else ("float32",):
                engine = VLLMEngine(model_dir, processor, dtype=dtype, max_model_len=2048, enforce_eager=a.eager)
                results[f"vllm ({'fp32' if dtype == 'float32' else 'bf16'})"] = best_rate(
                    lambda engine=engine: run(engine, images=images), a.repeats
                )
                engine.close()
            base = results["hf (fp32)"][0]
            print(f"\n{name}: {params:.1f}M parameters")
            for key, (rate, tokens) in results.items():
                print(f"  {key:<12}{rate:9.1f} tokens/s ({tokens} tokens)  vs hf {rate / base:.2f}x", flush=True)
                rows.append({"model": name, "engine": key, "tokens/s": rate, "vs hf": rate / base})
        _result.table(
            "vllm_generate",
            f"--engine vllm against --engine hf: {a.prompts} prompts x n={a.n}, <= {a.max_new_tokens} new tokens",
            rows,
            formats={"tokens/s": ".0f", "vs hf": ".2f"},
        )


if __name__ == "__main__":
    main()
