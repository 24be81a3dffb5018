"""Vocabulary-sized temporaries off glibc's heap, so a sampler's freed memory goes back to the system.

glibc serves an allocation of at least M_MMAP_THRESHOLD bytes with a mapping of its own, unmapped when it is freed;
smaller ones come from the heap, whose free space is kept for reuse and can only be returned from its top. The
threshold is dynamic: freeing a mapped block raises it to that block's size (up to 32 MiB on 64-bit). Sampling with a
151,936-token vocabulary makes several [sequences x vocabulary] fp32 temporaries per generated token (32 sequences:
19 MiB each: the logits, the log-probs, the Gumbel noise); once the first of them is freed, every later one comes
from the heap, between the small tensors a decode keeps (its KV cache, each step's tokens and log-probs), and the
space they free piles up under those where it cannot be returned. One synchronous rl-train step of the tiny model
at that vocabulary (4 prompts x 8 completions x 64 tokens) peaked at 1.69 to 2.10 GB from run to run on one commit
(BENCHMARKS.md): its generation left the heap at 0.99 GB with 0.75 GB of it free (mallinfo2) in a high run, at 0.25 GB
in a low one, while the learner's part stayed at 1.70 GB. Setting the threshold (which also turns the dynamic raise
off) keeps every block of 1 MiB or more out of the heap: the same step peaks at its learner's 1.70 GB every time
(measured at 1 MiB; 8 MiB, below, keeps the same blocks mapped).

Blocks under 8 MiB stay on the heap, where reuse is cheap. A mapped block costs its page faults every time it is
allocated, and the learner allocates its large activations anew each micro-batch: at 1 MiB the plain learner's step
(G = 8, 448x448 images) took 45% longer than with glibc's default and the shared-prefix one 6%; at 8 MiB 4% and 1%,
with the sampler's temporaries (19 MiB at 32 sequences) still mapped and the step's peak unchanged (BENCHMARKS.md).
Set for rl-train only: the supervised learners' 64 MiB loss chunks were measured with the default (BENCHMARKS.md, the
align proxy).
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
THRESHOLD = 8 << 20


def large_blocks_off_heap(threshold: int = THRESHOLD) -> bool:
    """Serve allocations of `threshold` bytes or more from their own mappings for the rest of the process (glibc's
    mallopt; module docstring). False where the C library is not glibc (musl, macOS: nothing to do)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
