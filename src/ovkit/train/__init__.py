"""Supervised training: one engine (`train`) behind `ovkit align`, `ovkit midtrain` and `ovkit sft`."""

from ovkit.train.config import STAGE_CONFIGS, AlignConfig, MidtrainConfig, SFTConfig, TrainConfig
from ovkit.train.loop import Result, train

__all__ = ["AlignConfig", "MidtrainConfig", "Result", "SFTConfig", "STAGE_CONFIGS", "TrainConfig", "train"]
