"""`ovkit science-report`: the report of `make science` (the seed write-ups' findings on sampler/learner mismatch and
data balancing, rerun with ovkit's own commands), built from the files the pipeline's runs wrote."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import typer

from ovkit import options as O
from ovkit.commands._common import done, resolve, stage
from ovkit.errors import OvkitError
from ovkit.options import option


@dataclass
class ScienceReportConfig(O.StageConfig):
    """Options of `ovkit science-report` (ovkit.science.build_report)."""

    launcher: ClassVar[str] = O.ONE_PROCESS

    run: Path | None = option(None, help="The pipeline's run directory (`make full-pipeline RUN=...`).", argument=True)
    science: Path | None = option(
        None, help="Where `make science` wrote its runs, and where the report goes. Default: RUN/science.", panel=O.IO
    )
    quiet: bool = O.quiet()

    def __post_init__(self) -> None:
        if self.run is None:
            raise OvkitError("RUN is required: the pipeline's run directory")


@stage(
    ScienceReportConfig,
    required=("run",),
    example="ovkit science-report runs/tiny --science runs/tiny/science",
)
def science_report(ctx: typer.Context) -> None:
    """Write SCIENCE/report.md, report.html and report.json from the outputs of `make full-pipeline` and
    `make science`: one line per finding, measured against the write-up's claim."""
    cfg = resolve(ctx)  # --quiet: the libraries' bars off (the report draws its figures with matplotlib)
    if not cfg.run.is_dir():
        raise OvkitError(f"{cfg.run}: no such run directory")
    from ovkit.science import build_report

    rep = build_report(cfg.run, cfg.science)
    out = cfg.science or cfg.run / "science"
    done(f"science report: {len(rep.findings)} findings, {len(rep.figures)} figures -> {out / 'report.html'}")
    for f in rep.findings:
        done(f"  [{f['source']}] {f['claim']}: {f['measured']} -> {f['verdict']}")
