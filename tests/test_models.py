"""ovkit.models: the tiny preset, composing a LLaVA model from a vision encoder and an LLM, loading, init-model."""

import json

import pytest

TEXTS = [
    "<image>\nDescribe the image.",
    "There are three red circles and one blue square.",
    "How many shapes are there?\nPut ONLY your final answer within <answer></answer>.",
    "<answer>3</answer>",
    "图片中有三个红色圆形。",
] * 20

QA = [
    {"role": "user", "content": "<image>\nHow many shapes are there?"},
    {"role": "assistant", "content": "<answer>3</answer>"},
]


def _img(w=84, h=84):
    from PIL import Image

    return Image.new("RGB", (w, h), (40, 160, 90))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from ovkit.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"), TEXTS, seed=0)


def _train_step_and_generate(model, processor, unused=()):
    """One forward+backward on an encoded sample, and one greedy `generate` from its prompt. Parameters whose name
    contains one of `unused` may get no gradient (LLaVA reads the penultimate encoder layer; the last one is idle)."""
    import torch

    from ovkit.models.encode import encode_prompt, encode_sample

    model.train()
    out = model(**encode_sample(processor, QA, [_img()]).model_inputs())
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    missing = [n for n, g in grads.items() if g is None and not any(u in n for u in unused)]
    assert not missing, f"no gradient for {missing[:5]}"
    model.zero_grad()
    model.eval()
    prompt = encode_prompt(processor, QA, [_img()])
    inputs = prompt.model_inputs(labels=False)
    with torch.no_grad():
        seq = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    # What greedy decoding must give, one full forward per token (no KV cache): the argmax continuation, cut after
    # the first end-of-sequence token, else 4 new tokens.
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    want = list(prompt.input_ids)
    with torch.no_grad():
        for _ in range(4):
            ids = torch.tensor([want])
            step = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
            for key in prompt.per_token:  # per-token inputs (token types): text after the prompt
                step[key] = torch.cat([inputs[key], inputs[key].new_zeros(1, len(want) - prompt.length)], dim=1)
            want.append(int(model(**step, use_cache=False).logits[0, -1].argmax()))
            if want[-1] in eos:
                break
    assert seq.shape == (1, len(want)) and prompt.length < len(want) <= prompt.length + 4
    assert seq[0].tolist() == want


def test_tiny_saves_and_loads_offline_with_auto_classes(tiny_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from ovkit.models.tiny import count_parameters

    model = AutoModelForImageTextToText.from_pretrained(tiny_dir)
    processor = AutoProcessor.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert 1_500_000 < count_parameters(model) < 4_000_000  # "a few million parameters"
    tok = processor.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert processor.chat_template and "<|im_start|>" in processor.chat_template
    # byte-level: any text round-trips, including text the tokenizer never saw
    for text in ["Put ONLY your final answer", "ünïcödé ☃ 12.5%", "图片"]:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_tiny_trains_and_generates(tiny_dir):
    from ovkit.models import load

    model, processor = load(tiny_dir)
    _train_step_and_generate(model, processor)


def test_tiny_is_deterministic_given_seed(tmp_path, tiny_dir):
    from safetensors.torch import load_file

    from ovkit.models.tiny import build_tiny

    again = build_tiny(tmp_path / "again", TEXTS, seed=0)
    other = build_tiny(tmp_path / "other", TEXTS, seed=1)
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    a, b, c = (load_file(p / "model.safetensors") for p in (tiny_dir, again, other))
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in a)


def test_tiny_keeps_small_images_and_caps_large_ones(tiny_dir):
    from ovkit.models import load
    from ovkit.models.encode import image_token_count

    _, processor = load(tiny_dir)
    assert image_token_count(processor, 84, 84) == 9
    assert image_token_count(processor, 168, 84) == 18
    assert image_token_count(processor, 3000, 2000) <= 256


