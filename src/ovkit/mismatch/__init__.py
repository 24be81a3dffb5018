"""Sampler/learner mismatch: how far the probabilities a sampler (low-precision, quantised, vLLM) reports for its own
tokens are from the learner's, and what rl-train's corrections would do about it (`ovkit mismatch-report`).

- `metrics`: the token- and sequence-level metrics (verl's `rollout_corr/` names where they overlap) and the share of
  tokens each rl-train correction would clip or mask;
- `analyses`: mismatch by sampler probability, by assistant turn, by response length, per category and source;
- `score`: the learner's log-probs of saved rollouts (one teacher-forced forward pass, rl-train's own);
- `sample`: rollouts from a chosen sampler (fp32 / bf16 / fp16 / int8 / vllm);
- `figures`, `report`: the PNG figures, report.md and the self-contained report.html;
- `run`: the options (`MismatchConfig`) and the run.
"""

from ovkit.mismatch.run import MismatchConfig, run_mismatch

__all__ = ["MismatchConfig", "run_mismatch"]
