"""Failures of the machine rather than of the input (issue #28): two writers of one output, a stop asked by a signal,
the device out of memory.

One writer per output. Every run holds an advisory lock on its output `OUT` for its whole life: `fcntl.flock` on
`OUT.lock` beside it (`OUT/part-I-of-N.lock` for a `--shard` part, so the parts of one output still run in parallel).
The kernel drops the lock when the process dies, however it dies, so a killed run never blocks the next one; the
holder writes its pid, host, command and start time into the file, and a second run exits 2 naming them. A run removes
its lock file when it ends; one left by a killed run is taken over by the next. A file of that name that is not an
ovkit lock (not empty, not a holder's line) is the user's: the run exits 2 naming it and leaves it as it is. flock is
advisory and per machine on local disks; on NFS (v4, or v3 with lockd) Linux turns it into a POSIX lock the server
arbitrates across hosts.

Interrupted on purpose. SIGINT (Ctrl-C) and SIGTERM (SLURM or Kubernetes preemption, `kill`) are handled by the CLI
(`signals()`). A learner's loop runs with the stop deferred (`with deferred_signals():` around it): the first signal
is noted, the step finishes, a checkpoint is written and the run exits saying `--resume` continues it (torchtitan and
Lightning do the same); a data stage stops at once and its temporary output is removed (ovkit.runs.Stage), so a
re-run starts clean. A second signal stops at once, whatever runs. Either way there is no traceback and the exit code
is the shell's for a death by that signal, 128 + its number (130 for SIGINT, 143 for SIGTERM): a job script or
scheduler sees a run that did not finish (a requeue rule can match it), and `set -e` scripts stop as they would after
Ctrl-C.

Out of space or not writable. Where it can be, before the work starts: taking `OUT.lock` beside the output proves
its directory writable (a read-only or forbidden place exits 2 there), and a learner compares a rough size of what it
will write (checkpoints, the final model, rollout tables) with the free space (`check_space`). Where it happens: an
OSError with ENOSPC, EDQUOT, EROFS or EACCES during a write (safetensors' and torch.save's own errors included, which
carry no errno: `write_failure`) ends in one line naming the path, the free and the needed space where known and what
to do, exit 2; the Stage removes its temporary output, a learner removes the checkpoint it was writing and keeps the
last complete one for `--resume`.

Out of GPU memory. torch.cuda.OutOfMemoryError anywhere ends in one message (the stage, the step, tokens per
micro-batch, peak and total device memory where known, the options that need less) and exit 3, apart from bad input's
2: a learner keeps its last checkpoint (ovkit.runtime.Runtime.out_of_memory), a data stage its finished chunks.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ovkit.errors import OvkitError

# Locks this process holds, by output: a learner's Runtime holds its OUT and its final Stage takes the same lock again.
_held: weakref.WeakValueDictionary[str, OutputLock] = weakref.WeakValueDictionary()


def lock_path(out: Path) -> Path:
    out = Path(out)
    return out.with_name(f"{out.name}.lock")


def hold(out: Path, command: str) -> OutputLock:
    """The lock on `out` for this process (taken now, or taken again: release() once per hold())."""
    key = os.path.abspath(out)
    lock = _held.get(key)
    if lock is None:
        lock = OutputLock(Path(out), command)
        _held[key] = lock
    lock.acquire()
    return lock


class OutputLock:
    """An exclusive flock on `OUT.lock`, counted: the file is unlocked and removed when the last user releases it (or
    when the object is collected, or the process ends)."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = Path(out), command
        self.path = lock_path(self.out)
        self.users = 0
        self._fd: int | None = None
        self._made: list[Path] = []  # directories created to hold the lock file, removed again if still empty

    def acquire(self) -> OutputLock:
        if self.users == 0:
            self._lock()
        self.users += 1
        return self

    def release(self) -> None:
        self.users = max(0, self.users - 1)
        if self.users == 0:
            self._unlock()

    def __del__(self) -> None:
        self._unlock()

    def _lock(self) -> None:
        parent = self.path.parent
        missing = [p for p in [parent, *parent.parents] if not p.exists()]
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OvkitError(
                f"--out {self.out}: cannot create {parent} ({e.strerror}); choose a writable place"
            ) from None
        self._made = missing
        if self.path.is_dir() or (self.path.exists() and not self.path.is_file()):
            self._remove_made()
            raise OvkitError(_not_a_lock(self.path, self.out))
        for _ in range(10):  # the holder may remove the file between our open and our flock: then lock the new one
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                self._remove_made()
                raise OvkitError(
                    f"--out {self.out}: cannot write in {parent} ({e.strerror}); choose a writable place"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._remove_made()
                raise OvkitError(
                    f"{self.out} is being written by another run ({holder(self.path)}); wait for it to end, "
                    f"or stop it and run again (a stopped or killed run releases its lock)"
                ) from None
            except OSError as e:  # a filesystem without flock: go on unguarded, and say so
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                print(
                    f"warning: {self.path}: this filesystem cannot lock ({e.strerror}); nothing stops a second run "
                    f"writing {self.out} at the same time",
                    file=sys.stderr,
                )
            if _same_file(fd, self.path):
                if not _is_lock_file(fd):  # locked, but the user's file: left exactly as it was
                    os.close(fd)
                    self._remove_made()
                    raise OvkitError(_not_a_lock(self.path, self.out))
                self._fd = fd
                self._write_holder()
                return
            os.close(fd)
        raise OvkitError(f"{self.path}: could not take the lock (the file keeps being replaced)")

    def _write_holder(self) -> None:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(info) + "\n").encode(), 0)

    def _unlock(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a run waiting on this file re-checks it (_same_file) and retries
        except OSError:
            pass
        os.close(fd)
        self._remove_made()

    def _remove_made(self) -> None:
        for d in self._made:  # innermost first
            try:
                d.rmdir()
            except OSError:
                break
        self._made = []


def _is_lock_file(fd: int) -> bool:
    """Whether the open file is empty (just made, by this run or by one killed before it wrote) or a holder's line."""
    size = os.fstat(fd).st_size
    if size == 0:
        return True
    if size > 4096:
        return False
    try:
        info = json.loads(os.pread(fd, size, 0))
    except ValueError:
        return False
    return isinstance(info, dict) and {"pid", "host", "command"} <= info.keys()


def _not_a_lock(path: Path, out: Path) -> str:
    return (
        f"{path} exists and is not an ovkit lock file: ovkit did not write it, so it never replaces or removes it; "
        f"a run of {out} keeps its lock there: move {path} away yourself, or choose another --out"
    )


def release_all() -> None:
    """Unlock every output this process holds: the CLI's last act, whichever way the command ended."""
    for lock in list(_held.values()):
        lock.users = 0
        lock._unlock()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder(path: Path) -> str:
    """`ovkit sft, pid 123 on host gpu7, since ...` from a lock file (the holder writes it just after locking)."""
    for _ in range(20):
        try:
            info = json.loads(Path(path).read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.05)
    else:
        return f"lock file {path}"
    here = " (this machine)" if info.get("host") == socket.gethostname() else ""
    return (
        f"ovkit {info.get('command')}, pid {info.get('pid')} on host {info.get('host')}{here}, since "
        f"{info.get('started')}; lock file {path}"
    )


# -- signals -------------------------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The run was stopped by `signum` (a BaseException, like KeyboardInterrupt: no `except Exception` swallows it).
    The CLI prints `message` and exits 128 + signum."""

    def __init__(self, signum: int, message: str | None = None):
        self.signum = int(signum)
        self.message = message or f"stopped by {signal.Signals(self.signum).name}"
        super().__init__(self.message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_asked: int | None = None  # the signal a deferred loop has not acted on yet
_defer = False


def _on_signal(signum: int, frame) -> None:
    global _asked
    if _defer and _asked is None:
        _asked = signum
        name = signal.Signals(signum).name
        print(
            f"\n{name}: stopping after this step, with a checkpoint (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        return
    if _asked is None:
        raise Interrupted(signum)
    raise Interrupted(
        signum,
        f"stopped at once by {signal.Signals(signum).name}; the run directory keeps its last "
        f"complete "
        f"checkpoint: run the same command with --resume to continue from it",
    )


@contextmanager
def signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted (or, in a deferred loop, are noted first) while the block runs; the
    previous handlers come back after it. Only the main thread can install handlers: elsewhere this does nothing."""
    global _asked, _defer
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    _asked, _defer = None, False
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        _asked, _defer = None, False


@contextmanager
def deferred_signals() -> Iterator[None]:
    """A learner's loop: while the block runs, the first SIGINT/SIGTERM waits for the step boundary (`asked`, which
    ovkit.runtime.Runtime.stop_if_asked acts on) and a second stops at once; after it a signal stops at once again
    (the final save and OUT's rename are quicker to finish than to resume)."""
    global _defer
    _defer = True
    try:
        yield
    finally:
        _defer = False


def asked() -> int | None:
    """The signal that asked a deferred loop to stop, if one did."""
    return _asked


# -- out of memory -------------------------------------------------------------------------------------------------

# The options that lower a data stage's memory (a learner's come from its config: Runtime.out_of_memory).
DATA_STAGE_OPTIONS = (
    "--batch-size (sequences per generate call), --max-new-tokens, --precision bf16, --max-pixels "
    "where the command has it"
)


def is_out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError)


