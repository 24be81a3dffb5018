"""Scorers for the worker-pool tests (tests/test_rewards_security.py); no tests here.

They live in their own small module because worker processes import a scorer by name: importing this module is
cheap, importing a test module (pytest and all) in every fresh worker is not.
"""

from __future__ import annotations

import os
import time

from ovkit.rewards.base import Reward


def record_pid_then_sleep(completion: str, answer: str, *, path: str) -> Reward:
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    return Reward(1.0, {})


def allocate(completion: str, answer: str) -> Reward:
    block = bytearray(16 << 30)  # 16 GiB: far beyond the worker's address-space limit
    return Reward(float(len(block) > 0), {})


def crash(completion: str, answer: str) -> Reward:
    os._exit(3)


def buggy(completion: str, answer: str) -> Reward:
    raise ValueError("a bug in a scorer")


def echo_length(completion: str, answer: str) -> Reward:
    return Reward(min(1.0, len(completion) / 10), {"pid": os.getpid()})
