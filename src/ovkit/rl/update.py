"""One GRPO update: advantages, the proximal log-probs, the mismatch corrections and decoupled-PPO optimiser steps.

    advantages      = group_advantages((r + bias) * scale)   over the group's std, the step's or none (--scale-rewards)
    prox_logprobs   = the learner at the start of the step (pi_prox; with one minibatch, the detached log-probs
                      of the gradient pass itself, since no parameter can move before it); --prox-logp loglinear:
                      AReaL's approximation from behave, the gradient pass's log-probs and the versions instead
                      (ovkit.rl.proximal: no no-grad pass with several minibatches)
    weights         = off_policy_weights(prox_logprobs, behave_logprobs)   behaviour cap + --correction
    ppo_update                                         decoupled PPO loss, clip 0.2 / 0.28, --ppo-minibatches
                                                       (--loss-type, --importance-sampling-level: ovkit.rl.loss)
    --top-entropy-quantile                             the step's entropy threshold, from a no-grad pass first
    --shared-prefix                                    every pass forwards each group's prompt once
                                                       (ovkit.rollouts.shared)

A step has a host side and a device side. `prepare_step` lays the groups out as trajectories and works out
on the host all that does not need the model's weights: advantages, token counts, each micro-batch's rows, width,
rope positions, vision layout and response positions (it takes the model's config, never the model, so it cannot
read a device value). `learn` then moves the step's tensors to the learner's device once and keeps everything
there: log-probs, entropies, proximal log-probs, weights, the loss and its parts, every statistic. The host reads the
device once per optimiser step, after the last backward and the gradient clipping: the skip guard (ovkit.runtime.guard,
every learner's: a minibatch in which every token was masked, or whose loss or gradient norm is not finite, takes no
optimiser step, which only the device knows) and, on the last one, all of the step's metrics with it. Inside
transformers' Qwen-VL forward 3 reads per forward remain (image-token count check, image split sizes), as for
`ovkit sft`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ovkit.models.encode import multimodal_token_ids
from ovkit.pack.packed import PackLayout
from ovkit.rl.advantages import group_advantages, transform_rewards, zero_std_fraction
from ovkit.rl.config import Update
from ovkit.rl.correction import Correction, off_policy_weights
from ovkit.rl.loss import aggregation_weights, decoupled_ppo_loss
from ovkit.rl.metrics import mismatch_tensors, staleness_metrics, turn_mismatch_tensors
from ovkit.rl.proximal import LoglinearProx
from ovkit.rl.shaping import entropy_threshold, high_entropy_mask, mask_truncated, truncated
from ovkit.rollouts import shared
from ovkit.rollouts.groups import Group
from ovkit.rollouts.trajectories import (
    MicroBatch,
    Trajectories,
    build_trajectories,
    chunks,
    forward_all,
    sequence_logprobs,
)
from ovkit.runtime.guard import StepGuard, in_backward
from ovkit.runtime.optim import clip_grad_norm


@dataclass
class StepBatch:
    """The host side of a step (module docstring)."""

    traj: Trajectories
    advantages: torch.Tensor  # [N] host
    minibatches: list[list[MicroBatch]]  # each optimiser step's micro-batches
    totals: list[list[float]]  # each minibatch's (response tokens, sequences), this process's
    whole: list[
        MicroBatch
    ]  # the no-grad passes over the whole batch (proximal log-probs with several minibatches, reference)
    n_tokens: int  # response tokens of the step (this process's)
    metrics: dict[str, Any]  # what the host knows without the model
    step: int = 0  # the loop's 0-based step


def prepare_step(
    groups: Sequence[Group], step: int, pad_id: int, config: Any, update: Update, layout: PackLayout | None = None
) -> StepBatch:
    """Trajectories, advantages and the micro-batches' host inputs, from the groups and the model's `config` (not the
    model: nothing here can read a device value; module docstring). `layout`: the config's ovkit.pack.PackLayout,
    which rl-train builds once for the run (building one costs a meta-device copy of the model); made here when not
    given."""
    batch = build_trajectories(groups, pad_id, multimodal_token_ids(config))
    layout = PackLayout.for_model(config) if layout is None else layout
    ppo = update.ppo
    cut = [truncated(c.finish_reason, c.termination) for g in groups for c in g.completions]
    if ppo.mask_truncated_completions and any(cut):
        # the rows train nothing and leave the normalisers; their rewards still shape their groups' advantages
        batch = dataclasses.replace(
            batch,
            mask=mask_truncated(batch.mask, cut),
            mask_cols=[[] if c else cols for c, cols in zip(cut, batch.mask_cols)],
            turn_tokens=None,
        )
    advantages = step_advantages(batch, ppo)
    if shared.sharing(update.shared_prefix, config, layout) and batch.prompt_keys is not None:
        order, plan = partial(shared.by_prompt, batch), partial(shared.micro_batch, batch, layout=layout)
    else:
        order, plan = batch.by_length, partial(batch.micro_batch, layout=layout)
    minibatches, totals = [], []
    for mb in chunks(range(batch.size), math.ceil(batch.size / update.ppo_minibatches)):
        minibatches.append([plan(idx) for idx in chunks(order(mb), update.micro_batch_size)])
        totals.append(
            [float(sum(len(batch.mask_cols[i]) for i in mb)), float(sum(1 for i in mb if batch.mask_cols[i]))]
        )
    whole = (
        minibatches[0]
        if len(minibatches) == 1
        else [plan(idx) for idx in chunks(order(range(batch.size)), update.micro_batch_size)]
    )
    metrics = {
        "advantage/abs_mean": float(advantages.abs().mean()),
        "frac_reward_zero_std": zero_std_fraction(batch.rewards, batch.group_ids),
        **({"masked_truncated_frac": sum(cut) / max(len(cut), 1)} if ppo.mask_truncated_completions else {}),
        **staleness_metrics(step, batch.versions),
    }
    return StepBatch(batch, advantages, minibatches, totals, whole, sum(map(len, batch.mask_cols)), metrics, step)


def step_advantages(batch: Trajectories, ppo: Any, batch_std: float | None = None) -> torch.Tensor:
    """The step's advantages (--scale-rewards); `batch_std`: the std of the transformed rewards of every process."""
    rewards = transform_rewards(batch.rewards, ppo.reward_bias, ppo.reward_scale)
    return group_advantages(rewards, batch.group_ids, eps=ppo.adv_eps, std=ppo.scale_rewards, batch_std=batch_std)


