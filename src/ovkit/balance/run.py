"""`ovkit balance`: concept-balanced resampling, on one machine or in three sharded phases.

    one machine:  balance DATA --concepts C --out OUT
    N machines:   balance DATA --concepts C --phase assign --shard I/N --out A     (writes A/part-I-of-N/)
                  balance --merge A --concepts C --out PLAN                        (global counts, weights, copies)
                  balance DATA --concepts C --phase sample --plan PLAN --shard I/N --out OUT

The sharded phases give the same rows as the single-machine run: assignment is per image, and counts, weights and
the seeded draw of copies are computed once, over the global row order, by the merge.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from ovkit import options as O
from ovkit.balance.assign import TextMatcher, batched, read_concepts
from ovkit.balance.sample import (
    COMBINE,
    concept_counts,
    distribution_stats,
    image_weights,
    inverse_frequency_copies,
    metaclip_copies,
    plot_long_tail,
    rare_gain,
    retrieval_precision,
)
from ovkit.data import read_samples, read_table, write_rejects, write_samples, write_table
from ovkit.errors import OvkitError
from ovkit.options import option

METHODS = ("embed", "text", "metaclip")
PHASES = ("all", "assign", "sample")


# --help panels of this config's own options (ovkit.options holds the shared ones)
METHOD = "Method"
SHARDED_RUNS = "Sharded runs"


@dataclass
class BalanceConfig(O.StageConfig):
    launcher: ClassVar[str] = O.RANK_SHARDED  # what it does under torchrun / accelerate launch (ovkit.launch)

    # input sample table (not used with --merge)
    data: Path | None = option(None, help="Sample table (parquet file or directory of shards).", argument=True)
    concepts: Path | None = option(None, help="Concept vocabulary: a text file, one concept per line.", panel=O.IO)
    out: Path | None = O.out()
    # embed: top-K by CLIP-family similarity; text: concept strings in captions; metaclip
    method: str = option(
        "embed",
        help="embed (top-K by encoder similarity), text (concepts in captions) or metaclip.",
        panel=METHOD,
        choices=METHODS,
    )
    # CLIP / SigLIP / MetaCLIP directory (embed); `init-model --preset tiny-clip` builds one
    encoder: Path | None = option(None, help="CLIP / SigLIP / MetaCLIP directory for --method embed.", panel=O.IO)
    top_k: int = option(3, help="Concepts per image (embed).", panel=METHOD, min=1)
    # how an image's per-concept inverse frequencies combine into its weight: mean|max|sum
    combine: str = option(
        "mean",
        help="How an image's per-concept inverse frequencies combine: mean, max or sum.",
        panel=METHOD,
        choices=COMBINE,
    )
    target: int | None = option(
        None,
        help="Rows after resampling (default: as many as the input).",
        panel=METHOD,
        default_doc="input rows",
    )
    # MetaCLIP t: a concept's matches are kept with probability min(1, t / count)
    threshold: float = option(
        20.0,
        help="MetaCLIP t: keep a concept's matches with probability min(1, t/count).",
        panel=METHOD,
        doc="MetaCLIP `t` (MetaCLIP used 20,000 for 400M pairs)",
    )
    concept_template: str = option(
        "{}",
        help="Text embedded per concept, e.g. 'a photo of {}.'",
        panel=METHOD,
    )
    chunk: int = option(
        65536,
        help="Concepts per similarity chunk (memory = batch x chunk).",
        panel=O.RUNTIME,
    )
    batch_size: int = option(64, help="Images per encoder batch.", panel=O.RUNTIME)
    phase: str = option(
        "all",
        help="all, or for sharded runs: assign (per shard), then --merge, then sample (per shard).",
        panel=SHARDED_RUNS,
        choices=PHASES,
    )
    merge: list[Path] | None = option(
        None,
        help="Assignment outputs (of --phase assign) to reduce into a plan.",
        panel=SHARDED_RUNS,
    )
    plan: Path | None = option(
        None,
        help="The output of --merge, for --phase sample.",
        panel=SHARDED_RUNS,
    )
    shard: str | None = O.shard(doc="`I/N`: this machine's part (with `--phase assign` or `sample`)")
    on_error: str = O.on_error()
    device: str = option("cpu", help="Device for the encoder (cpu, cuda).", panel=O.RUNTIME)
    seed: int = O.seed()
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet()

    def __post_init__(self):
        O.validate(self)  # each option's declared range and choices; the checks across options follow
        if self.out is None:
            raise OvkitError("--out is required")
        if self.concepts is None:
            raise OvkitError("--concepts is required (a text file, one concept per line)")
        if self.merge and self.data is not None:
            raise OvkitError("--merge reduces assignment outputs; do not also pass DATA")
        if not self.merge and self.data is None:
            raise OvkitError("DATA is required (or --merge ASSIGN_DIR...)")
        if self.method == "embed" and self.phase != "sample" and not self.merge and self.encoder is None:
            raise OvkitError(
                "--method embed needs --encoder DIR (a CLIP-family model; `ovkit init-model --preset tiny-clip` "
                "builds one)"
            )
        if self.phase == "sample" and self.plan is None:
            raise OvkitError("--phase sample needs --plan (the output of `ovkit balance --merge`)")
        if self.shard and self.phase == "all" and not self.merge:
            raise OvkitError("--shard needs --phase assign or sample (counts must be merged across shards first)")
        if "{}" not in self.concept_template:
            raise OvkitError("--concept-template must contain {} where the concept goes")


# ---- phase 1: assign concepts to images ------------------------------------------------------------------------------


def caption_text(messages: list[dict]) -> str:
    return " ".join(m["content"] for m in messages if m["role"] == "assistant")


def assign(cfg: BalanceConfig, table: pa.Table, concepts: list[str]) -> tuple[list[list[int]], list[list[float]]]:
    """Concept indices (and scores) per row."""
    if cfg.method == "embed":
        return _assign_embed(cfg, table, concepts)
    matcher = TextMatcher.build(concepts)
    found = [matcher.match(caption_text(m)) for m in table.column("messages").to_pylist()]
    return found, [[1.0] * len(f) for f in found]


def _assign_embed(cfg: BalanceConfig, table: pa.Table, concepts: list[str]):
    # heavy: torch (and the encoder) load when the embedding way runs, not for balance's --help or input checks
    import torch
    from PIL import Image
    from tqdm import tqdm

    from ovkit.balance.embed import Encoder, topk_chunked

    torch.manual_seed(cfg.seed)
    enc = Encoder(cfg.encoder, device=cfg.device)
    keys = enc.embed_texts([cfg.concept_template.format(c) for c in concepts])
    idx_out, score_out = [], []
    rows = table.column("images").to_pylist()
    for batch in tqdm(list(batched(range(len(rows)), cfg.batch_size)), desc="balance: embed", disable=cfg.quiet):
        first = {i: rows[i][0] for i in batch if rows[i]}  # the first image stands for the sample
        emb = enc.embed_images([Image.open(io.BytesIO(first[i]["bytes"])) for i in first]) if first else None
        scores, idx = topk_chunked(emb, keys, cfg.top_k, cfg.chunk) if first else (None, None)
        pos = {i: n for n, i in enumerate(first)}
        for i in batch:
            if i in pos:
                idx_out.append(idx[pos[i]].tolist())
                score_out.append([round(float(s), 6) for s in scores[pos[i]]])
            else:
                idx_out.append([])
                score_out.append([])
    return idx_out, score_out


def assignment_table(table: pa.Table, rows: list[int], idx: list[list[int]], scores: list[list[float]]) -> pa.Table:
    return pa.table(
        {
            "row": pa.array(rows, pa.int64()),
            "id": table.column("id"),
            "concepts": pa.array(idx, pa.list_(pa.int32())),
            "scores": pa.array(scores, pa.list_(pa.float32())),
            "truth": _truth_column(table),
        }
    )


def _truth_column(table: pa.Table) -> pa.Array:
    # Ground-truth concepts (the synthetic corpus has them) let the report measure retrieval precision.
    if "concepts" not in table.column_names:
        return pa.nulls(table.num_rows, pa.string())
    return table.column("concepts").combine_chunks().cast(pa.string())


# ---- phase 2: merge -> plan ------------------------------------------------------------------------------------------


def make_plan(cfg: BalanceConfig, assigned: pa.Table, concepts: list[str]) -> tuple[pa.Table, dict[str, Any]]:
    """Global counts, per-row weights and copies, and the report numbers."""
    idx = assigned.column("concepts").to_pylist()
    counts = concept_counts(idx, len(concepts))
    if cfg.method == "metaclip":
        weights = np.minimum(1.0, cfg.threshold / np.maximum(counts, 1))
        copies = metaclip_copies(idx, counts, cfg.threshold, cfg.seed)
        row_w = np.array([1.0 - float(np.prod(1.0 - weights[c])) if c else 0.0 for c in idx])
    else:
        row_w = image_weights(idx, counts, cfg.combine)
        copies = inverse_frequency_copies(row_w, cfg.target or assigned.num_rows, cfg.seed)
    after = concept_counts(idx, len(concepts), copies)
    plan = pa.table({"row": assigned.column("row"), "id": assigned.column("id"), "weight": row_w, "copies": copies})
    report = {
        "method": cfg.method,
        "rows_in": assigned.num_rows,
        "rows_out": int(copies.sum()),
        "unmatched_rows": int(sum(1 for c in idx if not c)),
        "before": distribution_stats(counts, concepts),
        "after": distribution_stats(after, concepts),
        **rare_gain(counts, after),
        "vocabulary": len(concepts),
    }
    report["retrieval"] = _retrieval(assigned, idx, concepts)
    return plan, report | {"_counts": (counts, after)}


def _retrieval(assigned: pa.Table, idx: list[list[int]], concepts: list[str]) -> dict:
    lookup = {c: i for i, c in enumerate(concepts)}
    truth = []
    for t in assigned.column("truth").to_pylist():
        names = json.loads(t) if t else []
        truth.append({lookup[n] for n in names if n in lookup})
    return retrieval_precision(idx, truth, len(concepts))


def write_plan(out: Path, plan: pa.Table, report: dict[str, Any]) -> dict[str, Any]:
    counts, after = report.pop("_counts")
    write_table(plan, out / "plan.parquet")
    np.save(out / "concept_counts.npy", counts)
    plot_long_tail(counts, after, out / "long_tail.png")
    (out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


# ---- phase 3: materialise --------------------------------------------------------------------------------------------


def resample(
    table: pa.Table, plan: pa.Table, rows: list[int], concepts: list[str], assigned: pa.Table | None
) -> pa.Table:
    """Repeat each row `copies` times (copy k > 0 gets id `ID#k`), with its weight and concepts as columns."""
    plan_rows = plan.column("row").to_numpy()
    pos = np.searchsorted(plan_rows, rows)
    if len(rows) and (pos.max() >= len(plan_rows) or not np.array_equal(plan_rows[pos], rows)):
        raise OvkitError(
            "--plan does not cover these rows of DATA: was it merged from the same DATA and --shard parts?"
        )
    sub = plan.take(pa.array(pos, pa.int64()))
    if sub.column("id").to_pylist() != table.column("id").to_pylist():
        raise OvkitError("--plan was made for different row ids: was it merged from the same DATA?")
    copies = sub.column("copies").to_numpy()
    take = np.repeat(np.arange(table.num_rows), copies)
    out = table.take(pa.array(take, pa.int64()))
    ids = table.column("id").to_pylist()
    new_ids, k_prev = [], {}
    for i in take:
        k = k_prev.get(i, 0)
        new_ids.append(ids[i] if k == 0 else f"{ids[i]}#{k}")
        k_prev[i] = k + 1
    out = out.set_column(out.column_names.index("id"), "id", pa.array(new_ids, pa.string()))
    out = out.append_column("balance_weight", pa.array(sub.column("weight").to_numpy()[take], pa.float64()))
    if assigned is not None:
        names = [
            json.dumps([concepts[c] for c in cs], ensure_ascii=False) for cs in assigned.column("concepts").to_pylist()
        ]
        out = out.append_column("balance_concepts", pa.array([names[i] for i in take], pa.string()))
    return out


# ---- the command's entry point ---------------------------------------------------------------------------------------


def run(cfg: BalanceConfig, out: Path, shard: tuple[int, int] | None) -> dict[str, Any]:
    """Run the configured phase, writing into `out` (the stage's temp dir). Returns headline metrics."""
    t0 = time.time()
    concepts = read_concepts(cfg.concepts)
    if cfg.merge:
        assigned = pa.concat_tables([read_table(p) for p in cfg.merge]).sort_by("row")
        report = write_plan(out, *make_plan(cfg, assigned, concepts))
        return _headline(report, t0)
    samples = read_samples(cfg.data, shard=shard, on_error=cfg.on_error)
    write_rejects(samples.rejects, out)
    if cfg.phase == "sample":
        plan = read_table(Path(cfg.plan) / "plan.parquet")
        table = resample(samples.table, plan, samples.rows, concepts, None)
        write_samples(table, out, shard)
        return {"rows_in": samples.table.num_rows, "rows_out": table.num_rows, "rejects": samples.n_rejects}
    idx, scores = assign(cfg, samples.table, concepts)
    assigned = assignment_table(samples.table, samples.rows, idx, scores)
    if cfg.phase == "assign":
        write_table(assigned, out / "assign.parquet")
        return {"rows": assigned.num_rows, "rejects": samples.n_rejects, "seconds": round(time.time() - t0, 2)}
    plan, report = make_plan(cfg, assigned, concepts)
    report = write_plan(out, plan, report)
    write_samples(resample(samples.table, plan, samples.rows, concepts, assigned), out)
    return _headline(report, t0) | {"rejects": samples.n_rejects}


def _headline(report: dict[str, Any], t0: float) -> dict[str, Any]:
    r = report.get("retrieval") or {}
    return {
        "rows_in": report["rows_in"],
        "rows_out": report["rows_out"],
        "unmatched_rows": report["unmatched_rows"],  # weight 0: no copies in the output
        "effective_concepts_before": round(report["before"]["effective_concepts"], 2),
        "effective_concepts_after": round(report["after"]["effective_concepts"], 2),
        "rare_gained_fraction": round(report["rare_gained_fraction"], 3),
        **(
            {"precision_at_k": round(r["precision_at_k"], 3), "chance_precision": round(r["chance_precision"], 4)}
            if r
            else {}
        ),
        "seconds": round(time.time() - t0, 2),
    }
