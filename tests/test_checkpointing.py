"""Activation checkpointing (ovkit.runtime.checkpointing) on a tiny Qwen2.5-VL with images.

Invariants: every mode gives every parameter the same gradient as no checkpointing (fp32, exact on CPU); the bytes
autograd keeps for backward strictly fall from off to mlp and from off to every-2 to full; `sft` and `rl-train`
with --activation-checkpointing full give the same losses and weights as without; a bad mode exits 2; the mode
is run control (not part of the resume trajectory) and is recorded in ovkit.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY, weights

from ovkit.runtime import checkpointing as ac

pytestmark = pytest.mark.usefixtures("one_thread")


MODES = ("off", "mlp", "every-2", "full")


@pytest.fixture(scope="module")
def tiny(deep):
    """The `deep` fixture's model (conftest.py): 4 decoder layers and a 4-block ViT (every-2 checkpoints half of
    each), small widths,
    16 samples with images."""
    return deep[0]


def _model_and_batch(root: Path):
    from ovkit.models import load, pad_token_id
    from ovkit.train.data import SampleSource

    model, processor = load(root / "model", dtype=torch.float32)
    model.config.use_cache = False
    source = SampleSource(root / "data", processor, max_len=4096)
    batch = source.collate([source[i] for i in range(4)], pad_token_id(processor, model))
    return model, batch


def _loss(model, batch):
    from ovkit.train.loop import token_nll_sum

    return token_nll_sum(model, batch, torch.device("cpu"))


def test_blocks_are_found_in_both_stacks(tiny):
    model, _ = _model_and_batch(tiny)
    stacks = ac.block_stacks(model)
    assert [n for n, _ in stacks["llm"]] == ["model.language_model.layers"]
    assert [n for n, _ in stacks["vision"]] == ["model.visual.blocks"]
    assert len(ac.targets(model, "full")) == 8 and len(ac.targets(model, "every-2")) == 4
    assert [n for n, _ in ac.targets(model, "every-2")][:2] == [
        "model.language_model.layers.1",
        "model.language_model.layers.3",
    ]
    assert all(n.endswith(".mlp") for n, _ in ac.targets(model, "mlp")) and len(ac.targets(model, "mlp")) == 8


@pytest.mark.parametrize("arch", ["llava-onevision", "smolvlm"])
def test_blocks_are_found_by_structure_in_other_architectures(arch):
    """No per-architecture table: LLaVA-OneVision (SigLIP + Qwen2) and SmolVLM/Idefics3 (its ViT + Llama), on meta."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
    )

    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=300,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
    )
    if arch == "llava-onevision":
        config = LlavaOnevisionConfig(
            text_config={"model_type": "qwen2", **text}, vision_config={"model_type": "siglip_vision_model", **vision}
        )
        cls, names = (
            LlavaOnevisionForConditionalGeneration,
            ("model.language_model.layers", "model.vision_tower.encoder.layers"),
        )
    else:
        config = Idefics3Config(text_config={"model_type": "llama", **text}, vision_config=vision)
        cls, names = Idefics3ForConditionalGeneration, ("model.text_model.layers", "model.vision_model.encoder.layers")
    with torch.device("meta"):
        model = cls(config)
    stacks = ac.block_stacks(model)
    assert [n for n, _ in stacks["llm"]] == [names[0]] and [n for n, _ in stacks["vision"]] == [names[1]]
    assert len(ac.targets(model, "full")) == 5 and len(ac.targets(model, "mlp")) == 5


def test_every_mode_gives_the_same_gradients_and_keeps_fewer_bytes(tiny):
    model, batch = _model_and_batch(tiny)
    assert batch["pixel_values"].numel() > 0
    grads, kept = {}, {}
    for mode in MODES:
        ac.remove(model)
        ac.apply(model, mode)
        model.zero_grad(set_to_none=True)
        kept[mode], loss = ac.saved_bytes(lambda: _loss(model, batch), exclude=model)
        loss.backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ac.remove(model)
    assert len(grads["off"]) == sum(1 for p in model.parameters() if p.requires_grad)
    for mode in MODES[1:]:
        assert grads[mode].keys() == grads["off"].keys()
        for name, g in grads["off"].items():
            torch.testing.assert_close(grads[mode][name], g, rtol=1e-6, atol=0, msg=f"{mode}: {name}")
    assert kept["off"] > kept["mlp"]
    assert kept["off"] > kept["every-2"] > kept["full"]


def test_lora_adapters_behind_frozen_embeddings_get_gradients(tiny):
    """Non-reentrant checkpointing needs no requires_grad on the inputs (peft's enable_input_require_grads)."""
    from ovkit.models import lora
    from ovkit.models.groups import trainable_names

    model, batch = _model_and_batch(tiny)
    lora.apply(model, trainable_names(model, ["llm"]), lora.LoraSpec(r=2))
    grads = {}
    for mode in ("off", "full"):
        ac.remove(model)
        ac.apply(model, mode)
        model.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["full"] and grads["full"].keys() == grads["off"].keys()
    assert all("lora_" in n for n in grads["full"])
    for name, g in grads["off"].items():
        torch.testing.assert_close(grads["full"][name], g, rtol=1e-6, atol=0, msg=name)


def test_generation_without_grad_runs_the_plain_forward(tiny):
    model, batch = _model_and_batch(tiny)
    ac.apply(model, "full")
    calls = []
    orig = torch.utils.checkpoint.checkpoint
    try:
        torch.utils.checkpoint.checkpoint = lambda *a, **k: calls.append(1) or orig(*a, **k)
        with torch.no_grad():
            _loss(model, batch)
        assert not calls
        _loss(model, batch)
        assert len(calls) == 8
    finally:
        torch.utils.checkpoint.checkpoint = orig


