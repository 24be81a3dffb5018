"""What each command does under a launcher (`torchrun --nproc_per_node N` or `accelerate launch`).

| commands | under N processes |
|---|---|
| align, midtrain, sft, rl-train | one run over N processes (data-parallel; ovkit.runtime), written once by the main process after every process has finished |
| convert, balance, pack, caption, rl-curate | process r runs `--shard r/N`: it writes OUT/part-r-of-N/ (complete or absent on its own), the output N machines with `--shard I/N` would write; the next stage reads OUT as one dataset only when every part is complete (ovkit.data.io) |
| eval | the processes share the rows (process r scores rows r, r + N, ...; each row sampled from its own seed) and the main process writes the one output, the one a single process writes apart from its timings |
| synth, init-model, mismatch-report, eval --compare | refused at start (exit 2): they run in one process |

A launcher that asked for N processes and started one (`accelerate launch --num_processes 2` on a CPU machine without
a MULTI_CPU config starts one process and says nothing) is an error naming it, not a silent single-process run.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError

DATA_PARALLEL = frozenset({"align", "midtrain", "sft", "rl-train"})
RANK_SHARDED = frozenset({"convert", "balance", "pack", "caption", "rl-curate"})
ROW_SHARED = frozenset({"eval"})


def processes() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment ((0, 1) without one)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check(command: str, cfg: Any) -> None:
    """Refuse what a command cannot do under the launcher, and give a rank-sharded command its shard."""
    rank, world = processes()
    if world == 1:
        asked = _accelerate_asked()
        if asked > 1:
            raise OvkitError(
                f"accelerate launch asked for {asked} processes and started one (on a CPU machine accelerate needs a "
                "config with distributed_type: MULTI_CPU); use `torchrun --nproc_per_node N -m ovkit ...` or fix the config"
            )
        return
    launcher = f"a launcher started {world} processes (WORLD_SIZE={world})"
    if command in DATA_PARALLEL or (command in ROW_SHARED and not getattr(cfg, "compare", False)):
        return
    if command in RANK_SHARDED and hasattr(cfg, "shard"):
        if cfg.shard not in (None, ""):
            raise OvkitError(f"ovkit {command}: --shard {cfg.shard} under {launcher}: the processes are the shards; drop --shard")
        cfg.shard = f"{rank}/{world}"
        return
    raise OvkitError(f"ovkit {command} runs in one process, but {launcher}: run it without torchrun / accelerate launch")


def share(n: int) -> list[int]:
    """This process's rows of `n` (r, r + N, r + 2N, ...: deterministic, and balanced within one row)."""
    rank, world = processes()
    return list(range(rank, n, world))


def gather(items: list) -> list:
    """Every process's `items` (picklable), concatenated in rank order, on every process; `items` with one process.
    Sets up the launcher's process group (gloo on CPU, NCCL on CUDA) on first use."""
    if processes()[1] == 1:
        return items
    import torch
    from accelerate import PartialState
    from accelerate.utils import gather_object

    PartialState(cpu=not torch.cuda.is_available())
    return gather_object(items)


def _accelerate_asked() -> int:
    """The process count `accelerate launch` was asked for when it started this process (0: not accelerate)."""
    if not any(k.startswith("ACCELERATE_") for k in os.environ):
        return 0
    try:
        args = shlex.split(Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    except OSError:
        return 0
    if "launch" not in args:
        return 0
    for flag in ("--num_processes", "--num-processes"):
        if flag in args and args.index(flag) + 1 < len(args):
            return _int(args[args.index(flag) + 1])
        for a in args:
            if a.startswith(flag + "="):
                return _int(a.split("=", 1)[1])
    for flag in ("--config_file", "--config-file"):
        if flag in args and args.index(flag) + 1 < len(args):
            return _from_config(Path(args[args.index(flag) + 1]))
    return 0


def _from_config(path: Path) -> int:
    try:
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError):
        return 0
    return _int(data.get("num_processes", 0))


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