def global_reward_std(rt: Any, batch: Trajectories, ppo: Any) -> float:
    """The population std of the step's transformed rewards over every process (two all-reduces: the mean first,
    then the squared deviations from it, as a one-process std computes it)."""
    rewards = transform_rewards(batch.rewards, ppo.reward_bias, ppo.reward_scale).to(torch.float64)
    n, total = _global(rt, [float(rewards.numel()), float(rewards.sum())])
    (squares,) = _global(rt, [float(((rewards - total / max(n, 1.0)) ** 2).sum())])
    return math.sqrt(squares / max(n, 1.0))


@dataclass
class OnDevice:
    """The step's per-token tensors on the learner's device, moved once."""

    mask: torch.Tensor
    behave: torch.Tensor
    adv: torch.Tensor
    turn_ids: torch.Tensor | None

    @classmethod
    def of(cls, sb: StepBatch, device: Any) -> OnDevice:
        t = sb.traj
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        mask = move(t.mask)
        return cls(mask, move(t.behave_logprobs), move(sb.advantages)[:, None].expand_as(mask), move(t.turn_ids))


@dataclass
class _Pass:
    """What every micro-batch of one step's gradient pass reads: the step's device tensors, and the proximal log-probs
    and entropies (given by a no-grad pass, or filled by the gradient pass itself when `fused`)."""

    sb: StepBatch
    dev: OnDevice
    ref: torch.Tensor | None
    prox: torch.Tensor
    entropy: torch.Tensor
    fused: bool
    pg_mask: torch.Tensor | None
    approx: LoglinearProx | None
    corr: Correction
    update: Update
    world: int

    def loss(self, model, plan: MicroBatch, minibatch: int, totals: Sequence[Any], rt: Any):
        """The decoupled-PPO loss parts of one micro-batch (its forward under the runtime's autocast)."""
        dev, update, ppo = self.dev, self.update, self.update.ppo
        rows = plan.row_index.to(dev.behave.device, non_blocking=True)
        cols = slice(0, plan.width - 1)
        mask = dev.mask[rows]
        agg = aggregation_weights(mask, ppo.loss_agg, constant=update.max_new_tokens, totals=totals)[:, cols]
        with rt.autocast() if rt is not None else nullcontext():
            logp, ent, _ = sequence_logprobs(
                model, self.sb.traj, plan.rows, update.temperature, entropy=self.fused, plan=plan
            )
        if self.fused:
            theta = logp.detach()
            self.prox[rows, cols] = (
                theta if self.approx is None else self.approx.prox(rows, cols, dev.behave, theta, first=minibatch == 0)
            )
            self.entropy[rows, cols] = ent
        prox = self.prox[rows, cols]
        weights = off_policy_weights(prox, dev.behave[rows, cols], mask[:, cols], self.corr, stats=False).weights
        return decoupled_ppo_loss(
            logp,
            prox,
            dev.adv[rows, cols],
            weights,
            agg * self.world,
            eps_clip=ppo.eps_clip,
            eps_clip_high=ppo.eps_clip_high,
            ref_logprobs=self.ref[rows, cols] if self.ref is not None else None,
            kl_coef=ppo.kl_coef,
            kl_estimator=ppo.kl_estimator,
            loss_type=ppo.loss_type,
            importance_sampling_level=ppo.importance_sampling_level,
            sapo_tau_pos=ppo.sapo_temperature_pos,
            sapo_tau_neg=ppo.sapo_temperature_neg,
            mask=mask[:, cols],
            pg_mask=self.pg_mask[rows, cols] if self.pg_mask is not None else None,
        )


