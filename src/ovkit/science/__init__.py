"""The science report of `make science`: the seed write-ups' findings on sampler/learner mismatch, packing and
balancing, measured with ovkit's own commands and summarised one line per finding (`ovkit science-report RUN`)."""

from ovkit.science.report import build_report

__all__ = ["build_report"]
