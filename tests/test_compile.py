"""--compile (ovkit.runtime.compiling) and --kernels (ovkit.runtime.kernels) on a micro Qwen2.5-VL with images.

Invariants: sft with --compile logs the same per-step losses as eager within float tolerance (inductor, fp32);
compiled blocks give the same loss and gradients as eager, with activation checkpointing inside them too; across
batches of new sequence lengths and batch sizes the compiled frames stop growing after the first batches (symbolic
shapes: no recompile per step); the sampler's deep copy and generation with a KV cache run eager. --kernels: auto
is torch on CPU, liger is refused on CPU and when the package is missing, with messages naming the fix.

Most checks use the aot_eager backend (Dynamo's graph capture and AOTAutograd, no code generation): what they test is
the capture, the graph breaks and the recompiles, and inductor's C++ compilation would cost a minute each on 2
cores. The end-to-end sft test uses inductor, the real backend.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import TINY, config, losses

from ovkit.runtime import checkpointing as ac
from ovkit.runtime import compiling
from ovkit.runtime import kernels as kern

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiling, "BACKEND", "aot_eager")


def _model_and_batches(root, sizes):
    from ovkit.models import attention as attn
    from ovkit.models import load, pad_token_id
    from ovkit.train.data import SampleSource

    model, processor = load(root / "model", dtype=torch.float32)
    attn.apply(model, attn.resolve("auto", "cpu", train=True))
    model.config.use_cache = False
    source = SampleSource(root / "data", processor, max_len=4096)
    pad, start, batches = pad_token_id(processor, model), 0, []
    for n in sizes:
        batches.append(source.collate([source[i % len(source)] for i in range(start, start + n)], pad))
        start += n
    return model, batches


def _loss_and_grads(model, batch):
    from ovkit.train.loop import token_nll_sum

    model.zero_grad(set_to_none=True)
    loss = token_nll_sum(model, batch, torch.device("cpu"))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("checkpointing", ["off", "full"])
def test_compiled_blocks_give_eager_loss_and_gradients(assets, aot_eager, checkpointing, monkeypatch):
    model, (batch,) = _model_and_batches(assets, [4])
    ac.apply(model, checkpointing)
    want, want_grads = _loss_and_grads(model, batch)
    info = compiling.apply(model)  # after checkpointing, as the Runtime does
    assert info["blocks"] == {"llm": 1, "vision": 1}
    real, calls = compiling._compiled, []
    monkeypatch.setattr(compiling, "_compiled", lambda backend: calls.append(backend) or real(backend))
    got, grads = _loss_and_grads(model, batch)
    # both blocks through the compiled function (checkpointed: forward, then again to recompute in backward)
    assert len(calls) == (4 if checkpointing == "full" else 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    compiling.remove(model)
    layer = model.model.language_model.layers[0]
    assert "_ovkit_eager_forward" not in layer.__dict__ and ("forward" in layer.__dict__) == (checkpointing == "full")


def test_recompiles_stop_growing_with_new_lengths(assets, aot_eager):
    # batch sizes and sequence lengths change every step: a shape-specialised graph would recompile each time. What
    # may compile once each: the text and the vision block, with a padding mask and without (a batch of 1)
    model, batches = _model_and_batches(assets, [4, 1, 3, 2, 4, 1, 3, 2])
    first, then = batches[:3], batches[3:]
    assert {tuple(b["input_ids"].shape) for b in then} - {
        tuple(b["input_ids"].shape) for b in first
    }  # new shapes later
    torch._dynamo.reset()  # count this model's compilation, not what earlier tests left in the cache
    info = compiling.apply(model)
    for batch in first:
        _loss_and_grads(model, batch)
    warm = compiling.report(info)
    assert warm["graphs"] >= 2 and warm["graph_breaks"] >= 1  # a text and a vision block; attention breaks
    for batch in then:
        _loss_and_grads(model, batch)
    assert compiling.report(info)["frames"] == warm["frames"]


def test_deep_copy_and_kv_cache_run_eager(assets, monkeypatch):
    model, _ = _model_and_batches(assets, [])
    compiling.apply(model)
    monkeypatch.setattr(compiling, "_compiled", lambda backend: lambda block, *a, **k: "compiled")
    layer = model.model.language_model.layers[0]
    twin = copy.deepcopy(model).model.language_model.layers[0]
    assert twin.forward.__self__ is twin and twin._ovkit_eager_forward.__self__ is twin  # rebound to the copy
    for block in (layer, twin):
        block._ovkit_eager_forward = lambda *a, **k: "eager"
    assert layer(torch.zeros(1)) == "compiled"
    assert layer(torch.zeros(1), past_key_values=object()) == "eager"  # generation with a KV cache
    assert twin(torch.zeros(1)) == "eager"  # the asynchronous sampler's copy


def test_sft_with_compile_matches_eager(assets, tmp_path):
    from ovkit.train import train

    runs = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        out = tmp_path / name
        train(config("SFTConfig", assets, out, lr=1e-2, activation_checkpointing="off", compile=compile_))
        runs[name] = out
    assert losses(runs["compiled"]) == pytest.approx(losses(runs["eager"]), rel=1e-5)
    info = json.loads((runs["compiled"] / "ovkit.json").read_text())["runtime"]
    assert (
        info["compile"]["enabled"]
        and info["compile"]["blocks"] == {"llm": 1, "vision": 1}
        and info["compile"]["backend"] == "inductor"
    )
    assert info["compile"]["graphs"] >= 1
    assert info["kernels"]["kernels"] == "torch" and "cpu" in info["kernels"]["why"]
    assert json.loads((runs["eager"] / "ovkit.json").read_text())["runtime"]["compile"] == {"enabled": False}


@pytest.mark.slow  # 40 s on 2 busy cores (two rl-train runs and the compile)
def test_rl_train_with_compile_matches_eager(rl_assets, tmp_path, cli, aot_eager):
    rl_model, rl_data = rl_assets
    rows = {}
    for name, flag in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / name
        code, _, err = cli(
            "rl-train",
            rl_data,
            "--model",
            rl_model,
            "--out",
            out,
            "--max-steps",
            "2",
            "--max-staleness",
            "0",
            "--precision",
            "fp32",
            "--quiet",
            *flag,
            *TINY,
        )
        assert code == 0, err
        rows[name] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows["eager"], rows["compiled"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6) and b["reward"] == a["reward"]
    info = json.loads((tmp_path / "compiled" / "ovkit.json").read_text())["runtime"]["compile"]
    assert info["enabled"] and info["blocks"]["llm"] >= 1 and info["blocks"]["vision"] >= 1


# ---------------------------------------------------------------------------------------------------- --kernels


def test_kernels_auto_is_torch_on_cpu_and_liger_where_it_can(monkeypatch):
    assert kern.resolve("auto", torch.device("cpu")) == ("torch", "auto: cpu (Liger-Kernel's Triton kernels need CUDA)")
    assert kern.resolve("torch", torch.device("cuda"))[0] == "torch"
    monkeypatch.setattr(kern, "liger_installed", lambda: True)
    assert kern.resolve("auto", torch.device("cuda"))[0] == "liger"
    monkeypatch.setattr(kern, "liger_installed", lambda: False)
    choice, why = kern.resolve("auto", torch.device("cuda"))
    assert choice == "torch" and "not installed" in why


def test_kernels_liger_is_refused_without_cuda_or_the_package(monkeypatch):
    import importlib.util

    from ovkit.errors import OvkitError

    with pytest.raises(OvkitError, match="needs a CUDA device"):
        kern.check_option("liger", cuda=False)
    with pytest.raises(OvkitError, match="needs a CUDA device"):
        kern.check_option("auto", use_liger_kernel=True, cuda=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    with pytest.raises(OvkitError, match=r"not installed \(pip install 'ovkit\[liger\]'"):
        kern.check_option("liger", cuda=True)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else real(name, *a)
    )
    assert kern.check_option("liger", cuda=True) == "liger"
    assert kern.check_option("auto", use_liger_kernel=True, cuda=True) == "liger"
    with pytest.raises(OvkitError, match="--use-liger-kernel means --kernels liger"):
        kern.check_option("torch", use_liger_kernel=True, cuda=True)
    with pytest.raises(OvkitError, match="--kernels must be one of"):
        kern.check_option("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_liger_on_cpu_exits_2_and_options_are_not_trajectory(assets, tmp_path, cli):
    from ovkit.rl.config import TRAJECTORY as RL_TRAJECTORY
    from ovkit.train.config import TRAJECTORY

    for flags in (["--kernels", "liger"], ["--use-liger-kernel"]):
        code, _, err = cli("sft", assets / "data", "--model", assets / "model", "--out", tmp_path / "o", *flags)
        assert code == 2 and "needs a CUDA device" in err and "Traceback" not in err
    code, _, err = cli(
        "rl-train", assets / "data", "--model", assets / "model", "--out", tmp_path / "o", "--kernels", "fast"
    )
    assert code == 2 and "--kernels must be one of" in err
    for name in ("compile", "kernels", "use_liger_kernel"):
        assert name not in TRAJECTORY and name not in RL_TRAJECTORY


@pytest.mark.parametrize("first", ["checkpointing", "compile"])
def test_the_checkpoint_wraps_the_compiled_forward_whichever_is_applied_first(assets, first):
    model, _ = _model_and_batches(assets, [])
    names = list(model.state_dict())
    layer = model.model.language_model.layers[0]
    own = layer.forward
    steps = {"checkpointing": lambda: ac.apply(model, "full"), "compile": lambda: compiling.apply(model)}
    steps[first]()
    steps[({"checkpointing", "compile"} - {first}).pop()]()
    assert layer.forward.__func__ is ac._checkpointed_forward
    assert layer._ovkit_plain_forward.__func__ is compiling._compiled_forward and layer._ovkit_eager_forward == own
    assert list(model.state_dict()) == names  # no wrapper module: parameter names, hence checkpoints, unchanged
    ac.remove(model)  # the compiled forward stays, now outermost
    assert layer.forward.__func__ is compiling._compiled_forward and layer._ovkit_eager_forward == own
    assert "_ovkit_plain_forward" not in layer.__dict__
    compiling.remove(model)
    assert "forward" not in layer.__dict__ and layer.forward == own