def ppo_update(
    model,
    optimizer,
    params,
    sb: StepBatch,
    dev: OnDevice,
    ref,
    corr: Correction,
    update: Update,
    prox=None,
    entropy=None,
    rt: Any = None,
    pg_mask=None,
    approx: LoglinearProx | None = None,
    sft=None,
):
    """Decoupled-PPO optimizer steps over `ppo_minibatches` slices of the batch -> the step's learner metrics.
    `model` is the prepared TokenScorer (or a bare model); `rt` the runtime whose backward and clipping to use (the
    fp32 master gradients with bf16-mixed; none: plain autograd).

    With `prox` given (the learner's log-probs at the start of the step, from a no-grad pass) every minibatch uses
    them. Without it (one minibatch: the parameters cannot move before the only gradient pass), the gradient pass
    itself provides them: pi_prox is exactly that pass's detached log-probs, so the recompute costs nothing extra.
    `pg_mask` [N, T-1]: the tokens the policy-gradient term trains (--top-entropy-quantile); None: all.
    `approx` (--prox-logp loglinear, only without `prox`): each micro-batch's pi_prox is its approximation from that
    gradient pass's detached log-probs instead (ovkit.rl.proximal).
    `sft`: the PPO-ptx mixer (ovkit.rl.sftmix), whose backward joins each optimiser step's accumulation; None: off.
    """
    fused = prox is None
    world = rt.processes if rt is not None else 1
    grad_pass = _Pass(
        sb=sb,
        dev=dev,
        ref=ref,
        prox=torch.zeros_like(dev.behave) if fused else prox,
        entropy=torch.zeros_like(dev.behave) if fused else entropy,
        fused=fused,
        pg_mask=pg_mask,
        approx=approx,
        corr=corr,
        update=update,
        world=world,
    )
    # Several processes: each holds a share of the batch; normalise by the global counts (one all-reduce for the
    # step), and undo DDP's mean over processes, so one step over N processes is the single-process step.
    totals = sb.totals
    if world > 1:
        flat = _global(rt, [x for t in totals for x in t])
        totals = [flat[2 * k : 2 * k + 2] for k in range(len(totals))]
    zero = torch.zeros((), dtype=torch.float32, device=dev.behave.device)
    parts_sum = {k: zero.clone() for k in ("pg_loss", "kl", "clipped_low", "clipped_high", "tokens")}
    grad_norms: list[float] = []
    skipped = nonfinite = 0
    metrics: dict[str, float] = {}
    guard = rt.guard if rt is not None else StepGuard(update.max_nonfinite_steps, command="rl-train")
    backward = rt.backward if rt is not None else torch.Tensor.backward
    sft_nll, sft_tokens = zero.clone(), 0
    for k, micro in enumerate(sb.minibatches):
        optimizer.zero_grad(set_to_none=True)
        kept = zero.clone()
        loss = zero.clone()  # the minibatch's loss, for the guard
        sft_k = 0  # the minibatch's SFT answer tokens, every process's
        if sft is not None:  # PPO-ptx: its gradient accumulates under no_sync, all-reduced with the last micro-batch's
            nll, sft_k, term = sft.backward(model, sb.step, k, rt)
            sft_nll, sft_tokens, loss = sft_nll + nll, sft_tokens + sft_k, loss + term
        for j, plan in enumerate(micro):
            # gradients are all-reduced once per optimiser step, after the last micro-batch (DDP's no_sync)
            with rt.no_sync(model, sync=j == len(micro) - 1) if rt is not None else nullcontext():
                parts = grad_pass.loss(model, plan, k, totals[k], rt)
                backward(parts.loss)
            for name in parts_sum:
                parts_sum[name] += getattr(parts, name).float()
            kept += parts.tokens.float()
            loss += parts.loss.detach().float()
        if world > 1:  # every process skips the step together or none does: one all-reduce of both
            kept, loss = rt.accelerator.reduce(torch.stack([kept, loss]), "sum").unbind()
        norm = (
            rt.clip(params, optimizer, update.max_grad_norm)
            if rt is not None
            else clip_grad_norm(optimizer, params, update.max_grad_norm)
        )
        # the host's one read of this optimiser step: the skip guard needs `kept`, the loss and the norm before
        # optimizer.step; the last minibatch's read carries every metric of the step (all final by now)
        last = k == len(sb.minibatches) - 1
        pending = step_tensors(sb, dev, grad_pass.prox, grad_pass.entropy, parts_sum, corr, approx) if last else {}
        if pending and sft is not None:
            pending["sft/nll_sum"] = sft_nll
        head = [kept.double(), norm.detach().to(kept.device).double(), loss.double()]
        values = torch.stack([*head, *(v.double() for v in pending.values())]).tolist()
        metrics = dict(zip(pending, values[3:]))
        # every RL token masked and no SFT rows mixed in: train nothing, but log it (with SFT rows the step trains
        # them alone: the masked RL term's gradient is exactly zero)
        empty = values[0] == 0 and sft_k == 0
        if not guard.admit(sb.step + 1, values[2], values[1], empty=empty, in_backward=in_backward(optimizer)):
            skipped += 1
            nonfinite += not empty
            continue
        grad_norms.append(values[1])
        optimizer.step()
        if rt is not None:
            rt.measure(params, optimizer)  # bytes per parameter, once (ovkit.json)
    optimizer.zero_grad(set_to_none=True)
    mixed = sft.metrics(metrics.pop("sft/nll_sum"), sft_tokens) if sft is not None else {}
    return {
        **_finish(metrics, grad_norms, skipped, with_kl=update.ppo.kl_coef > 0),
        "nonfinite_updates": nonfinite,
        **mixed,
    }


