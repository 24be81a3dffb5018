"""ovkit.runtime: the shared training runtime.

- attention calls per optimiser step stay proportional to layers (padded batches of many images, packed rows);
- packed == padded loss and update for every attention implementation that runs on CPU;
- the loss over a Qwen-sized vocabulary (151,936) peaks at the chunk's memory, not tokens x vocab;
- the chunked loss and log-probs equal the full-logits ones, gradients included;
- activation checkpointing with packed rows and a frozen group gives the same loss and gradients;
- bf16-mixed keeps fp32 master weights, resumes from them exactly, and stays near fp32;
- sft and the RL learner go through the same runtime functions.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import ENV, config, interrupted_then_resumed, make_rows, pack_plan, rl_cfg, sft_runtime, weights

pytestmark = pytest.mark.usefixtures("one_thread")


def _attention_calls(cfg) -> tuple[int, int]:
    """(SDPA calls, softmax calls) in one optimiser step of `train(cfg)`."""
    from torch.profiler import ProfilerActivity, profile

    from ovkit.train import train

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(cfg)
    counts = {e.key: e.count for e in prof.key_averages()}
    return counts.get("aten::scaled_dot_product_attention", 0), counts.get("aten::softmax", 0) + counts.get(
        "aten::_softmax", 0
    )


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_attention_calls_per_step_are_bounded_by_layers(deep, tmp_path, cli, layout):
    """16 images in one padded micro-batch, or two packed rows: at most 2 x (LLM layers + ViT depth) attention calls
    (sdpa), where transformers' per-image vision attention makes LLM layers + ViT depth x images (and eager shows
    it)."""
    root, spec = deep
    kw = dict(data=root / "data", model=root / "model", max_steps=1, batch_size=16)
    if layout == "packed":
        plan, n_packs = pack_plan(cli, root, 512)
        assert n_packs == 2
        kw.update(plan=plan, batch_size=2)
    bound = 2 * (spec.num_layers + spec.vision_depth)
    sdpa, _ = _attention_calls(config("SFTConfig", root, tmp_path / "sdpa", **kw, attn_implementation="sdpa"))
    assert 0 < sdpa <= bound
    _, softmaxes = _attention_calls(config("SFTConfig", root, tmp_path / "eager", **kw, attn_implementation="eager"))
    assert softmaxes >= spec.vision_depth * 16  # the reference loops over images: what sdpa no longer does


def _cpu_attention() -> list[str]:
    return ["sdpa", "eager"]  # flex_attention: Qwen2.5-VL does not support it (the fallback test below)


@pytest.mark.parametrize("attn", _cpu_attention())
def test_packed_equals_padded_for_every_cpu_attention(deep, tmp_path, cli, attn):
    root, _ = deep
    plan, n_packs = pack_plan(cli, root, 160)
    from ovkit.train import train

    padded = train(
        config("SFTConfig", root, tmp_path / "padded", batch_size=16, max_steps=1, lr=1e-2, attn_implementation=attn)
    )
    packed = train(
        config(
            "SFTConfig",
            root,
            tmp_path / "packed",
            plan=plan,
            batch_size=n_packs,
            max_steps=1,
            lr=1e-2,
            attn_implementation=attn,
        )
    )
    assert packed.metrics["first_loss"] == pytest.approx(padded.metrics["first_loss"], rel=1e-5)
    w_pad, w_pack = weights(tmp_path / "padded"), weights(tmp_path / "packed")
    for name in w_pad:
        torch.testing.assert_close(w_pad[name], w_pack[name], rtol=1e-4, atol=1e-6, msg=name)
    used = json.loads((tmp_path / "packed" / "ovkit.json").read_text())["runtime"]["attention"]
    from ovkit.models.attention import VARLEN

    # a learner's sdpa is the varlen function in the language model too: packed rows attend per sample, no T x T mask
    assert used["requested"] == attn and used["text"] == {"sdpa": VARLEN, "eager": "eager"}[attn]


def test_an_implementation_the_architecture_lacks_falls_back_to_sdpa_with_one_warning(deep, capsys):
    from ovkit.models import attention, load

    root, _ = deep
    attention._warn_once.cache_clear()  # "once per process": whatever ran before in this one
    used = [attention.apply(load(root / "model")[0], attention.resolve("flex_attention", "cpu")) for _ in range(2)]
    assert all(u.text == "sdpa" and u.vision == attention.VARLEN and "flex_attention" in u.note for u in used)
    assert capsys.readouterr().err.count("does not support flex_attention") == 1
    cuda_only = attention.resolve("flash_attention_2", "cpu")
    assert cuda_only.text == "sdpa" and "flash_attention_2 unavailable" in cuda_only.note


def test_chunked_loss_and_logprobs_equal_the_full_logits(deep):
    import torch.nn.functional as F

    from ovkit.models import load
    from ovkit.models.encode import decode_images, encode_sample
    from ovkit.models.precompute import model_inputs
    from ovkit.pack.batches import collate_padded
    from ovkit.runtime.loss import nll_sum, score

    root, _ = deep
    model, processor = load(root / "model")
    rows = make_rows(4)
    batch = collate_padded([encode_sample(processor, r["messages"], decode_images(r["images"])) for r in rows], 0)
    inputs = model_inputs(batch, "cpu")
    logits = model(**inputs).logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    full = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    full_grads = torch.autograd.grad(full, [p for p in model.parameters()], allow_unused=True)
    chunked = nll_sum(model, inputs, batch["labels"])
    chunked_grads = torch.autograd.grad(chunked, [p for p in model.parameters()], allow_unused=True)
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    for a, b in zip(full_grads, chunked_grads):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    where = targets != -100
    logp, ent = score(model, inputs, targets.clamp(min=0), where, temperature=0.7, entropy=True, chunk=5)
    ref = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(
        logp[where], ref.gather(-1, targets.clamp(min=0)[..., None])[..., 0][where], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(ent[where], -(ref.exp() * ref).sum(-1)[where], rtol=1e-5, atol=1e-5)
    assert (logp[~where] == 0).all()


PEAK_SCRIPT = r"""
import resource, sys, torch
from ovkit.runtime.loss import head_logprobs
torch.manual_seed(0)
vocab, hidden, tokens, chunked = 151936, 64, 4096, sys.argv[1] == "chunked"
head = torch.nn.Linear(hidden, vocab, bias=False)
h = torch.randn(tokens, hidden, requires_grad=True)
t = torch.randint(0, vocab, (tokens,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if chunked:
    logp, _ = head_logprobs(h, head, t)
else:
    logp = torch.log_softmax(head(h).float(), -1).gather(-1, t[:, None])[:, 0]
(-logp.sum()).backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


@pytest.mark.timeout(600)  # 69 s on a loaded 2-core box: GB-sized logits, in two subprocesses
def test_the_loss_over_a_qwen_vocabulary_peaks_at_the_chunk_not_tokens_x_vocab():
    """4,096 target tokens x 151,936 vocabulary: 2.5 GB of fp32 logits (and as much again for their gradient) the
    plain way; the chunked head stays within a few chunks (64 MiB each) plus the head's own gradient (39 MB) and
    what the allocator keeps."""
    peak = {}
    for mode in ("chunked", "full"):
        run = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, mode], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
        peak[mode] = int(run.stdout.split()[-1])
    logits_bytes = 4096 * 151936 * 4
    assert peak["full"] > logits_bytes  # the measurement can see a tokens x vocab tensor
    assert peak["chunked"] < 0.35 * logits_bytes  # measured 0.57 GB against 7.5 GB


def test_gradient_checkpointing_with_packed_rows_and_a_frozen_group_changes_nothing(deep, tmp_path, cli):
    root, _ = deep
    plan, n_packs = pack_plan(cli, root, 160)
    from ovkit.train import train

    kw = dict(plan=plan, batch_size=n_packs, max_steps=1, lr=1e-2, freeze_vision=True)
    plain = train(config("SFTConfig", root, tmp_path / "plain", **kw))
    ckpt = train(config("SFTConfig", root, tmp_path / "ckpt", gradient_checkpointing=True, **kw))
    assert ckpt.metrics["first_loss"] == pytest.approx(plain.metrics["first_loss"], rel=1e-6)
    a, b, start = weights(tmp_path / "plain"), weights(tmp_path / "ckpt"), weights(root / "model")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)
        if name.startswith("model.visual.") and "merger" not in name:
            assert torch.equal(a[name], start[name]), name  # frozen stays frozen


