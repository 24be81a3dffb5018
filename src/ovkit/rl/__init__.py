"""GRPO for VLMs as LLaVA-OneVision-1.5-RL trains them, and the curation of its data.

    advantages.py   reward transform and group-normalised advantages
    loss.py         AReaL's decoupled PPO loss (asymmetric clip), loss aggregation, KL estimators
    correction.py   the behaviour weight (cap, mask/clamp, token/sequence) and the mismatch corrections (TIS, MIS, Geo-RS)
    staleness.py    admission control for asynchronous rollouts (max_staleness) and version tags
    rollout.py      prompts, groups of scored completions, the synchronous and asynchronous producers
    metrics.py      rewards, lengths, sampler/learner mismatch, the step logger
    trainer.py      `ovkit rl-train`
    curate.py       `ovkit rl-curate`
"""