def step_tensors(
    sb: StepBatch,
    dev: OnDevice,
    prox,
    entropy,
    parts_sum: dict[str, torch.Tensor],
    corr: Correction,
    approx: LoglinearProx | None = None,
) -> dict[str, torch.Tensor]:
    """The step's learner metrics as 0-dim device tensors (read once, by ppo_update). With `approx`, `prox` is the
    approximation, and the mismatch metrics are computed from it."""
    out = {f"sum/{k}": v for k, v in parts_sum.items()}
    if sb.n_tokens:
        m = dev.mask.float()
        out["entropy"] = (entropy * m).sum() / sb.n_tokens
        out.update(mismatch_tensors(prox, dev.behave, dev.mask))
        out.update(turn_mismatch_tensors(prox, dev.behave, dev.mask, dev.turn_ids, sb.traj.turn_tokens))
        if approx is not None:
            out.update(approx.tensors(prox, dev.behave, dev.mask))
    out.update(
        off_policy_weights(prox, dev.behave, dev.mask, corr).stat_tensors
    )  # the same weights, for the batch's stats
    return out


def _finish(values: dict[str, float], grad_norms: list[float], skipped: int, *, with_kl: bool) -> dict[str, Any]:
    kept = max(values.pop("sum/tokens"), 1.0)
    low, high = values.pop("sum/clipped_low"), values.pop("sum/clipped_high")
    pg_loss, kl = values.pop("sum/pg_loss"), values.pop("sum/kl")
    entropy = values.pop("entropy", 0.0)
    mismatch = {k: values.pop(k) for k in list(values) if k.startswith("mismatch/")}
    return {
        "pg_loss": pg_loss,
        "clip/low_frac": low / kept,
        "clip/high_frac": high / kept,
        "clip/frac": (low + high) / kept,
        # this process's fractions again: combine() takes their min / max over processes (TRL's low_min, high_max)
        "clip/low_min": low / kept,
        "clip/high_max": high / kept,
        "entropy": entropy,
        "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        "skipped_updates": skipped,
        **({"kl": kl} if with_kl else {}),
        **mismatch,
        **values,  # the off-policy weights' statistics
    }


