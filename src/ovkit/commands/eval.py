"""`ovkit eval`: score a model on held-out rows per category; `ovkit eval --compare`: one table across runs."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from ovkit.commands._common import done, dropped, resolve, skipped, stage


@stage(
    "ovkit.evaluate.run:EvalConfig",
    required=("data",),
    example="ovkit eval runs/tiny/data/eval --model runs/tiny/models/sft --out runs/tiny/eval/sft --config "
    "examples/tiny/eval.yaml",
)
def evaluate(ctx: typer.Context) -> None:
    """Evaluate a model on held-out rows: mean reward and accuracy per category, per source and overall."""
    from ovkit.evaluate import compare_table, load_run, run_eval
    from ovkit.evaluate.results import unmapped
    from ovkit.launch import processes
    from ovkit.runs import Stage, claim, finished

    cfg = resolve(ctx)
    if cfg.compare:
        target = _compare_target(cfg.out) if cfg.out is not None else None  # refused before anything is read
        runs = [load_run(p) for p in cfg.data]
        for note in unmapped(runs, cfg.metric):
            typer.echo(f"warning: {note}", err=True)
        table = compare_table(runs, cfg.metric, paired_by=cfg.paired_by)
        typer.echo(table, nl=False)
        if cfg.out is not None:
            _write_text(target, table)
            done(f"eval --compare: {len(cfg.data)} runs -> {cfg.out}")
        return
    rank, world = processes()
    if rank > 0:  # under a launcher: score this process's share of the rows; the main process writes OUT
        claim(cfg.out)  # as the main process's Stage does: a path ovkit did not write stops every process
        if not finished(cfg.out, cfg, cfg.overwrite):
            run_eval(cfg, None)
        return
    stage = Stage(
        "eval", cfg, cfg.out, inputs=[*cfg.data, cfg.model], overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model
    )
    if stage.skipped:
        return skipped(cfg.out)
    with stage:
        stage.extra["runtime"] = {"processes": world}
        stage.metrics.update(run_eval(cfg, stage.path))
    m = stage.metrics
    done(
        f"eval: reward {m['overall']:.3f}, accuracy {m['accuracy']:.3f} on {m['rows']} rows x {cfg.n} "
        f"({len(m['categories'])} categories, {m['truncated']:.0%} truncated) in {m['seconds']['total']}s -> {cfg.out}"
    )
    dropped(
        "eval",
        "left out",
        {f"row(s) beyond --limit {cfg.limit} per category": m.get("rows_beyond_limit", 0)},
        f"not scored; counted in {cfg.out}/ovkit.json (metrics.rows_beyond_limit)",
    )


# The first line of every table --compare writes (an HTML comment: invisible where the markdown renders): a file
# without it is not ovkit's, and is never replaced (ovkit.runs.claim's rule for files).
COMPARE_MARK = "<!-- written by ovkit eval --compare; a rerun replaces it -->\n"


def _compare_target(path: Path) -> Path:
    """The file --compare writes (`compare.md` in a directory), after checking that it is absent or ovkit's."""
    from ovkit.errors import OvkitError

    path = Path(path)
    if path.is_dir():
        path = path / "compare.md"
    if path.exists() or path.is_symlink():
        try:
            ours = path.is_file() and path.open(errors="replace").readline() == COMPARE_MARK
        except OSError:
            ours = False
        if not ours:
            raise OvkitError(
                f"--out {path} exists and ovkit did not write it (it is not a table of eval --compare), so it never "
                f"replaces it; choose another --out, or move {path} away yourself"
            )
    return path


def _write_text(path: Path, text: str) -> None:
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        f.write(COMPARE_MARK + text)  # a fresh name: no file of the user's is written over on the way
    os.replace(f.name, path)