def test_load_errors_are_user_errors(tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.models import load

    with pytest.raises(OvkitError, match="no such directory"):
        load(tmp_path / "nope")
    with pytest.raises(OvkitError, match="no config.json"):
        load(tmp_path)


# ---- compose: a LLaVA model from a tiny random vision encoder and a tiny random LLM, built here --------------------


def _vision_dir(path, kind):
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    sizes = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14
    )
    if kind == "clip":
        model = CLIPVisionModel(CLIPVisionConfig(**sizes))
        processor = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    else:
        model = SiglipVisionModel(SiglipVisionConfig(**sizes))
        processor = SiglipImageProcessor(size={"height": 56, "width": 56})
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def _llm_dir(path, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from ovkit.models.tiny import train_tokenizer

    tok = train_tokenizer(TEXTS, 300)
    tok.eos_token = "<|endoftext|>"  # a base LLM: its own end-of-text, no ChatML end-of-turn
    sizes = dict(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    if kind == "qwen2":  # spare embedding rows for the added tokens, tied head (like Qwen2.5 LLMs)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok) + 8, tie_word_embeddings=True, **sizes))
    else:  # no spare rows: adding <image> grows the embeddings
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **sizes))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("vision_kind,llm_kind", [("clip", "qwen2"), ("siglip", "llama")])
def test_compose_copies_weights_trains_generates_and_reloads(tmp_path, vision_kind, llm_kind):
    from safetensors.torch import load_file

    from ovkit.models import load
    from ovkit.models.compose import compose

    vis = _vision_dir(tmp_path / "vision", vision_kind)
    llm = _llm_dir(tmp_path / "llm", llm_kind)
    facts = compose(vis, llm, tmp_path / "out", seed=0)
    assert facts["architecture"] == "LlavaForConditionalGeneration"
    assert facts["image_tokens"] == 16  # 56x56 / 14x14

    model, processor = load(tmp_path / "out")  # AutoModelForImageTextToText / AutoProcessor
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert type(processor).__name__ == "LlavaProcessor"
    state = model.state_dict()
    for k, v in load_file(vis / "model.safetensors").items():
        assert (state[f"model.vision_tower.{k}"] == v).all(), k
    for k, v in load_file(llm / "model.safetensors").items():
        name = f"model.language_model.{k[len('model.') :]}" if k.startswith("model.") else k
        got = state[name]
        assert (got[: v.shape[0]] == v).all(), k  # grown embeddings keep every trained row
    assert any("multi_modal_projector" in k for k in state)

    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids("<image>") == model.config.image_token_id
    assert (
        "<|im_end|>" in tok.get_vocab()
        and tok.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id
    )
    from ovkit.models.encode import encode_prompt, image_token_count

    for w, h in [(56, 56), (100, 40), (300, 500)]:
        enc = encode_prompt(processor, [{"role": "user", "content": "<image>hi"}], [_img(w, h)])
        assert image_token_count(processor, w, h) == enc.input_ids.count(model.config.image_token_id) == 16
    last = model.config.vision_config.num_hidden_layers - 1
    _train_step_and_generate(
        model, processor, unused=(f"vision_tower.encoder.layers.{last}.", "post_layernorm", "vision_tower.head.")
    )


def test_composed_llava_samples_the_same_with_a_shared_prefill(tmp_path):
    """The hf engine's shared prefill (its default: a prompt sampled n times is prefilled once, its KV cache copied)
    works on a composed LLaVA model too, not only on the Qwen-VL family: the same seeded samples and log-probs as
    prefilling every sequence on its own."""
    from ovkit.generate import HFEngine
    from ovkit.models import load
    from ovkit.models.compose import compose
    from ovkit.models.encode import encode_prompt

    compose(_vision_dir(tmp_path / "vision", "clip"), _llm_dir(tmp_path / "llm", "qwen2"), tmp_path / "out", seed=0)
    model, processor = load(tmp_path / "out")
    prompts = [
        encode_prompt(processor, [{"role": "user", "content": "<image>\nHow many shapes are there?"}], [_img()]),
        encode_prompt(processor, [{"role": "user", "content": "Describe it."}], []),
    ]
    kw = dict(n=3, temperature=1.0, max_new_tokens=6, seed=3)
    shared = HFEngine(model, processor, batch_size=6).generate(prompts, **kw)
    own = HFEngine(model, processor, batch_size=6, prefill="per-sequence").generate(prompts, **kw)
    for a, b in zip(shared, own):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_compose_projector_is_seeded(tmp_path):
    from safetensors.torch import load_file

    from ovkit.models.compose import compose

    vis, llm = _vision_dir(tmp_path / "v", "siglip"), _llm_dir(tmp_path / "l", "qwen2")
    a, b, c = (
        load_file(compose(vis, llm, tmp_path / n, seed=s) and tmp_path / n / "model.safetensors")
        for n, s in [("a", 0), ("b", 0), ("c", 1)]
    )
    proj = [k for k in a if "projector" in k]
    assert all((a[k] == b[k]).all() for k in a)
    assert any((a[k] != c[k]).any() for k in proj)