def memory_note() -> str:
    """`peak 71.2 GiB of 79.1 GiB` on CUDA; empty elsewhere."""
    import torch

    if not torch.cuda.is_available():
        return ""
    try:
        peak, total = (
            torch.cuda.max_memory_allocated(),
            torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory,
        )
    except Exception:  # noqa: BLE001 -- the note is a courtesy: a broken device must not hide the message
        return ""
    return f"; peak {peak / 2**30:.1f} GiB allocated of {total / 2**30:.1f} GiB"


def out_of_memory_message(command: str, e: BaseException) -> str:
    return (
        f"{command}: out of GPU memory{memory_note()}; lower {DATA_STAGE_OPTIONS}; then run the same command again "
        f"(a stage that saves finished chunks resumes from them) "
        f"[{str(e).splitlines()[0][:200] if str(e) else type(e).__name__}]"
    )


# -- out of space or not writable ----------------------------------------------------------------------------------

# errno -> (what happened, what to do)
_WRITE_ERRNOS = {
    errno.ENOSPC: ("no space left on device", "free space there or choose another --out"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota or choose another --out"),
    errno.EROFS: ("read-only file system", "choose a writable --out"),
    errno.EACCES: ("permission denied", "choose a writable --out or fix its permissions"),
}
# Libraries that report a failed write without an OSError: safetensors (Rust's `... (os error 28)`) and torch.save
# (its C++ zip writer: `PytorchStreamWriter failed writing file`, `unexpected pos N vs M`, an iostream error).
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_STRERROR = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
}
_TORCH_WRITER = re.compile(
    r"PytorchStreamWriter failed writing|file write failed|unexpected pos \d+ vs \d+|iostream error"
)


