"""General code: run the model's function against JSON test cases in a sandboxed subprocess.

Gold answer (JSON text in the `answer` column):

    {"entry": "solution", "tests": [{"input": 3, "output": 9}, {"args": [2, 5], "output": 7}]}

`entry` (default "solution") names the function; a test calls it with `input` as the single argument, or with the
positional `args`; the JSON-encoded return value must equal `output` (floats within 1e-6). All tests must pass for a
reward of 1 (released rule); `pass_rate` is reported as a part.

The sandbox (threat model and what is and is not contained: docs/rewards.md, "Security"):
- OS level (ovkit/rewards/sandbox.py): bubblewrap namespaces (no network, no other processes, a read-only view of
  the libraries and the interpreter, writes only in a throwaway scratch directory, uid 65534) and a seccomp filter (no
  new processes or programs, no sockets, no signals to other processes), or the strongest subset the machine allows;
- kernel limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE, no core files; a wall-clock limit enforced by
  the parent, which kills the child's process group (and with it the sandbox's pid namespace); an alarm() armed in a
  process the candidate cannot reach (bwrap) or cannot cancel (seccomp refuses alarm/setitimer); SIGKILL when the
  scoring worker dies (PR_SET_PDEATHSIG);
- a fresh `python -I -S -B` with an empty environment and stdin/stdout/stderr on /dev/null;
- in process, a second layer: an audit hook (PEP 578) installed before the model's code runs refuses sockets,
  subprocesses, signals, ctypes, writes outside the scratch directory, reads outside it and the standard library,
  links, permission changes, tracing and the other routes listed in _BOOTSTRAP. PEP 578 says audit hooks are not a
  security boundary; the OS level is.

The child only reports return values; the comparison with the expected outputs happens in the parent, so code that
forges the report still has to produce the right values.
"""

from __future__ import annotations

import functools
import json
import math
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from ovkit.errors import OvkitError
from ovkit.rewards import sandbox
from ovkit.rewards.base import Reward, gold_json
from ovkit.rewards.extract import extract_code

MAX_CODE_CHARS = 50_000
MAX_REPORT_BYTES = 1 << 20  # more output than this from the child is treated as a failure

