"""Model output is untrusted: adversarial completions return within their limits, the code sandbox refuses what it
promises to refuse, and the worker pool never hangs or leaks a process."""

from __future__ import annotations

import gc
import gzip
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from reward_scorers import allocate, buggy, crash, echo_length, ours_or_orphaned, record_pid_then_sleep

import ovkit.rewards as rewards
from ovkit.rewards import score, score_batch
from ovkit.rewards.codeexec import run_sandboxed
from ovkit.rewards.markup import render
from ovkit.rewards.pool import shared_pool

SLACK = 3.0  # seconds on top of a limit: process start and a loaded 2-core CI box
CODE_ONE_TEST = json.dumps({"entry": "solution", "tests": [{"input": 1, "output": 1}]})
SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="100" height="100"><circle cx="50" cy="50" r="30"/></svg>'


def A(text: str) -> str:
    return f"<answer>{text}</answer>"


@pytest.fixture(scope="module", autouse=True)
def warm_pool():
    """Start the worker processes once: limits are per item, not for the pool's first start (a few seconds)."""
    score_batch([dict(completion=A("1"), answer="1", answer_type="math")] * 2, workers=2, timeout=60.0)


# Cheap scorers run in the caller: each must finish well within CHEAP_LIMIT on any input (linear time, capped scan).
CHEAP_LIMIT = 1.0
CHEAP_CORPUS = [
    ("answer-tags-repeated", "string", "<answer>" * 200_000, "x"),
    ("close-tags-repeated", "multiple_choice", "</answer>" * 200_000, "B"),
    ("boxed-repeated-unbalanced", "number", "\\boxed{" * 200_000, "3"),
    ("braces-deep", "number", "{" * 500_000 + "}" * 500_000, "3"),
    ("digits-huge", "number", A("9" * 200_000), "3"),
    ("number-words-long-run", "number", A("one " * 100_000), "3"),
    ("minus-signs", "number", A("-" * 300_000 + "1"), "3"),
    ("ocr-long-vs-short", "ocr", A("a" * 1_000_000), "hello"),
    ("ocr-long-vs-long", "ocr", A("ab" * 40_000), json.dumps(["ba" * 40_000])),
    ("bbox-open-brackets", "bbox", A("[1, " * 200_000), "[0, 0, 1, 1]"),
    ("detection-open-objects", "detection", A("[{" * 200_000), '[{"label": "a", "box": [0, 0, 1, 1]}]'),
    (
        "detection-many-boxes",
        "detection",
        A(json.dumps([{"label": "a", "box": [i, i, i + 5, i + 5]} for i in range(5_000)])),
        json.dumps([{"label": "a", "box": [i, i, i + 5, i + 5]} for i in range(50)]),
    ),
    ("html-tag-flood", "html", A("<a " * 300_000), "<div></div>"),
    ("format-think-flood", "format", "<think>" * 300_000, ""),
    ("boolean-whitespace", "boolean", A(" " * 1_000_000 + "yes"), "yes"),
]


@pytest.mark.parametrize(
    "answer_type,completion,answer", [c[1:] for c in CHEAP_CORPUS], ids=[c[0] for c in CHEAP_CORPUS]
)
def test_adversarial_cheap_completions_are_bounded(answer_type, completion, answer):
    # The scorer's own CPU time, without a garbage collection of the whole test process in it: a wall-clock reading
    # on a loaded 2-core CI box once took 1.0016 s for a call that costs 0.02 s.
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        result = score(completion, answer, answer_type)
        elapsed = time.thread_time() - start
    finally:
        gc.enable()
    assert elapsed < CHEAP_LIMIT
    assert 0.0 <= result.reward <= 1.0


