"""The code reward's sandbox holds against the escapes an attacker tried (issue: aliased extension import + fork_exec,
pidfd kill, alarm cancel, detached grandchild, socket to localhost, file write outside the scratch directory).

Each escape is a candidate `solution` that attempts its trick and then returns the right value, so it earns reward 1
exactly when the trick did not raise. Containment is checked from outside the child: a TCP listener that must see no
connection, a marker path that must not appear, a bystander process that must survive, and a scan of /proc for any
process left behind. Every escape runs at every OS isolation level this machine has, with the in-process audit hook
on and off, so the OS level is shown to contain it on its own.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
from reward_scorers import ours_or_orphaned

from ovkit.rewards import score
from ovkit.rewards.codeexec import run_sandboxed
from ovkit.rewards.sandbox import LEVELS, isolation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS isolation is Linux's")

SLACK = 3.0
ANSWER = json.dumps({"entry": "solution", "tests": [{"input": 1, "output": 1}]})

# Loads an extension module from the standard library under a dotted alias (the blocklist once checked only the
# first part), then fork_execs a shell through it: the route that once bypassed every in-process check.
ALIASED_FORK_EXEC = r"""
import importlib.util, posix, sys
def _alias(name):
    dyn = [p for p in sys.path if p.endswith("lib-dynload")][0]
    fn = [f for f in posix.listdir(dyn) if f.startswith(name + ".")][0]
    spec = importlib.util.spec_from_file_location("x." + name, dyn + "/" + fn)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
def _shell(command):
    ps = _alias("_posixsubprocess")
    r, w = posix.pipe()
    return ps.fork_exec([b"/bin/sh", b"-c", command.encode()], [b"/bin/sh"], True, (), None, None,
                        -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
"""


def _solution(prelude: str, body: str) -> str:
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"{prelude}\ndef solution(x):\n{lines}\n    return x\n"


@pytest.fixture
def listener():
    """A TCP server on 127.0.0.1 that records every connection it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    seen: list[tuple] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, addr = server.accept()
                seen.append(addr)
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], seen
    stop.set()
    thread.join(timeout=2)
    server.close()


@pytest.fixture
def bystander():
    """An unrelated process of the same user: it must outlive every escape."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    alive = proc.poll() is None
    proc.kill()
    proc.wait()
    assert alive, "the sandboxed code killed an unrelated process"


BOOTSTRAP_MARK = b"def _guard(tmp, read_roots)"  # in the command line of every sandboxed interpreter and its forks


def _sandboxed(token: str | None = None) -> dict[int, str]:
    """The /proc status text of each live (not zombie) sandboxed interpreter (or fork of one) of this test process or
    orphaned by it, and of each process whose command line carries `token` (what a shell started)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        ours = (
            token is not None
            and token.encode() in cmdline
            or BOOTSTRAP_MARK in cmdline
            and ours_or_orphaned(int(entry))
        )
        if ours and "\nState:\tZ" not in status:
            found[int(entry)] = status
    return found


def _survivors(token: str, within: float = 5.0) -> list[int]:
    """`_sandboxed(token)` still alive after giving the kernel `within` s to reap them."""
    deadline = time.monotonic() + within
    while True:
        found = list(_sandboxed(token))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _levels() -> list[str]:
    available = []
    for level in LEVELS[:2]:  # the OS levels; `rlimits` contains only resources
        try:
            isolation(level)
            available.append(level)
        except Exception:
            pass
    return available


LEVEL_PARAMS = [
    pytest.param(level, hook, id=f"{level}-{'hook' if hook else 'os-only'}")
    for level in _levels()
    for hook in (True, False)
]


def _score(source: str, level: str, hook: bool, **limits) -> tuple[float, dict, float]:
    """(reward, flags, seconds) of one candidate through run_sandboxed at `level`, the reward as the code scorer
    computes it (every test passed)."""
    limits = {"cpu_s": 2.0, "wall_s": 2.0, "memory_mb": 200, **limits}
    start = time.perf_counter()
    reports, flags = run_sandboxed(source, "solution", [[1]], level=level, audit_hook=hook, **limits)
    elapsed = time.perf_counter() - start
    ok = reports is not None and len(reports) == 1 and reports[0].get("ok") and reports[0].get("value") == 1
    return float(bool(ok)), flags, elapsed