def test_bf16_mixed_keeps_fp32_masters_and_resumes_from_them_exactly(deep, tmp_path, monkeypatch):
    from ovkit.runtime import Runtime
    from ovkit.runtime.optim import MixedPrecisionAdamW
    from ovkit.train import train

    root, _ = deep
    seen = {}
    prepare = Runtime.prepare

    def spy(self, model, optimizer, scheduler):
        seen["optimizer"] = optimizer
        seen["dtypes"] = {p.dtype for p in model.parameters()}
        return prepare(self, model, optimizer, scheduler)

    monkeypatch.setattr(Runtime, "prepare", spy)
    kw = dict(max_steps=4, lr=1e-2, save_every=2, precision="bf16-mixed")
    straight = train(config("SFTConfig", root, tmp_path / "straight", **kw))
    assert isinstance(seen["optimizer"], MixedPrecisionAdamW) and seen["dtypes"] == {torch.bfloat16}
    assert all(m.dtype == torch.float32 for _, m in seen["optimizer"].pairs)
    fp32 = train(config("SFTConfig", root, tmp_path / "fp32", **{**kw, "precision": "fp32"}))
    assert straight.metrics["final_loss"] == pytest.approx(fp32.metrics["final_loss"], rel=0.05)
    assert all(v.dtype == torch.float32 for v in weights(tmp_path / "straight").values())  # saved from the masters

    interrupted_then_resumed(
        monkeypatch, lambda resume: config("SFTConfig", root, tmp_path / "cut", resume=resume, **kw), train
    )
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "cut")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the fp32 masters came back bit for bit


