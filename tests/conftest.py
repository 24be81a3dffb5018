import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def cli():
    """Invoke `ovkit ...` in-process through main(): returns (exit_code, stdout, stderr)."""
    import contextlib
    import io
    import sys

    from ovkit import cli as cli_mod

    def run(*args: str):
        out, err = io.StringIO(), io.StringIO()
        old = sys.argv
        sys.argv = ["ovkit", *map(str, args)]
        code = 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                cli_mod.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:
            sys.argv = old
        return code, out.getvalue(), err.getvalue()

    return run


# ------------------------------------------------------------------------------------------------ shared fixtures
# Fixtures that more than one test module uses. Session scope where the fixture is read-only (a saved model and
# table on disk); module scope where tests hold the loaded model and could change it (each module gets its own).


@pytest.fixture
def one_thread():
    """One torch intra-op thread for the test: tiny matrices on 2 contended cores run far faster with one OpenMP
    thread each than with a spinning team. Modules of tiny-model training tests apply it to every test with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    from helpers import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """A micro model (Qwen2.5-VL architecture, ~90K parameters) and a 16-sample table (helpers.make_rows): root/model,
    root/data. Read-only: tests write their runs under their own tmp_path."""
    from helpers import make_rows, micro_spec

    from ovkit.data.parts import write_samples
    from ovkit.data.schema import samples_table
    from ovkit.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("train")
    rows = make_rows(16)
    write_samples(samples_table(rows), root / "data", None)
    spec = micro_spec()
    texts = [m["content"] for r in rows for m in r["messages"]] * 4
    build_tiny(root / "model", texts, spec=spec)
    return root


@pytest.fixture(scope="session")
def deep(tmp_path_factory):
    """The tiny default's depth (4 LLM layers, a 4-block ViT), small widths, and a 16-sample table (root/model,
    root/data; helpers.pack_plan caches its pack plans beside them): (root, spec)."""
    from helpers import make_rows, micro_spec

    from ovkit.data.parts import write_samples
    from ovkit.data.schema import samples_table
    from ovkit.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("runtime")
    rows = make_rows(16)
    write_samples(samples_table(rows), root / "data", None)
    spec = micro_spec(4)
    build_tiny(root / "model", [m["content"] for r in rows for m in r["messages"]] * 4, spec=spec)
    return root, spec


@pytest.fixture(scope="session")
def rl_assets(tmp_path_factory):
    """A tiny model and the 6-prompt RL table (helpers.rl_rows), built once per session: (model dir, data dir)."""
    from helpers import rl_rows

    from ovkit.data import samples_table, write_samples
    from ovkit.models.tiny import build_tiny

    base = tmp_path_factory.mktemp("rl-assets")
    rows = rl_rows()
    texts = [m["content"] for r in rows for m in r["messages"]] + [
        "<answer>3</answer>",
        "<think>count</think><answer>2</answer>",
    ] * 20
    build_tiny(base / "model", texts, seed=0)
    write_samples(samples_table(rows), base / "data")
    return base / "model", base / "data"


@pytest.fixture(scope="module")
def spread_tiny(tmp_path_factory):
    """The tiny preset with weights spread wider than its init, so greedy decoding picks varied tokens (an untrained
    model repeats one token, which would make batch/cache comparisons vacuous): (model, processor), one per module."""
    import torch

    from ovkit.models import load
    from ovkit.models.tiny import build_tiny

    texts = [
        "<image>\nHow many circles are there?",
        "What colour is the square? red green blue yellow",
        "Put ONLY your final answer within <answer></answer>.",
        "<answer>3</answer> <think>one two three</think>",
        "the words cat moon, a bar chart: A is 3, B is 5",
    ] * 20
    model, processor = load(build_tiny(tmp_path_factory.mktemp("tiny"), texts, seed=0))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval(), processor


@pytest.fixture(scope="module")
def spread_prompts(spread_tiny):
    """Prompts of different lengths for `spread_tiny`: one image, text only, two images (one wide), a chart question;
    their images are helpers.PROMPT_IMAGES."""
    from helpers import PROMPT_IMAGES

    from ovkit.models.encode import encode_prompt

    _, processor = spread_tiny
    texts = [
        "<image>\nHow many circles are there?",
        "What colour is the square?",
        "<image>\nthe words\n<image>\ncompare",
        "<image>\nA bar chart: A is 3, B is 5. What is B?",
    ]
    return [
        encode_prompt(processor, [{"role": "user", "content": text}], images)
        for text, images in zip(texts, PROMPT_IMAGES)
    ]


@pytest.fixture(scope="session")
def eval_set(tmp_path_factory):
    """The hand-built eval table of helpers.EVAL_ROWS (one 84x84 image each)."""
    import json

    from helpers import EVAL_ROWS, eval_image

    from ovkit.data import image_cell, samples_table, write_samples

    rows = []
    for rid, cat, src, q, answer, atype, kwargs, _, _ in EVAL_ROWS:
        row = {
            "id": rid,
            "images": [image_cell(eval_image())],
            "messages": [{"role": "user", "content": f"<image>\n{q}"}],
            "source": src,
            "answer": answer,
            "answer_type": atype,
            "reward_kwargs": json.dumps(kwargs) if kwargs else None,
        }
        if cat:
            row["category"] = cat
        rows.append(row)
    out = tmp_path_factory.mktemp("eval")
    write_samples(samples_table(rows), out)
    return out


@pytest.fixture(scope="session")
def eval_tiny(tmp_path_factory):
    """The tiny preset's model directory, its tokenizer trained on helpers.EVAL_TEXTS (seed 0), for eval commands."""
    from helpers import EVAL_TEXTS

    from ovkit.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("eval-tiny") / "tiny", EVAL_TEXTS, seed=0)


@pytest.fixture
def llava_images(tmp_path):
    """An image folder laid out like LLaVA's (paths in the JSON are relative to it), with one broken file:
    (root, {relative path: bytes})."""
    from helpers import jpeg, png

    root = tmp_path / "images"
    (root / "coco").mkdir(parents=True)
    files = {"coco/a.png": png((255, 0, 0)), "coco/b.jpg": jpeg(), "c.png": png((0, 255, 0), (30, 8))}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png")
    return root, files
