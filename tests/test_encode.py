"""ovkit.models.encode: conversations -> input ids, answer-only labels and multimodal tensors, for any processor."""

import io
import math

import pytest

TEXTS = [
    "<image>\nDescribe the image.",
    "There are three red circles and one blue square.",
    "How many shapes are there?\nPut ONLY your final answer within <answer></answer>.",
    "<answer>3</answer>",
    "<think>I count the shapes one by one.</think><answer>4</answer>",
    "图片中有三个红色圆形。",
] * 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ovkit.models import load
    from ovkit.models.tiny import build_tiny

    path = build_tiny(tmp_path_factory.mktemp("tiny"), TEXTS, seed=0)
    return load(path)


def _img(w=84, h=84, colour=(200, 30, 30)):
    from PIL import Image

    return Image.new("RGB", (w, h), colour)


QA = [
    {"role": "user", "content": "<image>\nHow many shapes are there?"},
    {"role": "assistant", "content": "<answer>3</answer>"},
]


def test_to_hf_messages_puts_image_parts_where_the_markers_were():
    from ovkit.models.encode import to_hf_messages

    out = to_hf_messages([{"role": "user", "content": "a<image>b<image>"}, {"role": "assistant", "content": "x"}])
    assert out[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
        {"type": "image"},
    ]
    assert out[1] == {"role": "assistant", "content": [{"type": "text", "text": "x"}]}


def test_labels_are_exactly_the_answer_and_end_of_turn(tiny):
    from ovkit.models.encode import IGNORE, encode_sample

    _, proc = tiny
    enc = encode_sample(proc, QA, [_img()])
    assert enc.length == len(enc.input_ids) == len(enc.labels)
    labelled = [i for i, t in enumerate(enc.labels) if t != IGNORE]
    assert labelled == list(range(labelled[0], labelled[-1] + 1))  # one contiguous span
    assert [enc.input_ids[i] for i in labelled] == [enc.labels[i] for i in labelled]
    assert proc.tokenizer.decode([enc.labels[i] for i in labelled]) == "<answer>3</answer><|im_end|>"
    assert enc.input_ids.count(proc.image_token_id) == 9  # 84x84 -> 3x3 merged patches
    assert set(enc.mm) == {"pixel_values", "image_grid_thw"}
    assert enc.per_token["mm_token_type_ids"].count(1) == 9


def test_prompt_plus_answer_is_the_sample(tiny):
    from ovkit.models.encode import IGNORE, encode_prompt, encode_sample

    _, proc = tiny
    sample = encode_sample(proc, QA, [_img()])
    prompt = encode_prompt(proc, QA[:1], [_img()])
    assert encode_prompt(proc, QA, [_img()]).input_ids == prompt.input_ids  # a trailing answer is dropped
    assert set(prompt.labels) == {IGNORE}
    answer = [t for t in sample.labels if t != IGNORE]
    assert sample.input_ids[: prompt.length + len(answer)] == prompt.input_ids + answer
    assert proc.tokenizer.decode(prompt.input_ids).endswith("<|im_start|>assistant\n")


def test_only_the_last_assistant_turn_is_a_target(tiny):
    from ovkit.models.encode import IGNORE, encode_sample

    _, proc = tiny
    msgs = [
        {"role": "system", "content": "You are a helpful AI assistant."},
        {"role": "user", "content": "<image>\nWhat colour?"},
        {"role": "assistant", "content": "<answer>red</answer>"},
        {"role": "user", "content": "And this one? <image>"},
        {"role": "assistant", "content": "<answer>blue</answer>"},
        {"role": "user", "content": "a trailing turn without an answer is dropped"},
    ]
    enc = encode_sample(proc, msgs, [_img(), _img(168, 84)])
    assert proc.tokenizer.decode([t for t in enc.labels if t != IGNORE]) == "<answer>blue</answer><|im_end|>"
    assert enc.input_ids.count(proc.image_token_id) == 9 + 18
    assert enc.mm["image_grid_thw"].tolist() == [[1, 6, 6], [1, 6, 12]]
    assert "trailing" not in proc.tokenizer.decode(enc.input_ids)


