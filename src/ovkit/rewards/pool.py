"""Killable worker processes for the scorers that run untrusted or unbounded work (math, svg, code).

Why not multiprocessing.Pool / ProcessPoolExecutor: neither can kill one stuck task. And why not multiprocessing's
forkserver: every process it starts re-imports the caller's `__main__` (a training script), and `fork` from the
caller copies its threads and CUDA state. So ovkit runs its own small fork server, the *zygote*: a fresh Python
process that imports SymPy, math-verify, cairosvg and scikit-image once and forks workers on request, so a
replacement after a kill starts in milliseconds.

Properties:
- hard per-item wall-clock limit: a task past its deadline scores 0 with `timeout=True` and its worker is SIGKILLed
  (by the zygote, which only signals its own un-reaped children, so a recycled pid is never hit);
- memory limit: each worker caps its address space (RLIMIT_AS) at its size after start-up plus `memory_mb`; a
  MemoryError scores 0 with `memory=True` and the worker is replaced;
- killed from outside (SIGKILL from the OOM killer, a crash): the worker is replaced and its item scored again on the
  fresh one (RETRIES_AFTER_CRASH), then it scores 0 with `crashed=True`; `worker_crashes` in its parts counts the
  deaths, and a dead idle worker is replaced when next checked out;
- no hang, no leaked process: the zygote exits (killing its workers) when its control socket closes, i.e. when the
  caller exits or dies; workers die with the zygote and sandboxed children with their worker (PR_SET_PDEATHSIG);
- thread-safe: each call checks workers out of a shared idle list under a lock, so concurrent calls (a training loop
  and an eval thread) never share a worker; a process that forks gets a fresh pool.
"""

from __future__ import annotations

import atexit
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ovkit.errors import OvkitError
from ovkit.rewards.base import Reward

DEFAULT_MEMORY_MB = 1024
# A worker killed from outside (the kernel's OOM killer picks the largest process, not the guilty one) has its item
# scored again on a fresh worker, this many times; then the item scores 0 with `crashed=True`. Either way the item's
# parts say `worker_crashes`, which rl-train sums into its step metrics.
RETRIES_AFTER_CRASH = 1
# Imported once by the zygote, so every worker forked from it starts with them (a missing one is skipped).
PRELOAD = ("numpy", "sympy", "math_verify", "cairosvg", "PIL.Image", "skimage.metrics", "ovkit.rewards")

Task = tuple[Callable[..., Reward], str, str, dict]


# ---- inside the worker -----------------------------------------------------------------------------------------


