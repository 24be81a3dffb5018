"""Offline packing: ovkit's best-fit-decreasing against TRL's `pack_dataset(strategy="bfd")`, first-fit-decreasing
and the LLaVA-OneVision-1.5 release's seed-and-fill idea, on the same lengths in one run.

    python bench/pack.py                      # 1M lengths, L = 8192 and 16384, every method
    python bench/pack.py --n 10000000 --only ovkit   # the 10M-lengths timing

Lengths are drawn from a stated multimodal mixture (see `draw_lengths`); samples longer than L are dropped, as
`ovkit pack` rejects them. Every method packs the same array; each result is checked (every sample in exactly one
pack, no pack over L) before its numbers are printed. Times are wall-clock on one process; numpy and arrow are
limited to one thread, so "one core" holds for every method.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "ARROW_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import bisect  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import _result  # noqa: E402
import numpy as np  # noqa: E402

from ovkit.pack.binpack import best_fit_decreasing, first_fit_decreasing  # noqa: E402

# The mixture (fractions of samples):
#   caption 60%      one image of logU[64, 1296] visual tokens + 2 vision start/end tokens, caption U[20, 200] text
#                    tokens, a 10-token prompt, 12 tokens of chat template;
#   instruction 30%  0-4 images (10/70/10/5/5%) of logU[64, 1296] visual tokens (+2 each); 1-8 turns (geometric,
#                    p=0.5); per turn a question lognormal(median 30, sigma 0.8) and an answer lognormal(median 120,
#                    sigma 1.0) plus 10 template tokens;
#   text-only 10%    lognormal(median 600, sigma 1.0) tokens.
MIXTURE = {"caption": 0.6, "instruction": 0.3, "text": 0.1}


def _log_uniform(rng, lo, hi, size):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size)).astype(np.int64)


def draw_lengths(n: int, max_len: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """`n` sample lengths <= max_len from the mixture above, and how many longer ones were dropped to get them."""
    rng = np.random.default_rng(seed)
    out, dropped = [], 0
    while sum(a.size for a in out) < n:
        m = int(n * 1.05) + 1000
        kind = rng.choice(3, size=m, p=list(MIXTURE.values()))
        lengths = np.empty(m, dtype=np.int64)
        cap = kind == 0
        k = int(cap.sum())
        lengths[cap] = _log_uniform(rng, 64, 1296, k) + 2 + rng.integers(20, 201, k) + 10 + 12
        ins = kind == 1
        k = int(ins.sum())
        n_img = rng.choice(5, size=k, p=[0.1, 0.7, 0.1, 0.05, 0.05])
        img = np.zeros(k, dtype=np.int64)
        for j in range(1, 5):
            more = n_img >= j
            img[more] += _log_uniform(rng, 64, 1296, int(more.sum())) + 2
        turns = np.minimum(rng.geometric(0.5, k), 8)
        text = np.zeros(k, dtype=np.int64)
        for t in range(1, 9):
            on = turns >= t
            c = int(on.sum())
            q = rng.lognormal(np.log(30), 0.8, c)
            a = rng.lognormal(np.log(120), 1.0, c)
            text[on] += (q + a).astype(np.int64) + 10
        lengths[ins] = img + text
        txt = kind == 2
        lengths[txt] = np.maximum(1, rng.lognormal(np.log(600), 1.0, int(txt.sum())).astype(np.int64))
        keep = lengths <= max_len
        dropped += int((~keep).sum())
        out.append(lengths[keep])
    lengths = np.concatenate(out)
    return lengths[:n], dropped


# --- the recipe's original seed-and-fill (LLaVA-OneVision-1.5 release), reimplemented from its description --------


def seed_and_fill(
    lengths: np.ndarray, capacity: int, ratios=(0.96, 0.94, 0.92, 0.90), min_items: int = 1
) -> np.ndarray:
    """Hash-bucket items by exact length. Phase 1: exactly full packs from power-of-two lengths that divide the
    capacity (round-robin over those keys). Phase 2, per load ratio: every seed (an item >= capacity/2, largest
    first) starts a pack that is filled greedily with the largest remaining item that fits; the pack is kept if it
    reaches ratio * capacity with >= min_items items, else its items go back. Last pass: force-emit the rest the
    same greedy way starting from the largest item."""
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets: dict[int, list[int]] = {}
    for idx in np.argsort(lengths, kind="stable")[::-1].tolist():  # each bucket pops its lowest index first
        buckets.setdefault(int(lengths[idx]), []).append(idx)
    keys = sorted(buckets)  # lengths with items left, ascending
    assign = np.full(lengths.size, -1, dtype=np.int64)
    n_packs = 0

    def pop(s: int) -> int:
        b = buckets[s]
        idx = b.pop()
        if not b:
            del buckets[s]
            keys.pop(bisect.bisect_left(keys, s))
        return idx

    def push(s: int, idx: int) -> None:
        if s not in buckets:
            buckets[s] = []
            bisect.insort(keys, s)
        buckets[s].append(idx)

    def fill(room: int, items: list[tuple[int, int]]) -> int:
        while keys and keys[0] <= room:
            s = keys[bisect.bisect_right(keys, room) - 1]
            items.append((s, pop(s)))
            room -= s
        return room

    def emit(items: list[tuple[int, int]]) -> None:
        nonlocal n_packs
        for _, idx in items:
            assign[idx] = n_packs
        n_packs += 1

    powers = [p for p in (1 << k for k in range(capacity.bit_length())) if capacity % p == 0]
    progress = True
    while progress:  # phase 1, round-robin over the power-of-two keys
        progress = False
        for p in powers:
            need = capacity // p
            if len(buckets.get(p, ())) >= need:
                emit([(p, pop(p)) for _ in range(need)])
                progress = True
    for ratio in ratios:  # phase 2
        for s in [k for k in reversed(keys) if 2 * k >= capacity]:
            while s in buckets:
                items = [(s, pop(s))]
                room = fill(capacity - s, items)
                if capacity - room >= ratio * capacity and len(items) >= min_items:
                    emit(items)
                    continue
                for t, idx in reversed(items):  # not full enough: undo; the next seed of this length would fail too
                    push(t, idx)
                break
    while keys:  # last pass: force-emit
        s = keys[-1]
        items = [(s, pop(s))]
        fill(capacity - s, items)
        emit(items)
    return assign


# --- TRL --------------------------------------------------------------------------------------------------------


def trl_pack(lengths: np.ndarray, capacity: int, global_batch: bool) -> tuple[np.ndarray, float]:
    """TRL `pack_dataset(strategy="bfd")` on a dataset whose `input_ids` have these lengths (int8 zeros, to keep
    memory at one byte per token). Returns each sample's pack (recovered from the packed rows' `seq_lengths`:
    TRL keeps no sample ids, so samples are matched by length, which is enough to count packs and loads) and the
    seconds spent inside `pack_dataset`."""
    import datasets
    import pyarrow as pa
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int8))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    ds = datasets.Dataset(pa.table({"input_ids": column}))
    kwargs = {"map_kwargs": {"batch_size": len(lengths)}} if global_batch else {}
    t = time.perf_counter()
    packed = pack_dataset(ds, capacity, strategy="bfd", **kwargs)
    seconds = time.perf_counter() - t
    seq_lengths = packed.data.column("seq_lengths").combine_chunks()
    per_pack = np.diff(seq_lengths.offsets.to_numpy())
    flat = seq_lengths.values.to_numpy()
    pack_of_item = np.repeat(np.arange(per_pack.size), per_pack)
    # Match TRL's items back to ours by length (a permutation within equal lengths; packs and loads are unchanged).
    ours = np.argsort(lengths, kind="stable")
    theirs = np.argsort(flat, kind="stable")
    if not np.array_equal(lengths[ours], flat[theirs]):
        raise AssertionError("TRL's packed lengths are not a permutation of the input lengths")
    assign = np.empty(lengths.size, dtype=np.int64)
    assign[ours] = pack_of_item[theirs]
    return assign, seconds


# --- running and reporting ----------------------------------------------------------------------------------------


def check(assign: np.ndarray, lengths: np.ndarray, capacity: int) -> dict:
    if assign.shape != lengths.shape or (assign < 0).any():
        raise AssertionError("some samples were not packed")
    loads = np.bincount(assign, weights=lengths.astype(np.float64))
    packs = int((loads > 0).sum())
    if loads.max() > capacity:
        raise AssertionError(f"a pack holds {loads.max()} > {capacity} tokens")
    tokens = int(lengths.sum())
    lower = -(-tokens // capacity)
    return {
        "packs": packs,
        "lower_bound": lower,
        "over_lb_pct": 100 * (packs - lower) / lower,
        "efficiency": tokens / (packs * capacity),
    }


def run(name, fn, lengths, capacity, results):
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    assign, seconds = out if isinstance(out, tuple) else (out, seconds)
    row = {"method": name, **check(assign, lengths, capacity), "seconds": seconds}
    results.append(row)
    print(
        f"  {name:<26} packs {row['packs']:>9,}  +{row['over_lb_pct']:.4f}% over LB  eff {row['efficiency']:.5f}  "
        f"{seconds:8.2f} s",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="lengths per run")
    ap.add_argument("--max-len", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", default=None, help="methods to run: ovkit ffd seed-fill trl trl-global")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    methods = args.only or ["ovkit", "ffd", "seed-fill", "trl", "trl-global"]
    print(
        f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}, numpy "
        f"{np.__version__}"
    )
    report = []
    for capacity in args.max_len:
        lengths, dropped = draw_lengths(args.n, capacity, args.seed)
        print(
            f"\nL={capacity}: {lengths.size:,} lengths (mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, "
            f"p99 {np.percentile(lengths, 99):.0f}; {dropped:,} longer than L dropped), lower bound "
            f"{-(-int(lengths.sum()) // capacity):,} packs"
        )
        results: list[dict] = []
        table = {
            "ovkit": ("ovkit bfd (global)", lambda: best_fit_decreasing(lengths, capacity)),
            "ffd": ("first-fit-decreasing", lambda: first_fit_decreasing(lengths, capacity)),
            "seed-fill": ("seed-and-fill (recipe)", lambda: seed_and_fill(lengths, capacity)),
            "trl": ("trl bfd (batch 1000)", lambda: trl_pack(lengths, capacity, global_batch=False)),
            "trl-global": ("trl bfd (one global batch)", lambda: trl_pack(lengths, capacity, global_batch=True)),
        }
        for m in methods:
            run(*table[m], lengths, capacity, results)
        report.append(
            {
                "max_len": capacity,
                "n": int(lengths.size),
                "dropped": dropped,
                "tokens": int(lengths.sum()),
                "results": results,
            }
        )
    rows = []
    for run_ in report:
        base = next((r for r in run_["results"] if r["method"].startswith("ovkit")), None)
        for r in run_["results"]:
            rows.append(
                {
                    "L": run_["max_len"],
                    "method": r["method"],
                    "packs": r["packs"],
                    "% over LB": r["over_lb_pct"],
                    "efficiency": r["efficiency"],
                    "seconds": r["seconds"],
                    "time / ovkit": r["seconds"] / base["seconds"] if base else None,
                    "packs / ovkit": r["packs"] / base["packs"] if base else None,
                }
            )
    _result.table(
        "pack",
        f"packing {args.n:,} lengths per L (seed {args.seed})",
        rows,
        formats={
            "packs": ",d",
            "% over LB": ".4f",
            "efficiency": ".5f",
            "seconds": ".2f",
            "time / ovkit": ".1f",
            "packs / ovkit": ".5f",
        },
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mixture": MIXTURE, "seed": args.seed, "runs": report}, f, indent=2)


if __name__ == "__main__":
    main()