# Runs in the child. Reads {"code", "entry", "calls", "tmp", "read_roots", "seccomp", "hook"} from stdin, installs the
# seccomp filter and the audit hook, runs the code, calls the entry function once per test and writes one JSON line
# per call to a private copy of stdout.
_BOOTSTRAP = r"""
import sys, posix, json

def _guard(tmp, read_roots):
    # Everything the hook uses is bound here, immutable, and never looked up again at call time: model code can
    # replace module attributes and builtins but not these bindings.
    getcwd = posix.getcwd
    str_, bytes_, int_, type_, len_ = str, bytes, int, type, len
    refuse = PermissionError
    WRITE = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC
    BLOCKED = frozenset((
        "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
        "os.chmod", "os.chown", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "os.symlink", "os.link",
        "os.chroot", "subprocess.Popen", "pty.spawn", "shutil.chown", "resource.setrlimit", "resource.prlimit",
        "code.__new__", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace", "sys.setprofile",
        "sys._current_frames", "sys._current_exceptions", "sys.remote_exec",
    ))
    BLOCKED_PREFIXES = ("socket.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn", "os.set", "os.pidfd",
                        "urllib.", "http.", "ftplib.", "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.",
                        "webbrowser.", "winreg.", "msvcrt.", "_winapi.", "sqlite3.", "syslog.")
    BLOCKED_MODULES = frozenset(("ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "subprocess",
                                 "_posixsubprocess", "multiprocessing", "_multiprocessing", "signal", "_signal",
                                 "resource", "pty", "fcntl", "mmap", "select", "selectors", "asyncio", "_asyncio",
                                 "gc", "sqlite3", "_sqlite3", "_xxsubinterpreters", "_interpreters"))
    # (event, indices of path arguments that must lie in tmp, indices of dir_fd arguments that must be None)
    WRITES = (("os.remove", (0,), (1,)), ("os.rmdir", (0,), (1,)), ("os.mkdir", (0,), (2,)),
              ("os.rename", (0, 1), (2, 3)), ("os.truncate", (0,), ()), ("os.utime", (0,), (3,)),
              ("os.mkfifo", (0,), (2,)), ("os.mknod", (0,), (3,)), ("shutil.rmtree", (0,), (1,)))
    READS = (("os.listdir", (0,), ()), ("os.scandir", (0,), ()), ("os.chdir", (0,), ()))

    def hook(event, args):
        if event in BLOCKED or event.startswith(BLOCKED_PREFIXES):
            raise refuse("sandbox: " + event)
        if event == "import":
            for part in args[0].split("."):  # every part: `x._posixsubprocess` is the extension all the same
                if part in BLOCKED_MODULES:
                    raise refuse("sandbox: import " + args[0])
            return
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            write = (type_(mode) is str_ and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
                type_(flags) is int_ and flags & WRITE)
            if mode is None and type_(path) is str_ and not path.startswith("/"):
                raise refuse("sandbox: os.open needs an absolute path")  # dir_fd is invisible to the hook
            todo = ((path, write),)
        else:
            todo = ()
            for name, paths, dirfds in WRITES:
                if event == name:
                    for i in dirfds:
                        if i < len_(args) and args[i] is not None and args[i] != -1:
                            raise refuse("sandbox: dir_fd")
                    todo = tuple((args[i], True) for i in paths if i < len_(args))
            for name, paths, dirfds in READS:
                if event == name:
                    todo = tuple((args[i], False) for i in paths if i < len_(args))
        for path, write in todo:
            if path is None or type_(path) is int_:
                continue  # an already open descriptor (only ones this process may open exist)
            if type_(path) is bytes_:
                path = path.decode("utf-8", "surrogateescape")
            if type_(path) is not str_:
                raise refuse("sandbox: only str paths")  # a custom __fspath__ could answer differently later
            if not path.startswith("/"):
                path = getcwd() + "/" + path
            parts = []
            for seg in path.split("/"):
                if seg == "" or seg == ".":
                    continue
                if seg == "..":
                    if parts:
                        parts.pop()
                    continue
                parts.append(seg)
            path = "/" + "/".join(parts)
            allowed = (tmp,) if write else read_roots
            ok = False
            for root in allowed:
                if path == root or path.startswith(root + "/"):
                    ok = True
            if not ok:
                raise refuse("sandbox: " + ("write " if write else "read ") + path)

    sys.addaudithook(hook)

def _seccomp(program):
    # Installed before any model code, irrevocably (filters can only be added, never removed). ctypes is loaded for
    # this alone and dropped from sys.modules, so the model's `import ctypes` reaches the audit hook again.
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    class sock_fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    buf = ctypes.create_string_buffer(program, len(program))
    prog = sock_fprog(len(program) // 8, ctypes.addressof(buf))
    ok = libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0  # NO_NEW_PRIVS, SECCOMP
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
        del sys.modules[name]
    return ok

def _main():
    cfg = json.loads(sys.stdin.buffer.read())
    report = posix.dup(1)
    null = posix.open("/dev/null", posix.O_RDWR)
    for fd in (0, 1, 2):
        posix.dup2(null, fd)
    posix.close(null)
    dumps, write, encode = json.dumps, posix.write, str.encode
    if cfg["seccomp"] and not _seccomp(bytes.fromhex(cfg["seccomp"])):
        write(report, encode(dumps({"ok": False, "error": "sandbox: seccomp"}) + "\n"))
        return  # fail closed: no filter, no run
    if cfg["hook"]:
        _guard(cfg["tmp"], tuple(cfg["read_roots"]))
    namespace = {"__name__": "__solution__"}
    try:
        exec(compile(cfg["code"], "<solution>", "exec"), namespace)
        fn = namespace[cfg["entry"]]
    except BaseException as e:
        write(report, encode(dumps({"ok": False, "error": "load: " + type(e).__name__}) + "\n"))
        return
    for args in cfg["calls"]:
        try:
            line = dumps({"ok": True, "value": fn(*args)})
        except BaseException as e:
            line = dumps({"ok": False, "error": type(e).__name__})
        write(report, encode(line + "\n"))

_main()
"""