def test_sft_and_the_rl_learner_go_through_the_same_runtime(deep, rl_assets, tmp_path, monkeypatch):
    from ovkit.rl.loop import train_rl
    from ovkit.runtime import Runtime
    from ovkit.train import train

    calls: dict[str, list[str]] = {}
    for name in (
        "load_model",
        "optimizer",
        "prepare",
        "resume",
        "logger",
        "backward",
        "clip",
        "save_checkpoint",
        "finish",
    ):
        original = getattr(Runtime, name)

        def spy(self, *a, _name=name, _original=original, **k):
            calls.setdefault(self.command, []).append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(Runtime, name, spy)
    root, _ = deep
    train(config("SFTConfig", root, tmp_path / "sft", max_steps=2, save_every=1))
    model_dir, data = rl_assets
    train_rl(rl_cfg(model_dir, data, tmp_path / "rl", max_steps=2, save_every=1, quiet=True))
    assert (
        set(calls["sft"])
        == set(calls["rl-train"])
        == {"load_model", "optimizer", "prepare", "resume", "logger", "backward", "clip", "save_checkpoint", "finish"}
    )
    prov = json.loads((tmp_path / "rl" / "ovkit.json").read_text())
    assert (
        prov["runtime"]["precision"]["used"] == "fp32"
        and prov["runtime"]["attention"]["vision"] == "ovkit_varlen_flash"
    )


# ---- LoRA ------------------------------------------------------------------------------------------------------------


