"""What each command does under a launcher (`torchrun --nproc_per_node N` or `accelerate launch`).

| commands (their config's `launcher`) | under N processes |
|---|---|
| align, midtrain, sft, rl-train | one run over N processes (data-parallel; ovkit.runtime), written once by the main
process after every process has finished |
| convert, balance, pack, caption, rl-curate | process r runs `--shard r/N`: it writes OUT/part-r-of-N/ (complete or
absent on its own), the output N machines with `--shard I/N` would write; the next stage reads OUT as one dataset only
when every part is complete (ovkit.data.io) |
| eval | the processes share the rows (process r scores rows r, r + N, ...; each row sampled from its own seed) and the
main process writes the one output, the one a single process writes apart from its timings |
| synth, init-model, mismatch-report, eval --compare | refused at start (exit 2): they run in one process |

A launcher that asked for N processes and started one (`accelerate launch --num_processes 2` on a machine without
GPUs starts several processes only through MPI, else one, and says nothing) is an error naming it and what works, not
a silent single-process run. An engine the launcher's config asked for that this machine does not run (FSDP or
DeepSpeed without CUDA: accelerate runs plain data-parallel processes) is named in a warning, and ovkit.json's
`runtime` records what ran (`distributed`) beside what was asked (`requested_distributed`).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.options import DATA_PARALLEL, ONE_PROCESS, RANK_SHARDED, ROW_SHARED, StageConfig


def processes() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment ((0, 1) without one)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def check(command: str, cfg: StageConfig) -> None:
    """Refuse what a command cannot do under the launcher, and give a rank-sharded command its shard. The policy is
    the stage config's `launcher` class attribute (ovkit.options: DATA_PARALLEL, RANK_SHARDED, ROW_SHARED,
    ONE_PROCESS)."""
    rank, world = processes()
    if world == 1:
        asked = _accelerate_asked()
        if asked > 1:
            raise OvkitError(
                f"accelerate launch asked for {asked} processes and started one: without GPUs, accelerate launch "
                f"starts "
                "several processes only through MPI (its config's mpirun_config: mpirun_hostfile, with Intel MPI / "
                "oneCCL "
                f"installed), whatever its distributed_type; run `torchrun --nproc_per_node {asked} -m ovkit "
                f"{command} ...` "
                "(gloo over the CPU cores) instead"
            )
        return
    launcher = f"a launcher started {world} processes (WORLD_SIZE={world})"
    policy = getattr(type(cfg), "launcher", ONE_PROCESS)
    if policy == DATA_PARALLEL or (policy == ROW_SHARED and not getattr(cfg, "compare", False)):
        return
    if policy == RANK_SHARDED and hasattr(cfg, "shard"):
        if cfg.shard not in (None, ""):
            raise OvkitError(
                f"ovkit {command}: --shard {cfg.shard} under {launcher}: the processes are the shards; drop --shard"
            )
        cfg.shard = f"{rank}/{world}"
        return
    raise OvkitError(
        f"ovkit {command} runs in one process, but {launcher}: run it without torchrun / accelerate launch"
    )


ENGINE_FLAGS = {
    "ACCELERATE_USE_FSDP": "FSDP",
    "ACCELERATE_USE_DEEPSPEED": "DEEPSPEED",
    "ACCELERATE_USE_MEGATRON_LM": "MEGATRON_LM",
}


def requested_engine() -> str | None:
    """The distributed engine `accelerate launch` was asked for (FSDP, DEEPSPEED, MEGATRON_LM: its environment, else
    its config file's distributed_type); None outside accelerate launch or without one."""
    for var, name in ENGINE_FLAGS.items():
        if os.environ.get(var, "").lower() in ("1", "true"):
            return name
    if not any(k.startswith("ACCELERATE_") for k in os.environ):
        return None
    value = str(_launch_config().get("distributed_type") or "").upper()
    return value if value in ENGINE_FLAGS.values() else None


def engine_warning(ran: str) -> str | None:
    """The warning for an engine that was asked for and not run (`ran`: accelerate's distributed_type), or None."""
    asked = requested_engine()
    if asked is None or asked == ran:
        return None
    return (
        f"warning: accelerate launch asked for {asked}, but this run is {ran} (accelerate runs {asked} only on CUDA "
        f"GPUs; "
        "without them its processes are plain data-parallel, each holding the whole model and optimiser state): the "
        f"same updates, not {asked}'s memory savings. ovkit.json records distributed: {ran}. On this machine use "
        "`torchrun --nproc_per_node N -m ovkit ...`; on GPUs the same config runs FSDP / DeepSpeed."
    )


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


def close() -> None:
    """Tear down the launcher's process group if this run set one up. A gloo group left to the interpreter's exit can
    abort the process there ("terminate called without an active exception", SIGABRT: seen in CI on a 2-process eval
    that had finished its work; a 10-line torchrun script of gather_object and exit fails so in 4-5 runs of 25 here,
    and in 0 of 25 with destroy_process_group before exit, with or without a barrier first). No barrier: every
    collective has completed on both sides when it returns, and a barrier could outlast the NCCL timeout while the
    main process is still writing the output, which would abort the others. Never imports torch: a run that did not
    load it has no group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- the run's outcome is decided; a failed teardown must not change its exit code
        pass


def _accelerate_asked() -> int:
    """The process count `accelerate launch` was asked for when it started this process (0: not accelerate)."""
    if not any(k.startswith("ACCELERATE_") for k in os.environ):
        return 0
    try:
        args = shlex.split(
            Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
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
    return _int(_launch_config(args).get("num_processes", 0))


def _launch_config(args: list[str] | None = None) -> dict[str, Any]:
    """The config file `accelerate launch` read (its --config_file, else accelerate's default one), as a dict."""
    if args is None:
        try:
            args = shlex.split(
                Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            return {}
        if "launch" not in args:
            return {}
    path = None
    for flag in ("--config_file", "--config-file"):
        if flag in args and args.index(flag) + 1 < len(args):
            path = Path(args[args.index(flag) + 1])
    if path is None:
        home = Path(
            os.environ.get("HF_HOME", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface")
        )
        path = home / "accelerate" / "default_config.yaml"
    try:
        import yaml

        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
