"""What one RL step reports: rewards, lengths, turns, staleness, sampler/learner mismatch, and its console line.

Mismatch metrics follow "When speed kills stability" (Liu, Li et al. 2025) and verl's `rollout_corr/` names:
learner PPL and sampler PPL are per-response exp(-mean log-prob) averaged over responses (fsdp-ppl / vllm-ppl),
`vllm_kl` is the K3 estimator of the sampler/learner gap, mean over response tokens of exp(d) - d - 1 with
d = prox_logprobs - behave_logprobs, and |delta logp| is |d| (max and mean over tokens, as in Yao et al. 2025).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ovkit.rl.advantages import groups_with_signal
from ovkit.rl.correction import read
from ovkit.rl.staleness import staleness_histogram

if TYPE_CHECKING:
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.trajectories import Trajectories


def mismatch_stats(prox_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:

    return read(mismatch_tensors(prox_logprobs, behave_logprobs, mask)) if mask.bool().any() else {}


def mismatch_tensors(
    prox_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`mismatch_stats` as 0-dim device tensors, by masked reductions (no device-to-host read); the caller knows
    that `mask` selects at least one token."""
    mask = mask.bool()
    m = mask.float()
    n_tok = m.sum(-1).clamp(min=1)
    seqs = mask.any(-1)
    n_seq = seqs.sum().clamp(min=1)
    learner_log_ppl = -(prox_logprobs * m).sum(-1) / n_tok
    sampler_log_ppl = -(behave_logprobs * m).sum(-1) / n_tok
    over_seqs = lambda x: torch.where(seqs, x, torch.zeros_like(x)).sum() / n_seq  # noqa: E731
    # exp(d) - d - 1 cancels in fp32; d is 0 off the mask, where every term below is 0 too
    d = torch.where(mask, prox_logprobs - behave_logprobs, torch.zeros_like(prox_logprobs)).double()
    n = m.sum().double()
    k3 = d.clamp(-20, 20)  # the exp overflows beyond; k1 and |d| are reported as they are
    prob_diff = torch.where(mask, prox_logprobs.exp() - behave_logprobs.exp(), torch.zeros_like(prox_logprobs)).abs()
    return {
        "mismatch/learner_ppl": over_seqs(learner_log_ppl.exp()),
        "mismatch/sampler_ppl": over_seqs(sampler_log_ppl.exp()),
        "mismatch/log_ppl_abs_diff": over_seqs((learner_log_ppl - sampler_log_ppl).abs()),
        "mismatch/vllm_kl": (k3.exp() - k3 - 1).sum() / n,
        "mismatch/k1": (-d).sum() / n,
        "mismatch/delta_logp_max": d.abs().max(),
        "mismatch/delta_logp_mean": d.abs().sum() / n,
        "mismatch/prob_diff_max": prob_diff.max(),
    }