def test_the_strongest_level_is_the_default_here():
    """On a Linux box with user namespaces (CI, the development machines) nothing weaker than bwrap is used."""
    if "bwrap" not in _levels():
        pytest.skip("this machine refuses user namespaces or has no bwrap")
    assert isolation().level == "bwrap" and isolation().seccomp is not None


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_aliased_fork_exec_shell_is_contained(level, hook, tmp_path, listener, bystander):
    port, seen = listener
    token = f"ovkit-escape-{uuid.uuid4().hex}"
    marker = tmp_path / "marker"
    command = (
        f"echo pwned > {marker}; cat /etc/passwd > {marker}.passwd; "
        f"(setsid sleep 60 {token} &); python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}))'; "
        f"kill -9 {bystander}"
    )
    reward, _, _ = _score(
        _solution(ALIASED_FORK_EXEC, f"_shell({command!r})\nimport time\ntime.sleep(0.5)"), level, hook
    )
    assert reward == 0.0
    assert not marker.exists() and not (tmp_path / "marker.passwd").exists()
    assert seen == []
    assert _survivors(token) == []


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_pidfd_and_kill_cannot_reach_another_process(level, hook, bystander):
    for body in (
        f"import posix, _signal\nfd = posix.pidfd_open({bystander})\n_signal.pidfd_send_signal(fd, 9)",
        f"import posix\nposix.kill({bystander}, 9)",
    ):
        reward, _, _ = _score(_solution("", body), level, hook)
        assert reward == 0.0
    time.sleep(0.2)  # a signal, had one been sent, is delivered by now; the fixture checks the bystander lives


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_cancelling_the_alarm_does_not_outlive_the_wall_clock(level, hook):
    token = f"ovkit-escape-{uuid.uuid4().hex}"
    body = f"import _signal, time\n_signal.alarm(0)\ntime.sleep(60)  # {token}"
    reward, flags, elapsed = _score(_solution("", body), level, hook, wall_s=1.0, cpu_s=30.0)
    assert reward == 0.0 and flags["timeout"]
    assert elapsed < 1.0 + SLACK
    assert _survivors(token) == []


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_a_detached_grandchild_does_not_survive(level, hook):
    token = f"ovkit-escape-{uuid.uuid4().hex}"
    body = (
        f"import posix, time\nif posix.fork() == 0:\n    posix.setsid()\n    if posix.fork() == 0:\n"
        f"        time.sleep(60)  # {token}\n    posix._exit(0)\ntime.sleep(0.5)"
    )
    reward, _, _ = _score(_solution("", body), level, hook)
    assert reward == 0.0
    assert _survivors(token) == []


def _peak_processes(source: str, level: str, hook: bool, **limits) -> tuple[float, int, int]:
    """(reward, most sandboxed processes of this test seen at once, most threads seen in one of them) while
    `source` is scored, sampled from /proc every 20 ms."""
    peak = {"processes": 0, "threads": 0}
    done = threading.Event()

    def sample():
        while not done.is_set():
            found = _sandboxed()
            threads = [
                int(line.split()[1])
                for status in found.values()
                for line in status.splitlines()
                if line.startswith("Threads:")
            ]
            peak["processes"] = max(peak["processes"], len(found))
            peak["threads"] = max(peak["threads"], *threads, 0)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        reward, _, _ = _score(source, level, hook, **limits)
    finally:
        done.set()
        sampler.join()
    return reward, peak["processes"], peak["threads"]


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_the_candidate_is_one_process_and_its_threads_are_bounded(level, hook):
    """The process-count limit: a candidate that forks in a loop (swallowing each refusal) never has more processes
    than one that only sleeps, and a thread bomb stops at the address-space limit (each thread reserves its stack)."""
    idle = "import time\ntime.sleep(1.0)"
    forks = (
        "import posix, time\nborn = 0\nfor _ in range(50):\n    try:\n        pid = posix.fork()\n"
        "    except Exception:\n        continue\n    if pid == 0:\n        time.sleep(5)\n        posix._exit(0)\n"
        "    born += 1\ntime.sleep(1.0)\nx = x + born"
    )
    threads = (
        "import _thread, time\nlock = _thread.allocate_lock()\nlock.acquire()\nstarted = 0\nfor _ in range(2000):\n"
        "    try:\n        _thread.start_new_thread(lock.acquire, ())\n    except Exception:\n        break\n"
        "    started += 1\ntime.sleep(1.0)"
    )
    _, baseline, _ = _peak_processes(_solution("", idle), level, hook, wall_s=4.0)
    reward, peak, _ = _peak_processes(_solution("", forks), level, hook, wall_s=4.0)
    assert baseline >= 1
    # every fork refused: nothing born, the right answer returned (+1: slack for a sample taken mid-start-up; a fork
    # that works adds up to 50)
    assert peak <= baseline + 1 and reward == 1.0
    _, _, most_threads = _peak_processes(_solution("", threads), level, hook, wall_s=4.0, memory_mb=50)
    assert 1 <= most_threads <= 16


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_no_connection_to_localhost(level, hook, listener):
    port, seen = listener
    body = f"import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))"
    reward, _, _ = _score(_solution("", body), level, hook)
    assert reward == 0.0
    time.sleep(0.3)
    assert seen == []


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_no_file_written_outside_the_scratch_directory(level, hook, tmp_path):
    if level == "seccomp" and not hook and not isolation("seccomp").drop_to_nobody:
        pytest.skip("at the seccomp level files are the uid drop's and the audit hook's: neither is active here")
    marker = tmp_path / "marker"
    reward, _, _ = _score(_solution("", f"open({str(marker)!r}, 'w').write('pwned')"), level, hook)
    assert reward == 0.0
    assert not marker.exists()


