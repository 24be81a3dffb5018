"""What one RL step reports: rewards, lengths, sampler/learner mismatch, and the logger that writes it.

Mismatch metrics follow "When speed kills stability" (Liu, Li et al. 2025) and verl's `rollout_corr/` names:
learner PPL and sampler PPL are per-response exp(-mean log-prob) averaged over responses (fsdp-ppl / vllm-ppl),
`vllm_kl` is the K3 estimator of the sampler/learner gap, mean over response tokens of exp(d) - d - 1 with
d = prox_logprobs - behave_logprobs, and |delta logp| is |d| (max and mean over tokens, as in Yao et al. 2025).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch


def mismatch_stats(prox_logprobs: torch.Tensor, behave_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    mask = mask.bool()
    if not mask.any():
        return {}
    m = mask.float()
    n_tok = m.sum(-1).clamp(min=1)
    seqs = mask.any(-1)
    learner_log_ppl = (-(prox_logprobs * m).sum(-1) / n_tok)[seqs]
    sampler_log_ppl = (-(behave_logprobs * m).sum(-1) / n_tok)[seqs]
    d = (prox_logprobs - behave_logprobs)[mask].double().clamp(-20, 20)  # exp(d) - d - 1 cancels in fp32
    return {
        "mismatch/learner_ppl": float(learner_log_ppl.exp().mean()),
        "mismatch/sampler_ppl": float(sampler_log_ppl.exp().mean()),
        "mismatch/log_ppl_abs_diff": float((learner_log_ppl - sampler_log_ppl).abs().mean()),
        "mismatch/vllm_kl": float((d.exp() - d - 1).mean()),
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


class ConsoleSink:
    """The RL step line on stderr (ovkit.train.log's sinks write metrics.jsonl and TensorBoard)."""

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        import sys

        print(console_line(step, metrics), file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def make_logger(run_dir: Path, *, quiet: bool, report_to: Sequence[str], start: int):
    """metrics.jsonl (lines after `start` dropped on resume), TensorBoard if asked, and the console line."""
    from ovkit.train.log import JsonlSink, Logger, TensorBoardSink

    sinks: list[Any] = [JsonlSink(Path(run_dir) / "metrics.jsonl", resume_step=start)]
    if "tensorboard" in report_to:
        sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard", resume_step=start))
    if not quiet:
        sinks.append(ConsoleSink())
    return Logger(sinks)


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