def write_errno(e: BaseException, *, saving: bool = False, within: Path | None = None) -> int | None:
    """ENOSPC, EDQUOT, EROFS or EACCES when `e` (or what caused it) is a write that the machine refused; None
    otherwise. `saving`: `e` came from a save (torch.save's writer errors, which name no cause, count as ENOSPC).
    EACCES is also what reading a forbidden input raises: it counts only from a save or for a file under `within`."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen and not isinstance(e, OvkitError):  # an OvkitError is told already
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
            if e.errno != errno.EACCES or saving or _under(e.filename, within):
                return e.errno
        text = str(e)
        m = _RUST_OS_ERROR.search(text)
        if m and int(m[1]) in _WRITE_ERRNOS:
            return int(m[1])
        for words, code in _STRERROR.items():
            if words in text:
                return code
        if saving and _TORCH_WRITER.search(text):
            return errno.ENOSPC
        e = e.__cause__ or e.__context__
    return None


def _under(filename: object, root: Path | None) -> bool:
    if not filename or root is None:
        return False
    name, root_ = os.path.abspath(os.fsdecode(filename)), os.path.abspath(root)
    return name == root_ or name.startswith(root_.rstrip(os.sep) + os.sep)


def free_bytes(path: Path) -> int | None:
    """Free space for this user on the filesystem that holds `path` (or the nearest directory above it that exists)."""
    p = Path(os.path.abspath(path))
    for q in [p, *p.parents]:
        if q.exists():
            try:
                return shutil.disk_usage(q).free
            except OSError:
                return None
    return None


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def write_failure(
    e: BaseException,
    path: Path,
    *,
    needed: int | None = None,
    then: str = "then run the same command again",
    saving: bool = False,
    within: Path | None = None,
) -> OvkitError | None:
    """The one-line error for a write the machine refused (None when `e` is something else): the path (the file the
    OSError names, else `path`), why, the free and the needed space where known, what to do, and `then`."""
    code = write_errno(e, saving=saving, within=within)
    if code is None:
        return None
    what, fix = _WRITE_ERRNOS[code]
    named = getattr(e, "filename", None) or path
    space = ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(Path(named))
        known = [f"{size(free)} free"] if free is not None else []
        known += [f"about {size(needed)} needed"] if needed else []
        space = f" ({', '.join(known)})" if known else ""
    return OvkitError(f"{named}: could not write: {what}{space}; {fix}, {then}")


def check_space(out: Path, needed: int, what: str) -> None:
    """Exit 2 before the work starts when `what` (about `needed` bytes, a rough estimate) cannot fit where `out`
    goes."""
    free = free_bytes(out)
    if free is not None and needed > free:
        raise OvkitError(
            f"--out {out}: {what} need about {size(needed)}, and its filesystem has {size(free)} free; "
            f"free space there or choose another --out"
        )
