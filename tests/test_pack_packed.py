"""Packed training rows are exact: on a tiny Qwen2.5-VL (3D rope, native-resolution ViT) and a tiny LLaVA (CLIP
tower, 1D positions), the loss and every gradient of one packed row equal the token-weighted mean over the same
samples run one at a time, with sdpa, eager and mask-free packed positions. Computed in float64; tolerances are
stated at each assertion. Also: the vision tower never attends across images, PackedDataset reads a plan."""

import numpy as np
import pytest
import torch

from ovkit.pack.packed import PackLayout, collate_packed, cu_seqlens, pack_encoded, packed_row_stats

TEXTS = ["a red circle and a blue square", "Describe the image.", "how many shapes", "<answer>3</answer>"] * 20


def noise(size, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def conversations():
    """Captions, a text-only row, a two-image multi-turn row and a row with an image late in the text."""
    return [
        (
            [
                {"role": "user", "content": "<image>\nDescribe the image."},
                {"role": "assistant", "content": "a red circle"},
            ],
            [noise((84, 84), 0)],
        ),
        ([{"role": "user", "content": "how many shapes?"}, {"role": "assistant", "content": "<answer>3</answer>"}], []),
        (
            [
                {"role": "user", "content": "<image> and <image>: how many shapes"},
                {"role": "assistant", "content": "two blue squares"},
                {"role": "user", "content": "and a circle?"},
                {"role": "assistant", "content": "a red circle and two squares"},
            ],
            [noise((168, 84), 1), noise((112, 140), 2)],
        ),
        (
            [
                {"role": "user", "content": "Describe the image. <image>"},
                {"role": "assistant", "content": "a blue square"},
            ],
            [noise((56, 112), 3)],
        ),
    ]


# Tiny float64 models run faster on one thread than fighting over two busy cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen():
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ovkit.models.tiny import tiny_config, tiny_processor, train_tokenizer

    tok = train_tokenizer(TEXTS)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(tok)).double()
    return model, tiny_processor(tok)


@pytest.fixture(scope="module")
def llava():
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
    )

    from ovkit.models.tiny import IMAGE_PAD, chatml_template, train_tokenizer

    tok = train_tokenizer(TEXTS)
    size = {"height": 28, "width": 28}
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size=size),
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=chatml_template(IMAGE_PAD),
        image_token=IMAGE_PAD,
    )
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        text_config=Qwen2Config(
            vocab_size=len(tok),
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        image_token_id=tok.convert_tokens_to_ids(IMAGE_PAD),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).double(), processor


def as_float64(inputs):
    return {
        k: v.double() if torch.is_tensor(v) and v.is_floating_point() and k != "attention_mask" else v
        for k, v in inputs.items()
    }


def token_ce(logits, labels):
    """Summed next-token cross-entropy in float64 (transformers' own loss upcasts logits to float32 only)."""
    logits, labels = logits[0, :-1].double(), labels[0, 1:]
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference(model, encoded):
    """Each sample alone (its own 3D rope from the processor outputs); token-weighted mean loss and gradients."""
    model.zero_grad()
    n_total = sum(sum(1 for t in e.labels[1:] if t != -100) for e in encoded)
    total, hf_total = 0.0, 0.0
    for e in encoded:
        out = model(**as_float64(e.model_inputs()), use_cache=False)
        loss = token_ce(out.logits, torch.tensor([e.labels])) / n_total
        loss.backward()
        total += loss.item()
        hf_total += out.loss.item() * sum(1 for t in e.labels[1:] if t != -100) / n_total
    return total, hf_total, grads(model)


def packed(model, item):
    model.zero_grad()
    out = model(**as_float64(item), use_cache=False)
    n_total = int((item["labels"][0, 1:] != -100).sum())
    loss = token_ce(out.logits, item["labels"]) / n_total
    loss.backward()
    return loss.item(), out.loss.item(), grads(model)


def assert_same(ref, got, tol=1e-10):
    """`tol`: relative, 1e-10 when everything runs in float64; transformers' eager attention takes its softmax in
    float32 (whatever the model dtype), so eager is compared at float32 precision."""
    ref_loss, ref_hf, ref_grads = ref
    loss, hf, g = got
    assert loss == pytest.approx(ref_loss, rel=max(tol, 1e-12))
    assert hf == pytest.approx(ref_hf, rel=1e-6)  # model(**item).loss: transformers computes CE in float32
    assert set(g) == set(ref_grads)
    # relative to the largest gradient of the model: some are analytically zero (a key bias under softmax) and
    # come out as 1e-20 noise
    scale = max(v.abs().max().item() for v in ref_grads.values())
    for name in ref_grads:
        assert (g[name] - ref_grads[name]).abs().max().item() <= tol * scale, name


@pytest.mark.parametrize("attention", ["sdpa", "eager", "positions"])
@pytest.mark.parametrize("arch", ["qwen", "llava"])
def test_packed_row_equals_samples_one_at_a_time(arch, attention, request):
    from ovkit.models.encode import encode_sample

    model, processor = request.getfixturevalue(arch)
    model.set_attn_implementation("eager" if attention == "eager" else "sdpa")
    encoded = [encode_sample(processor, m, im) for m, im in conversations()]
    layout = PackLayout.for_model(model, attention=attention)
    assert layout.has_rope_index == (arch == "qwen")
    item = pack_encoded(encoded, layout)
    T = sum(e.length for e in encoded)
    assert item["input_ids"].shape == (1, T)
    assert item["position_ids"].shape == ((4, 1, T) if arch == "qwen" else (1, T))
    assert ("attention_mask" in item) == (attention != "positions")
    assert cu_seqlens(item).tolist() == np.cumsum([0] + [e.length for e in encoded]).tolist()
    assert packed_row_stats(item, 1024)["samples"] == len(encoded)
    assert_same(reference(model, encoded), packed(model, item), tol=1e-5 if attention == "eager" else 1e-10)