def test_compose_refuses_what_it_cannot_build(tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.models.compose import compose

    llm = _llm_dir(tmp_path / "llm", "qwen2")
    with pytest.raises(OvkitError, match="not a vision encoder"):
        compose(llm, llm, tmp_path / "out")
    vis = _vision_dir(tmp_path / "vision", "clip")
    (vis / "preprocessor_config.json").unlink()
    with pytest.raises(OvkitError, match="no image processor"):
        compose(vis, llm, tmp_path / "out")


# ---- the command -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from ovkit.data import image_cell, samples_table, write_samples

    rows = [
        {
            "id": f"r{i}",
            "images": [image_cell(_img())],
            "messages": [{"role": "user", "content": t}, {"role": "assistant", "content": f"<answer>{i}</answer>"}],
            "source": "test",
        }
        for i, t in enumerate(TEXTS)
    ]
    out = tmp_path_factory.mktemp("corpus")
    write_samples(samples_table(rows), out)
    return out


def test_init_model_tiny_end_to_end(cli, corpus, tmp_path):
    out = tmp_path / "tiny"
    code, stdout, err = cli("init-model", "--preset", "tiny", "--corpus", corpus, "--out", out, "--seed", "3")
    assert code == 0, err
    assert "init-model: tiny (Qwen2_5_VLForConditionalGeneration" in stdout
    prov = json.loads((out / "ovkit.json").read_text())
    assert prov["metrics"]["image_tokens_84x84"] == 9
    assert 1_500_000 < prov["metrics"]["parameters"] < 4_000_000
    assert prov["seed"] == 3 and prov["inputs"][0]["path"] == str(corpus)
    from ovkit.models import load

    model, processor = load(out)
    assert sum(p.numel() for p in model.parameters()) == prov["metrics"]["parameters"]
    assert "<image>" not in processor.tokenizer.get_vocab()  # markers are stripped from the tokenizer's text
    code, stdout, _ = cli("init-model", "--corpus", corpus, "--out", out)
    assert code == 0 and "skipped" in stdout


def test_init_model_composes(cli, tmp_path):
    vis, llm = _vision_dir(tmp_path / "v", "clip"), _llm_dir(tmp_path / "l", "qwen2")
    code, stdout, err = cli("init-model", "--vision", vis, "--llm", llm, "--out", tmp_path / "out")
    assert code == 0, err
    assert "init-model: compose (LlavaForConditionalGeneration" in stdout
    # a preset name is a promise about the LLM: a different one is refused
    code, _, err = cli(
        "init-model", "--preset", "llava-ov-1.5-8b", "--vision", vis, "--llm", llm, "--out", tmp_path / "o2"
    )
    assert code == 2 and "hidden size 48" in err and "Qwen/Qwen3-8B-Base" in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "llava-ov-1.5-8b"], "pass --vision DIR --llm DIR"),
        (["--preset", "qwen2.5-vl-3b"], "Qwen/Qwen2.5-VL-3B-Instruct"),
        (["--preset", "nope"], "choose one of: tiny"),
        ([], "--corpus is required"),
        (["--vision", "v"], "needs both --vision DIR and --llm DIR"),
        (["--preset", "tiny", "--vision", "v", "--llm", "l"], "drop --vision/--llm"),
    ],
)
def test_init_model_usage_errors_exit_2(cli, tmp_path, args, message):
    code, _, err = cli("init-model", "--out", tmp_path / "x", *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "x").exists()


def test_list_presets_names_every_preset_and_downloads_nothing(cli):
    from ovkit.models.presets import PRESETS

    code, out, _ = cli("init-model", "--list-presets")
    assert code == 0
    for p in PRESETS.values():
        assert p.name in out
        for hub_id in (p.model, p.stage0, p.vision, p.llm):
            assert hub_id is None or hub_id in out


# ---- random init: published architectures, offline ------------------------------------------------------------------


@pytest.mark.parametrize("name,billions", [("qwen2.5-vl-2b", 2.21), ("qwen2.5-vl-3b", 3.75), ("qwen2.5-vl-7b", 8.29)])
def test_random_init_configs_have_the_published_sizes(name, billions):
    """Built on the meta device: the published parameter counts (Qwen2.5-VL-3B/7B config.json dimensions), the
    tiny tokenizer's special tokens inside the padded vocabulary."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ovkit.models.presets import random_config
    from ovkit.models.tiny import train_tokenizer

    tokenizer = train_tokenizer(["a red circle"] * 10)
    config = random_config(name, tokenizer)
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>") < config.text_config.vocab_size


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preset", "qwen2.5-vl-2b"], "add --random-init"),
        (["--preset", "tiny", "--random-init"], "--random-init builds the architecture of a preset"),
        (["--preset", "llava-ov-1.5-8b", "--random-init"], "has none"),
    ],
)
def test_random_init_refuses_what_it_cannot_build(cli, tmp_path, args, message):
    code, _, err = cli("init-model", "--out", tmp_path / "x", *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_random_init_builds_a_loadable_2b_model(cli, tmp_path):
    import torch

    from ovkit.models import load

    code, out, err = cli(
        "init-model",
        "--preset",
        "qwen2.5-vl-2b",
        "--random-init",
        "--dtype",
        "bfloat16",
        "--out",
        tmp_path / "m",
        "--quiet",
    )
    assert code == 0, err
    model, processor = load(tmp_path / "m", dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(2.21, abs=0.01)
    assert processor.image_processor.merge_size == 2
