"""What one RL step reports: rewards, lengths, turns, staleness, sampler/learner mismatch, and its console line.

Mismatch metrics follow "When speed kills stability" (Liu, Li et al. 2025) and verl's `rollout_corr/` names:
learner PPL and sampler PPL are per-response exp(-mean log-prob) averaged over responses (fsdp-ppl / vllm-ppl),
`vllm_kl` is the K3 estimator of the sampler/learner gap, mean over response tokens of exp(d) - d - 1 with
d = prox_logprobs - behave_logprobs, and |delta logp| is |d| (max and mean over tokens, as in Yao et al. 2025).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ovkit.rl.staleness import staleness_histogram

if TYPE_CHECKING:
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.trajectories import Trajectories


def mismatch_stats(prox_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    mask = mask.bool()
    if not mask.any():
        return {}
    m = mask.float()
    n_tok = m.sum(-1).clamp(min=1)
    seqs = mask.any(-1)
    learner_log_ppl = (-(prox_logprobs * m).sum(-1) / n_tok)[seqs]
    sampler_log_ppl = (-(behave_logprobs * m).sum(-1) / n_tok)[seqs]
    d = (prox_logprobs - behave_logprobs)[mask].double()  # exp(d) - d - 1 cancels in fp32
    k3 = d.clamp(-20, 20)  # the exp overflows beyond; k1 and |d| are reported as they are
    return {
        "mismatch/learner_ppl": float(learner_log_ppl.exp().mean()),
        "mismatch/sampler_ppl": float(sampler_log_ppl.exp().mean()),
        "mismatch/log_ppl_abs_diff": float((learner_log_ppl - sampler_log_ppl).abs().mean()),
        "mismatch/vllm_kl": float((k3.exp() - k3 - 1).mean()),
        "mismatch/k1": float((-d).mean()),
        "mismatch/delta_logp_max": float(d.abs().max()),
        "mismatch/delta_logp_mean": float(d.abs().mean()),
        "mismatch/prob_diff_max": float((prox_logprobs[mask].exp() - behave_logprobs[mask].exp()).abs().max()),
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


def length_stats(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    n = max(len(lengths), 1)
    return {
        "length/mean": sum(lengths) / n,
        "length/max": float(max(lengths, default=0)),
        "length/truncated_frac": sum(map(bool, truncated)) / n,
    }


def console_line(step: int, m: dict[str, Any]) -> str:
    """`step 00042 | reward 0.41 | acc 0.31 | len 12 | clip 0.02 | kl 1.2e-03 | gnorm 0.80 | 25.3 samples/s | ...`"""
    parts = [
        f"step {step:05d}",
        f"reward {m.get('reward/mean', 0):.3f}",
        f"acc {m.get('accuracy', 0):.2f}",
        f"len {m.get('length/mean', 0):.1f}",
        *([f"turns {m['turns/mean']:.2f}"] if "turns/mean" in m else []),
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
    if batch.turn_ids is None or not (batch.mask & (batch.turn_ids > 0)).any():
        return {}
    out = {}
    for name, where in (("first_turn", batch.turn_ids == 0), ("later_turns", batch.turn_ids > 0)):
        stats = mismatch_stats(prox, batch.behave_logprobs, batch.mask & where)
        out.update({f"mismatch/{name}/{k}": stats[f"mismatch/{k}"] for k in ("vllm_kl", "delta_logp_mean", "log_ppl_abs_diff") if f"mismatch/{k}" in stats})
    return out


def rollout_metrics(groups: Sequence[Group]) -> dict[str, Any]:
    trajectories = [(g, i) for g in groups for i in range(len(g.completions))]
    task = [g.task_rewards[i] for g, i in trajectories]
    out: dict[str, Any] = reward_stats(task, [g.prompt.category for g, _ in trajectories], [g.parts[i].get("accuracy", 0.0) >= 1.0 for g, i in trajectories])
    out["reward/format"] = sum(g.format_rewards[i] for g, i in trajectories) / len(trajectories)
    out["reward/optimised"] = sum(g.rewards[i] for g, i in trajectories) / len(trajectories)
    completions = [g.completions[i] for g, i in trajectories]
    out.update(length_stats([sum(c.mask) for c in completions], [c.finish_reason == "length" for c in completions]))
    if any(c.termination is not None for c in completions):
        from ovkit.rollouts.episodes import turn_stats

        out.update(turn_stats(completions, task))
    return out