def _read_roots() -> list[str]:
    """Where the child may read: Python's standard library (as the child's sys.path will list it) and /dev/null."""
    lib = os.path.dirname(os.__file__)
    roots = {lib, os.path.join(lib, "lib-dynload"), sys.base_prefix + "/lib", "/dev/null", "/dev/urandom"}
    return sorted(os.path.realpath(r) for r in roots if os.path.realpath(r) != "/")


def _limit_child(cpu_s: float, wall_s: float, memory_mb: int, drop_to_nobody: bool):
    """preexec_fn: runs in the forked child before exec (the scoring worker is single-threaded, so this is safe).
    Under bwrap these limits and the alarm sit on the outer bwrap process too, which the candidate cannot reach; the
    address-space limit comes last: nothing may be loaded after it."""
    import resource

    _die_with_parent()
    if drop_to_nobody:
        sandbox.drop_privileges()
    signal.alarm(max(1, math.ceil(wall_s)) + 1)  # survives exec; the default action of SIGALRM terminates
    cpu = max(1, math.ceil(cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


@functools.lru_cache(maxsize=1)
def _prctl():
    """libc's prctl, looked up in the parent: loading ctypes in a forked child would need memory past its limit."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG); a no-op elsewhere."""
    prctl = _prctl()
    if prctl is not None:
        prctl(1, signal.SIGKILL, 0, 0, 0)


def _read_report(proc: subprocess.Popen, deadline: float) -> tuple[bytes, bool, bool]:
    """(bytes read, timed out, too much output), reading until EOF, the deadline or MAX_REPORT_BYTES."""
    fd = proc.stdout.fileno()
    chunks, size = [], 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), True, False
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), False, False
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REPORT_BYTES:
            return b"", False, True


