"""Sample lengths for packing: the image-size shortcut equals the processor's own encoding (min/max pixels, odd
sizes, several images, text only), a disagreement falls back to the processor, and the cache key tracks inputs."""

import numpy as np
import pytest


@pytest.fixture(scope="module")
def processor():
    from ovkit.models.tiny import tiny_processor, train_tokenizer

    return tiny_processor(train_tokenizer(["a red circle and a blue square", "Describe the image.", "how many"] * 20))


def row(sizes, text="Describe the image.", answer="a red circle"):
    from PIL import Image

    from ovkit.data import image_cell

    images = [image_cell(Image.new("RGB", s, (200, 10, 10))) for s in sizes]
    user = "".join("<image>" for _ in sizes) + "\n" + text
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}], images


# Tiny preset: 14-pixel patches, 2x2 merge, min 28*28 and max 448*448 pixels. Sizes below the minimum are scaled
# up, above the maximum scaled down, odd sizes rounded to multiples of 28; extreme aspect ratios included.
SIZES = [
    (84, 84),
    (168, 84),
    (28, 28),
    (1, 1),
    (13, 29),
    (27, 200),
    (500, 3),
    (448, 448),
    (449, 448),
    (1000, 700),
    (3000, 40),
    (57, 85),
    (300, 301),
]


@pytest.mark.parametrize("size", SIZES)
def test_sizes_method_equals_the_processor(processor, size):
    from ovkit.pack.lengths import length_by_processor, length_by_sizes

    messages, images = row([size])
    assert length_by_sizes(processor, messages, images) == length_by_processor(processor, messages, images)


def test_sizes_method_on_random_multi_image_and_multi_turn_rows(processor):
    from ovkit.pack.lengths import length_by_processor, length_by_sizes

    rng = np.random.default_rng(0)
    for _ in range(12):
        k = int(rng.integers(0, 4))
        sizes = [(int(rng.integers(5, 900)), int(rng.integers(5, 900))) for _ in range(k)]
        messages, images = row(sizes, text="how many " * int(rng.integers(1, 30)))
        messages += [
            {"role": "user", "content": "and now?"},
            {"role": "assistant", "content": "two " * int(rng.integers(1, 9))},
        ]
        if rng.random() < 0.3:
            messages.append({"role": "user", "content": "a trailing question without an answer"})
        assert length_by_sizes(processor, messages, images) == length_by_processor(processor, messages, images)


def test_compute_lengths_falls_back_to_the_processor_when_sizes_disagree(processor, tmp_path, monkeypatch):
    import ovkit.models.encode as encode
    from ovkit.data import samples_table
    from ovkit.pack.lengths import compute_lengths, length_by_processor

    processor.save_pretrained(tmp_path)
    rows = [row([(84, 84)]), row([]), row([(168, 84), (30, 30)])]
    table = samples_table(
        [{"id": str(i), "images": im, "messages": m, "source": "t"} for i, (m, im) in enumerate(rows)]
    )
    want = [length_by_processor(processor, m, im) for m, im in rows]

    good = compute_lengths(table, tmp_path, progress=False)
    assert good.method == "sizes" and list(good.lengths) == want and "matched" in good.note

    monkeypatch.setattr(encode, "image_token_count", lambda processor, w, h: 1)  # a wrong size rule
    fallback = compute_lengths(table, tmp_path, progress=False)
    assert fallback.method == "processor" and list(fallback.lengths) == want and "gave" in fallback.note


def test_unencodable_rows_get_a_reason_not_a_crash(processor, tmp_path):
    from ovkit.data import samples_table
    from ovkit.pack.lengths import compute_lengths

    processor.save_pretrained(tmp_path)
    messages, images = row([(84, 84)])
    rows = [
        {"id": "ok", "images": images, "messages": messages, "source": "t"},
        {"id": "bad", "images": [], "messages": messages[:1], "source": "t"},
    ]
    out = compute_lengths(samples_table(rows), tmp_path, progress=False)
    assert out.lengths[0] > 0 and out.errors[0] is None
    assert out.lengths[1] == -1 and "assistant" in out.errors[1]


def test_cache_key_follows_data_processor_method_and_shard(processor, tmp_path):
    from ovkit.pack.lengths import cache_key

    processor.save_pretrained(tmp_path / "m")
    fp = {"path": "d", "files": 1, "bytes": 10, "sha256": "abc"}
    key = cache_key(fp, tmp_path / "m", "sizes", None)
    assert key == cache_key(dict(fp), tmp_path / "m", "sizes", None)
    assert key != cache_key({**fp, "sha256": "abd"}, tmp_path / "m", "sizes", None)
    assert key != cache_key(fp, tmp_path / "m", "processor", None)
    assert key != cache_key(fp, tmp_path / "m", "sizes", (0, 2))
    (tmp_path / "m" / "model.safetensors").write_bytes(b"weights do not change lengths")
    assert key == cache_key(fp, tmp_path / "m", "sizes", None)
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ messages }}")
    assert key != cache_key(fp, tmp_path / "m", "sizes", None)
