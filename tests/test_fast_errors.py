"""An input error appears before the heavy imports: a learner's options, DATA and --model are checked without
torch, so a typo is reported in a fraction of a second instead of after torch and transformers load (~6 s)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Runs the CLI's main in a fresh interpreter and reports, at its exit, the code and whether torch was ever imported.
PROBE = """
import json, sys
sys.argv = ["ovkit", *json.loads(sys.argv[1])]
from ovkit.cli import main
try:
    main()
    code = 0
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def run_cli(*args: str) -> tuple[dict, str, float]:
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(args)], capture_output=True, text=True, env=env, timeout=120
    )
    elapsed = time.perf_counter() - start
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, elapsed


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"  # exists: the option checks, not locate, are under test (the loop would check its files)
    d.mkdir()
    return d


@pytest.mark.parametrize(
    "command, args, message",
    [
        ("sft", ["{missing}", "--model", "{model}"], "DATA {missing}: no such file or directory"),
        ("align", ["{data}", "--model", "{tmp}/no-such-model"], "--model {tmp}/no-such-model: no such directory"),
        ("sft", ["{data}", "--model", "{model}", "--precision", "bf17"], "--precision must be one of"),
        (
            "midtrain",
            ["{data}", "--model", "{model}", "--optim", "adamw_bf16", "--precision", "fp32"],
            "--optim adamw_bf16",
        ),
        (
            "sft",
            ["{data}", "--model", "{model}", "--activation-checkpointing", "every-0"],
            "--activation-checkpointing must be",
        ),
        ("sft", ["{data}", "--model", "{model}", "--kernels", "triton"], "--kernels must be one of"),
        (
            "sft",
            ["{data}", "--model", "{model}", "--attn-implementation", "flash"],
            "--attn-implementation must be one of",
        ),
        ("rl-train", ["{missing}", "--model", "{model}"], "DATA {missing}: no such file or directory"),
        ("rl-train", ["{data}", "--model", "{model}", "--loss-agg", "mean"], "--loss-agg must be one of"),
        ("rl-train", ["{data}", "--model", "{model}", "--correction", "tis9"], "--correction: unknown correction"),
        (
            "rl-train",
            ["{data}", "--model", "{model}", "--sampler-precision", "fp8"],
            "--sampler-precision must be one of",
        ),
        ("rl-train", ["{data}", "--model", "{model}", "--engine", "sglang"], "--engine must be one of"),
        # every command that loads a model checks --precision and --attn-implementation at start, as the learners do
        *(
            (command, ["{data}", "--model", "{model}", option, value], f"{option} must be one of")
            for command in ("eval", "caption", "rl-curate", "mismatch-report")
            for option, value in (("--precision", "bf17"), ("--attn-implementation", "flash"))
        ),
        # the sampling and data commands: DATA is read and checked before the engine or encoder loads
        ("rl-curate", ["{missing}", "--model", "{model}"], "{missing}: no such file or directory"),
        ("eval", ["{missing}", "--model", "{model}"], "{missing}: no such file or directory"),
        ("caption", ["{missing}", "--model", "{model}"], "{missing}: no such file or directory"),
        ("mismatch-report", ["{missing}", "--model", "{model}"], "{missing}: no such file or directory"),
        ("pack", ["{missing}", "--model", "{model}"], "{missing}: no such file or directory"),
        ("balance", ["{missing}", "--concepts", "{missing}", "--method", "text"], "{missing}"),
    ],
)
def test_an_input_error_exits_2_before_torch_imports(tmp_path, model_dir, command, args, message):
    names = {"missing": tmp_path / "no-such-data", "model": model_dir, "data": tmp_path, "tmp": tmp_path}
    argv = [command, *(a.format(**names) for a in args), "--out", str(tmp_path / "out")]
    report, err, elapsed = run_cli(*argv)
    assert report["code"] == 2, err
    assert message.format(**names) in err
    assert not report["torch"] and not report["transformers"], f"{command}: torch imported before the input error"
    assert elapsed < 3.0, f"{command}: the error took {elapsed:.1f}s (torch alone takes ~5s to import)"
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("args", [("--help",), ("sft", "--help"), ("rl-train", "--help")])
def test_help_builds_every_command_without_torch(args):
    """Every command's options are built when the command table is (eager registration, typer's public API): that
    stays cheap only while every stage config module imports neither torch nor transformers."""
    report, err, elapsed = run_cli(*args)
    assert report["code"] == 0, err
    assert not report["torch"] and not report["transformers"], f"ovkit {' '.join(args)} imported torch"
    assert elapsed < 3.0, f"ovkit {' '.join(args)} took {elapsed:.1f}s"
