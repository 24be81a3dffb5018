"""One GRPO update: advantages, the proximal log-probs, the mismatch corrections and decoupled-PPO optimiser steps.

    advantages      = group_advantages((r + bias) * scale)
    prox_logprobs   = the learner at the start of the step (pi_prox; with one minibatch, the detached log-probs
                      of the gradient pass itself, since no parameter can move before it)
    weights         = off_policy_weights(prox_logprobs, behave_logprobs)   behaviour cap + --correction
    ppo_update                                         decoupled PPO loss, clip 0.2 / 0.28, --ppo-minibatches
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ovkit.rl.advantages import group_advantages, transform_rewards, zero_std_fraction
from ovkit.rl.correction import Correction, off_policy_weights
from ovkit.rl.loss import aggregation_weights, decoupled_ppo_loss
from ovkit.rl.metrics import mismatch_stats, staleness_metrics, turn_mismatch_stats
from ovkit.rollouts.groups import Group
from ovkit.runtime.optim import clip_grad_norm
from ovkit.rollouts.trajectories import Trajectories, build_trajectories, chunks, forward_all, multimodal_token_ids, sequence_logprobs


@dataclass
class UpdateStats:
    pg_loss: float = 0.0
    kl: float = 0.0
    clipped_low: float = 0.0
    clipped_high: float = 0.0
    tokens: float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0  # minibatches in which every token was masked: no optimizer step

    def add(self, parts) -> None:
        self.pg_loss += parts.pg_loss
        self.kl += parts.kl
        self.clipped_low += parts.clipped_low
        self.clipped_high += parts.clipped_high
        self.tokens += parts.tokens


def ppo_update(model, optimizer, params, batch: Trajectories, advantages, ref, corr: Correction, cfg: Any, prox=None, rt: Any = None):
    """Decoupled-PPO optimizer steps over `ppo_minibatches` slices of the batch -> (prox_logprobs, entropy, stats).
    `model` is the prepared TokenScorer (or a bare model); `rt` the runtime whose backward and clipping to use (the
    fp32 master gradients with bf16-mixed; none: plain autograd).

    With `prox` given (the learner's log-probs at the start of the step, from a no-grad pass) every minibatch uses
    them. Without it (one minibatch: the parameters cannot move before the only gradient pass), the gradient pass
    itself provides them: pi_prox is exactly that pass's detached log-probs, so the recompute costs nothing extra.
    """
    stats = UpdateStats()
    fused = prox is None
    prox = torch.zeros_like(batch.behave_logprobs) if fused else prox
    entropy = torch.zeros_like(batch.behave_logprobs)
    adv = advantages[:, None].expand_as(batch.mask)
    world = rt.processes if rt is not None else 1
    for mb in chunks(range(batch.size), math.ceil(batch.size / cfg.ppo_minibatches)):
        agg = torch.zeros_like(prox)
        # Several processes: each holds a share of the batch; normalise by the global counts, and undo DDP's mean
        # over processes, so one step over N processes is the single-process step over the same groups.
        totals = _global(rt, [float(batch.mask[mb].sum()), float(batch.mask[mb].any(-1).sum())]) if world > 1 else None
        agg[mb] = aggregation_weights(batch.mask[mb], cfg.loss_agg, constant=cfg.max_new_tokens, totals=totals) * world
        optimizer.zero_grad(set_to_none=True)
        kept = 0.0
        micro = chunks(batch.by_length(mb), cfg.micro_batch_size)
        for j, idx in enumerate(micro):
            # gradients are all-reduced once per optimiser step, after the last micro-batch (DDP's no_sync)
            with rt.no_sync(model, sync=j == len(micro) - 1) if rt is not None else nullcontext():
                with rt.autocast() if rt is not None else nullcontext():
                    logp, ent, width = sequence_logprobs(model, batch, idx, cfg.temperature, entropy=fused)
                cols = slice(0, width - 1)
                if fused:
                    prox[idx, cols], entropy[idx, cols] = logp.detach(), ent
                weights = off_policy_weights(prox[idx, cols], batch.behave_logprobs[idx, cols], batch.mask[idx, cols], corr).weights
                parts = decoupled_ppo_loss(
                    logp, prox[idx, cols], adv[idx, cols], weights, agg[idx, cols],
                    eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                    ref_logprobs=ref[idx, cols] if ref is not None else None, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                )  # fmt: skip
                if rt is not None:
                    rt.backward(parts.loss)
                else:
                    parts.loss.backward()
            stats.add(parts)
            kept += parts.tokens
        if world > 1:
            kept = _global(rt, [kept])[0]  # every process skips the step together or none does
        if kept == 0:
            stats.skipped += 1  # everything masked: train nothing (no optimizer step), but log it
            continue
        norm = rt.clip(params, optimizer, cfg.max_grad_norm) if rt is not None else clip_grad_norm(optimizer, params, cfg.max_grad_norm)
        stats.grad_norms.append(float(norm))
        optimizer.step()
        if rt is not None:
            rt.measure(params, optimizer)  # bytes per parameter, once (ovkit.json)
    optimizer.zero_grad(set_to_none=True)
    return prox, entropy, stats


def _global(rt: Any, values: list[float]) -> list[float]:
    """`values` summed over every process."""
    acc = rt.accelerator
    return [float(v) for v in acc.reduce(torch.tensor(values, dtype=torch.float64, device=acc.device), "sum")]


def train_step(model, optimizer, params, groups: Sequence[Group], step: int, pad_id: int, corr: Correction, ref_model, cfg: Any, rt: Any = None) -> dict[str, float]:
    """One GRPO step on already-scored groups; returns its metrics (rollout-side ones are added by the caller)."""
    batch = build_trajectories(groups, pad_id, multimodal_token_ids(model))
    rewards = transform_rewards(batch.rewards, cfg.reward_bias, cfg.reward_scale)
    advantages = group_advantages(rewards, batch.group_ids, eps=cfg.adv_eps, std=cfg.adv_std)
    ref = forward_all(ref_model, batch, cfg.micro_batch_size, cfg.temperature)[0] if ref_model is not None else None
    prox = entropy = None
    if cfg.ppo_minibatches > 1:
        prox, entropy = forward_all(model, batch, cfg.micro_batch_size, cfg.temperature, entropy=True)
    prox, fused_entropy, upd = ppo_update(model, optimizer, params, batch, advantages, ref, corr, cfg, prox, rt=rt)
    entropy = fused_entropy if entropy is None else entropy
    opw = off_policy_weights(prox, batch.behave_logprobs, batch.mask, corr)  # the same weights, for the batch's stats
    kept = max(upd.tokens, 1.0)
    return {
        "pg_loss": upd.pg_loss,
        "clip/low_frac": upd.clipped_low / kept,
        "clip/high_frac": upd.clipped_high / kept,
        "clip/frac": (upd.clipped_low + upd.clipped_high) / kept,
        "entropy": float(entropy[batch.mask].mean()) if batch.mask.any() else 0.0,
        "grad_norm": sum(upd.grad_norms) / len(upd.grad_norms) if upd.grad_norms else 0.0,
        "skipped_updates": upd.skipped,
        "advantage/abs_mean": float(advantages.abs().mean()),
        "frac_reward_zero_std": zero_std_fraction(batch.rewards, batch.group_ids),
        **({"kl": upd.kl} if cfg.kl_coef else {}),
        **mismatch_stats(prox, batch.behave_logprobs, batch.mask),
        **turn_mismatch_stats(prox, batch),
        **opw.stats,
        **staleness_metrics(step, batch.versions),
    }
