"""`--optimizer-in-backward` (ovkit.runtime.optim.OptimizerInBackward): each parameter's optimiser steps from a
post-accumulate-grad hook and frees the gradient. The weights are those of the whole-model step, bit for bit, for every
`--optim`; the logged grad norm is the whole gradient's; gradients cost 0 bytes per parameter; a crashed run resumes
bit for bit; the combinations that cannot be exact exit 2 naming the flags.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import config, dies_at_first_checkpoint, interrupted_then_resumed, losses, sft_runtime, weights

pytestmark = pytest.mark.usefixtures("one_thread")

# (--optim, --precision) -> bytes per trainable parameter with the gradients freed in backward (test_optim.EXPECTED
# less the gradients): fp32 16 - 4; bf16-mixed 18 - 4 (the fp32 master's gradient); bf16-true 8 - 2, 10 - 2.
SUPPORTED = {
    ("adamw_torch_fused", "fp32"): 12.0,
    ("adamw_torch", "fp32"): 12.0,
    ("adamw_torch_fused", "bf16-mixed"): 14.0,
    ("adamw_torch", "bf16-true"): 6.0,
    ("adamw_bf16", "bf16-true"): 8.0,
    ("adamw_8bit", "fp32"): None,  # 32-bit state on the micro model's small tensors (test_optim): not asserted
    ("adamw_8bit", "bf16-mixed"): None,
}


def _run(assets, out, **kw):
    from ovkit.train import train

    opts = dict(max_steps=4, lr=1e-2, batch_size=4, max_grad_norm=0.0, weight_decay=0.01, warmup_ratio=0.3)
    return train(config("SFTConfig", assets, out, **{**opts, **kw}))


def _grad_norms(out) -> list[float]:
    return [json.loads(line)["grad_norm"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optim,precision", list(SUPPORTED))
def test_in_backward_equals_the_whole_model_step(assets, tmp_path, optim, precision):
    """4 sft steps (weight decay on, a warmup so the schedule moves the lr) with and without the option: every saved
    weight equal bit for bit (each per-parameter optimiser runs the same elementwise update on the same tensor), the
    same losses, the same grad norm up to summation order and precision (the option sums fp32 squares of each
    gradient; clip_grad_norm_ takes norms in the gradient's dtype), and gradients counted 0 bytes per parameter."""
    kw = dict(optim=optim, precision=precision)
    _run(assets, tmp_path / "whole", **kw)
    _run(assets, tmp_path / "inbwd", optimizer_in_backward=True, **kw)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "inbwd")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    start = weights(assets / "model")
    assert sum(not torch.equal(a[k], start[k].float()) for k in a if k in start) > len(a) // 2  # the steps moved them
    assert losses(tmp_path / "whole") == losses(tmp_path / "inbwd")
    rel = 1e-5 if precision != "bf16-true" else 1e-2  # bf16 gradients: clip_grad_norm_'s per-tensor norms are bf16
    assert _grad_norms(tmp_path / "inbwd") == pytest.approx(_grad_norms(tmp_path / "whole"), rel=rel)

    runtime = json.loads((tmp_path / "inbwd" / "ovkit.json").read_text())["runtime"]
    measured, whole = runtime["bytes_per_param"], json.loads((tmp_path / "whole" / "ovkit.json").read_text())
    assert measured["grads"] == 0.0 and whole["runtime"]["bytes_per_param"]["grads"] > 0
    if SUPPORTED[optim, precision] is not None:
        assert measured["total"] == pytest.approx(SUPPORTED[optim, precision], abs=0.05), measured


def test_in_backward_with_activation_checkpointing_equals_the_whole_model_step(assets, tmp_path):
    """`--activation-checkpointing full` recomputes each block in backward: a block's weights step only after their
    gradient is complete, which is after the block's recompute and backward, so the result is still bit-identical."""
    kw = dict(optim="adamw_bf16", precision="bf16-true", activation_checkpointing="full")
    _run(assets, tmp_path / "whole", **kw)
    _run(assets, tmp_path / "inbwd", optimizer_in_backward=True, **kw)
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "inbwd")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = json.loads((tmp_path / "inbwd" / "ovkit.json").read_text())["runtime"]["activation_checkpointing"]
    assert ckpt["mode"] == "full" and ckpt["blocks"] > 0


