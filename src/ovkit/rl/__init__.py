"""GRPO for VLMs as LLaVA-OneVision-1.5-RL trains them, and the curation of its data.

    config.py       `ovkit rl-train`'s options (RLTrainConfig)
    advantages.py   reward transform and group-normalised advantages
    loss.py         AReaL's decoupled PPO loss (asymmetric clip), loss aggregation, KL estimators
    correction.py   the behaviour weight (cap, mask/clamp, token/sequence) and the mismatch corrections (TIS, MIS,
                    Geo-RS)
    staleness.py    admission control for asynchronous rollouts (max_staleness) and version tags
    rollout.py      the synchronous and asynchronous rollout producers
    update.py       one GRPO update (advantages, proximal log-probs, corrections, decoupled-PPO steps)
    metrics.py      what a step reports: rewards, lengths, turns, staleness, mismatch
    loop.py         `ovkit rl-train`: the loop, on the shared runtime (ovkit.runtime)
    curate.py       `ovkit rl-curate`

Prompts, groups, scoring, the multi-turn episode loop and the learner batch are ovkit.rollouts' (shared with eval and
mismatch-report).
"""