def test_text_only_sample_has_no_multimodal_tensors(tiny):
    from ovkit.models.encode import encode_sample

    _, proc = tiny
    enc = encode_sample(proc, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], [])
    assert enc.mm == {}
    assert proc.image_token_id not in enc.input_ids


def test_one_answer_for_the_image_placeholder_token(tiny):
    """placeholder_token_id: the processor's `image_token_id`, else its `image_token` in the vocabulary (a processor
    that names the token only, as LLaVA's did), else None; the vLLM engines' and the samplers' sets are built on it."""
    from types import SimpleNamespace

    from ovkit.generate.vllm import placeholder_token_ids
    from ovkit.models.encode import placeholder_ids, placeholder_token_id

    _, proc = tiny
    pad = proc.image_token_id
    assert placeholder_token_id(proc) == pad == proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    named_only = SimpleNamespace(image_token=proc.image_token, tokenizer=proc.tokenizer)
    assert placeholder_token_id(named_only) == pad
    assert placeholder_token_id(SimpleNamespace(image_token="<not-a-token>", tokenizer=proc.tokenizer)) is None
    assert placeholder_token_id(None, tokenizer=proc.tokenizer) is None
    assert pad in placeholder_token_ids(proc, proc.tokenizer) <= placeholder_ids(proc)


def test_loss_is_finite_and_counts_only_the_answer(tiny):
    import torch

    from ovkit.models.encode import encode_sample

    model, proc = tiny
    enc = encode_sample(proc, QA, [_img()])
    inputs = enc.model_inputs()
    with torch.no_grad():
        out = model(**inputs)
    assert math.isfinite(out.loss.item())
    # The same loss by hand over the labelled positions (shifted by one).
    logits, labels = out.logits[0, :-1], inputs["labels"][0, 1:]
    keep = labels != -100
    manual = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    assert torch.allclose(out.loss, manual, atol=1e-5)


@pytest.mark.parametrize("size", [(84, 84), (168, 84), (56, 56), (30, 30), (1000, 700), (500, 20)])
def test_image_token_count_matches_the_processor(tiny, size):
    from ovkit.models.encode import encode_prompt, image_token_count

    _, proc = tiny
    w, h = size
    enc = encode_prompt(proc, [{"role": "user", "content": "<image>"}], [_img(w, h)])
    assert image_token_count(proc, w, h) == enc.input_ids.count(proc.image_token_id)


def test_large_images_are_capped(tiny):
    from ovkit.models.encode import image_token_count

    _, proc = tiny
    assert image_token_count(proc, 4000, 3000) <= 256  # max_pixels 448*448 -> at most 16x16 merged tokens


def test_errors_are_clear(tiny):
    from ovkit.errors import OvkitError
    from ovkit.models.encode import encode_sample

    _, proc = tiny
    with pytest.raises(OvkitError, match="2 <image> markers but the row has 1 images"):
        encode_sample(
            proc, [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}], [_img()]
        )
    with pytest.raises(OvkitError, match="no assistant turn"):
        encode_sample(proc, [{"role": "user", "content": "hi"}], [])


def test_decode_images_reads_bytes_and_paths(tmp_path):
    from PIL import Image

    from ovkit.models.encode import decode_images

    buf = io.BytesIO()
    Image.new("RGBA", (10, 7), (1, 2, 3, 4)).save(buf, format="PNG")
    path = tmp_path / "a.png"
    Image.new("L", (5, 5), 9).save(path)
    imgs = decode_images([{"bytes": buf.getvalue(), "path": None}, {"bytes": None, "path": str(path)}])
    assert [(i.mode, i.size) for i in imgs] == [("RGB", (10, 7)), ("RGB", (5, 5))]
    assert imgs[0].getpixel((0, 0)) == (1, 2, 3)