def test_modes_parse_and_auto_decides_by_device_and_memory():
    assert [ac.canonical(m) for m in ("OFF", "full", "mlp", "every-3", "every-1", "auto")] == [
        "off",
        "full",
        "mlp",
        "every-3",
        "full",
        "auto",
    ]
    for bad in ("every-0", "every", "some", "every-x"):
        with pytest.raises(ValueError):
            ac.canonical(bad)
    assert ac.choose("auto", torch.device("cpu"))[0] == "off"
    assert ac.choose("mlp", torch.device("cpu")) == ("mlp", "asked for")
    gib = 1 << 30
    assert ac.choose("auto", torch.device("cuda"), needed=50 * gib, free=40 * gib)[0] == "full"
    assert ac.choose("auto", torch.device("cuda"), needed=10 * gib, free=40 * gib)[0] == "off"


def test_bad_mode_exits_2_naming_the_flag(tiny, tmp_path, cli):
    code, _, err = cli(
        "sft",
        tiny / "data",
        "--model",
        tiny / "model",
        "--out",
        tmp_path / "o",
        "--activation-checkpointing",
        "sometimes",
    )
    assert code == 2 and "--activation-checkpointing" in err
    code, _, err = cli(
        "rl-train",
        tiny / "data",
        "--model",
        tiny / "model",
        "--out",
        tmp_path / "o",
        "--activation-checkpointing",
        "every-0",
    )
    assert code == 2 and "--activation-checkpointing" in err
    code, _, err = cli(
        "sft",
        tiny / "data",
        "--model",
        tiny / "model",
        "--out",
        tmp_path / "o",
        "--gradient-checkpointing",
        "--activation-checkpointing",
        "mlp",
    )
    assert code == 2 and "--gradient-checkpointing" in err


def test_gradient_checkpointing_means_full_and_is_not_trajectory():
    from ovkit.rl.config import TRAJECTORY as RL_TRAJECTORY
    from ovkit.train.config import TRAJECTORY, SFTConfig

    cfg = SFTConfig(data=["d"], model="m", out="o", gradient_checkpointing=True)
    assert cfg.activation_checkpointing == "full"
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        assert name not in TRAJECTORY and name not in RL_TRAJECTORY


def test_sft_with_full_checkpointing_matches_without(tiny, tmp_path, cli):
    runs = {}
    for mode in ("off", "full"):
        out = tmp_path / mode
        code, _, err = cli(
            "sft",
            tiny / "data",
            "--model",
            tiny / "model",
            "--out",
            out,
            "--batch-size",
            "4",
            "--max-steps",
            "2",
            "--precision",
            "fp32",
            "--lr",
            "1e-2",
            "--activation-checkpointing",
            mode,
            "--quiet",
        )
        assert code == 0, err
        runs[mode] = out
    losses = {
        m: [json.loads(x)["loss"] for x in (o / "metrics.jsonl").read_text().splitlines()] for m, o in runs.items()
    }
    assert losses["full"] == pytest.approx(losses["off"], rel=1e-6)
    a, b = weights(runs["off"]), weights(runs["full"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)
    info = json.loads((runs["full"] / "ovkit.json").read_text())["runtime"]["activation_checkpointing"]
    assert info["mode"] == "full" and info["blocks"] == 8
    assert json.loads((runs["off"] / "ovkit.json").read_text())["runtime"]["activation_checkpointing"]["mode"] == "off"


def test_rl_train_with_full_checkpointing_matches_without(rl_assets, tmp_path, cli):
    model_dir, data = rl_assets
    runs = {}
    for mode in ("off", "full"):
        out = tmp_path / mode
        code, _, err = cli(
            "rl-train",
            data,
            "--model",
            model_dir,
            "--out",
            out,
            "--max-steps",
            "2",
            "--max-staleness",
            "0",
            "--precision",
            "fp32",
            "--activation-checkpointing",
            mode,
            "--quiet",
            *TINY,
        )
        assert code == 0, err
        runs[mode] = out
    rows = {m: [json.loads(x) for x in (o / "metrics.jsonl").read_text().splitlines()] for m, o in runs.items()}
    for a, b in zip(rows["off"], rows["full"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7) and b["reward"] == a["reward"]
    a, b = weights(runs["off"]), weights(runs["full"])
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)
    assert (
        json.loads((runs["full"] / "ovkit.json").read_text())["runtime"]["activation_checkpointing"]["mode"] == "full"
    )


def test_qlora_with_full_checkpointing_matches_without(tiny, tmp_path, cli):
    """4-bit base + adapters: peft's prepare step no longer turns on HF's own checkpointing; ovkit's (non-reentrant)
    trains the adapters behind the frozen 4-bit layers to the same weights."""
    pytest.importorskip("bitsandbytes")
    runs = {}
    for mode in ("off", "full"):
        out = tmp_path / mode
        code, _, err = cli(
            "sft",
            tiny / "data",
            "--model",
            tiny / "model",
            "--out",
            out,
            "--batch-size",
            "4",
            "--max-steps",
            "2",
            "--precision",
            "fp32",
            "--lr",
            "5e-2",
            "--lora-r",
            "4",
            "--trainable",
            "llm",
            "--load-in-4bit",
            "--activation-checkpointing",
            mode,
            "--quiet",
        )
        assert code == 0, err
        runs[mode] = out
    a, b = weights(runs["off"]), weights(runs["full"])
    assert any(not torch.equal(a[n], weights(tiny / "model")[n]) for n in a if "layers" in n)  # the adapters trained
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