def reward_stats(rewards: Sequence[float], categories: Sequence[str], correct: Sequence[bool]) -> dict[str, float]:
    """Mean/std of the task reward overall and per category, and accuracy (share of fully correct answers)."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    out = {
        "reward/mean": float(r.mean()) if r.numel() else 0.0,
        "reward/std": float(r.std(unbiased=False)) if r.numel() else 0.0,
        "accuracy": sum(map(bool, correct)) / max(len(correct), 1),
    }
    by_cat: dict[str, list[float]] = defaultdict(list)
    for cat, value in zip(categories, rewards):
        by_cat[cat or "none"].append(value)
    for cat, values in sorted(by_cat.items()):
        out[f"reward/{cat}"] = sum(values) / len(values)
    return out


def func_stats(values: Sequence[dict[str, float]]) -> dict[str, float]:
    """The user's reward functions (ovkit.rewards.custom) as TRL logs each reward function: `func/<name>/mean` and
    `/std` (written as TRL's rewards/<name>/..., ovkit.runtime.log) over the completions it applied to (None -> NaN
    is left out, TRL's nanmean), and `func/<name>/timeout` etc.: how many of its calls scored 0 for a limit."""
    out: dict[str, float] = {}
    for name in sorted({k for v in values for k in v}):
        got = [v[name] for v in values if name in v]
        if "/" in name:  # <function>/timeout, /memory, /crashed: counts
            out[f"func/{name}"] = float(sum(got))
            continue
        applied = torch.tensor([x for x in got if x == x], dtype=torch.float64)
        out[f"func/{name}/mean"] = float(applied.mean()) if applied.numel() else float("nan")
        out[f"func/{name}/std"] = float(applied.std(unbiased=False)) if applied.numel() else float("nan")
    return out


def length_stats(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """Completion lengths, all and those that ended before max_new_tokens ("terminated": TRL's
    completions/*_terminated_length, 0 when every completion was cut, as TRL logs it)."""
    n = max(len(lengths), 1)
    ended = [x for x, cut in zip(lengths, truncated) if not cut]
    return {
        "length/mean": sum(lengths) / n,
        "length/min": float(min(lengths, default=0)),
        "length/max": float(max(lengths, default=0)),
        "length/terminated_mean": sum(ended) / len(ended) if ended else 0.0,
        "length/terminated_min": float(min(ended, default=0)),
        "length/terminated_max": float(max(ended, default=0)),
        "length/truncated_frac": sum(map(bool, truncated)) / n,
    }


def console_line(step: int, m: dict[str, Any]) -> str:
    """`step 00042 | reward 0.41 | acc 0.31 | len 12 | clip 0.02 | ent 1.20 | vllm-kl 1.2e-03 | ... | gnorm 0.80 | 25.3
    samples/s` (`turns` with several turns, `sft` with --sft-coef)"""
    parts = [
        f"step {step:05d}",
        f"reward {m.get('reward/mean', 0):.3f}",
        f"acc {m.get('accuracy', 0):.2f}",
        f"len {m.get('length/mean', 0):.1f}",
        *([f"turns {m['turns/mean']:.2f}"] if "turns/mean" in m else []),
        *([f"sft {m['sft/loss']:.3f}"] if "sft/loss" in m else []),  # --sft-coef: the mixed rows' NLL per token
        f"clip {m.get('clip/frac', 0):.3f}",
        f"ent {m.get('entropy', 0):.2f}",
        f"vllm-kl {m.get('mismatch/vllm_kl', 0):.1e}",
        f"masked {m.get('masked/token_frac', 0):.2f}",
        f"gnorm {m.get('grad_norm', 0):.2f}",
        f"stale {m.get('staleness/max', 0)}",
        f"{m.get('samples_per_s', 0):.1f} samples/s",
    ]
    return " | ".join(parts)


def staleness_metrics(step: int, versions: Sequence[int]) -> dict[str, Any]:
    ages = [step - v for v in versions]
    return {
        "staleness/max": max(ages),
        "staleness/mean": sum(ages) / len(ages),
        "staleness/hist": staleness_histogram(step, list(versions)),
    }


def turn_mismatch_stats(prox: torch.Tensor, batch: Trajectories) -> dict[str, float]:
    """Mismatch of first-turn tokens vs later-turn tokens (004 section 3.4.1: later turns drift more)."""

    if batch.turn_ids is None:
        return {}
    counts = (int((batch.mask & (batch.turn_ids == 0)).sum()), int((batch.mask & (batch.turn_ids > 0)).sum()))
    return read(turn_mismatch_tensors(prox, batch.behave_logprobs, batch.mask, batch.turn_ids, counts))


def turn_mismatch_tensors(prox, behave, mask, turn_ids, turn_tokens: tuple[int, int]) -> dict[str, torch.Tensor]:
    """`turn_mismatch_stats` as device tensors; `turn_tokens`: how many response tokens the first and the later
    turns have (host counts: they decide the keys without a read of the device). No later turn: nothing."""
    if turn_ids is None or not turn_tokens[1]:
        return {}
    out = {}
    for name, where, n in (
        ("first_turn", turn_ids == 0, turn_tokens[0]),
        ("later_turns", turn_ids > 0, turn_tokens[1]),
    ):
        if n:
            stats = mismatch_tensors(prox, behave, mask & where)
            out.update(
                {
                    f"mismatch/{name}/{k}": stats[f"mismatch/{k}"]
                    for k in ("vllm_kl", "delta_logp_mean", "log_ppl_abs_diff")
                }
            )
    return out


def rollout_metrics(groups: Sequence[Group]) -> dict[str, Any]:
    trajectories = [(g, i) for g in groups for i in range(len(g.completions))]
    task = [g.task_rewards[i] for g, i in trajectories]
    out: dict[str, Any] = reward_stats(
        task,
        [g.prompt.category for g, _ in trajectories],
        [g.parts[i].get("accuracy", 0.0) >= 1.0 for g, i in trajectories],
    )
    # The task reward alone (the answer's score before --format-weight mixes in the format reward): TRL logs each
    # reward function as rewards/<name>/mean and /std, so this is rewards/task/*, beside rewards/format/*.
    out["task_reward/mean"], out["task_reward/std"] = out["reward/mean"], out["reward/std"]
    fmt = torch.tensor([float(g.format_rewards[i]) for g, i in trajectories], dtype=torch.float64)
    out["reward/format"], out["reward/format_std"] = float(fmt.mean()), float(fmt.std(unbiased=False))
    out["reward/optimised"] = sum(g.rewards[i] for g, i in trajectories) / len(trajectories)
    # Reward workers killed from outside during the step (ovkit.rewards.pool), and the items that scored 0 for it.
    out["rewards/worker_crashes"] = sum(g.parts[i].get("worker_crashes", 0) for g, i in trajectories)
    out["rewards/crashed"] = sum(bool(g.parts[i].get("crashed")) for g, i in trajectories)
    out.update(func_stats([g.parts[i].get("funcs", {}) for g, i in trajectories]))
    penalties = [g.parts[i]["overlong_penalty"] for g, i in trajectories if "overlong_penalty" in g.parts[i]]
    if penalties:  # --overlong-buffer-len: DAPO's length penalty, already in reward/optimised
        out["overlong/penalty_mean"] = sum(penalties) / len(penalties)
        out["overlong/frac"] = sum(p < 0 for p in penalties) / len(penalties)
    completions = [g.completions[i] for g, i in trajectories]
    out.update(length_stats([sum(c.mask) for c in completions], [c.finish_reason == "length" for c in completions]))
    if any(c.termination is not None for c in completions):
        # heavy: pyarrow loads on first use, not at CLI start or in config checks
        from ovkit.rollouts.episodes import turn_stats

        out.update(turn_stats(completions, task))
    return out


def dynamic_sampling_metrics(groups: Sequence[Group]) -> dict[str, Any]:
    """--dynamic-sampling: groups dropped for tied rewards (counts, summed over processes), places that kept a tied
    group at the bound, and the most groups one place drew (verl's num_gen_batches)."""
    signal = groups_with_signal([g.rewards for g in groups])
    return {
        "dynamic_sampling/groups_filtered": sum(g.draws - 1 for g in groups),
        "dynamic_sampling/unfilled": sum(not s for s in signal),
        "dynamic_sampling/gen_batches_max": max((g.draws for g in groups), default=0),
    }


def cut_or_masked(metrics_jsonl: Path, max_new_tokens: int) -> str | None:
    """What a finished run cut or masked, as the mean per-step share over its metrics.jsonl: completions cut at
    --max-new-tokens (`completions/clipped_ratio`; trained on as cut) and sequences the mismatch corrections masked
    out whole (`ovkit/masked/seq_frac`; no gradient). None when neither happened (or no metrics.jsonl)."""
    import json

    path = Path(metrics_jsonl)
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []

    def mean(key: str) -> float:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else 0.0

    truncated, masked = mean("completions/clipped_ratio"), mean("ovkit/masked/seq_frac")
    said = []
    if truncated > 0:
        said.append(f"{truncated:.1%} of completions cut at --max-new-tokens {max_new_tokens} (trained on as cut)")
    if masked > 0:
        said.append(f"{masked:.1%} of sequences masked out whole by the mismatch corrections (no gradient)")
    if not said:
        return None
    return f"mean per step, {', '.join(said)}; per step in {path} (completions/clipped_ratio, ovkit/masked/seq_frac)"
