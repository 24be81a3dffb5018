"""`ovkit rl-train`: GRPO with AReaL's decoupled PPO, bounded-staleness asynchronous rollouts, and mismatch corrections.

One step (the loop in `train_rl`, as in LLaVA-OneVision-1.5-RL's trains/grpo.py):

    groups          = rollouts.next_batch(step)        prompts_per_step groups of group_size scored completions,
                                                       each tagged with the sampler version that generated it
    advantages      = group_advantages((r + bias) * scale)
    prox_logprobs   = the learner at the start of the step (pi_prox; with one minibatch, the detached log-probs
                      of the gradient pass itself, since no parameter can move before it)
    weights         = off_policy_weights(prox_logprobs, behave_logprobs)   behaviour cap + --correction
    ppo_update                                         decoupled PPO loss, clip 0.2 / 0.28, --ppo-minibatches
    rollouts.sync(model, step + 1)                     the sampler gets the new weights; admission control moves on

Layout while running and at the end (as `ovkit sft`, ovkit.train.checkpoint):

    OUT.partial/metrics.jsonl, checkpoints/step-N/ (model + processor, state.pt, trainer_state.json, ovkit.json)
    OUT/  the final model at its root, metrics.jsonl, checkpoints/, rollouts/ (with --save-rollouts),
          config.yaml, ovkit.json
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ovkit.errors import OvkitError
from ovkit.rl.advantages import group_advantages, transform_rewards, zero_std_fraction
from ovkit.rl.correction import Correction, canonical_mode, off_policy_weights
from ovkit.rl.loss import AGGREGATIONS, KL_ESTIMATORS, aggregation_weights, decoupled_ppo_loss
from ovkit.rl.metrics import length_stats, make_logger, mismatch_stats, reward_stats
from ovkit.rl.rollout import AsyncRollouts, Group, Sampling, SyncRollouts, encode_prompts
from ovkit.rl.staleness import staleness_histogram

STAGE_MODES = {1: "answer", 2: "think"}  # stage 1: answer-only prompts; stage 2: think prompts (ovkit.prompts)
STAGE_FORMAT_WEIGHT = {1: 0.0, 2: 0.1}
STATE_FILE = "state.pt"
# Options that shape the trajectory: a resumed run must use the same values.
TRAJECTORY = (
    "data", "model", "stage", "engine", "sampler_dtype", "sampler_quant", "prompts_per_step", "group_size",
    "max_new_tokens", "temperature", "top_p", "lr", "weight_decay", "warmup_ratio", "max_grad_norm", "eps_clip",
    "eps_clip_high", "reward_bias", "reward_scale", "loss_agg", "kl_coef", "correction", "max_staleness",
    "ppo_minibatches", "format_weight", "system_prompt", "seed", "env", "env_arg", "max_turns", "max_response_tokens",
)


@dataclass
class RLTrainConfig:
    """Options of `ovkit rl-train`. Defaults are the published LLaVA-OneVision-1.5-RL values (anchors.md section 1)."""

    data: list[Path] | None = None  # RL sample tables (answer, answer_type): e.g. rl-curate's OUT/stage1
    model: Path | None = None  # HF model directory: the SFT model for stage 1, the stage-1 output for stage 2
    out: Path | None = None
    stage: int = 1  # 1: answer-only prompts; 2: think prompts + format reward (the curriculum)
    engine: str = "hf"  # hf | vllm (ovkit.generate)
    sampler_dtype: str | None = None  # sample in another precision than the learner (bfloat16: mismatch on CPU)
    sampler_quant: str | None = None  # int8: dynamically quantised sampler (the INT8-rollout ablation of Yao et al.)
    prompts_per_step: int = 32  # GRPO groups per step (batch size 32)
    group_size: int = 16  # completions per prompt (G)
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    max_steps: int | None = None  # exclusive with --epochs
    epochs: float | None = None  # passes over the prompts (30 when neither is given)
    lr: float = 2e-6
    weight_decay: float = 0.01
    warmup_ratio: float = 0.001  # constant learning rate after a linear warmup over this fraction of the steps
    max_grad_norm: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    reward_bias: float = -0.5  # r' = (r + bias) * scale
    reward_scale: float = 10.0
    adv_eps: float = 1e-6  # A = (r' - mean) / (std + eps)
    adv_std: bool = True  # divide by the group std (--no-adv-std: centre only, Dr. GRPO)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    kl_coef: float = 0.0  # KL to the initial model (the recipe uses none)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    behave_cap: float = 5.0  # behaviour-weight cap exp(prox - behave) (0: no cap)
    behave_action: str = "mask"  # mask: tokens above the cap train nothing; clamp: weight = cap
    behave_level: str = "token"  # token | sequence (geometric mean of the sequence's ratios)
    correction: str = "none"  # none | token-tis | seq-tis | token-mis | seq-mis | geo-rs (verl names accepted)
    correction_threshold: float = 2.0  # C: upper truncation (TIS) / rejection (MIS) bound
    correction_lower: float | None = None  # lower bound (MIS: mask below; TIS: clamp below)
    geo_lower: float = 0.999  # geo-rs bounds on the geometric-mean ratio
    geo_upper: float = 1.001
    veto_threshold: float | None = None  # mask a sequence with any token ratio below this
    max_staleness: int = 4  # ETA: max versions between the sampler that made a sample and the learner using it
    ppo_minibatches: int = 1  # optimizer steps per batch (AReaL ppo_n_minibatches)
    micro_batch_size: int = 8  # trajectories per learner forward (memory)
    rollout_batch_size: int = 64  # sequences per generate call of the hf engine
    format_weight: float | None = None  # weight of the format reward; None = 0 in stage 1, 0.1 in stage 2
    system_prompt: bool = True  # prepend "You are a helpful AI assistant." (the recipe's system prompt)
    max_pixels: int = 512 * 512  # images are downscaled to at most this many pixels (the recipe's 512x512 cap)
    freeze_vision: bool = False
    save_every: int = 250  # checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2
    save_rollouts: bool = False  # write every step's trajectories to OUT/rollouts/
    resume: bool = False  # continue the run in OUT.partial/ from its last checkpoint
    report_to: list[str] = field(default_factory=list)  # tensorboard
    reward_workers: int = 2
    env: str | None = None  # multi-turn: an environment (ovkit.envs: zoom, verifier, or package.module:factory)
    env_arg: Any = None  # its arguments: key=value strings (--env-arg, repeatable) or a mapping (YAML)
    max_turns: int = 3  # multi-turn: assistant turns at most
    max_response_tokens: int | None = None  # multi-turn: token budget after the prompt (sampled + observation)
    env_retries: int = 2  # multi-turn: extra tries of a failed environment call
    env_timeout: float = 30.0  # multi-turn: seconds per environment call
    trust_remote_code: bool = False
    seed: int = 0
    overwrite: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        from ovkit.rl.multiturn import check_env_options

        if not self.data:
            raise OvkitError("DATA is required: RL sample tables (e.g. rl-curate's OUT/stage1)")
        check_env_options(self)
        self.data = [Path(p) for p in (self.data if isinstance(self.data, (list, tuple)) else [self.data])]
        for name in ("model", "out"):
            if getattr(self, name) is None:
                raise OvkitError(f"--{name} is required")
            setattr(self, name, Path(getattr(self, name)))
        if self.stage not in STAGE_MODES:
            raise OvkitError(f"--stage must be 1 or 2, got {self.stage}")
        if self.format_weight is None:
            self.format_weight = STAGE_FORMAT_WEIGHT[self.stage]
        try:
            self.correction = canonical_mode(self.correction)
        except ValueError as e:
            raise OvkitError(f"--correction: {e}") from None
        self.report_to = [r for r in (self.report_to or []) if r != "none"]
        self._check()

    def _check(self) -> None:
        positive = ("prompts_per_step", "group_size", "max_new_tokens", "ppo_minibatches", "micro_batch_size", "rollout_batch_size", "keep_checkpoints", "reward_workers")
        for name in positive:
            if getattr(self, name) < 1:
                raise OvkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.epochs is not None:
            raise OvkitError("give --max-steps or --epochs, not both")
        if (self.max_steps is not None and self.max_steps < 1) or (self.epochs is not None and self.epochs <= 0):
            raise OvkitError("--max-steps must be >= 1 and --epochs > 0")
        if self.ppo_minibatches > self.prompts_per_step * self.group_size:
            raise OvkitError("--ppo-minibatches cannot exceed the trajectories per step (prompts-per-step x group-size)")
        checks = [
            (self.max_staleness >= 0, "--max-staleness must be >= 0 (0 = synchronous on-policy)"),
            (self.lr > 0 and self.weight_decay >= 0 and self.max_grad_norm >= 0, "need --lr > 0, --weight-decay >= 0, --max-grad-norm >= 0"),
            (0 <= self.warmup_ratio < 1, "--warmup-ratio must be in [0, 1)"),
            (0 <= self.eps_clip < 1 and self.eps_clip_high >= 0, "need 0 <= --eps-clip < 1 and --eps-clip-high >= 0"),
            (self.behave_cap >= 0, "--behave-cap must be >= 0 (0 = no cap)"),
            (self.behave_action in ("mask", "clamp"), "--behave-action must be mask or clamp"),
            (self.behave_level in ("token", "sequence"), "--behave-level must be token or sequence"),
            (self.loss_agg in AGGREGATIONS, f"--loss-agg must be one of {', '.join(AGGREGATIONS)}"),
            (self.kl_estimator in KL_ESTIMATORS, f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}"),
            (self.kl_coef >= 0, "--kl-coef must be >= 0"),
            (0 <= self.format_weight <= 1, "--format-weight must be in [0, 1]"),
            (self.correction_threshold > 0, "--correction-threshold must be > 0"),
            (self.correction_lower is None or 0 <= self.correction_lower <= self.correction_threshold, "need 0 <= --correction-lower <= --correction-threshold"),
            (self.geo_lower <= self.geo_upper, "need --geo-lower <= --geo-upper"),
            (self.engine in ("hf", "vllm"), "--engine must be hf or vllm"),
            (self.save_every >= 0, "--save-every must be >= 0"),
            (all(r == "tensorboard" for r in self.report_to), "--report-to must be tensorboard (or none)"),
        ]
        for ok, message in checks:
            if not ok:
                raise OvkitError(message)

    @property
    def partial(self) -> Path:
        return self.out.parent / f"{self.out.name}.partial"

    @property
    def mode(self) -> str:
        return STAGE_MODES[self.stage]

    def correction_config(self) -> Correction:
        return Correction(
            mode=self.correction,
            upper=self.correction_threshold,
            lower=self.correction_lower,
            geo_lower=self.geo_lower,
            geo_upper=self.geo_upper,
            veto=self.veto_threshold,
            behave_cap=self.behave_cap or None,
            behave_action=self.behave_action,
            behave_level=self.behave_level,
        )


# ------------------------------------------------------------------------------------------------ the batch


@dataclass
class Trajectories:
    """A step's trajectories in one right-padded [N, T] layout. Token tensors are shifted by one: column j holds the
    log-prob of input_ids[:, j + 1], so `mask` marks response tokens and `behave_logprobs` lines up with it."""

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    per_token: dict[str, torch.Tensor]  # e.g. mm_token_type_ids [N, T]
    mm: list[dict[str, Any]]  # per trajectory: pixel_values, image_grid_thw, ...
    mask: torch.Tensor  # [N, T-1] bool
    behave_logprobs: torch.Tensor  # [N, T-1]
    group_ids: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N] the optimised reward (task and format mixed)
    versions: list[int]
    turn_ids: torch.Tensor | None = None  # [N, T-1] the assistant turn of each response token (multi-turn)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def by_length(self, idx: Sequence[int]) -> list[int]:
        """`idx` sorted by sequence length, so that micro-batches of similar lengths carry little padding."""
        lengths = self.attention_mask.sum(-1).tolist()
        return sorted(idx, key=lambda i: lengths[i])

    def model_inputs(self, idx: Sequence[int], device: Any) -> tuple[dict[str, Any], int]:
        """Inputs for trajectories `idx`, trimmed to their longest length W; returns (inputs, W)."""
        rows = torch.as_tensor(list(idx))
        width = int(self.attention_mask[rows].sum(-1).max())
        inputs: dict[str, Any] = {
            "input_ids": self.input_ids[rows, :width],
            "attention_mask": self.attention_mask[rows, :width],
            **{k: v[rows, :width] for k, v in self.per_token.items()},
        }
        for key in sorted({k for i in idx for k in self.mm[i]}):
            inputs[key] = torch.cat([self.mm[i][key] for i in idx if key in self.mm[i]], dim=0)
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, width


def multimodal_token_ids(model) -> set[int]:
    """Placeholder tokens (image/video pads, vision start/end) a sampler may emit but a learner cannot re-read: the
    forward pass would look for image features behind them."""
    found = set()
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        for name, value in vars(cfg or object()).items():
            if isinstance(value, int) and any(w in name for w in ("image_token", "video_token", "vision_start", "vision_end")):
                found.add(value)
    return found


def _trainable_tokens(token_ids: Sequence[int], forbidden: set[int], loss_mask: Sequence[int] | None = None) -> int:
    """How many leading response tokens the learner can re-read: up to the first multimodal placeholder the policy
    sampled (an observation's image placeholders, loss mask 0, are real images and stay)."""
    mask = loss_mask if loss_mask is not None else [1] * len(token_ids)
    return next((j for j, (t, m) in enumerate(zip(token_ids, mask)) if m and t in forbidden), len(token_ids))


def build_trajectories(groups: Sequence[Group], pad_id: int, forbidden: set[int] = frozenset()) -> Trajectories:
    """Trajectories of the groups; a response is cut before any multimodal placeholder it sampled (the rest trains
    nothing, its reward still counts). Multi-turn trajectories train only their sampled tokens (loss mask 1); their
    observation images are appended to the prompt's processor outputs, once per key. A trajectory whose environment
    failed (env_error) trains nothing and sits in a group of its own, so its reward moves no other advantage."""
    from ovkit.rl.multiturn import merge_mm

    pairs = [(g, c, r) for g in groups for c, r in zip(g.completions, g.rewards)]
    cut = [_trainable_tokens(c.token_ids, forbidden, c.loss_mask) for _, c, _ in pairs]
    width = max(g.prompt.encoded.length + n for (g, _, _), n in zip(pairs, cut))
    n = len(pairs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    keys = sorted({k for g, c, _ in pairs for k in (*g.prompt.encoded.per_token, *c.per_token)})
    per_token = {k: torch.zeros((n, width), dtype=torch.long) for k in keys}
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    behave = torch.zeros((n, width - 1), dtype=torch.float32)
    turns = torch.zeros((n, width - 1), dtype=torch.long)
    group_ids = [g.index for g, _, _ in pairs]
    mm = []
    for i, (g, c, _) in enumerate(pairs):
        enc, L, R = g.prompt.encoded, g.prompt.encoded.length, cut[i]
        input_ids[i, :L] = torch.tensor(enc.input_ids)
        input_ids[i, L : L + R] = torch.tensor(c.token_ids[:R], dtype=torch.long)
        attention_mask[i, : L + R] = 1
        for k, values in enc.per_token.items():
            per_token[k][i, :L] = torch.as_tensor(values).reshape(-1)  # sampled response tokens are text (0)
        for k, values in c.per_token.items():
            per_token[k][i, L : L + R] = torch.as_tensor(values[:R], dtype=torch.long)
        if c.termination != "env_error":
            mask[i, L - 1 : L + R - 1] = torch.tensor(c.mask[:R], dtype=torch.bool)
        else:
            group_ids[i] = -1 - i
        behave[i, L - 1 : L + R - 1] = torch.tensor(c.logprobs[:R], dtype=torch.float32)
        if c.turn_ids is not None:
            turns[i, L - 1 : L + R - 1] = torch.tensor(c.turn_ids[:R], dtype=torch.long)
        mm.append(merge_mm([enc.mm, c.mm]) if c.mm else enc.mm)  # the observations' images after the prompt's
    return Trajectories(
        input_ids=input_ids,
        attention_mask=attention_mask,
        per_token=per_token,
        mm=mm,
        mask=mask,
        behave_logprobs=behave,
        group_ids=torch.tensor(group_ids),
        rewards=torch.tensor([r for _, _, r in pairs], dtype=torch.float32),
        versions=[g.version for g, _, _ in pairs],
        turn_ids=turns,
    )


def sequence_logprobs(model, batch: Trajectories, idx: Sequence[int], temperature: float, *, entropy: bool = False):
    """Log-probs of the sampled tokens under `model` (logits / temperature, as the sampler drew them): [len(idx), W-1],
    and the per-token entropy of that distribution when asked."""
    device = next(model.parameters()).device
    inputs, width = batch.model_inputs(idx, device)
    logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = inputs["input_ids"][:, 1:]
    log_z = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    ent = None
    if entropy:
        with torch.no_grad():
            ent = (log_z - (torch.softmax(logits, -1) * logits).sum(-1)).cpu()
    return logp.cpu(), ent, width


def chunks(indices: Sequence[int], size: int) -> list[list[int]]:
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


@torch.no_grad()
def forward_all(model, batch: Trajectories, micro: int, temperature: float, *, entropy: bool = False):
    """[N, T-1] log-probs (and entropies) of every trajectory, micro-batch by micro-batch, no gradient."""
    logp = torch.zeros_like(batch.behave_logprobs)
    ent = torch.zeros_like(batch.behave_logprobs)
    for idx in chunks(batch.by_length(range(batch.size)), micro):
        lp, e, width = sequence_logprobs(model, batch, idx, temperature, entropy=entropy)
        logp[idx, : width - 1] = lp
        if e is not None:
            ent[idx, : width - 1] = e
    return logp, ent


# ------------------------------------------------------------------------------------------------ one update


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


def ppo_update(model, optimizer, params, batch: Trajectories, advantages, ref, corr: Correction, cfg: RLTrainConfig, prox=None):
    """Decoupled-PPO optimizer steps over `ppo_minibatches` slices of the batch -> (prox_logprobs, entropy, stats).

    With `prox` given (the learner's log-probs at the start of the step, from a no-grad pass) every minibatch uses
    them. Without it (one minibatch: the parameters cannot move before the only gradient pass), the gradient pass
    itself provides them: pi_prox is exactly that pass's detached log-probs, so the recompute costs nothing extra.
    """
    stats = UpdateStats()
    fused = prox is None
    prox = torch.zeros_like(batch.behave_logprobs) if fused else prox
    entropy = torch.zeros_like(batch.behave_logprobs)
    adv = advantages[:, None].expand_as(batch.mask)
    for mb in chunks(range(batch.size), math.ceil(batch.size / cfg.ppo_minibatches)):
        agg = torch.zeros_like(prox)
        agg[mb] = aggregation_weights(batch.mask[mb], cfg.loss_agg, constant=cfg.max_new_tokens)
        optimizer.zero_grad(set_to_none=True)
        kept = 0.0
        for idx in chunks(batch.by_length(mb), cfg.micro_batch_size):
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
            parts.loss.backward()
            stats.add(parts)
            kept += parts.tokens
        if kept == 0:
            stats.skipped += 1  # everything masked: train nothing (no optimizer step), but log it
            continue
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        stats.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return prox, entropy, stats


def train_step(model, optimizer, params, groups: Sequence[Group], step: int, pad_id: int, corr: Correction, ref_model, cfg: RLTrainConfig) -> dict[str, float]:
    """One GRPO step on already-scored groups; returns its metrics (rollout-side ones are added by the caller)."""
    batch = build_trajectories(groups, pad_id, multimodal_token_ids(model))
    rewards = transform_rewards(batch.rewards, cfg.reward_bias, cfg.reward_scale)
    advantages = group_advantages(rewards, batch.group_ids, eps=cfg.adv_eps, std=cfg.adv_std)
    ref = forward_all(ref_model, batch, cfg.micro_batch_size, cfg.temperature)[0] if ref_model is not None else None
    prox = entropy = None
    if cfg.ppo_minibatches > 1:
        prox, entropy = forward_all(model, batch, cfg.micro_batch_size, cfg.temperature, entropy=True)
    prox, fused_entropy, upd = ppo_update(model, optimizer, params, batch, advantages, ref, corr, cfg, prox)
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
        out.update(turn_stats(completions, task))
    return out


def turn_stats(completions: Sequence[Any], rewards: Sequence[float]) -> dict[str, Any]:
    """Multi-turn rollouts: turn-count distribution, termination reasons, reward by turn count."""
    from collections import Counter

    from ovkit.rl.multiturn import TERMINATIONS

    n = len(completions)
    turns = [c.turns for c in completions]
    reasons = Counter(c.termination for c in completions)
    out: dict[str, Any] = {
        "turns/mean": sum(turns) / n,
        "turns/max": max(turns),
        "turns/hist": {str(k): v for k, v in sorted(Counter(turns).items())},
        "length/observation_tokens": sum(len(c.token_ids) - sum(c.mask) for c in completions) / n,
    }
    out.update({f"termination/{r}": reasons.get(r, 0) / n for r in TERMINATIONS})
    for t in sorted(set(turns)):
        values = [r for r, k in zip(rewards, turns) if k == t]
        out[f"reward/by_turns/{t}"] = sum(values) / len(values)
    return out


# ------------------------------------------------------------------------------------------------ the run


def train_rl(cfg: RLTrainConfig) -> dict[str, Any] | None:
    """Run GRPO and write cfg.out; None when cfg.out is already complete (skipped)."""
    from ovkit.runs import Stage, is_complete

    if is_complete(cfg.out) and not cfg.overwrite:
        return None
    stage = Stage("rl-train", cfg, cfg.out, inputs=cfg.data, overwrite=cfg.overwrite, seed=cfg.seed, parent=cfg.model)
    resume_from = find_resume(cfg)
    torch.manual_seed(cfg.seed)
    model, processor = _load(cfg, resume_from or cfg.model)
    params = _trainable(model, cfg)
    prompts = _prompts(cfg, processor)
    make_run_dir(cfg, resume_from)  # only now: bad inputs leave nothing behind
    n_steps = total_steps(cfg, len(prompts))
    optimizer, scheduler = _optimizer(params, cfg, n_steps)
    state: dict[str, Any] = {"step": 0, "elapsed_s": 0.0, "samples": 0}
    if resume_from is not None:
        state = _load_state(cfg, resume_from, optimizer, scheduler)
    ref_model = _load(cfg, cfg.model)[0].requires_grad_(False) if cfg.kl_coef else None
    pad_id = _pad_id(processor)
    rollouts = _rollouts(cfg, model, processor, prompts)
    logger = make_logger(cfg.partial, quiet=cfg.quiet, report_to=cfg.report_to, start=state["step"])
    corr = cfg.correction_config()
    t_start = time.perf_counter() - state["elapsed_s"]
    model.eval()  # no dropout: the proximal pass and the gradient pass are the same function
    rollouts.start(state["step"])
    try:
        for step in range(state["step"], n_steps):
            t0 = time.perf_counter()
            groups = rollouts.next_batch(step)
            t1 = time.perf_counter()
            metrics = train_step(model, optimizer, params, groups, step, pad_id, corr, ref_model, cfg)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            t2 = time.perf_counter()
            rollouts.sync(model, step + 1)
            t3 = time.perf_counter()
            if cfg.save_rollouts:
                _save_rollouts(cfg.partial, step + 1, groups, processor)
            n = sum(len(g.completions) for g in groups)
            state.update(step=step + 1, samples=state["samples"] + n, elapsed_s=time.perf_counter() - t_start)
            metrics = {
                **rollout_metrics(groups),
                **metrics,
                "lr": lr,
                "version": step + 1,
                "time/rollout": t1 - t0,
                "time/train": t2 - t1,
                "time/sync": t3 - t2,
                "samples_per_s": n / max(t3 - t0, 1e-9),
                "samples": state["samples"],
                "elapsed_s": state["elapsed_s"],
            }
            logger.log(step + 1, metrics)
            state["last"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < n_steps:
                save_checkpoint(model, processor, optimizer, scheduler, cfg, state)
    finally:
        rollouts.stop()
        logger.close()
    return _finish(cfg, stage, model, processor, state, n_steps, resume_from)


def _finish(cfg, stage, model, processor, state, n_steps, resume_from) -> dict[str, Any]:
    """Save the final model into OUT.partial and turn it into OUT; the summary comes from the whole metrics.jsonl
    (a resumed run's included)."""
    import json

    from ovkit.runs import write_json
    from ovkit.train.checkpoint import TRAINER_STATE

    model.save_pretrained(cfg.partial, safe_serialization=True)
    processor.save_pretrained(cfg.partial)
    write_json(cfg.partial / TRAINER_STATE, state)
    rows = [json.loads(ln) for ln in (cfg.partial / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    summary = {
        "steps": n_steps,
        "stage": cfg.stage,
        "samples": state["samples"],
        "elapsed_s": round(state["elapsed_s"], 2),
        "samples_per_s": round(state["samples"] / max(state["elapsed_s"], 1e-9), 2),
        "first_reward": first.get("reward/mean"),
        "final_reward": last.get("reward/mean"),
        "final_accuracy": last.get("accuracy"),
        "max_staleness_seen": max((r.get("staleness/max", 0) for r in rows), default=0),
        "resumed_from": str(resume_from) if resume_from else None,
    }
    with stage:  # OUT.partial becomes the stage's temp dir; the Stage adds config.yaml + ovkit.json and renames
        stage.metrics.update(summary)
        stage.path.rmdir()
        os.replace(cfg.partial, stage.path)
    return summary


def total_steps(cfg: RLTrainConfig, n_prompts: int) -> int:
    if cfg.max_steps is not None:
        return cfg.max_steps
    epochs = 30.0 if cfg.epochs is None else cfg.epochs
    return max(1, math.ceil(epochs * n_prompts / cfg.prompts_per_step))


def _load(cfg: RLTrainConfig, path: Path):
    from ovkit.models import load

    model, processor = load(path, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model, processor


def _trainable(model, cfg: RLTrainConfig) -> list[torch.nn.Parameter]:
    from ovkit.models.groups import set_trainable, trainable_names

    set_trainable(model, trainable_names(model, ["all"], freeze_vision=cfg.freeze_vision))
    return [p for p in model.parameters() if p.requires_grad]


def _prompts(cfg: RLTrainConfig, processor) -> list:
    """Every row of every DATA path (several: e.g. the shards of a sharded rl-curate); empty tables are skipped."""
    from ovkit.data import parquet_files, read_samples

    from ovkit.rl.multiturn import env_instruction, env_tools

    prompts = []
    for path in cfg.data:
        if sum(pq_rows(f) for f in parquet_files(path)) == 0:
            continue
        table = read_samples(path).table
        prompts += encode_prompts(table, processor, mode=cfg.mode, system=cfg.system_prompt, max_pixels=cfg.max_pixels, extra=env_instruction(cfg), tools=env_tools(cfg))
    if not prompts:
        raise OvkitError(f"DATA {', '.join(map(str, cfg.data))}: no RL prompts (an rl-curate stage set can be empty when the model solves all or none of the prompts)")
    return prompts


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


def _optimizer(params, cfg: RLTrainConfig, n_steps: int):
    """AdamW (eps 1e-5, weight decay on matrices only), constant learning rate after a linear warmup."""
    from ovkit.train.config import ADAM_EPS

    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, eps=ADAM_EPS)
    warmup = round(cfg.warmup_ratio * n_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def _pad_id(processor) -> int:
    tokenizer = getattr(processor, "tokenizer", processor)
    for pid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pid is not None:
            return int(pid)
    return 0


def make_sampler(cfg: RLTrainConfig, model, processor):
    """The rollout engine. Asynchronous runs sample from their own copy of the weights (synced every step);
    synchronous ones share the learner's unless --sampler-dtype / --sampler-quant asks for a separate copy."""
    from ovkit.generate import make_engine

    if cfg.engine == "vllm":
        if cfg.sampler_quant:
            raise OvkitError("--sampler-quant int8 is for --engine hf (vLLM quantises through its own options)")
        return make_engine("vllm", cfg.model, processor, dtype=cfg.sampler_dtype or "auto", seed=cfg.seed)
    source = copy.deepcopy(model) if cfg.max_staleness > 0 else model
    return make_engine("hf", source, processor, dtype=cfg.sampler_dtype, quant=cfg.sampler_quant, batch_size=cfg.rollout_batch_size)


def _rollouts(cfg: RLTrainConfig, model, processor, prompts):
    from functools import partial

    from ovkit.rl.rollout import score_groups

    from ovkit.rl.multiturn import make_runner

    engine = make_sampler(cfg, model, processor)
    engine.update_weights(model)  # a resumed run's sampler starts from the checkpoint's weights
    episodes = make_runner(cfg, engine, processor, mode=cfg.mode, max_pixels=cfg.max_pixels, model=model)
    sampling = Sampling(cfg.group_size, cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.seed, episodes=episodes)
    score = partial(score_groups, mode=cfg.mode, format_weight=cfg.format_weight, workers=cfg.reward_workers)
    if cfg.max_staleness == 0:
        return SyncRollouts(engine, prompts, cfg.prompts_per_step, sampling, score)
    return AsyncRollouts(engine, prompts, cfg.prompts_per_step, sampling, score, cfg.max_staleness, groups_per_call=cfg.prompts_per_step)


# ------------------------------------------------------------------------------------------------ checkpoints


def find_resume(cfg: RLTrainConfig) -> Path | None:
    """The checkpoint to resume from (None: start fresh); an unfinished OUT.partial needs --resume or --overwrite."""
    from ovkit.train.checkpoint import latest_checkpoint

    run_dir = cfg.partial
    if not run_dir.exists() or cfg.overwrite:
        return None
    ckpt = latest_checkpoint(run_dir)
    if not cfg.resume:
        at = f"its last checkpoint is {ckpt.name}" if ckpt else "it has no checkpoint yet"
        raise OvkitError(f"{run_dir} holds an unfinished run ({at}); pass --resume to continue it or --overwrite to start over")
    return ckpt


def make_run_dir(cfg: RLTrainConfig, resume_from: Path | None) -> None:
    """OUT.partial, emptied unless a run resumes from it."""
    if cfg.partial.exists() and resume_from is None:
        shutil.rmtree(cfg.partial)
    cfg.partial.mkdir(parents=True, exist_ok=True)


def save_checkpoint(model, processor, optimizer, scheduler, cfg: RLTrainConfig, state: dict[str, Any]) -> Path:
    """checkpoints/step-N/: a loadable model, optimizer + schedule state, trainer state, and ovkit.json written last
    (a directory without it is incomplete); built as .step-N.tmp and renamed, so kill -9 leaves no half checkpoint."""
    from ovkit.config import to_plain
    from ovkit.runs import write_json
    from ovkit.train.checkpoint import PROVENANCE, TRAINER_STATE, list_checkpoints, step_dir

    final = step_dir(cfg.partial, state["step"])
    tmp = final.parent / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / STATE_FILE)
    write_json(tmp / TRAINER_STATE, state)
    write_json(tmp / PROVENANCE, {"command": "rl-train", "config": to_plain(cfg), "parent": {"path": str(cfg.model)}, "step": state["step"], "metrics": state.get("last", {})})
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(cfg.partial)[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _load_state(cfg: RLTrainConfig, ckpt: Path, optimizer, scheduler) -> dict[str, Any]:
    import json

    from ovkit.config import to_plain
    from ovkit.train.checkpoint import PROVENANCE, TRAINER_STATE

    saved = json.loads((ckpt / PROVENANCE).read_text())["config"]
    now = to_plain(cfg)
    changed = [k.replace("_", "-") for k in TRAJECTORY if saved.get(k.replace("_", "-")) != now.get(k.replace("_", "-"))]
    if changed:
        diffs = ", ".join(f"--{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise OvkitError(f"--resume: {ckpt} was trained with different options ({diffs}); use the same ones, or --overwrite to start over")
    blob = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    return json.loads((ckpt / TRAINER_STATE).read_text())


def _save_rollouts(run_dir: Path, step: int, groups: Sequence[Group], tokenizer: Any = None) -> None:
    from ovkit.rl.rollout import groups_table
    from ovkit.data import write_table

    write_table(groups_table(groups, tokenizer=getattr(tokenizer, "tokenizer", tokenizer)), Path(run_dir) / "rollouts" / f"step-{step:06d}.parquet")
