"""One rl-train step's memory at Qwen2.5's 151,936-token vocabulary stays under 2.0 GB: the sampler's
vocabulary-sized temporaries are served off glibc's heap (ovkit.runtime.heap), so what a decode frees goes back to the
system instead of piling up under the tensors it keeps. The fast test checks the mechanism on the allocator itself;
the slow one the peak RSS of a whole step (BENCHMARKS.md has the figures and the bench command)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ENV

VOCAB = 151936

# A decode's pattern: per token, [32 x vocabulary] fp32 temporaries (logits, log-probs, noise) and one small tensor
# that outlives the step; then how much the heap grew and how much of it is free (glibc's mallinfo2).
DECODE = r"""
import ctypes, sys, torch
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "off-heap":
    from ovkit.runtime.heap import large_blocks_off_heap
    assert large_blocks_off_heap()
keep, base = [], libc.mallinfo2().arena
for token in range(16):
    logits = torch.randn(32, VOCAB)
    logp = torch.log_softmax(logits, -1)
    keep.append(logp[:, :1].clone())
    noise = torch.rand(32, VOCAB).log_().neg_()
    del logits, logp, noise
info = libc.mallinfo2()
print(info.arena - base, info.fordblks)
""".replace("VOCAB", str(VOCAB))


def _heap_after_decode(mode: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", DECODE, mode], env=ENV, capture_output=True, text=True, timeout=120, check=True
    )
    grown, free = map(int, done.stdout.split())
    return grown, free


def _glibc() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="glibc's allocator (mallopt, mallinfo2)")
def test_vocabulary_sized_temporaries_leave_nothing_on_the_heap():
    temporary = 32 * VOCAB * 4
    grown, free = _heap_after_decode("plain")
    assert grown >= temporary, grown  # glibc's dynamic threshold: after the first free they come from the heap
    grown, free = _heap_after_decode("off-heap")
    assert grown < 4 << 20 and free < 4 << 20, (grown, free)


PEAK = r"""
import resource, sys
from ovkit.cli import main
sys.argv = ["ovkit", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    if e.code:
        raise
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_one_synchronous_rl_step_at_a_151936_vocabulary_peaks_under_2_gb(rl_assets, tmp_path):
    """bench/runtime_proxies.py's RL proxy on the test prompts: 4 prompts x 8 completions x 64 new tokens, one step."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model_dir, data = rl_assets
    big = tmp_path / "tiny-151936"
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    model.resize_token_embeddings(VOCAB, mean_resizing=False)
    model.save_pretrained(big)
    AutoProcessor.from_pretrained(model_dir).save_pretrained(big)
    del model
    args = ["rl-train", data, "--model", big, "--out", tmp_path / "out", "--prompts-per-step", "4"]
    args += ["--group-size", "8", "--max-new-tokens", "64", "--max-steps", "1", "--max-staleness", "0"]
    args += ["--reward-workers", "1", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", PEAK, *map(str, args)], env=ENV, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peak = int(done.stdout.split("PEAK")[-1])
    assert peak < 2.0e9, f"peak RSS {peak / 1e9:.2f} GB"
