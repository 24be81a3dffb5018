"""Scorers for the reward-pool tests, importable by the pool's worker processes (tests/ is on their sys.path)."""

import os
import time
from pathlib import Path

from ovkit.rewards.base import Reward


def slow(completion: str, answer: str) -> Reward:
    """Say which worker scores the item (a file named by its pid, in the directory `completion`), then take `answer`
    s."""
    (Path(completion) / str(os.getpid())).write_text(answer)
    time.sleep(float(answer))
    return Reward(1.0, {"pid": os.getpid()})


def die(completion: str, answer: str) -> Reward:
    """A worker that is killed whatever it scores."""
    os.kill(os.getpid(), 9)
    return Reward(1.0)