@pytest.mark.parametrize("level,hook", [p for p in LEVEL_PARAMS if p.values[0] == "bwrap"])
def test_the_host_filesystem_is_not_visible(level, hook):
    reward, _, _ = _score(_solution("", "open('/etc/passwd').read()"), level, hook)
    assert reward == 0.0


@pytest.mark.parametrize("level,hook", LEVEL_PARAMS)
def test_ordinary_code_still_runs(level, hook):
    """Threads, the scratch directory and the standard library work at every level: isolation costs no rewards."""
    body = (
        "import threading, heapq, collections, json\nout = []\nt = threading.Thread(target=lambda: out.append(x))\n"
        "t.start(); t.join()\nopen('scratch.txt', 'w').write(json.dumps(out))\n"
        "assert json.loads(open('scratch.txt').read()) == [x]"
    )
    reward, flags, _ = _score(_solution("", body), level, hook)
    assert reward == 1.0, flags


def test_the_public_entry_contains_the_aliased_shell(tmp_path, listener, bystander):
    """Through ovkit.rewards.score, as rl-train calls it (worker pool, default level): reward 0, nothing escaped."""
    port, seen = listener
    token = f"ovkit-escape-{uuid.uuid4().hex}"
    marker = tmp_path / "marker"
    command = f"echo pwned > {marker}; (setsid sleep 60 {token} &); kill -9 {bystander}"
    source = _solution(ALIASED_FORK_EXEC, f"_shell({command!r})\nimport time\ntime.sleep(0.5)")
    result = score(f"<answer>```python\n{source}```</answer>", ANSWER, "code")
    assert result.reward == 0.0
    assert not marker.exists() and seen == [] and _survivors(token) == []


def test_a_fallback_is_said_once_and_an_impossible_request_is_an_error(monkeypatch, capsys):
    import ovkit.rewards.sandbox as sandbox
    from ovkit.errors import OvkitError

    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    sandbox.isolation.cache_clear()
    try:
        first = sandbox.isolation()
        again = sandbox.isolation()
        with pytest.raises(OvkitError, match="bubblewrap is unavailable"):
            sandbox.isolation("bwrap")
    finally:
        sandbox.isolation.cache_clear()
    assert first is again and first.level in ("seccomp", "rlimits")
    err = capsys.readouterr().err
    assert err.count("code reward sandbox falls back to") == 1 and "no bwrap binary" in err


@pytest.mark.parametrize("level", [*_levels(), "rlimits"])
def test_the_cpu_limit_is_a_timeout_when_it_comes_before_the_wall_clock(level):
    # Under bwrap a child killed by SIGXCPU shows as bwrap's exit code 128 + SIGXCPU, not as -SIGXCPU: both are a
    # timeout, and a run that ends before its last report never passes as a complete (empty) one.
    reports, flags = run_sandboxed(
        "def f():\n    while True: pass", "f", [[]], level=level, cpu_s=1.0, wall_s=30.0, memory_mb=200
    )
    assert flags["timeout"] and reports is None
