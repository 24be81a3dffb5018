"""Evaluation: generate on held-out rows, score with `ovkit.rewards`, report per category / source / overall in the
lmms-eval layout, and compare runs in one table (`ovkit eval`, `ovkit eval --compare`)."""

from ovkit.evaluate.metrics import CORRECT, aggregate, pass_at_k, row_metrics, summarize
from ovkit.evaluate.results import compare_table, load_run
from ovkit.evaluate.run import EvalConfig, load_rows, run_eval

__all__ = [
    "CORRECT",
    "EvalConfig",
    "aggregate",
    "compare_table",
    "load_rows",
    "load_run",
    "pass_at_k",
    "row_metrics",
    "run_eval",
    "summarize",
]