def test_lora_trains_adapters_only_and_saves_a_merged_model_and_the_adapter(deep, tmp_path):
    """sft --lora-r 4: base weights frozen, adapters (and nothing else of the LLM) move; OUT holds the merged model
    (base + scale * B A), which loads with transformers and gives the adapted model's logits, and OUT/adapter loads
    with peft onto the base."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ovkit.models import load
    from ovkit.train import train

    root, _ = deep
    res = train(
        config("SFTConfig", root, tmp_path / "lora", max_steps=3, lr=5e-2, lora_r=4, lora_alpha=8, trainable=["llm"])
    )
    assert res.metrics["trainable_params"] < res.metrics["total_params"] / 5
    start, merged = weights(root / "model"), weights(tmp_path / "lora")
    assert set(start) == set(merged)  # the checkpoint layout of the base: no peft names
    changed = {k for k in start if not torch.equal(start[k], merged[k])}
    assert changed and all(
        k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        for k in changed
    )
    base = AutoModelForImageTextToText.from_pretrained(root / "model")
    adapted = PeftModel.from_pretrained(base, tmp_path / "lora" / "adapter").eval()
    plain, processor = load(tmp_path / "lora")
    from ovkit.models.encode import decode_images, encode_sample

    row = make_rows(1)[0]
    inputs = encode_sample(processor, row["messages"], decode_images(row["images"])).model_inputs(labels=False)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(**inputs).logits, adapted(**inputs).logits, rtol=1e-4, atol=1e-5)


def test_lora_adapter_is_the_whole_update_projector_included(deep, tmp_path, monkeypatch):
    """sft --lora-r 4 with the default --trainable all: the projector trains in full, so the adapter lists it in
    modules_to_save and base + adapter (peft's merge) equals OUT's weights exactly; the base is named by its absolute
    path though --model was typed relative; and the adapter directory given as --model names peft and the merged OUT."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ovkit.errors import OvkitError
    from ovkit.models import check_model_dir
    from ovkit.train import train

    root, _ = deep
    monkeypatch.chdir(root)
    out = tmp_path / "lora"
    train(config("SFTConfig", root, out, model="model", max_steps=3, lr=5e-2, lora_r=4, lora_alpha=8))
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == ["model.visual.merger"]
    assert adapter_config["base_model_name_or_path"] == str((root / "model").resolve())
    base = AutoModelForImageTextToText.from_pretrained(adapter_config["base_model_name_or_path"])
    start = {k: v.clone() for k, v in base.state_dict().items()}
    merged = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    assert any(not torch.equal(start[k], merged[k]) for k in start if k.startswith("model.visual.merger."))
    rebuilt = PeftModel.from_pretrained(base, out / "adapter").merge_and_unload().state_dict()
    assert set(rebuilt) == set(merged)
    for k, v in merged.items():
        torch.testing.assert_close(rebuilt[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    with pytest.raises(OvkitError, match=rf"peft LoRA adapter .* --model {out}\b"):
        check_model_dir(out / "adapter")


def test_rl_train_with_lora_samples_from_the_adapted_model(rl_assets, tmp_path):
    """rl-train --lora-r: the synchronous sampler is the adapted learner (on-policy: the learner re-reads the
    sampler's tokens exactly), an asynchronous sampler's copy carries the adapters; the output is the merged model."""
    from ovkit.rl.loop import train_rl

    model_dir, data = rl_assets
    for staleness in (0, 1):
        out = tmp_path / f"rl-{staleness}"
        train_rl(rl_cfg(model_dir, data, out, max_steps=2, lora_r=4, lr=1e-2, max_staleness=staleness, quiet=True))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        if staleness == 0:
            assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows)
        assert (out / "adapter" / "adapter_config.json").is_file()
        assert set(weights(out)) == set(weights(model_dir))


def test_every_checkpoint_state_file_loads_with_weights_only(deep, tmp_path):
    """No pickled object in a checkpoint: the optimiser, model and RNG states load with weights_only=True, the way
    accelerate's load_state reads them (its allowlist adds numpy's RNG state types); the lr schedule is replayed
    from the step on resume instead of unpickled."""
    from accelerate.utils import load

    from ovkit.train import train

    root, _ = deep
    train(config("SFTConfig", root, tmp_path / "out", max_steps=2, save_every=1))
    state = tmp_path / "out" / "checkpoints" / "step-000001" / "state"
    files = [f for f in state.iterdir() if f.suffix in (".bin", ".pkl", ".pt")]
    assert files and not [f for f in files if f.name.startswith("custom_checkpoint")]
    for f in files:
        load(f, map_location="cpu", weights_only=True)


def test_qlora_trains_adapters_on_a_four_bit_base_and_saves_a_plain_merged_model(deep, tmp_path):
    """sft --lora-r 4 --load-in-4bit (bitsandbytes' NF4, which runs on CPU): the language model's Linear layers are
    4-bit and stay as loaded, the vision tower and the head are not quantised, the adapters train; OUT is a plain
    checkpoint (no quantisation config) whose logits equal the 4-bit base + adapters' own."""
    bnb = pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from ovkit.errors import OvkitError
    from ovkit.models import lora
    from ovkit.models.encode import decode_images, encode_sample
    from ovkit.train import train

    root, _ = deep
    with pytest.raises(OvkitError, match="--lora-r"):
        train(config("SFTConfig", root, tmp_path / "no-rank", max_steps=1, load_in_4bit=True))
    cfg = config(
        "SFTConfig",
        root,
        tmp_path / "qlora",
        max_steps=3,
        lr=5e-2,
        lora_r=4,
        lora_alpha=8,
        trainable=["llm"],
        load_in_4bit=True,
    )
    rt = sft_runtime(cfg)
    model, processor = rt.load_model(root / "model")
    four_bit = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all("layers." in n and "visual" not in n for n in four_bit) and "lm_head" not in four_bit
    before = {n: m.weight.data.clone() for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}

    res = train(cfg)
    assert res.metrics["trainable_params"] < res.metrics["total_params"] / 5
    assert "quantization_config" not in json.loads((tmp_path / "qlora" / "config.json").read_text())
    merged = weights(tmp_path / "qlora")
    assert set(merged) == set(weights(root / "model"))  # the base's checkpoint layout, every weight full precision
    assert all(v.dtype == torch.float32 for v in merged.values())

    row = make_rows(1)[0]
    inputs = encode_sample(processor, row["messages"], decode_images(row["images"])).model_inputs(labels=False)
    # the user's way back to the trained model: the 4-bit base (plain transformers) and the adapter through peft
    base = AutoModelForImageTextToText.from_pretrained(
        root / "model", quantization_config=lora.four_bit_config(torch.float32)
    )
    assert all(
        torch.equal(before[n], m.weight.data) for n, m in base.named_modules() if n in before
    )  # NF4 is deterministic
    with torch.no_grad():  # train mode: bitsandbytes' CPU inference path (eval + no grad) repacks the weights and
        untrained = base.train()(**inputs).logits  # fails on tiny layers; no dropout anywhere, so the same function
    adapted = PeftModel.from_pretrained(base, tmp_path / "qlora" / "adapter")
    plain = AutoModelForImageTextToText.from_pretrained(tmp_path / "qlora").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(**inputs).logits, adapted.train()(**inputs).logits, rtol=1e-3, atol=1e-4)
        assert not torch.allclose(plain(**inputs).logits, untrained, atol=1e-4)  # the adapters moved
