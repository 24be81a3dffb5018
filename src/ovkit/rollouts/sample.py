"""One sampler for eval, rl-curate, rl-train and mismatch-report: `n` completions per prompt, single-turn (one
`engine.generate` call) or multi-turn (an `EpisodeRunner`: one generate call per turn over the running trajectories).

The seed rule, the same on every path and engine: a prompt's seed is `prompt_seed(run seed, key)`, where `key` is the
prompt's identity: its row id (eval, rl-curate, mismatch-report), or its position in the prompt stream (rl-train,
where a row comes back every epoch and must draw anew), never its place in a call, a batch, a shard or a process's
share. Completion k of a prompt draws from its own stream seeded by (prompt seed, k): `HFEngine`'s per-sequence
streams, or vLLM's per-request seed (whose k-th child samples with seed + k); turn t of multi-turn trajectory k draws
from `prompt_seed(prompt seed, (k, t))`. So N processes, other batch sizes, `--shard` or `--limit` sample for a prompt
what one process samples over all of them (up to the float noise of another padding on the HF engine).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any


def prompt_seed(seed: int, key: Hashable) -> int:
    """The seed of the prompt `key` in a run seeded `seed`: 62 bits of blake2b over both (stable across processes and
    Python runs, unlike `hash`), so seeds of different prompts or runs are unrelated (a linear `seed * M + key` makes
    run s + 1's prompt k run s's prompt k + M), and a vLLM seed plus the sample index stays under torch's int64."""
    digest = hashlib.blake2b(repr((int(seed), key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


def sample(
    engine: Any,
    prompts: Sequence[Any],
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    keys: Sequence[Hashable] | None = None,
    episodes: Any = None,
) -> list[list[Any]]:
    """Per prompt (an `ovkit.rollouts.prompts.Prompt`), `n` Completions, each drawn from the stream of (run `seed`,
    the prompt's key, its sample index): `keys` (default: the prompts' ids) name the prompts. With `episodes` (an
    `ovkit.rollouts.episodes.EpisodeRunner` over `engine`) the completions are multi-turn trajectories."""
    if not prompts:
        return []
    keys = [p.id for p in prompts] if keys is None else list(keys)
    if len(keys) != len(prompts):
        raise ValueError(f"keys: {len(keys)} for {len(prompts)} prompts")
    seeds = [prompt_seed(seed, key) for key in keys]
    if episodes is not None:
        return episodes.run(
            prompts, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, seeds=seeds
        )
    return engine.generate(
        [p.encoded for p in prompts],
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        seeds=seeds,
        images=[p.images for p in prompts],
    )
