"""ovkit: run and study the LLaVA-OneVision-1.5 recipe end to end."""

__version__ = "0.1.0"