def test_grad_norm_is_the_whole_gradients_norm():
    """On a model of three 64x64 matrices: the norm the hooks summed equals clip_grad_norm_'s over the same
    gradients, and the next backward starts a fresh sum."""
    from ovkit.runtime.optim import OptimizerInBackward, adamw, clip_grad_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
    x = torch.randn(8, 64)
    reference = [p.detach().clone() for p in model.parameters()]
    model(x).square().mean().backward()
    expected = clip_grad_norm(None, list(model.parameters()), 0.0)
    for p, r in zip(model.parameters(), reference):
        p.grad = None
        p.data.copy_(r)
    opt = OptimizerInBackward(model.parameters(), lambda p: adamw([p], lr=1e-3, weight_decay=0.0))
    model(x).square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert clip_grad_norm(opt, list(model.parameters()), 0.0).item() == pytest.approx(expected.item(), rel=1e-6)
    assert opt.grad_norm().item() == 0.0


def test_the_per_parameter_steps_are_not_counted_as_optimiser_steps():
    """bench/_syncs.py's OptimizerSteps (the sync counter's and bench/step_costs.py's step boundary) sees one step
    per loop iteration, the façade's, not one per parameter inside backward."""
    from helpers import OptimizerSteps

    from ovkit.runtime.optim import OptimizerInBackward, adamw

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = OptimizerInBackward(model.parameters(), lambda p: adamw([p], lr=1e-3, weight_decay=0.0))
    steps: list[int] = []
    hooks = OptimizerSteps(lambda: steps.append(1))
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    finally:
        hooks.remove()
    assert len(steps) == 3


@pytest.mark.parametrize("optim,precision", [("adamw_torch_fused", "fp32"), ("adamw_bf16", "bf16-true")])
def test_in_backward_crash_and_resume_is_bit_identical(assets, tmp_path, monkeypatch, optim, precision):
    """4 steps straight vs 2 + a checkpoint + a crash + 2 resumed, both in backward: the per-parameter optimiser
    states and the schedule come back, and every saved weight is equal bit for bit."""
    kw = dict(optim=optim, precision=precision, optimizer_in_backward=True, save_every=2)
    _run(assets, tmp_path / "straight", **kw)
    interrupted_then_resumed(
        monkeypatch, lambda resume: dict(resume=resume, **kw), lambda k: _run(assets, tmp_path / "cut", **k)
    )
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "straight") == losses(tmp_path / "cut")


def test_resume_keeps_the_option(assets, tmp_path, monkeypatch):
    """The checkpoint's optimiser state is saved per parameter: a resumed run that drops the option exits naming it."""
    from ovkit.errors import OvkitError

    with dies_at_first_checkpoint(monkeypatch), pytest.raises(KeyboardInterrupt):
        _run(assets, tmp_path / "cut", optimizer_in_backward=True, save_every=2)
    with pytest.raises(OvkitError, match="--optimizer-in-backward True -> False"):
        _run(assets, tmp_path / "cut", resume=True, save_every=2)


@pytest.mark.parametrize(
    "command,argv,message",
    [
        ("sft", ("--max-grad-norm", "0", "--grad-accum", "2"), "--optimizer-in-backward .* needs --grad-accum 1"),
        ("sft", (), "--optimizer-in-backward cannot clip .*set --max-grad-norm 0"),
        ("midtrain", ("--max-grad-norm", "1.0"), "set --max-grad-norm 0"),
        ("rl-train", (), "rl-train does not take --optimizer-in-backward"),
    ],
)
def test_combinations_that_cannot_be_exact_exit_2_naming_the_flags(cli, tmp_path, command, argv, message):
    code, _, err = cli(
        command,
        tmp_path / "data",
        "--model",
        tmp_path / "model",
        "--out",
        tmp_path / "out",
        "--optimizer-in-backward",
        *argv,
    )
    assert code == 2 and re.search(message, " ".join(err.split())), err


def test_several_processes_are_refused(assets, tmp_path, monkeypatch):
    """DDP / FSDP reduce the gradients after each parameter's hook would have stepped: Runtime exits 2 before loading
    anything (accelerate's process state faked to MULTI_CPU) and leaves no lock behind."""
    from accelerate.utils import DistributedType

    from ovkit.errors import OvkitError
    from ovkit.runtime import Runtime

    monkeypatch.setattr(Runtime, "distributed", property(lambda self: DistributedType.MULTI_CPU.value))
    cfg = config("SFTConfig", assets, tmp_path / "out", optimizer_in_backward=True, max_grad_norm=0.0)
    with pytest.raises(OvkitError, match="--optimizer-in-backward needs one process"):
        sft_runtime(cfg, trajectory=())
    assert not (tmp_path / "out.lock").exists()


def test_a_launcher_with_several_processes_is_refused_before_torch_loads(assets, tmp_path, monkeypatch):
    """Under torchrun / accelerate launch with N > 1 the config itself refuses (the environment says N), before any
    model or process group exists."""
    from ovkit.errors import OvkitError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(OvkitError, match=r"needs one process \(this launcher started 2\)"):
        config("SFTConfig", assets, tmp_path / "out", optimizer_in_backward=True, max_grad_norm=0.0)