# Sandboxed scorers: each item gets ITEM_LIMIT seconds in a killable worker.
ITEM_LIMIT = 1.0
SANDBOXED_CORPUS = [
    ("math-power-tower", "math", A("9^9^9^9"), "3"),
    ("math-latex-power-tower", "math", A("9^{9^{9^{9}}}"), "3"),
    ("math-factorial-chain", "math", A("10!!!!!!"), "3"),
    ("math-factorial-huge", "math", A("(10^{10})!"), "3"),
    ("math-nested-parens", "math", A("(" * 1_000 + "1" + ")" * 1_000), "1"),
    ("math-nested-sqrt", "math", A("\\sqrt{" * 900 + "2" + "}" * 900), "2"),
    ("math-long-expression", "math", A("1+" * 50_000 + "1"), "3"),
    (
        "svg-entity-bomb",
        "svg",
        A(
            '<?xml version="1.0"?><!DOCTYPE svg ['
            + "".join(f'<!ENTITY e{i} "{f"&e{i - 1};" * 10 if i else "lol"}">' for i in range(10))
            + "]><svg>&e9;</svg>"
        ),
        SVG,
    ),
    (
        "svg-recursive-use",
        "svg",
        A(
            '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
            '<g id="a"><use xlink:href="#b"/></g><g id="b"><use xlink:href="#a"/></g></svg>'
        ),
        SVG,
    ),
    (
        "svg-use-fanout",
        "svg",
        A(
            '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"><circle id="l0" r="1"/>'
            + "".join(f'<g id="l{i}">' + f'<use xlink:href="#l{i - 1}"/>' * 10 + "</g>" for i in range(1, 9))
            + "</svg>"
        ),
        SVG,
    ),
    (
        "svg-huge-declared-size",
        "svg",
        A(
            '<svg xmlns="http://www.w3.org/2000/svg" width="100000000" height="100000000">'
            '<rect width="100%" height="100%"/></svg>'
        ),
        SVG,
    ),
    (
        "svg-deep-nesting",
        "svg",
        A("<svg xmlns='http://www.w3.org/2000/svg'>" + "<g>" * 20_000 + "</g>" * 20_000 + "</svg>"),
        SVG,
    ),
    ("code-infinite-loop", "code", A("def solution(x):\n    while True: pass"), CODE_ONE_TEST),
    ("code-sleep", "code", A("import time\ndef solution(x):\n    time.sleep(100)"), CODE_ONE_TEST),
    ("code-memory-bomb", "code", A("def solution(x):\n    return len(bytearray(1 << 34))"), CODE_ONE_TEST),
    ("code-fork-bomb", "code", A("import os\ndef solution(x):\n    while True: os.fork()"), CODE_ONE_TEST),
    ("code-output-flood", "code", A("def solution(x):\n    while True: print('x' * 10000)"), CODE_ONE_TEST),
    ("code-recursion", "code", A("def solution(x):\n    return solution(x)"), CODE_ONE_TEST),
    ("code-huge-return", "code", A("def solution(x):\n    return 'x' * (1 << 24)"), CODE_ONE_TEST),
]


def test_adversarial_sandboxed_completions_return_within_their_limit():
    """Each item is scored alone by score(timeout=ITEM_LIMIT) and timed; two caller threads share the two cores."""

    def timed(case):
        start = time.perf_counter()
        result = score(case[2], case[3], case[1], timeout=ITEM_LIMIT)
        return case, time.perf_counter() - start, result

    with ThreadPoolExecutor(max_workers=2) as ex:
        outcomes = list(ex.map(timed, SANDBOXED_CORPUS))
    for (name, answer_type, _, _), elapsed, result in outcomes:
        assert elapsed < ITEM_LIMIT + SLACK, name
        assert 0.0 <= result.reward <= 1.0, name
        if result.parts["timeout"]:
            assert result.reward == 0.0, name
        if answer_type in ("math", "code"):
            assert result.reward == 0.0, name