def _global(rt: Any, values: list[float]) -> list[float]:
    """`values` summed over every process."""
    acc = rt.accelerator
    return [float(v) for v in acc.reduce(torch.tensor(values, dtype=torch.float64, device=acc.device), "sum").tolist()]


def train_step(
    model,
    optimizer,
    params,
    groups: Sequence[Group],
    step: int,
    pad_id: int,
    corr: Correction,
    ref_model,
    update: Update,
    rt: Any = None,
    layout: PackLayout | None = None,
    sft=None,
) -> dict[str, float]:
    """One GRPO step on already-scored groups; returns its metrics (rollout-side ones are added by the caller).
    `layout`: as for `prepare_step`; `sft`: as for `ppo_update`."""
    config = getattr(model, "module", model).config  # a bare model, a TokenScorer, or either under DDP
    sb = prepare_step(groups, step, pad_id, config, update, layout)
    return learn(model, optimizer, params, sb, corr, ref_model, update, rt=rt, sft=sft)


def learn(
    model, optimizer, params, sb: StepBatch, corr: Correction, ref_model, update: Update, rt: Any = None, sft=None
) -> dict[str, Any]:
    """The device side of a step (module docstring)."""
    device = next(model.parameters()).device
    ppo = update.ppo
    if ppo.scale_rewards == "batch" and rt is not None and rt.processes > 1:
        # every process's rewards make the std, so N processes train what one process would on the same groups
        sb.advantages = step_advantages(sb.traj, ppo, global_reward_std(rt, sb.traj, ppo))
        sb.metrics["advantage/abs_mean"] = float(sb.advantages.abs().mean())
    dev = OnDevice.of(sb, device)
    ref = (
        forward_all(ref_model, sb.traj, update.micro_batch_size, update.temperature, plans=sb.whole, device=device)[0]
        if ref_model is not None
        else None
    )
    prox = entropy = pg_mask = approx = None
    top_entropy = ppo.top_entropy_quantile < 1.0
    recompute = ppo.prox_logp == "recompute"
    # the top-entropy threshold is the whole step's, known only before the gradient pass: the no-grad pass gives it
    # (and with it the exact pi_prox, which every minibatch then uses, as AReaL's loglinear uses a recomputed one)
    if (update.ppo_minibatches > 1 and recompute) or top_entropy:
        prox, entropy = forward_all(
            model, sb.traj, update.micro_batch_size, update.temperature, entropy=True, plans=sb.whole, device=device
        )
    if top_entropy:
        # the response tokens' entropies, without a host read: sorted with the others last, the first n_tokens (known
        # on the host) are exactly them. Several processes gather them (padding NaN), which reads sizes and values.
        values = entropy.float().masked_fill(~dev.mask, float("inf")).flatten().sort().values[: sb.n_tokens]
        if rt is not None and rt.processes > 1:
            acc = rt.accelerator
            values = acc.gather(acc.pad_across_processes(values, dim=0, pad_index=float("nan")))
            values = values[~values.isnan()]
        pg_mask = high_entropy_mask(entropy, dev.mask, entropy_threshold(values, ppo.top_entropy_quantile))
    if prox is None and not recompute:
        approx = LoglinearProx.of(sb.traj.versions, sb.step, dev.behave)
    learner = ppo_update(
        model,
        optimizer,
        params,
        sb,
        dev,
        ref,
        corr,
        update,
        prox,
        entropy,
        rt=rt,
        pg_mask=pg_mask,
        approx=approx,
        sft=sft,
    )
    metrics = {**learner, **sb.metrics}
    order = (
        "pg_loss",
        "clip/low_frac",
        "clip/high_frac",
        "clip/frac",
        "entropy",
        "grad_norm",
        "skipped_updates",
        "advantage/abs_mean",
        "frac_reward_zero_std",
        "kl",
    )
    return {**{k: metrics[k] for k in order if k in metrics}, **metrics}
