"""Recaptioning: generate a caption per image with any VLM, filter it with the released rules, measure it against
ground-truth concepts where the data has them, and keep the original beside it. The stage is `ovkit.caption.run`."""

from ovkit.caption.filter import REFUSALS, CaptionFilter, longest_run, words
from ovkit.caption.quality import concept_recall, parse_concepts

__all__ = ["REFUSALS", "CaptionFilter", "concept_recall", "longest_run", "parse_concepts", "words"]