def test_qwen_positions_are_each_samples_own_rope_index(qwen):
    from ovkit.models.encode import encode_sample

    model, processor = qwen
    encoded = [encode_sample(processor, m, im) for m, im in conversations()]
    item = pack_encoded(encoded, PackLayout.for_model(model))
    offset = 0
    for e in encoded:
        inputs = e.model_inputs()
        own, _ = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw")
        )
        assert torch.equal(item["position_ids"][1:, :, offset : offset + e.length], own)
        assert torch.equal(item["position_ids"][0, 0, offset : offset + e.length], torch.arange(e.length))
        offset += e.length
    # text after an image continues from the image's rope offset, not from the token count
    third = item["position_ids"][1, 0, encoded[0].length + encoded[1].length :][: encoded[2].length]
    assert third.max().item() < encoded[2].length - 1


def test_naive_concatenation_is_not_equivalent(qwen):
    """The test has teeth: one row with plain positions and a causal mask over everything gives another loss."""
    from ovkit.models.encode import encode_sample

    model, processor = qwen
    model.set_attn_implementation("sdpa")
    encoded = [encode_sample(processor, m, im) for m, im in conversations()]
    item = pack_encoded(encoded, PackLayout.for_model(model, attention="positions"))
    del item["position_ids"]
    ref_loss = reference(model, encoded)[0]
    assert abs(packed(model, item)[0] - ref_loss) > 1e-3


def test_vision_tower_keeps_images_apart(qwen):
    """Qwen2.5-VL's vision attention blocks come from image_grid_thw, one per image: features of concatenated
    images equal each image's features alone."""
    model, processor = qwen
    images = [noise((84, 84), 5), noise((168, 84), 6), noise((140, 112), 7)]
    alone = []
    for im in images:
        enc = processor.image_processor(images=[im], return_tensors="pt")
        alone.append(
            model.model.get_image_features(enc["pixel_values"].double(), enc["image_grid_thw"]).pooler_output[0]
        )
    enc = processor.image_processor(images=images, return_tensors="pt")
    together = model.model.get_image_features(enc["pixel_values"].double(), enc["image_grid_thw"]).pooler_output
    for a, b in zip(alone, together):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def plan(qwen, tmp_path_factory):
    from ovkit.data import image_cell, samples_table, write_samples
    from ovkit.pack.plan import PackConfig, build_plan

    model, processor = qwen
    root = tmp_path_factory.mktemp("packed")
    processor.save_pretrained(root / "model")
    model.config.save_pretrained(root / "model")
    rows = []
    for i in range(12):
        msgs, images = conversations()[i % 4]
        rows.append({"id": f"s{i}", "images": [image_cell(im) for im in images], "messages": msgs, "source": "t"})
    write_samples(samples_table(rows), root / "data")
    (root / "plan").mkdir()
    cfg = PackConfig(
        data=root / "data", model=root / "model", max_len=256, out=root / "plan", cache=root / "cache", quiet=True
    )
    build_plan(cfg, root / "plan")
    return root


def test_packed_dataset_items_are_exact_and_collate(qwen, plan):
    from ovkit.data import read_table
    from ovkit.models.encode import decode_images, encode_sample
    from ovkit.pack import PackedDataset

    model, processor = qwen
    model.set_attn_implementation("sdpa")
    ds = PackedDataset(plan / "plan", plan / "data", processor, model.config)
    data = read_table(plan / "data").to_pylist()
    assert 1 < len(ds) < 12 and ds.capacity == 256
    assert sum(ds.info(i)["samples"] for i in range(len(ds))) == 12
    for i in (0, len(ds) - 1):
        item = ds[i]
        assert item["input_ids"].shape[1] == ds.lengths[i] == ds.info(i)["tokens"] <= 256
        encoded = [
            encode_sample(processor, data[int(ds.rows[j])]["messages"], decode_images(data[int(ds.rows[j])]["images"]))
            for j in ds.members(i)
        ]
        assert_same(reference(model, encoded), packed(model, item))
    both = ds.collate([ds[0], ds[1]])  # two packs as one row: still every sample on its own
    encoded = [
        encode_sample(processor, data[int(ds.rows[j])]["messages"], decode_images(data[int(ds.rows[j])]["images"]))
        for i in (0, 1)
        for j in ds.members(i)
    ]
    assert both["input_ids"].shape[1] == ds.lengths[0] + ds.lengths[1]
    assert_same(reference(model, encoded), packed(model, both))
    assert collate_packed([ds[0]])["input_ids"].shape[1] == ds.lengths[0]


def test_packed_dataset_refuses_a_plan_from_another_processor(qwen, plan, tmp_path):
    import pyarrow.parquet as pq

    from ovkit.errors import OvkitError
    from ovkit.pack import PackedDataset

    model, processor = qwen
    t = pq.read_table(plan / "plan" / "plan.parquet")
    lengths = t.column("length").to_numpy().copy()
    lengths[0] += 1
    stale = t.set_column(3, "length", __import__("pyarrow").array(lengths.astype(np.int32)))
    (tmp_path / "plan").mkdir()
    pq.write_table(stale, tmp_path / "plan" / "plan.parquet")
    ds = PackedDataset(tmp_path / "plan", plan / "data", processor, model)
    with pytest.raises(OvkitError, match="re-run `ovkit pack`"):
        ds[0]
