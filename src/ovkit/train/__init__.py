"""Supervised training: one engine (`train`) behind `ovkit align`, `ovkit midtrain` and `ovkit sft`."""

from typing import Any

from ovkit.train.config import STAGE_CONFIGS, AlignConfig, MidtrainConfig, SFTConfig, TrainConfig

__all__ = ["AlignConfig", "MidtrainConfig", "Result", "SFTConfig", "STAGE_CONFIGS", "TrainConfig", "train"]


def __getattr__(name: str) -> Any:
    """`train` and `Result` load torch (ovkit.train.loop), so on first use: a config is checked without it."""
    if name in ("train", "Result"):
        from ovkit.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'ovkit.train' has no attribute {name!r}")
