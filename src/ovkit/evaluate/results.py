"""Eval outputs in the lmms-eval layout (lmms-eval's output files), `summary.json`, and the table across runs.

    OUT/<model-name>/<timestamp>_results.json          results / configs / versions / n-samples / config / git_hash /
                                                       date
    OUT/<model-name>/<timestamp>_samples_<task>.jsonl  one line per row: doc_id, target, input, resps, filtered_resps,
    metrics
    OUT/summary.json                                   {"overall", "categories", "sources", "accuracy", "detail",
    "model", "n", ...}

Tasks are the eval set's categories. Metric keys follow lmms-eval: `"<metric>,none"` and `"<metric>_stderr,none"`
(the filter is `none`: completions are scored as generated).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.evaluate.metrics import paired_difference, wilson_interval
from ovkit.files import write_json

SUMMARY = "summary.json"
FILTER = "none"


def safe_name(text: str) -> str:
    """A file-name-safe version of a task or model name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "unnamed"


def model_name(model: str | Path) -> str:
    """The `<model-name>` folder: a local directory's name, or a hub id with '/' as '__' (as lmms-eval writes it)."""
    text = str(model).rstrip("/")
    path = Path(text)
    if path.exists():
        return safe_name(path.resolve().name)
    return safe_name(text.replace("/", "__"))


def lmms_metrics(metrics: Mapping[str, float]) -> dict[str, Any]:
    """Our aggregate metrics as lmms-eval's `"<metric>,none"` / `"<metric>_stderr,none"` keys."""
    return {f"{k},{FILTER}": v for k, v in metrics.items() if k != "rows"}


def write_results(
    out: Path,
    *,
    model: str,
    timestamp: str,
    summary: Mapping[str, Any],
    records: Sequence[Mapping[str, Any]],
    task_configs: Mapping[str, Any],
    n_original: Mapping[str, int],
    run_config: Mapping[str, Any],
    version: str,
    seconds: float,
) -> Path:
    """Write `<out>/<model-name>/<timestamp>_results.json` and one `_samples_<task>.jsonl` per task."""
    folder = Path(out) / model_name(model)
    folder.mkdir(parents=True, exist_ok=True)
    tasks = summary["categories"]
    results = {t: {"alias": t, **lmms_metrics(m)} for t, m in tasks.items()}
    metric_names = [k for k in summary["overall"] if k != "rows" and not k.endswith("_stderr")]
    doc = {
        "results": results,
        "groups": {"overall": {"alias": "overall", **lmms_metrics(summary["overall"])}},
        "configs": dict(task_configs),
        "versions": {t: version for t in tasks},
        "n-shot": {t: 0 for t in tasks},
        "higher_is_better": {t: {m: m != "truncated" for m in metric_names} for t in tasks},
        "n-samples": {
            t: {"original": int(n_original.get(t, m["rows"])), "effective": int(m["rows"])} for t, m in tasks.items()
        },
        "config": dict(run_config),
        "git_hash": _git_hash(),
        "date": timestamp,
        "total_evaluation_time_seconds": f"{seconds:.2f}",
    }
    results_path = folder / f"{timestamp}_results.json"
    write_json(results_path, doc)
    for task in tasks:
        lines = [json.dumps(_sample_line(r), ensure_ascii=False) for r in records if r["category"] == task]
        (folder / f"{timestamp}_samples_{safe_name(task)}.jsonl").write_text("\n".join(lines) + "\n")
    return results_path


def _sample_line(r: Mapping[str, Any]) -> dict[str, Any]:
    texts = [c["text"] for c in r["completions"]]
    return {
        "doc_id": r["doc_id"],
        "id": r["id"],
        "source": r["source"],
        "target": r["answer"],
        "input": r["input"],
        "resps": [texts],
        "filtered_resps": texts,
        "rewards": [c["reward"] for c in r["completions"]],
        "reward_parts": [c["parts"] for c in r["completions"]],
        "finish_reasons": [c["finish_reason"] for c in r["completions"]],
        **({"turn_texts": [c["turn_texts"] for c in r["completions"]]} if "turn_texts" in r["completions"][0] else {}),
        **r["metrics"],
    }


def _git_hash() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# -- comparing runs ------------------------------------------------------------------------------------------------


