"""Reward throughput: completions scored per second, per scorer and for a realistic mix, with the time limits on.

    python bench/rewards.py [--scale 1.0] [--workers 2] [--timeout 10]

Every row goes through `ovkit.rewards.score_batch` exactly as rl-train calls it: cheap scorers in the calling thread,
math / svg / code in `--workers` killable worker processes with a `--timeout` s limit per item. Completions are
short, tiny-model-like outputs, half right and half wrong. The `math (in-process)` row scores the same math items by
calling the scorer directly in this process, no worker and no time limit: the price of the sandbox is the ratio of
the two math rows. The pool's one-off start (a fresh interpreter importing SymPy, math-verify, cairosvg and
scikit-image) is timed separately and not counted in any row.

The last table is the price of the code sandbox's OS isolation: the same code items run one after another through
`run_sandboxed` at each isolation level this machine has (bubblewrap namespaces + seccomp, seccomp, rlimits only),
milliseconds per item and the ratio to `rlimits` (a plain interpreter start with the audit hook).
`--isolation-only` prints just that table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import _result

from ovkit.rewards import SCORERS, score_batch, shutdown
from ovkit.rewards.codeexec import _tests, run_sandboxed
from ovkit.rewards.sandbox import LEVELS, isolation

SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="84" height="84"><rect width="84" height="84" fill="white"/>'
    '<{shape} fill="{colour}"/></svg>'
)
SHAPES = ['circle cx="42" cy="42" r="{r}"', 'rect x="{r}" y="{r}" width="30" height="30"']
COLOURS = ["red", "blue", "green"]
WORDS = ["stop", "exit", "open", "cafe", "hotel", "north", "river", "bridge"]


def A(text: str) -> str:
    return f"<answer>{text}</answer>"


def mc(rng: random.Random) -> dict:
    gold = rng.choice("ABCD")
    return {
        "answer_type": "multiple_choice",
        "answer": gold,
        "completion": A(rng.choice([gold, "ABCD"[rng.randrange(4)]])),
    }


def number(rng: random.Random) -> dict:
    n = rng.randrange(1, 10)
    return {
        "answer_type": "number",
        "answer": str(n),
        "completion": A(rng.choice([str(n), f"{n}.0", str(n + 1), "three"])),
    }


def ocr(rng: random.Random) -> dict:
    gold = " ".join(rng.sample(WORDS, 2))
    pred = rng.choice([gold, gold.upper(), gold[:-1], rng.choice(WORDS)])
    return {"answer_type": "ocr", "answer": gold, "completion": A(pred)}


def bbox(rng: random.Random) -> dict:
    x, y = rng.randrange(0, 60), rng.randrange(0, 60)
    gold = [x, y, x + 21, y + 21]
    dx = rng.randrange(-8, 9)
    pred = [x + dx, y, x + 21 + dx, y + 21]
    return {
        "answer_type": "bbox",
        "answer": json.dumps(gold),
        "completion": A(json.dumps(pred)),
        "reward_kwargs": '{"coords": "pixel"}',
    }


def detection(rng: random.Random) -> dict:
    gold = [
        {"label": rng.choice(COLOURS) + " shape", "box": [i * 25, i * 20, i * 25 + 21, i * 20 + 21]}
        for i in range(rng.randrange(1, 4))
    ]
    pred = [dict(d, box=[v + rng.randrange(-3, 4) for v in d["box"]]) for d in gold[: rng.randrange(1, len(gold) + 1)]]
    return {"answer_type": "detection", "answer": json.dumps(gold), "completion": A(json.dumps(pred))}


def math(rng: random.Random) -> dict:
    a, b = rng.randrange(1, 20), rng.randrange(1, 20)
    pred = rng.choice([str(a + b), f"\\frac{{{2 * (a + b)}}}{{2}}", f"{a}+{b}", str(a + b + 1)])
    return {"answer_type": "math", "answer": str(a + b), "completion": A(pred)}


def svg(rng: random.Random) -> dict:
    r = rng.randrange(10, 30)
    gold = SVG.format(shape=rng.choice(SHAPES).format(r=r), colour=rng.choice(COLOURS))
    pred = SVG.format(shape=rng.choice(SHAPES).format(r=r + rng.randrange(-4, 5)), colour=rng.choice(COLOURS))
    return {"answer_type": "svg", "answer": gold, "completion": A(rng.choice([gold, pred]))}


def string(rng: random.Random) -> dict:
    gold = f"a {rng.choice(COLOURS)} {rng.choice(['circle', 'square'])}"
    return {"answer_type": "string", "answer": gold, "completion": A(rng.choice([gold, gold + ".", "a shape"]))}


def html(rng: random.Random) -> dict:
    gold = "<div><h1>Title</h1><p>text</p></div>"
    return {"answer_type": "html", "answer": gold, "completion": A(rng.choice([gold, "<div><p>text</p></div>"]))}


def code(rng: random.Random) -> dict:
    gold = json.dumps({"entry": "solution", "tests": [{"input": i, "output": i * i} for i in range(3)]})
    body = rng.choice(["return x * x", "return x + x"])
    return {"answer_type": "code", "answer": gold, "completion": A(f"def solution(x):\n    {body}")}


# (name, generator, items at --scale 1)
ROWS = [
    ("multiple_choice", mc, 20_000),
    ("number", number, 20_000),
    ("ocr", ocr, 20_000),
    ("bbox", bbox, 20_000),
    ("detection", detection, 5_000),
    ("string", string, 20_000),
    ("html", html, 5_000),
    ("math", math, 2_000),
    ("svg", svg, 300),
    ("code", code, 100),
]
# The synthetic corpus' RL mix (ovkit.data.synth_tasks: counting, OCR, grounding, detection, spatial MC, math, SVG,
# captions).
MIX = [(mc, 0.2), (number, 0.2), (ocr, 0.15), (bbox, 0.15), (detection, 0.1), (math, 0.1), (svg, 0.05), (string, 0.05)]


def timed(items: list[dict], workers: int, timeout: float) -> tuple[float, float]:
    start = time.perf_counter()
    results = score_batch(items, workers=workers, timeout=timeout)
    elapsed = time.perf_counter() - start
    return elapsed, sum(r.reward for r in results) / len(results)


def isolation_cost(rng: random.Random, items: int) -> None:
    """ms per code item at each available isolation level, one item at a time (no pool, no concurrency)."""
    entry, calls, _ = _tests(code(rng)["answer"])
    source = "def solution(x):\n    return x * x"
    timings = {}
    for level in LEVELS:
        try:
            iso = isolation(level)
        except Exception as e:
            print(f"{level:<10} unavailable here: {e}")
            continue
        run_sandboxed(source, entry, calls, cpu_s=2, wall_s=10, memory_mb=50, level=level)  # warm the page cache
        start = time.perf_counter()
        for _ in range(items):
            reports, _ = run_sandboxed(source, entry, calls, cpu_s=2, wall_s=10, memory_mb=50, level=level)
            assert reports and all(r["ok"] for r in reports)
        timings[level] = (time.perf_counter() - start) / items * 1000, iso.describe()
    base = timings.get("rlimits", (None,))[0]
    rows = [
        {"isolation": level, "ms/item": ms, "vs rlimits": ms / base if base else None, "mechanism": what}
        for level, (ms, what) in timings.items()
    ]
    _result.table(
        "rewards",
        f"the code sandbox's isolation, {items} items each",
        rows,
        formats={"ms/item": ".1f", "vs rlimits": ".2f"},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every row's item count")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for math / svg / code")
    parser.add_argument("--timeout", type=float, default=10.0, help="per-item time limit, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--isolation-only", action="store_true", help="only the code sandbox's isolation cost")
    parser.add_argument("--isolation-items", type=int, default=50, help="code items per isolation level")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if args.isolation_only:
        isolation_cost(rng, args.isolation_items)
        return

    start = time.perf_counter()
    score_batch([math(rng)] * args.workers, workers=args.workers, timeout=60.0)
    print(f"pool start (zygote import + warm-up + {args.workers} workers): {time.perf_counter() - start:.2f} s")
    print(f"cpu cores: {os.cpu_count()}  workers: {args.workers}  per-item time limit: {args.timeout} s\n")
    rows: list[dict] = []

    def row(name: str, items: list[dict], elapsed: float, mean: float) -> None:
        rows.append(
            {
                "scorer": name,
                "items": len(items),
                "seconds": elapsed,
                "items/s": len(items) / elapsed,
                "mean reward": mean,
            }
        )
        print(f"{name}: {len(items) / elapsed:.0f} items/s", flush=True)

    for name, make, count in ROWS:
        items = [make(rng) for _ in range(max(10, int(count * args.scale)))]
        row(name, items, *timed(items, args.workers, args.timeout))
        if name == "math":
            start = time.perf_counter()
            rewards = [SCORERS["math"](it["completion"], it["answer"]).reward for it in items]
            row("math (in-process)", items, time.perf_counter() - start, sum(rewards) / len(rewards))

    makers, weights = zip(*MIX)
    items = [rng.choices(makers, weights)[0](rng) for _ in range(max(10, int(5_000 * args.scale)))]
    row("realistic mix", items, *timed(items, args.workers, args.timeout))
    shutdown()
    _result.table(
        "rewards",
        f"completions scored per second ({args.workers} workers, {args.timeout:g} s per-item limit)",
        rows,
        formats={"seconds": ".2f", "items/s": ".0f", "mean reward": ".3f"},
    )
    isolation_cost(rng, args.isolation_items)


if __name__ == "__main__":
    main()
