"""`python -m ovkit.science RUN [--science DIR]`: write DIR/report.md, report.html and report.json (DIR defaults
to RUN/science) from the outputs of `make full-pipeline` and `make science`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ovkit.science", description=__doc__)
    parser.add_argument("run", type=Path, help="the pipeline's run directory (make full-pipeline RUN=...)")
    parser.add_argument(
        "--science", type=Path, default=None, help="where make science wrote its runs (default RUN/science)"
    )
    args = parser.parse_args(argv)
    if not args.run.is_dir():
        print(f"error: {args.run}: no such run directory", file=sys.stderr)
        return 2
    from ovkit.science import build_report

    rep = build_report(args.run, args.science)
    out = args.science or args.run / "science"
    print(f"science report: {len(rep.findings)} findings, {len(rep.figures)} figures -> {out / 'report.html'}")
    for f in rep.findings:
        print(f"  [{f['source']}] {f['claim']}: {f['measured']} -> {f['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
