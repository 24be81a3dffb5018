"""Scorers for the worker-pool tests (tests/test_rewards_security.py, tests/test_sandbox_escapes.py); no tests here,
and not named test_*: pytest does not collect it, and no test module imports another.

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


def ours_or_orphaned(pid: int) -> bool:
    """Whether process `pid` is this test process's descendant, or an orphan (re-parented to PID 1): what a sandbox
    run of this process could have left behind. A live process under another parent is another test run's (two
    suites on one machine), not a leak of ours."""
    me, seen = os.getpid(), set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if ppid == me or ppid == 1 and len(seen) == 1:
            return True
        pid = ppid
    return False
