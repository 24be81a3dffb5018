"""`ovkit synth`: the embedded corpus is deterministic, valid, held out where it says, and its answers are right."""

from __future__ import annotations

import hashlib
import io
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from ovkit.data import read_samples, synth_tasks
from ovkit.data.synth import (
    CONCEPTS_FILE,
    PREVIEW_FILE,
    SPLITS,
    SynthConfig,
    build_corpus,
    concept_counts,
    corpus_texts,
    pretrain_rows,
)
from ovkit.data.synth_tasks import ANSWER_TYPES, CATEGORIES, COLOURS, SHAPES, is_heldout, render_svg, side_of
from ovkit.errors import OvkitError
from ovkit.prompts import ANSWER_PROMPT, THINK_PROMPT

SCALE = 0.05  # 200 pretrain, 396 instruct, 33 rl, 33 val, 165 eval rows: a few seconds


def build(out: Path, scale: float = SCALE, seed: int = 0) -> dict:
    out.mkdir(parents=True)
    return build_corpus(SynthConfig(out=out, scale=scale, seed=seed, quiet=True), out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "data"
    build(out)
    return out


def rows(corpus: Path, split: str) -> list[dict]:
    return read_samples(corpus / split).table.to_pylist()


def data_files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_same_seed_gives_byte_identical_files_and_another_seed_differs(tmp_path):
    a, b, c = build(tmp_path / "a", 0.01), build(tmp_path / "b", 0.01), build(tmp_path / "c", 0.01, seed=1)
    assert a["splits"] == b["splits"] == c["splits"]
    files_a, files_b, files_c = data_files(tmp_path / "a"), data_files(tmp_path / "b"), data_files(tmp_path / "c")
    assert set(files_a) == {f"{s}/part-00000-of-00001.parquet" for s in SPLITS} | {CONCEPTS_FILE, PREVIEW_FILE}
    assert files_a == files_b
    for split in SPLITS:
        name = f"{split}/part-00000-of-00001.parquet"
        assert files_a[name] != files_c[name], split


def test_every_split_is_a_valid_sample_table_with_one_image_per_row(corpus):
    for split in SPLITS:
        samples = read_samples(corpus / split)  # validates ids, markers, roles and decodes every image
        assert samples.n_rejects == 0
        for row in samples.table.to_pylist():
            assert len(row["images"]) == 1
            assert row["messages"][0]["content"].startswith("<image>\n")
            assert sum(m["content"].count("<image>") for m in row["messages"]) == 1
            assert row["source"] == f"synth/{row['category']}"
            assert set(json.loads(row["concepts"])) <= set((corpus / CONCEPTS_FILE).read_text().split("\n"))


def test_pretrain_is_bilingual_captions(corpus):
    pretrain = rows(corpus, "pretrain")
    assert {r["category"] for r in pretrain} == {"caption"}
    assert {r["lang"] for r in pretrain} == {"en", "zh"}
    for r in pretrain:
        user, assistant = r["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        has_han = re.search(r"[\u4e00-\u9fff]", assistant["content"]) is not None
        assert has_han == (r["lang"] == "zh"), assistant["content"]
    kinds = {r["composition"].split(":")[0] for r in pretrain}
    assert {"caption", "ocr", "math", "chart"} <= kinds  # the vision tower also sees text before instruction tuning


def test_instruct_targets_follow_the_stage_instructions(corpus):
    instruct = rows(corpus, "instruct")
    modes = []
    for r in instruct:
        user, assistant = r["messages"]
        assert user["content"].endswith("\n" + ANSWER_PROMPT) or user["content"].endswith("\n" + THINK_PROMPT)
        think = user["content"].endswith(THINK_PROMPT)
        modes.append(think)
        want = f"<answer>{r['answer']}</answer>"
        assert assistant["content"].endswith(want)
        assert assistant["content"].startswith("<think>") == think
    assert 0.15 < sum(modes) / len(modes) < 0.45  # about 30% think


def test_rl_and_eval_cover_every_category_with_its_scorer(corpus):
    for split in ("rl", "val", "eval"):
        table = rows(corpus, split)
        assert {r["category"] for r in table} == set(CATEGORIES)
        for r in table:
            assert [m["role"] for m in r["messages"]] == ["user"]
            assert ANSWER_PROMPT not in r["messages"][0]["content"]  # the command adds the instruction
            assert r["answer_type"] == ANSWER_TYPES[r["category"]]
            assert r["answer"]
            kwargs = json.loads(r["reward_kwargs"]) if r["reward_kwargs"] else None
            if r["answer_type"] in ("bbox", "detection"):
                assert kwargs == {"coords": "pixel", "image_size": [84, 84]}
            else:
                assert kwargs is None


def test_eval_and_val_are_held_out_from_every_training_split_and_from_each_other(corpus):
    train = [r for split in ("pretrain", "instruct", "rl") for r in rows(corpus, split)]
    evals, vals = rows(corpus, "eval"), rows(corpus, "val")
    train_keys = {r["composition"] for r in train}
    assert all(side_of(r["composition"]) == "eval" for r in evals)
    assert all(side_of(r["composition"]) == "val" for r in vals)
    assert not any(is_heldout(k) for k in train_keys)
    eval_keys, val_keys = {r["composition"] for r in evals}, {r["composition"] for r in vals}
    assert not train_keys & eval_keys and not train_keys & val_keys and not val_keys & eval_keys
    digest = lambda r: hashlib.sha1(r["images"][0]["bytes"]).hexdigest()  # noqa: E731
    train_images, eval_images, val_images = ({digest(r) for r in t} for t in (train, evals, vals))
    assert not train_images & eval_images and not train_images & val_images and not val_images & eval_images
    assert {r["category"] for r in vals} == set(CATEGORIES)


def test_held_out_shares_are_about_one_in_eight_each():
    keys = [f"counting:{c} {s} x{n}" for c in COLOURS for s in SHAPES for n in range(1, 6)]
    for side in ("eval", "val"):
        share = sum(side_of(k) == side for k in keys) / len(keys)
        assert 0.05 < share < 0.25, side


def test_text_renders_without_freetype(monkeypatch):
    monkeypatch.setattr(synth_tasks, "font", lambda size: None)  # Pillow built without FreeType: bitmap font, scaled
    img = Image.new("RGB", (168, 84), (255, 255, 255))
    synth_tasks.draw_text(img, (84, 42), "cat 7", 32)
    box = Image.eval(img.convert("L"), lambda v: 255 - v).getbbox()
    assert box is not None and box[3] - box[1] >= 20  # ink, and glyphs big enough to read


def test_pretrain_concepts_are_long_tailed():
    counts = concept_counts(pretrain_rows(seed=0, sizes={"all": 600}, images={}))
    assert max(counts.values()) >= 10 * statistics.median(counts.values())


def _image(row: dict) -> Image.Image:
    return Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")


def _colour_share(img: Image.Image, box: list[int], colour: str) -> float:
    crop = list(img.crop(tuple(box)).getdata())
    return sum(p == COLOURS[colour] for p in crop) / len(crop)


def _centroid(img: Image.Image, colour: str) -> tuple[float, float]:
    import numpy as np

    ys, xs = np.where((np.asarray(img) == COLOURS[colour]).all(-1))
    return float(xs.mean()), float(ys.mean())


def test_answers_agree_with_what_is_drawn(corpus):
    table = [r for split in ("instruct", "eval") for r in rows(corpus, split)]
    seen = set()
    for r in table:
        cat, answer, img = r["category"], r["answer"], _image(r)
        question = r["messages"][0]["content"]
        seen.add(cat)
        if cat == "grounding":
            name = re.search(r"Where is the (\w+ \w+)\?", question).group(1)
            assert _colour_share(img, json.loads(answer), name.split()[0]) > 0.3
        elif cat == "detection":
            for obj in json.loads(answer):
                assert _colour_share(img, obj["box"], obj["label"].split()[0]) > 0.3
        elif cat == "svg":
            assert render_svg(answer).tobytes() == img.tobytes()
        elif cat == "math":
            a, op, b = r["composition"].removeprefix("math:").split()
            assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        elif cat == "chart":
            assert answer in r["composition"].removeprefix("chart:").split(",")
        elif cat == "spatial":
            relation = r["composition"].split()[2]
            assert re.search(rf"^{answer}\. {relation}$", question, re.M)
            a, b = re.search(r"Where is the (\w+) \w+ relative to the (\w+) \w+\?", question).groups()
            if a != b:  # where the colours tell the two shapes apart, check the relation on the pixels
                (ax, ay), (bx, by) = _centroid(img, a), _centroid(img, b)
                assert {"left": ax < bx, "right": ax > bx, "above": ay < by, "below": ay > by}[relation]
        elif cat == "counting":
            n = int(r["composition"].rsplit("x", 1)[1])
            assert answer == str(n)
        elif cat in ("diagram", "science"):
            assert re.search(rf"^{answer}\. \w+ \w+$", question, re.M)
        if cat == "science":
            options = dict(re.findall(r"^([AB])\. (\w+) \w+$", question, re.M))
            heavy, light = options[answer], options["B" if answer == "A" else "A"]
            if heavy != light:  # the heavier shape sits lower on the tipped seesaw
                assert _centroid(img, heavy)[1] > _centroid(img, light)[1]
    assert seen == set(CATEGORIES)


def test_gold_answers_score_one_with_the_rewards(corpus):
    rewards = pytest.importorskip("ovkit.rewards")
    # Sandboxed scorers (svg) start worker processes, seconds each on a busy CPU; svg gold answers are checked above
    # by re-rendering them.
    evals = [r for r in rows(corpus, "eval") if r["answer_type"] not in rewards.SANDBOXED]
    items = [
        {"completion": f"<answer>{r['answer']}</answer>", "answer": r["answer"], "answer_type": r["answer_type"],
         "source": r["source"], "reward_kwargs": r["reward_kwargs"]}
        for r in evals
    ]  # fmt: skip
    for r, got in zip(evals, rewards.score_batch(items, workers=1)):
        assert got.reward == 1.0, (r["category"], got)


def test_instruct_targets_pass_the_format_reward(corpus):
    rewards = pytest.importorskip("ovkit.rewards")
    for r in rows(corpus, "instruct"):
        target = r["messages"][-1]["content"]
        mode = "think" if target.startswith("<think>") else "answer"
        if mode == "think" and r["category"] in ("detection", "svg"):
            continue  # a JSON list or SVG source is longer than 20% of any short rationale (the format rule's cap)
        assert rewards.format_reward(target, mode).reward == 1.0, target


def test_corpus_texts_covers_messages_answers_and_both_languages(corpus):
    texts = list(corpus_texts(corpus))
    joined = "\n".join(texts)
    assert ANSWER_PROMPT in joined and THINK_PROMPT in joined
    assert re.search(r"[\u4e00-\u9fff]", joined)
    assert any(t.startswith("<svg") for t in texts)
    with pytest.raises(OvkitError, match="ovkit synth"):
        next(corpus_texts(corpus / "missing"))


def test_config_names_the_flag():
    with pytest.raises(OvkitError, match="--out"):
        SynthConfig()
    with pytest.raises(OvkitError, match="--scale"):
        SynthConfig(out=Path("x"), scale=0)


def test_cli_writes_provenance_and_skips_a_complete_output(tmp_path):
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "ovkit", "synth", "--out", str(out), "--scale", "0.01", "--seed", "3", "--quiet"]
    first = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert first.returncode == 0, first.stderr
    assert "synth:" in first.stdout
    assert (out / "config.yaml").is_file() and (out / "preview.png").is_file()
    prov = json.loads((out / "ovkit.json").read_text())
    assert prov["command"] == "synth" and prov["seed"] == 3 and prov["config"]["scale"] == 0.01
    from ovkit.data.synth import split_sizes

    assert prov["metrics"]["splits"]["eval"] == sum(split_sizes(0.01)["eval"].values()) >= len(CATEGORIES)
    before = (out / "ovkit.json").read_bytes()
    second = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert second.returncode == 0 and "skipped" in second.stdout
    assert (out / "ovkit.json").read_bytes() == before


def test_cli_help_is_documented(cli):
    code, out, _ = cli("synth", "--help")
    assert code == 0
    page = (Path(__file__).parents[1] / "commands" / "synth.md").read_text()
    for flag in set(re.findall(r"--[a-z][a-z-]+", out)):
        assert flag in page, flag


def test_cli_usage_error_exits_2(cli):
    code, _, err = cli("synth", "--scale", "0.01")
    assert code == 2 and "--out is required" in err