def _address_space_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _serve(conn: Connection, memory_mb: int) -> None:
    """The worker loop: one task at a time, (func, completion, answer, kwargs) in, (kind, value) out."""
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = _address_space_bytes() + (memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    while True:
        try:
            func, completion, answer, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reward = func(completion, answer, **kwargs)
            reply: tuple[str, Any] = ("ok", (reward.reward, reward.parts))
        except OvkitError as e:
            reply = ("user_error", str(e))
        except MemoryError:
            reply = ("memory", None)
        except Exception as e:  # a bug in a scorer: re-raised in the caller with the worker's traceback
            import traceback

            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return
        if reply[0] == "memory":
            return  # after a MemoryError the interpreter may be in a bad state: the pool starts a fresh worker


# ---- the zygote ------------------------------------------------------------------------------------------------


def _reap(live: set[int]) -> None:
    for pid in list(live):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            live.discard(pid)


def _warm_up() -> None:
    """Import the heavy libraries and run each sandboxed scorer once, so forked workers start warm (math-verify
    builds its grammars and scikit-image loads its submodules lazily, on first use)."""
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    from ovkit.rewards import markup, mathexpr, sandbox

    try:
        sandbox.isolation()  # probe bwrap and build the seccomp filter once; forked workers inherit the answer
    except OvkitError:
        pass  # an impossible OVKIT_SANDBOX request: reported by the first code item, in the caller

    shape = '<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="4" height="4"/></svg>'
    for warm in (
        lambda: mathexpr.math("<answer>\\frac{1}{2}</answer>", "0.5"),
        lambda: markup.svg(shape, shape.replace('"4"', '"5"')),
    ):
        try:
            warm()
        except Exception:
            pass


def zygote_main(fd: int) -> None:
    """Serve `spawn MEMORY_MB` (with the worker's socket attached) and `kill PID` on the control socket."""
    from ovkit.rewards.codeexec import _die_with_parent

    ctrl = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle; its exit closes our socket
    _warm_up()
    live: set[int] = set()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 256, 1)
        except OSError:
            break
        if not msg:
            break
        command, _, arg = msg.decode().partition(" ")
        _reap(live)
        if command == "spawn" and fds:
            pid = os.fork()
            if pid == 0:  # the worker
                code = 0
                try:
                    ctrl.close()
                    _die_with_parent()
                    _serve(Connection(fds[0]), int(arg))
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)
            os.close(fds[0])
            live.add(pid)
            ctrl.sendall(b"%d\n" % pid)
        elif command == "kill":
            pid = int(arg)
            if pid in live:  # an un-reaped child: its pid cannot have been recycled
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                live.discard(pid)
            ctrl.sendall(b"ok\n")
        else:
            for extra in fds:
                os.close(extra)
            ctrl.sendall(b"?\n")
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Zygote:
    """The caller's handle on the zygote process: one request at a time, under a lock."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        boot = (
            f"import sys; sys.path[:0] = {sys.path!r}; from ovkit.rewards.pool import zygote_main; "
            f"zygote_main({theirs.fileno()})"
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", boot], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env
        )
        theirs.close()
        self.ctrl = ours
        self.lock = threading.Lock()

    def _request(self, message: bytes, fds: list[int] = ()) -> bytes:  # type: ignore[assignment]
        with self.lock:
            socket.send_fds(self.ctrl, [message], list(fds))
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = self.ctrl.recv(64)
                if not chunk:
                    raise OSError("the reward worker zygote exited")
                reply += chunk
        return reply.strip()

    def spawn(self, memory_mb: int) -> tuple[int, Connection]:
        ours, theirs = socket.socketpair()
        try:
            pid = int(self._request(b"spawn %d" % memory_mb, [theirs.fileno()]))
        finally:
            theirs.close()
        return pid, Connection(ours.detach())

    def kill(self, pid: int) -> None:
        self._request(b"kill %d" % pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.ctrl.close()  # the zygote sees EOF, kills its workers and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Worker:
    def __init__(self, zygote: _Zygote, memory_mb: int):
        self.zygote = zygote
        self.pid, self.conn = zygote.spawn(memory_mb)

    def kill(self) -> None:
        try:
            self.zygote.kill(self.pid)
        except OSError:
            pass  # the zygote is gone, and its workers with it
        self.conn.close()

    def alive(self) -> bool:
        """An idle worker has nothing to say: readable means its end closed (it exited)."""
        if self.conn.closed or not self.zygote.alive():
            return False
        try:
            return not self.conn.poll(0)
        except (OSError, EOFError):
            return False


# ---- the pool ----------------------------------------------------------------------------------------------------


class WorkerPool:
    """Idle workers shared by all callers; `run` borrows some, scores a list of tasks and gives them back."""

    def __init__(self, memory_mb: int = DEFAULT_MEMORY_MB, max_idle: int = 4):
        self.memory_mb = memory_mb
        self.max_idle = max_idle
        self.pid = os.getpid()
        self._zygote: _Zygote | None = None
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def _new_worker(self) -> _Worker:
        with self._lock:
            if self._zygote is None or not self._zygote.alive():
                self._zygote = _Zygote()
            zygote = self._zygote
        return _Worker(zygote, self.memory_mb)

    def _checkout(self, n: int) -> list[_Worker]:
        with self._lock:
            taken = [self._idle.pop() for _ in range(min(n, len(self._idle)))]
        for w in [w for w in taken if not w.alive()]:
            w.kill()
            taken.remove(w)
        return taken + [self._new_worker() for _ in range(n - len(taken))]

    def _checkin(self, workers: list[_Worker]) -> None:
        with self._lock:
            keep = [w for w in workers if w.alive()][: max(0, self.max_idle - len(self._idle))]
            self._idle.extend(keep)
        for w in workers:
            if w not in keep:
                w.kill()

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        return self._new_worker()

    def shutdown(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            zygote, self._zygote = self._zygote, None
        for w in idle:
            w.conn.close()
        if zygote is not None:
            zygote.close()

    def run(self, tasks: list[Task], *, workers: int, timeout: float) -> list[Reward | BaseException]:
        """Score every task with at most `workers` processes; each task gets `timeout` seconds of wall clock."""
        results: list[Reward | BaseException | None] = [None] * len(tasks)
        if not tasks:
            return []
        pending = deque(range(len(tasks)))
        crashes = [0] * len(tasks)  # how often a worker died under each task
        idle = self._checkout(min(workers, len(tasks)))
        busy: dict[Connection, tuple[_Worker, int, float]] = {}  # conn -> (worker, task index, deadline)
        try:
            while pending or busy:
                while pending and idle:
                    w, i = idle.pop(), pending.popleft()
                    try:
                        w.conn.send(tasks[i])
                    except (OSError, ValueError):  # it died while idle: replace it and retry the task
                        idle.append(self._replace(w))
                        pending.appendleft(i)
                        continue
                    busy[w.conn] = (w, i, time.monotonic() + timeout)
                next_deadline = min(d for _, _, d in busy.values())
                for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                    w, i, _ = busy.pop(conn)  # type: ignore[index]
                    results[i], healthy = _receive(w)
                    idle.append(w if healthy else self._replace(w))
                    if _crashed(results[i]):
                        crashes[i] += 1
                        if crashes[i] <= RETRIES_AFTER_CRASH:  # the OOM killer's choice, not the item's fault: again
                            results[i] = None
                            pending.appendleft(i)
                now = time.monotonic()
                for conn, (w, i, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[conn]
                        results[i] = Reward(0.0, {"timeout": True})
                        idle.append(self._replace(w))
        finally:
            for w, _, _ in busy.values():  # interrupted (e.g. KeyboardInterrupt): never leave a worker mid-task
                w.kill()
            self._checkin(idle)
        for i, n in enumerate(crashes):
            if n and isinstance(results[i], Reward):  # counted in the step's metrics (rewards/worker_crashes)
                results[i].parts["worker_crashes"] = n  # type: ignore[union-attr]
        return results  # type: ignore[return-value]


def _crashed(result: Reward | BaseException | None) -> bool:
    return isinstance(result, Reward) and bool(result.parts.get("crashed"))


def _receive(worker: _Worker) -> tuple[Reward | BaseException, bool]:
    """(result, worker still usable)."""
    try:
        kind, value = worker.conn.recv()
    except (EOFError, OSError):  # killed by the kernel (e.g. out of memory) or crashed
        return Reward(0.0, {"crashed": True}), False
    if kind == "ok":
        return Reward(value[0], value[1]), True
    if kind == "memory":
        return Reward(0.0, {"memory": True}), False
    if kind == "user_error":
        return OvkitError(value), True
    return RuntimeError(f"reward scorer failed in its worker process:\n{value}"), True


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def shared_pool() -> WorkerPool:
    """The process-wide pool (a forked child gets its own: the parent's workers are not its to use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = WorkerPool()
        return _POOL


def shutdown() -> None:
    """Stop the idle workers and the zygote now (they also stop when this process exits)."""
    with _POOL_LOCK:
        pool = _POOL
    if pool is not None and pool.pid == os.getpid():
        pool.shutdown()


atexit.register(shutdown)