def load_run(spec: str | Path) -> tuple[str, dict[str, Any]]:
    """(label, summary) of one run: `PATH` or `LABEL=PATH`, where PATH is an eval output directory, its
    summary.json, or an lmms-eval `*_results.json` (its tasks become the categories). The label defaults to the
    directory's name."""
    text = str(spec)
    label, _, path_text = text.partition("=") if "=" in text and not Path(text).exists() else ("", "", text)
    path = Path(path_text)
    if path.is_dir():
        path = path / SUMMARY
        if not path.is_file():
            raise OvkitError(
                f"{path.parent}: not an eval output (no {SUMMARY}); run `ovkit eval --model ... --out {path.parent}`"
            )
    if not path.is_file():
        raise OvkitError(f"{path_text}: no such eval output")
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OvkitError(f"{path}: not readable JSON ({e})") from None
    summary = doc if "categories" in doc else _summary_from_lmms(doc, path)
    summary["_path"] = str(path)  # where it was read from: per-row values live beside it (row_values)
    if not label:
        label = path.parent.resolve().name or path.stem  # the eval output's directory (lmms-eval: the model folder)
    return label, summary


def _summary_from_lmms(doc: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """A summary from an lmms-eval results file: each task (results, then groups) becomes a category holding its
    metrics by name (`"<metric>,<filter>"`, the `none` filter preferred, stderr and non-numbers left out) and, from
    `n-samples`, its row count. ovkit's own results files map one to one; another harness's tasks keep their own
    metric names (see metric_value)."""
    if not isinstance(doc.get("results"), Mapping):
        raise OvkitError(f"{path}: neither an ovkit {SUMMARY} nor an lmms-eval results file")

    def metrics(entry: Any) -> dict[str, float]:
        found: dict[str, tuple[bool, float]] = {}
        for key, value in entry.items() if isinstance(entry, Mapping) else ():
            name, _, filt = str(key).partition(",")
            if name.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if name not in found or (filt == FILTER and not found[name][0]):
                found[name] = (filt == FILTER, float(value))
        return {name: v for name, (_, v) in found.items()}

    samples = doc.get("n-samples") if isinstance(doc.get("n-samples"), Mapping) else {}
    detail: dict[str, dict[str, float]] = {}
    for task, entry in [*doc["results"].items(), *(doc.get("groups") or {}).items()]:
        if task == "overall" or task in detail:
            continue
        detail[task] = metrics(entry)
        n = samples.get(task, {}) if isinstance(samples.get(task), Mapping) else {}
        if "rows" not in detail[task] and isinstance(n.get("effective", n.get("original")), int):
            detail[task]["rows"] = n.get("effective", n.get("original"))
    overall = metrics((doc.get("groups") or {}).get("overall", {}))
    # the file's row count is its tasks' n-samples (lmms-eval writes none for the whole run): known only when every
    # task has one, so a run's count is never a part of its rows
    counts = [detail[task].get("rows") for task in doc["results"]]
    if "rows" not in overall and counts and all(isinstance(n, int) for n in counts):
        overall["rows"] = sum(counts)
    return {"categories": {}, "detail": {"categories": detail, "overall": overall}, "harness": "lmms-eval"}


def headline(summary: Mapping[str, Any], metric: str, category: str) -> str | None:
    """The metric a category of another harness's results is shown under when it lacks `metric`: its only metric
    (e.g. mmmu_acc, exact_match), else None (several, e.g. MME's perception and cognition scores: --metric picks)."""
    found = summary.get("detail", {}).get("categories", {}).get(category, {})
    if summary.get("harness") != "lmms-eval" or metric in found:
        return None
    names = [k for k in found if k != "rows"]
    return names[0] if len(names) == 1 else None


def unmapped(runs: Sequence[tuple[str, Mapping[str, Any]]], metric: str) -> list[str]:
    """One warning per task of an lmms-eval results file that the table cannot show under `metric`."""
    notes = []
    for label, s in runs:
        if s.get("harness") != "lmms-eval":
            continue
        for task, found in s.get("detail", {}).get("categories", {}).items():
            names = sorted(k for k in found if k != "rows")
            if metric not in found and headline(s, metric, task) is None:
                offer = (
                    f"it reports {', '.join(names)}: pass --metric with one of them"
                    if names
                    else "it reports no number"
                )
                notes.append(
                    f"{label}: lmms-eval task {task!r} has no {metric!r} and no single metric to show instead; {offer}"
                )
    return notes


def _where(summary: Mapping[str, Any], category: str | None) -> Mapping[str, Any]:
    """The detail entry of `category` (None = overall): its metrics by name and its row count."""
    detail = summary.get("detail", {})
    return detail.get("overall", {}) if category is None else detail.get("categories", {}).get(category, {})


def _raw(summary: Mapping[str, Any], metric: str, category: str | None) -> Any:
    """`metric` of `category` as stored, or the category's stand-in (headline) metric; None if neither."""
    where = _where(summary, category)
    value = where.get(metric)
    if value is None and category is not None:
        value = where.get(headline(summary, metric, category) or "")
    return value


def _as_reported(summary: Mapping[str, Any], metric: str, category: str | None) -> bool:
    """Whether a cell holds another harness's number outside [0, 1] (a score or a percentage), shown unscaled."""
    raw = _raw(summary, metric, category) if summary.get("harness") == "lmms-eval" else None
    return raw is not None and not 0.0 <= float(raw) <= 1.0


def metric_value(summary: Mapping[str, Any], metric: str, category: str | None) -> float | None:
    """One number of a run: `metric` of `category` (None = overall), or None where the run lacks it."""
    value = _raw(summary, metric, category)
    if _as_reported(summary, metric, category):
        value = float(value) / 100  # a score or a percentage: shown as the harness reports it (the table is x 100)
    if value is None and metric == summary.get("metric", "reward"):
        value = summary.get("overall") if category is None else summary.get("categories", {}).get(category)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


METRIC_TITLES = {
    "reward": "mean reward x 100",
    "accuracy": "accuracy x 100 (share of completions with reward >= 0.5)",
    "truncated": "share of completions cut by --max-new-tokens x 100",
}


def row_values(summary: Mapping[str, Any], metric: str = "reward") -> dict[str, tuple[str, float]] | None:
    """Per-row `metric` of a run, {row id: (category, value)}, from the `_samples_<task>.jsonl` files written with its
    results; None when they are not there (e.g. a bare lmms-eval results file)."""
    results = summary.get("results")
    if not results or "_path" not in summary:
        return None
    results_path = Path(summary["_path"]).parent / results
    prefix = results_path.name.removesuffix("_results.json")
    files = sorted(results_path.parent.glob(f"{prefix}_samples_*.jsonl"))
    if not files:
        return None
    # a file is named by safe_name(task): map it back to the category as the summary (and the table) spells it
    named = {safe_name(c): c for c in _categories(summary)}
    out: dict[str, tuple[str, float]] = {}
    for f in files:
        task = f.stem[len(prefix) + len("_samples_") :]
        for line in f.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if metric in rec:
                    out[str(rec["id"])] = (named.get(task, task), float(rec[metric]))
    return out or None


def paired_change(
    before: Mapping[str, tuple[str, float]], after: Mapping[str, tuple[str, float]], category: str | None = None
) -> tuple[float, float] | None:
    """(mean change, half-width of its 95% interval) of `after` against `before`, two runs' `row_values`, paired over
    the rows both scored (in `category`, for both runs; None = every row); None where they share no such row. Pairing
    cancels what the rows share (their difficulty), so a change is seen that two cells' own intervals would hide."""
    common = sorted(
        i for i in before.keys() & after.keys() if category is None or before[i][0] == after[i][0] == category
    )
    if not common:
        return None
    return paired_difference([after[i][1] for i in common], [before[i][1] for i in common])


PAIRED_BY = ("overall", "category")  # eval --paired-by: the paired change of overall only, or of every category too


def compare_table(
    runs: Sequence[tuple[str, Mapping[str, Any]]], metric: str = "reward", ci: bool = True, paired_by: str = "overall"
) -> str:
    """A markdown table, aligned so it also reads in a terminal: rows = categories (then `overall`, the mean over
    all rows), columns = runs in the given order, values = `metric` x 100 with the half-width of its 95% Wilson
    interval (`ci`); `-` where a run lacks a category. When the runs' per-row results are at hand, a last row gives
    each run's change in `overall` against the column before it, paired over the rows both scored, with its 95%
    interval: the number that says whether a stage helped. `paired_by="category"` adds a second table of that
    paired change for every category, since two overlapping cell intervals can hide a change the pairing shows."""
    if paired_by not in PAIRED_BY:
        raise OvkitError(f"--paired-by must be one of {', '.join(PAIRED_BY)}, got {paired_by!r}")
    if not runs:
        raise OvkitError("--compare needs at least one eval output")
    categories = sorted({c for _, s in runs for c in _categories(s)})
    if not any(metric_value(s, metric, c) is not None for _, s in runs for c in [None, *categories]):
        raise OvkitError(
            f"--metric {metric}: no run reports it (reward and accuracy always exist; pass@k needs --n > 1)"
        )
    header = ["category", *[label for label, _ in runs]]

    def cell(s: Mapping[str, Any], c: str | None) -> str:
        value = metric_value(s, metric, c)
        text = _cell(value, _rows(s, c) if ci and not _as_reported(s, metric, c) else 0)
        stand_in = headline(s, metric, c) if c is not None else None
        return f"{text} ({stand_in})" if stand_in and value is not None else text

    body = [[c, *[cell(s, c) for _, s in runs]] for c in categories]
    body.append(["**overall**", *[cell(s, None) for _, s in runs]])
    values = [row_values(s, metric) for _, s in runs] if len(runs) > 1 else []
    deltas = ["", *_paired_cells(values, None)] if values and all(v is not None for v in values) else None
    if deltas:
        body.append(["**change vs left**", *deltas])
    title = METRIC_TITLES.get(metric, f"{metric} x 100")
    lines = _aligned(header, body)
    note = f"Held-out {title}; rows = categories, columns = runs; overall = mean over all rows."
    if ci:
        note += " +- = the larger side of the 95% Wilson interval of the mean over the cell's rows."
    if deltas:
        note += " change vs left: overall minus the column to its left, paired over the same rows, +- its 95% interval."
    if any(s.get("harness") == "lmms-eval" for _, s in runs):
        note += (
            f" lmms-eval results: a task without {metric!r} shows its only metric (named in the cell); values"
            " outside [0, 1] (scores, percentages) are shown as the harness reports them, without an interval."
        )
    counts = {label: n for label, s in runs if (n := _rows(s, None))}  # 0: not known (lmms-eval without n-samples)
    if len(set(counts.values())) > 1:  # e.g. one run used --limit: its numbers are not comparable row for row
        note += " Runs scored different rows: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + "."
    out = [note, "", *lines]
    if paired_by == "category":
        out += ["", *_paired_by_category(runs, values, categories, metric, title)]
    return "\n".join(out) + "\n"


def _paired_by_category(
    runs: Sequence[tuple[str, Mapping[str, Any]]],
    values: Sequence[Mapping[str, tuple[str, float]] | None],
    categories: Sequence[str],
    metric: str,
    title: str,
) -> list[str]:
    """The lines of the second table of `--paired-by category`: rows = categories then overall, columns = each run
    after the first, cell = its paired change against the run before it; one line instead where it cannot be built."""
    if len(runs) < 2:
        return ["--paired-by category: a paired change needs at least two runs."]
    unread = [label for (label, _), v in zip(runs, values) if v is None]
    # a run without them: a bare lmms-eval results file (no _samples_*.jsonl beside it), or rows without `metric`
    missing = f"no per-row {metric!r} for {', '.join(unread)} (no _samples_*.jsonl beside its results, or none has it)"
    if all(a is None or b is None for a, b in zip(values, values[1:])):
        return [f"--paired-by category: no paired change to show, {missing}."]
    header = ["category", *[f"{label} vs {before}" for (before, _), (label, _) in zip(runs, runs[1:])]]
    body = [[c, *_paired_cells(values, c)] for c in categories]
    body.append(["**overall**", *_paired_cells(values, None)])
    note = (
        f"Held-out {title}, change per category: `B vs A` = B minus A, paired over the rows both scored in the"
        " category (overall: all rows), +- its 95% interval; - where a run lacks the category or its per-row results."
    )
    if unread:
        note += f" {missing[0].upper()}{missing[1:]}."
    return [note, "", *_aligned(header, body)]


def _aligned(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table's lines, padded so its columns line up in a terminal (first left-, the rest right-aligned)."""
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "| " + " | ".join([first, *[c.rjust(w) for c, w in zip(cells[1:], widths[1:])]]) + " |"

    rule = "|" + "|".join(["-" * (widths[0] + 2), *["-" * (w + 1) + ":" for w in widths[1:]]]) + "|"
    return [line(header), rule, *[line(r) for r in body]]


def _rows(summary: Mapping[str, Any], category: str | None) -> int:
    return int(_where(summary, category).get("rows", 0) or 0)


def _paired_cells(values: Sequence[Mapping[str, tuple[str, float]] | None], category: str | None) -> list[str]:
    """One cell per run after the first: its `paired_change` against the run before it in `category` (None = overall)
    x 100, `+-` its 95% interval; `-` where either run's per-row values are missing or they share no row there."""
    cells = []
    for before, after in zip(values, values[1:]):
        change = paired_change(before, after, category) if before is not None and after is not None else None
        cells.append("-" if change is None else f"{100 * change[0]:+.1f} ±{100 * change[1]:.1f}")
    return cells


def _categories(summary: Mapping[str, Any]) -> list[str]:
    return list(summary.get("detail", {}).get("categories", {}) or summary.get("categories", {}))


def _cell(value: float | None, rows: int = 0) -> str:
    """`45.3 ±3.1`: the value x 100 and the larger side of its 95% Wilson interval (no interval without a row count,
    or for a metric outside [0, 1])."""

    if value is None:
        return "-"
    if rows <= 0 or not 0.0 <= value <= 1.0:
        return f"{100 * value:.1f}"
    lo, hi = wilson_interval(value, rows)
    return f"{100 * value:.1f} ±{100 * max(value - lo, hi - value):.1f}"
