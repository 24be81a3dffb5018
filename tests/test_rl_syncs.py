"""The RL learner's step on the device (#25, #26): the host reads the device a bounded number of times per optimiser
step whatever the batch, and never inside the gradient pass but for the one read of the step's metrics and skip
guard (bench/_syncs.py counts the reads on CPU: on a GPU each one stalls the host).

On a CPU-only box the model and the host share a device, so "no tensor of the loss on another device" cannot fail
here; what can is a host read (`.cpu()`, `.item()`, `.tolist()`, a boolean-mask index) in the learner's part of
the step, which is what the learner used to do (its log-probs came back with `.cpu()` in the gradient pass). Both
are checked: the devices of every op's outputs (meaningful where a GPU is present) and the host reads (everywhere).
"""

from __future__ import annotations

import pytest
import torch
from helpers import rl_cfg, rl_groups
from torch.utils._python_dispatch import TorchDispatchMode

# reads inside transformers' Qwen-VL forward (none since the learner builds its input embeddings from host-computed
# image positions: ovkit.runtime.loss._embedded); kept apart so a regression there names itself
TRANSFORMERS = ("modeling_qwen2_5_vl.py", "import_utils.py")


def _learner_syncs(cfg) -> list:
    """Where the host read the device in each step's device side (ovkit.rl.update.learn) of an rl-train run."""
    from helpers import SyncCounter

    from ovkit.rl import update
    from ovkit.rl.loop import train_rl

    sites, learn = [], update.learn

    def counted(*a, **k):
        with SyncCounter() as syncs:
            out = learn(*a, **k)
        sites.append(syncs.where)
        return out

    update.learn = counted
    try:
        train_rl(cfg)
    finally:
        update.learn = learn
    return sites


def _ours(where) -> dict:
    return {k: n for k, n in where.items() if not k.startswith(TRANSFORMERS)}


@pytest.mark.parametrize("group_size", [2, 4])
def test_a_learner_step_reads_the_device_once_whatever_the_batch(rl_assets, tmp_path, group_size):
    """One read per step (the skip guard and every metric, after the backward), none inside transformers' forward.
    Before #26: 284 per step at 4 prompts x group 4, growing with the batch."""
    model, data = rl_assets
    counts = {}
    for g in (group_size, 2 * group_size):
        cfg = rl_cfg(
            model,
            data,
            tmp_path / f"g{g}",
            group_size=g,
            micro_batch_size=2 * g,
            max_steps=2,
            quiet=True,
            precision="fp32",
        )
        sites = _learner_syncs(cfg)
        counts[g] = [sum(w.values()) for w in sites]
        for where in sites:
            assert list(_ours(where).values()) == [1], dict(where)
    assert counts[group_size] == counts[2 * group_size]
    assert max(counts[group_size]) == 1, counts


def test_several_micro_batches_and_minibatches_read_once_per_optimiser_step(rl_assets, tmp_path):
    """Each optimiser step reads once (its skip guard; the last one carries the metrics), whatever the micro-batches
    and forwards (reference and proximal passes over the batch included)."""
    model, data = rl_assets
    cfg = rl_cfg(
        model,
        data,
        tmp_path / "mb",
        group_size=4,
        micro_batch_size=3,
        ppo_minibatches=2,
        kl_coef=0.01,
        max_steps=1,
        quiet=True,
    )
    (where,) = _learner_syncs(cfg)
    assert sum(where.values()) == sum(_ours(where).values()) == 2, dict(where)  # two optimiser steps


class _Devices(TorchDispatchMode):
    """The devices of every tensor an op outputs."""

    def __init__(self):
        super().__init__()
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out


def test_the_loss_lives_on_the_models_device_with_no_host_read_in_the_gradient_pass(rl_assets, tmp_path, monkeypatch):
    """Between the first forward and the optimiser step, no op outputs a tensor off the model's device and the host
    reads nothing but inside transformers' forward, until the step's one read (after the clipping)."""

    from helpers import SyncCounter

    from ovkit.models import attention as attn
    from ovkit.models import load
    from ovkit.rl import update
    from ovkit.rl.loop import trainable
    from ovkit.runtime.optim import adamw

    model_dir, data = rl_assets
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = rl_cfg(model_dir, data, tmp_path / "unused", kl_coef=0.01, correction="token-tis")
    model, processor = load(model_dir)
    attn.apply(model, attn.resolve("auto", device, train=True))  # the learner's attention, as rl-train loads it
    model.eval()
    groups = rl_groups(model, processor, data, cfg, [[1, 0, 1, 0], [0, 1, 0.5, 0]])
    model.to(device)
    params = trainable(model, cfg)
    optimizer = adamw(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sb = update.prepare_step(groups, 0, processor.tokenizer.pad_token_id, model.config, cfg.update_options())

    seen, clip = {}, update.clip_grad_norm

    def clipped(*a, **k):  # the gradient pass ends at the clipping; what follows is the step's read
        seen["reads"] = dict(syncs.where)
        seen["devices"] = set(devices.devices)
        return clip(*a, **k)

    monkeypatch.setattr(update, "clip_grad_norm", clipped)
    with SyncCounter() as syncs, _Devices() as devices:
        metrics = update.learn(model, optimizer, params, sb, cfg.correction_config(), None, cfg.update_options())
    assert seen["devices"] == {torch.device(device).type}
    assert not seen["reads"], seen["reads"]  # no .cpu()/.item()/.tolist()/mask index in the pass, transformers included
    assert [k for k in _ours(syncs.where)] == [k for k in _ours(syncs.where) if "ppo_update (Tensor.tolist)" in k]
    assert metrics["grad_norm"] > 0 and metrics["skipped_updates"] == 0 and "mismatch/vllm_kl" in metrics