def test_adversarial_batch_is_bounded_and_in_order():
    """Bombs in one batch through 2 workers: at most ceil(n / 2) rounds of the per-item limit, results in order."""
    bombs = [c for c in SANDBOXED_CORPUS if c[0] in ("math-power-tower", "math-factorial-chain", "code-sleep")]
    items = [dict(completion=c[2], answer=c[3], answer_type=c[1]) for c in bombs]
    items.insert(1, dict(completion=A("1/2"), answer="0.5", answer_type="math"))
    start = time.perf_counter()
    results = score_batch(items, workers=2, timeout=ITEM_LIMIT)
    assert time.perf_counter() - start < -(-len(items) // 2) * ITEM_LIMIT + SLACK
    assert [r.reward for r in results] == [0.0, 1.0, 0.0, 0.0]
    # The sleeping code must be stopped by the time limit; the expression bombs only have to come back within the
    # bound with 0 (depending on the machine, math-verify gives up on the power tower before the limit).
    assert results[3].parts["timeout"]


# ---- the code sandbox ------------------------------------------------------------------------------------------------


def _run(source: str, calls=([],), **limits):
    limits = {"cpu_s": 2.0, "wall_s": 2.0, "memory_mb": 50, **limits}
    return run_sandboxed(source, "f", [list(c) for c in calls], **limits)


SANDBOX_ESCAPES = [
    ("network", "import socket\n    return socket.socket().connect(('127.0.0.1', 9))"),
    ("network-after-import", "import urllib.request\n    return urllib.request.urlopen('http://127.0.0.1:9').read()"),
    ("subprocess", "import subprocess\n    return subprocess.run(['true']).returncode"),
    ("os-system", "import os\n    return os.system('true')"),
    ("fork", "import os\n    return os.fork()"),
    ("ctypes", "import ctypes\n    return 1"),
    ("read-outside", "return open('/etc/hostname').read()"),
    ("list-outside", "import os\n    return os.listdir('/')"),
    ("symlink", "import os\n    os.symlink('/etc', 'etc')\n    return 1"),
    ("chmod", "import os\n    os.chmod('.', 0o777)\n    return 1"),
    (
        "dir-fd-escape",
        "import os\n    d = os.open(os.path.dirname(os.__file__), os.O_RDONLY)\n    return os.open('x', os.O_WRONLY "
        "| os.O_CREAT, dir_fd=d)",
    ),
    ("gc-walk", "import gc\n    return len(gc.get_objects())"),
    ("settrace", "import sys\n    sys.settrace(lambda *a: None)\n    return 1"),
]


@pytest.mark.parametrize("body", [b for _, b in SANDBOX_ESCAPES], ids=[n for n, _ in SANDBOX_ESCAPES])
def test_sandbox_refuses(body):
    reports, flags = _run("def f():\n    " + body)
    assert reports is not None and len(reports) == 1
    assert reports[0]["ok"] is False, reports[0]
    assert reports[0]["error"] in ("PermissionError", "ImportError", "ModuleNotFoundError", "OSError")


def test_sandbox_cannot_write_the_callers_files(tmp_path):
    target = tmp_path / "owned.txt"
    source = f"def f():\n    open({str(target)!r}, 'w').write('x')\n    return 1"
    relative = "def f():\n    import os\n    open(os.path.join('..', '..', {!r}), 'w')\n    return 1".format(
        str(target).lstrip("/")
    )
    for code in (source, relative):
        reports, _ = _run(code)
        assert reports[0]["ok"] is False
    assert not target.exists()


def test_sandbox_allows_ordinary_code():
    source = (
        "from dataclasses import dataclass\nimport heapq, collections, itertools, functools, math, re, random\n"
        "@dataclass\nclass P:\n    x: int\n"
        "def f(n):\n    open('scratch.txt', 'w').write(str(n))\n    return P(int(open('scratch.txt').read())).x * 2"
    )
    reports, flags = _run(source, calls=([3], [4]))
    assert [r["value"] for r in reports] == [6, 8] and not flags["timeout"]


@pytest.mark.parametrize(
    "body,flag",
    [
        ("while True: pass", "timeout"),
        ("import time\n    time.sleep(60)", "timeout"),
        ("print('x' * 100)\n    return 1", None),
    ],
    ids=["cpu-loop", "sleep", "print-goes-to-dev-null"],
)
def test_sandbox_limits(body, flag):
    start = time.perf_counter()
    reports, flags = _run("def f():\n    " + body, wall_s=1.0, cpu_s=1.0)
    assert time.perf_counter() - start < 1.0 + SLACK
    if flag:
        assert flags[flag] and reports is None
    else:
        assert reports == [{"ok": True, "value": 1}]  # printing goes to /dev/null, not into the report


def test_sandbox_memory_limit():
    reports, _ = _run("def f():\n    return len(bytearray(200 << 20))", memory_mb=50)
    assert reports[0] == {"ok": False, "error": "MemoryError"}


def _sandbox_children() -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"def _guard(tmp, read_roots)" in f.read() and ours_or_orphaned(int(entry)):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_sandbox_leaves_no_process_behind():
    _run("import time\ndef f():\n    time.sleep(60)", wall_s=0.5)
    assert _sandbox_children() == []


# ---- SVG rendering --------------------------------------------------------------------------------------------------


def test_svg_render_refuses_gzip_and_files(tmp_path):
    assert render(gzip.compress(SVG.encode())) is None
    from PIL import Image

    red = tmp_path / "red.png"
    Image.new("RGB", (10, 10), (255, 0, 0)).save(red)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><image href="file://{red}" width="10" '
        f'height="10"/></svg>'
    )
    image = render(svg)
    assert image is None or (image == 255).all()  # never the red file's pixels
    assert render(SVG).shape == (336, 336, 3)