def run_sandboxed(
    source: str,
    entry: str,
    calls: list[list[Any]],
    *,
    cpu_s: float,
    wall_s: float,
    memory_mb: int,
    level: str | None = None,
    audit_hook: bool = True,
) -> tuple[list[dict] | None, dict]:
    """Run `source` and call `entry(*args)` for each of `calls`; returns (one report per call or None, flags).

    `level` picks the OS isolation (sandbox.LEVELS; default: OVKIT_SANDBOX, else the strongest available);
    `audit_hook=False` leaves out the in-process layer, so tests can show what the OS level contains on its own."""
    iso = sandbox.isolation(level)
    with tempfile.TemporaryDirectory(prefix="ovkit-code-", ignore_cleanup_errors=True) as tmp:
        tmp = os.path.realpath(tmp)
        if iso.drop_to_nobody:
            os.chown(tmp, sandbox.NOBODY, sandbox.NOBODY)
        payload = json.dumps(
            {
                "code": source,
                "entry": entry,
                "calls": calls,
                "tmp": tmp,
                "read_roots": [*_read_roots(), tmp],
                "seccomp": iso.seccomp.hex() if iso.seccomp else None,
                "hook": audit_hook,
            }
        ).encode()
        _prctl()
        info_r = info_w = None
        if iso.level == "bwrap":  # bwrap reports the sandbox's pid there: the parent waits for it to be gone
            info_r, info_w = os.pipe()
        wrap = sandbox.bwrap_argv(iso.bwrap, tmp, info_fd=info_w) if iso.level == "bwrap" else []
        proc = subprocess.Popen(
            [*wrap, sandbox.interpreter(), "-I", "-S", "-B", "-c", _BOOTSTRAP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
            env={"LC_ALL": "C.UTF-8"},
            start_new_session=True,
            close_fds=True,
            pass_fds=(info_w,) if info_w is not None else (),
            preexec_fn=lambda: _limit_child(cpu_s, wall_s, memory_mb, iso.drop_to_nobody),
        )
        if info_w is not None:
            os.close(info_w)
        try:
            try:
                proc.stdin.write(payload)
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass
            raw, timed_out, overflow = _read_report(proc, time.monotonic() + wall_s)
            if not (timed_out or overflow):  # EOF: let the exit status say whether a limit ended it
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            # The process group is the child (or the outer bwrap, whose death takes the whole pid namespace with it:
            # --die-with-parent), so every descendant ends here, whatever it did with its session or alarm.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            proc.stdout.close()
            if info_r is not None:  # the namespace dies with its first process (PDEATHSIG): wait until it has
                _wait_gone(_sandbox_pid(info_r))
                os.close(info_r)
    flags = {"timeout": timed_out or proc.returncode in _LIMIT_EXITS, "output_limit": overflow}
    if flags["timeout"] or overflow:  # a run stopped by a limit has no complete report, whichever limit came first
        return None, flags
    reports = []
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            reports.append(json.loads(line))
        except ValueError:
            return None, flags
    if len(reports) != len(calls):  # ended before its last report, by a signal no limit of ours sends
        return None, flags
    return reports, flags


# How a run ended by the CPU limit (SIGXCPU) or the wall alarm (SIGALRM) exits: killed by the signal, or, under bwrap,
# which reports a signalled child as 128 + the signal's number, that exit code.
_LIMIT_EXITS = frozenset(code for sig in (signal.SIGXCPU, signal.SIGALRM) for code in (-sig, 128 + sig))


def _sandbox_pid(fd: int) -> int | None:
    """The pid (in our namespace) of the sandbox's first process, from bwrap's --info-fd JSON."""
    data = b""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _wait_gone(pid: int | None, within: float = 2.0) -> None:
    """Until `pid` has exited (gone or a zombie), at most `within` seconds."""
    if pid is None:
        return
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return
        time.sleep(0.005)


def _same(actual: Any, expected: Any) -> bool:
    """JSON equality, with floats compared to within 1e-6 (relative or absolute)."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return actual is expected
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return math.isclose(actual, expected, rel_tol=1e-6, abs_tol=1e-6) or actual == expected
    if isinstance(expected, list) and isinstance(actual, list):
        return len(actual) == len(expected) and all(_same(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(_same(actual[k], expected[k]) for k in expected)
    return actual == expected


def _tests(answer: str) -> tuple[str, list[list[Any]], list[Any]]:
    spec = gold_json(answer, '{"entry": ..., "tests": [{"input": ..., "output": ...}]}')
    tests = spec.get("tests") if isinstance(spec, dict) else None
    entry = spec.get("entry", "solution") if isinstance(spec, dict) else None
    if not isinstance(entry, str) or not entry.isidentifier() or not isinstance(tests, list) or not tests:
        raise OvkitError('column \'answer\': code answers are {"entry": name, "tests": [{"input"|"args", "output"}]}')
    calls, expected = [], []
    for test in tests:
        if not isinstance(test, dict) or "output" not in test or ("input" in test) == ("args" in test):
            raise OvkitError(f'column \'answer\': each code test needs "output" and one of "input"/"args": {test!r}')
        args = test["args"] if "args" in test else [test["input"]]
        if not isinstance(args, list):
            raise OvkitError(f"column 'answer': \"args\" must be a list: {test!r}")
        calls.append(args)
        expected.append(test["output"])
    return entry, calls, expected


def code(
    completion: str,
    answer: str,
    *,
    cpu_s: float = 2.0,
    wall_s: float = 2.0,
    memory_mb: int = 50,
    strict: bool = False,
) -> Reward:
    """1 if every test passes (released rule), else 0; limits default to the released 2 s CPU, 2 s wall, 50 MB."""
    entry, calls, expected = _tests(answer)
    source = extract_code(completion, strict=strict)
    if not source or len(source) > MAX_CODE_CHARS:
        return Reward(0.0, {"passed": 0, "total": len(calls), "pass_rate": 0.0, "timeout": False})
    reports, flags = run_sandboxed(source, entry, calls, cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb)
    passed = 0
    if reports is not None and len(reports) == len(calls):
        passed = sum(bool(r.get("ok")) and _same(r.get("value"), e) for r, e in zip(reports, expected))
    total = len(calls)
    return Reward(float(passed == total), {"passed": passed, "total": total, "pass_rate": passed / total, **flags})
