"""`ovkit pack`: measure every sample with the model's processor, pack them globally, write the plan.

A plan directory holds `plan.parquet` (one row per packed sample: `id`, `shard`, `row`, `length`, `pack`; sorted by
pack, then row), `stats.json`, `fill.png` and, when some samples could not be packed, `rejects.parquet` (`id`,
`shard`, `row`, `length`, `reason`). `row` is the sample's 0-based row in the input dataset (all shards in
`part-*` order), `shard` the --shard part that packed it, `pack` the pack's index within that part. With
`--shard I/N` the part is written to `PLAN/part-I-of-N/` with the same files, and `read_plan(PLAN)` reads every
part as one plan (a pack is identified by (shard, pack)).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ovkit import options as O
from ovkit.data import read_samples
from ovkit.errors import OvkitError
from ovkit.files import fingerprint, write_json
from ovkit.options import option
from ovkit.pack.binpack import best_fit_decreasing, pack_loads
from ovkit.pack.lengths import cache_key, compute_lengths, default_cache_dir, read_cached, write_cached
from ovkit.pack.stats import fill_histogram, merge_stats, pack_stats

PLAN = "plan.parquet"
STATS = "stats.json"
FILL = "fill.png"
REJECTS = "rejects.parquet"
PLAN_SCHEMA = pa.schema(
    [("id", pa.string()), ("shard", pa.int32()), ("row", pa.int64()), ("length", pa.int32()), ("pack", pa.int64())]
)
_PART = re.compile(r"part-(\d+)-of-(\d+)")
REJECT_SCHEMA = pa.schema(
    [("id", pa.string()), ("shard", pa.int32()), ("row", pa.int64()), ("length", pa.int64()), ("reason", pa.string())]
)


# --help panels of this config's own options (ovkit.options holds the shared ones)
PACKING = "Packing"


@dataclass
class PackConfig(O.StageConfig):
    launcher: ClassVar[str] = O.RANK_SHARDED  # what it does under torchrun / accelerate launch (ovkit.launch)

    data: Path | None = option(
        None,
        help="Sample table to pack (a parquet file or a directory of shards).",
        argument=True,
    )
    model: Path | None = option(
        None,
        help="Model directory whose processor measures each sample.",
        panel=O.IO,
    )
    # pack capacity L in tokens; longer samples are rejected
    max_len: int = option(8192, help="Pack capacity L in tokens; longer samples go to rejects.", panel=PACKING, min=1)
    out: Path | None = O.out(doc="plan directory (with `--shard`, the part goes to `OUT/part-I-of-N/`)")
    shard: str | None = O.shard()
    workers: int = option(
        1,
        help="Processes measuring lengths.",
        panel=O.RUNTIME,
        min=1,
        doc="processes measuring lengths (results do not depend on it)",
    )
    # encode every sample with the processor instead of using image header sizes
    exact_lengths: bool = option(
        False, help="Encode every image with the processor instead of counting from image sizes.", panel=PACKING
    )
    cache: Path | None = option(
        None,
        help="Lengths cache directory (default $OVKIT_CACHE or ~/.cache/ovkit).",
        panel=O.IO,
        default_doc="`$OVKIT_CACHE/lengths`",
    )
    baseline_batch: int = option(
        8,
        help="B of the 'pad to longest in random batches' baseline.",
        panel=PACKING,
        min=1,
    )
    on_error: str = O.on_error()
    seed: int = O.seed(doc="shuffles the random-batch padding baseline (the plan does not depend on it)")
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        from ovkit.data import parse_shard

        O.validate(self)  # each option's declared range and choices; the checks across options follow
        if self.data is None:
            raise OvkitError("DATA is required: the sample table to pack")
        if self.model is None:
            raise OvkitError("--model is required: the model directory whose processor measures the samples")
        if self.out is None:
            raise OvkitError("--out is required: the plan directory to write")
        self.data, self.model, self.out = Path(self.data), Path(self.model), Path(self.out)
        if self.cache is not None:
            self.cache = Path(self.cache)
        parse_shard(self.shard)

    @property
    def shard_tuple(self) -> tuple[int, int] | None:
        from ovkit.data import parse_shard

        return parse_shard(self.shard)

    @property
    def target(self) -> Path:
        """Where this run writes: OUT, or OUT/part-I-of-N for a shard."""
        s = self.shard_tuple
        return self.out / f"part-{s[0]:05d}-of-{s[1]:05d}" if s else self.out


def build_plan(cfg: PackConfig, out_dir: Path) -> dict:
    """Measure, pack and write the plan files into `out_dir`; returns the stats (also in stats.json)."""

    started = time.perf_counter()
    shard = cfg.shard_tuple
    shard_index = shard[0] if shard else 0
    samples = read_samples(
        cfg.data, shard=shard, on_error=cfg.on_error, images="header"
    )  # the length pass decodes them
    table = samples.table
    ids = table.column("id").to_pylist()
    rows = samples.rows  # each kept row's index in the whole input (its id may repeat a rejected row's)

    measured = _lengths(cfg, table, ids, shard)
    lengths = measured.lengths
    bad = [i for i, e in enumerate(measured.errors) if e is not None]
    if bad and cfg.on_error == "fail":
        i = bad[0]
        at = samples.where(i, _error_column(measured.errors[i]))
        raise OvkitError(f"{at}: {measured.errors[i]} (use --on-error skip to move bad rows to {REJECTS})")
    too_long = [i for i in range(len(ids)) if measured.errors[i] is None and lengths[i] > cfg.max_len]
    keep = np.array([measured.errors[i] is None and lengths[i] <= cfg.max_len for i in range(len(ids))], dtype=bool)

    t_pack = time.perf_counter()
    packs = best_fit_decreasing(lengths[keep], cfg.max_len)
    pack_seconds = time.perf_counter() - t_pack

    plan = _plan_table(ids, rows, lengths, keep, packs, shard, cfg.max_len)
    pq.write_table(plan, out_dir / PLAN, compression="zstd")

    rejects = _rejects(samples.rejects, ids, rows, lengths, measured.errors, too_long, cfg.max_len, shard_index)
    if rejects.num_rows:
        pq.write_table(rejects, out_dir / REJECTS, compression="zstd")

    stats = pack_stats(lengths[keep], packs, cfg.max_len, batch=cfg.baseline_batch, seed=cfg.seed)
    stats.update(
        rows_in=len(ids) + samples.n_rejects,
        rejects={"invalid_row": samples.n_rejects, "unencodable": len(bad), "longer_than_max_len": len(too_long)},
        shard=list(shard) if shard else None,
        length_method=measured.method,
        length_note=measured.note,
        lengths_cached=measured.cached,
        seconds={
            "lengths": round(measured.seconds, 3),
            "pack": round(pack_seconds, 3),
            "total": round(time.perf_counter() - started, 3),
        },
    )
    write_json(out_dir / STATS, stats)
    fill_histogram(pack_loads(packs, lengths[keep]), cfg.max_len, out_dir / FILL)
    return stats


def _plan_table(ids, rows, lengths, keep, packs, shard, max_len: int) -> pa.Table:
    """The kept samples with their packs, sorted by pack, then input row."""
    kept = np.flatnonzero(keep)
    rows = np.asarray(rows, dtype=np.int64)[kept]
    order = np.lexsort((rows, packs))
    table = pa.table(
        {
            "id": pa.array([ids[i] for i in kept[order]], pa.string()),
            "shard": pa.array(np.full(order.size, shard[0] if shard else 0, dtype=np.int32)),
            "row": pa.array(rows[order]),
            "length": pa.array(lengths[kept[order]].astype(np.int32)),
            "pack": pa.array(packs[order]),
        },
        schema=PLAN_SCHEMA,
    )
    return table.replace_schema_metadata(
        {"ovkit": json.dumps({"max_len": max_len, "shard": list(shard) if shard else None})}
    )


def _lengths(cfg: PackConfig, table: pa.Table, ids: list[str], shard):

    method = "processor" if cfg.exact_lengths else "sizes"
    key = cache_key(fingerprint(cfg.data), cfg.model, method, shard)
    path = (cfg.cache or default_cache_dir()) / f"lengths-{key}.parquet"
    cached = read_cached(path, ids)
    if cached is not None:
        return cached
    result = compute_lengths(table, cfg.model, method=method, workers=cfg.workers, progress=not cfg.quiet)
    try:
        write_cached(path, ids, result)
    except OSError:  # a read-only cache location must not fail the run
        pass
    return result


def _error_column(error: str) -> str:
    """The column a length-pass error is about: a picture that does not decode, else the conversation."""
    return "images" if error.startswith("image ") else "messages"


def _rejects(
    invalid: pa.Table | None, ids, rows, lengths, errors, too_long, max_len: int, shard_index: int
) -> pa.Table:
    out = {name: [] for name in REJECT_SCHEMA.names}

    def add(rid, row, length, reason):
        for k, v in zip(REJECT_SCHEMA.names, (rid, shard_index, row, length, reason)):
            out[k].append(v)

    if invalid is not None:
        for rid, reason in zip(invalid.column("id").to_pylist(), invalid.column("reason").to_pylist()):
            add(rid, None, None, reason)
    for i, e in enumerate(errors):
        if e is not None:
            add(ids[i], rows[i], None, f"column '{_error_column(e)}': {e}")
    for i in too_long:
        add(ids[i], rows[i], int(lengths[i]), f"length {int(lengths[i])} > --max-len {max_len}")
    return pa.table(out, schema=REJECT_SCHEMA)


# --- reading a plan ----------------------------------------------------------------------------------------------


def plan_files(plan_dir: Path | str) -> list[Path]:
    """PLAN/plan.parquet, or every PLAN/part-I-of-N/plan.parquet (all N parts must be there)."""
    plan_dir = Path(plan_dir)
    if (plan_dir / PLAN).is_file():
        return [plan_dir / PLAN]
    if plan_dir.is_file() and plan_dir.suffix == ".parquet":
        return [plan_dir]
    named = {p: _PART.fullmatch(p.parent.name) for p in sorted(plan_dir.glob(f"part-*-of-*/{PLAN}"))}
    parts = [p for p, m in named.items() if m]  # not the temporary directories of a run in progress
    if not parts:
        raise OvkitError(f"{plan_dir}: not a pack plan (no {PLAN}, no part-*-of-*/{PLAN}); run `ovkit pack` first")
    totals = {int(named[p].group(2)) for p in parts}
    if len(totals) != 1:
        raise OvkitError(
            f"{plan_dir}: parts of different --shard splits ({', '.join(map(str, sorted(totals)))}) are mixed"
        )
    n = totals.pop()
    have = {int(named[p].group(1)) for p in parts}
    missing = sorted(set(range(n)) - have)
    if missing:
        raise OvkitError(
            f"{plan_dir}: parts {', '.join(map(str, missing))} of {n} are missing; run `ovkit pack --shard I/{n}` "
            f"for them"
        )
    return parts


def read_plan(plan_dir: Path | str) -> tuple[pa.Table, int]:
    """The whole plan (all parts), sorted by (shard, pack, row), and its --max-len."""
    tables, max_lens = [], set()
    for f in plan_files(plan_dir):
        t = pq.read_table(f)
        meta = json.loads((t.schema.metadata or {}).get(b"ovkit", b"{}"))
        max_lens.add(meta.get("max_len"))
        tables.append(t.replace_schema_metadata(None).cast(PLAN_SCHEMA))
    if len(max_lens) != 1 or None in max_lens:
        raise OvkitError(f"{plan_dir}: plan parts disagree on --max-len ({sorted(map(str, max_lens))})")
    plan = pa.concat_tables(tables)
    idx = np.lexsort((plan.column("row").to_numpy(), plan.column("pack").to_numpy(), plan.column("shard").to_numpy()))
    return plan.take(pa.array(idx)), max_lens.pop()


def plan_stats(plan_dir: Path | str) -> dict:
    """stats.json of a plan; for a plan in parts, the parts' headline numbers merged (and each part's file)."""

    files = plan_files(plan_dir)
    parts = [json.loads((f.parent / STATS).read_text()) for f in files]
    return parts[0] if len(parts) == 1 else {**merge_stats(parts), "part_stats": [str(f.parent / STATS) for f in files]}