# ---- the worker pool ------------------------------------------------------------------------------------------------


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_pool_timeout_kills_the_worker(tmp_path):
    path = tmp_path / "pid"
    start = time.perf_counter()
    (result,) = shared_pool().run([(record_pid_then_sleep, "", "", {"path": str(path)})], workers=1, timeout=2.0)
    assert time.perf_counter() - start < 2.0 + SLACK
    assert result.reward == 0.0 and result.parts["timeout"] is True
    assert _gone(int(path.read_text()))


def test_pool_memory_limit_crash_and_recovery():
    tasks = [(allocate, "", "", {}), (crash, "", "", {}), (echo_length, "x" * 5, "", {})]
    memory, crashed, ok = shared_pool().run(tasks, workers=1, timeout=20.0)
    assert memory.reward == 0.0 and (memory.parts.get("memory") or memory.parts.get("crashed"))
    assert crashed.reward == 0.0 and crashed.parts["crashed"] is True
    assert ok.reward == 0.5


def test_pool_reraises_scorer_bugs():
    (result,) = shared_pool().run([(buggy, "", "", {})], workers=1, timeout=20.0)
    assert isinstance(result, RuntimeError) and "a bug in a scorer" in str(result)


def test_pool_is_thread_safe():
    """Concurrent callers (a training loop and an eval thread) get their own workers and the right results."""
    outputs: dict[int, list[float]] = {}

    def caller(k: int) -> None:
        tasks = [(echo_length, "x" * ((k + j) % 11), "", {}) for j in range(12)]
        outputs[k] = [r.reward for r in shared_pool().run(tasks, workers=2, timeout=20.0)]

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for k in range(4):
        assert outputs[k] == [min(1.0, ((k + j) % 11) / 10) for j in range(12)]


def test_shutdown_leaves_no_process():
    score(A("1/2"), "0.5", "math")  # make sure a zygote and a worker exist
    pool = shared_pool()
    zygote = pool._zygote
    worker_pids = [w.pid for w in pool._idle]
    assert zygote is not None and worker_pids
    rewards.shutdown()
    assert zygote.proc.poll() is not None
    assert all(_gone(pid) for pid in worker_pids)
