"""ovkit caption: the released filter's rules, concept recall, language draw, the replace/reject paths, resume after a
crash without generating a row twice, --shard == one machine, and an end-to-end run on the tiny model."""

import json
from pathlib import Path

import pytest
from PIL import Image

import ovkit.caption.run as caption_run
from ovkit.caption import CaptionFilter, concept_recall, longest_run, parse_concepts, words
from ovkit.caption.run import CaptionConfig, pick_language, run, work_dir
from ovkit.data import image_cell, read_table, samples_table, write_samples
from ovkit.errors import OvkitError
from ovkit.generate import Completion

ROOT = Path(__file__).resolve().parents[1]
LONG = "A detailed picture of several coloured shapes on a plain white background."  # 74 characters

# ---- the filter ----------------------------------------------------------------------------------------------------


def _repeat(word: str, n: int) -> str:
    return f"The picture shows {' '.join([word] * n)} on a white background with nothing else."


@pytest.mark.parametrize(
    "text, rule",
    [
        (LONG, None),
        ("I'm sorry, but I cannot describe this image because it is too small to see.", "refusal"),
        ("I\u2019m sorry, this picture is not something I am able to describe for you today.", "refusal"),
        ("As an AI language model, I do not have the ability to look at pictures like this.", "refusal"),
        ("抱歉，我无法描述这张图片，因为它太小了，看不清楚里面的内容，请换一张更大的图片再试。" * 2, "refusal"),
        (_repeat("circle", 7), None),
        (_repeat("circle", 8), "repetition"),
        (_repeat("circle", 20), "repetition"),
        ("The picture shows circle, Circle. CIRCLE circle circle! circle circle circle on white.", "repetition"),
        ("a" * 49, "too short"),
        ("a" * 50, None),
        ("  " + "a" * 49 + "  ", "too short"),  # surrounding whitespace does not count
        (" ".join(f"word{i}" for i in range(600)), "too long"),
        ("", "empty"),
        (None, "empty"),
        ("(" * 60, "empty"),  # no word at all: what an untrained captioner writes
        ("\x12" * 60 + " ???? \ufffd" * 5, "empty"),
    ],
)
def test_filter_rules(text, rule):
    problem = CaptionFilter().problem(text)
    assert (problem.split(":")[0] if problem else None) == rule, problem


def test_repetition_rule_is_exactly_eight_identical_consecutive_words():
    f = CaptionFilter(min_chars=0)
    assert f.problem("red " * 7 + "blue " + "red " * 7) is None  # 14 reds, never 8 in a row
    assert f.problem("red " * 8) == "repetition: 'red' 8 times in a row (--repeat-limit 8)"
    assert f.problem("红" * 7) is None and f.problem("红" * 8).startswith("repetition")  # a CJK character is a word
    assert CaptionFilter(min_chars=0, repeat_limit=3).problem("a b b b c").startswith("repetition")
    assert f.problem("a" * 3500) is None and CaptionFilter().problem("a" * 3501).startswith("too long")


def test_words_and_longest_run():
    assert words("Two RED circles, (two) 红色圆形!") == ["two", "red", "circles", "two", "红", "色", "圆", "形"]
    assert longest_run("a b b c c c d") == ("c", 3)
    assert longest_run("... !! \x12\x12") == (None, 0)


# ---- concept recall and languages ----------------------------------------------------------------------------------


def test_concept_recall_matches_whole_words_and_plurals():
    assert concept_recall("two yellow squares and a red circle", ["yellow square", "red circle"]) == 1.0
    assert concept_recall("a yellowish square, a red  circle", ["yellow square", "red circle"]) == 0.5
    assert concept_recall("Bar charts!", ["bar chart"]) == 1.0
    assert concept_recall(None, ["arrow"]) == 0.0
    assert parse_concepts('["a", "b", "a"]') == ["a", "b"]
    assert parse_concepts("not json") is None and parse_concepts("[]") is None and parse_concepts(None) is None


def test_language_draw_is_deterministic_by_id_and_follows_the_shares():
    shares = CaptionConfig(data=Path("d"), model=Path("m"), out=Path("o")).languages()
    assert shares == [("en", 0.75), ("zh", 0.25)]
    langs = [pick_language(f"row-{i}", 0, shares) for i in range(4000)]
    assert 0.72 < langs.count("en") / 4000 < 0.78
    assert langs == [pick_language(f"row-{i}", 0, shares) for i in range(4000)]
    assert langs != [pick_language(f"row-{i}", 1, shares) for i in range(4000)]  # the seed changes the draw
    assert {pick_language(f"row-{i}", 0, [("en", 1.0)]) for i in range(100)} == {"en"}


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"out": None}, "--out is required"),
        ({"model": None}, "--model is required"),
        ({"lang": "en,en"}, "distinct languages"),
        ({"lang_ratio": "0.5"}, "one share >= 0 per --lang"),
        ({"lang_ratio": "a,b"}, "numbers separated by commas"),
        ({"lang": "en,fr"}, "no prompt for --lang fr"),
        ({"prompt": ["Describe it"]}, "LANG=TEXT"),
        ({"min_chars": 100, "max_chars": 50}, "--min-chars <= --max-chars"),
        ({"repeat_limit": 1}, "--repeat-limit"),
        ({"engine": "tgi"}, "--engine"),
        ({"shard": "2/2"}, "0 <= I < N"),
    ],
)
def test_config_errors_name_the_flag(kw, message):
    args = {"data": Path("d"), "model": Path("m"), "out": Path("o"), **kw}
    with pytest.raises(OvkitError, match=message):
        CaptionConfig(**args)


def test_prompts_and_ratios_from_options_and_yaml():
    cfg = CaptionConfig(
        data=Path("d"),
        model=Path("m"),
        out=Path("o"),
        lang=["en", "fr"],
        lang_ratio=[1, 3],
        prompt=["fr=Décris cette image.", "en=Caption it."],
    )
    assert cfg.lang == "en,fr" and cfg.languages() == [("en", 0.25), ("fr", 0.75)]
    assert cfg.prompts() == {"en": "Caption it.", "fr": "Décris cette image."}
    assert CaptionConfig(data=Path("d"), model=Path("m"), out=Path("o"), lang="zh").languages() == [("zh", 1.0)]


def test_example_config_is_valid():
    from ovkit.config import load_yaml, merge

    values = load_yaml(ROOT / "examples" / "tiny" / "caption.yaml")
    cfg = merge(
        CaptionConfig, {"data": Path("d"), "model": Path("m"), "out": Path("o")}, {"data", "model", "out"}, values
    )
    assert cfg.keep_original_on_reject and cfg.max_new_tokens == 16


# ---- the stage, with a scripted engine
# --------------------------------------------------------------------------------

COLOURS = [(220, 30, 30), (30, 180, 30), (30, 30, 220), (230, 220, 20), (128, 0, 128), (255, 165, 0)]


def rows(n=6, concepts=True, no_image=()):
    out = []
    for i in range(n):
        row = {
            "id": f"r{i}",
            "images": [] if i in no_image else [image_cell(Image.new("RGB", (84, 84), COLOURS[i % len(COLOURS)]))],
            "messages": [
                {"role": "user", "content": "Say something." if i in no_image else "<image>\nDescribe the image."},
                {"role": "assistant", "content": f"a red circle number {i}"},
            ],
            "source": "test",
        }
        if concepts:
            row["concepts"] = json.dumps(["red circle"])
        out.append(row)
    return out


def dataset(tmp_path, table_rows, name="data"):
    write_samples(samples_table(table_rows), tmp_path / name)
    return tmp_path / name


class Scripted:
    """Stands in for HFEngine: `respond(prompt)` writes each caption."""

    def __init__(self, respond):
        self.respond = respond

    def generate(self, prompts, *, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, images=None):
        return [[Completion(token_ids=[1, 2, 3], text=self.respond(p), finish_reason="stop")] for p in prompts]


class Counting:
    """Wraps an engine: counts generate calls and prompts, and can crash on a given call."""

    def __init__(self, inner, crash_on_call=None):
        self.inner, self.crash_on_call = inner, crash_on_call
        self.calls = self.prompts = 0

    def generate(self, prompts, **kw):
        self.calls += 1
        if self.calls == self.crash_on_call:
            raise RuntimeError("simulated crash")
        self.prompts += len(prompts)
        return self.inner.generate(prompts, **kw)


def FakeEngine(respond, crash_on_call=None):
    return Counting(Scripted(respond), crash_on_call)


def scripted(texts):
    it = iter(texts)
    return FakeEngine(lambda prompt: next(it))


def by_content(prompt):
    """A caption that depends only on the prompt (its tokens and pixels), whatever the batch or shard."""
    return f"{LONG} tokens {sum(prompt.input_ids)} pixels {float(prompt.mm['pixel_values'].sum()):.2f}"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from ovkit.data.synth import pretrain_rows
    from ovkit.models.tiny import build_tiny

    synth = pretrain_rows(0, {"all": 12}, {})
    texts = [m["content"] for r in synth for m in r["messages"]] * 4
    base = tmp_path_factory.mktemp("caption")
    model = build_tiny(base / "tiny", texts, seed=0)
    write_samples(samples_table(synth), base / "synth")
    return model, base / "synth"


@pytest.fixture(scope="module")
def processor(tiny_model):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_model[0]))


def run_lib(tmp_path, data, engine, processor, name="out", **kw):
    cfg = CaptionConfig(data=data, model=Path("fake-model"), out=tmp_path / name, quiet=True, **{"chunk_rows": 4, **kw})
    out = tmp_path / name
    out.mkdir()
    metrics = run(cfg, out, None, work=work_dir(out), engine=engine, processor=processor)
    rejects = read_table(out / "rejects.parquet") if (out / "rejects.parquet").exists() else None
    return read_table(out).to_pylist(), rejects, metrics


def test_better_recaptions_replace_the_targets(tmp_path, processor):
    data = dataset(tmp_path, rows(6))
    texts = [f"{LONG} There is one red circle, number {i}." for i in range(6)]
    out, rejects, m = run_lib(tmp_path, data, scripted(texts), processor, lang="en")
    assert m["replaced"] and m["concept_recall"] == {
        "original": 1.0,
        "recaption": 1.0,
        "rows_original": 6,
        "rows_recaption": 6,
    }
    assert rejects is None and m["pass_rate"] == 1.0 and m["status"] == {"recaption": 6}
    for i, row in enumerate(out):
        assert row["messages"] == [
            {"role": "user", "content": "<image>\nDescribe this image in detail."},
            {"role": "assistant", "content": texts[i]},
        ]
        assert row["original_caption"] == f"a red circle number {i}" and row["recaption"] == texts[i]
        assert (
            row["caption_lang"] == "en"
            and row["caption_model"] == "fake-model"
            and row["caption_status"] == "recaption"
        )
        assert json.loads(row["concepts"]) == ["red circle"]  # unknown columns are kept


def test_worse_recaptions_leave_the_targets_and_are_kept_beside(tmp_path, processor):
    data = dataset(tmp_path, rows(6))
    texts = [f"{LONG} Number {i}." for i in range(5)] + ["I'm sorry, I cannot describe this image."]
    out, rejects, m = run_lib(tmp_path, data, scripted(texts), processor, lang="en")
    assert not m["replaced"] and "concept recall 0.000 < 1.000" in m["decision"]
    assert len(out) == 6 and rejects is None  # targets unchanged: no row is dropped for an unused recaption
    assert [r["messages"][-1]["content"] for r in out] == [f"a red circle number {i}" for i in range(6)]
    assert [r["recaption"] for r in out] == texts
    assert [r["caption_status"] for r in out][:5] == ["original: not better"] * 5
    assert out[5]["caption_status"].startswith("original: rejected (refusal")
    assert m["rejected_by_rule"] == {"refusal": 1} and m["pass_rate"] == pytest.approx(5 / 6, abs=1e-4)


@pytest.mark.parametrize("keep", [False, True])
def test_rejected_recaptions_go_to_rejects_or_keep_their_original(tmp_path, processor, keep):
    data = dataset(
        tmp_path, rows(6, concepts=False) + [{**rows(1)[0], "id": "bad", "images": []}]
    )  # bad: marker, no image
    texts = [f"{LONG} {i}" for i in range(4)] + ["too short", "red " * 9]
    out, rejects, m = run_lib(
        tmp_path, data, scripted(texts), processor, lang="en", keep_original_on_reject=keep, on_error="skip"
    )
    assert m["replaced"] and "no `concepts` ground truth" in m["decision"]
    assert m["rows_in"] == 7 == m["rows_out"] + m["rejects"] and m["input_rejects"] == 1
    assert len(out) == m["rows_out"] and len(rejects) == m["rejects"]
    assert m["rejected_by_rule"] == {"repetition": 1, "too short": 1}
    reasons = dict(zip(rejects.column("id").to_pylist(), rejects.column("reason").to_pylist()))
    assert "marker" in reasons["bad"]
    if keep:
        assert len(out) == 6 and set(reasons) == {"bad"}
        assert out[4]["messages"][-1]["content"] == "a red circle number 4"
        assert out[4]["caption_status"].startswith("original: rejected (too short")
    else:
        assert len(out) == 4 and set(reasons) == {"bad", "r4", "r5"}
        assert reasons["r4"].startswith("caption filter: too short") and reasons["r5"].startswith(
            "caption filter: repetition"
        )
    assert all(r["caption_status"] in ("recaption",) for r in out[:4])


def test_rows_without_images_pass_through_uncaptioned(tmp_path, processor):
    data = dataset(tmp_path, rows(4, no_image={1, 2}))
    engine = FakeEngine(by_content)
    out, _, m = run_lib(tmp_path, data, engine, processor, lang="zh")
    assert engine.prompts == 2 and m["captioned"] == 2
    assert [r["caption_status"] for r in out] == ["recaption", "original: no image", "original: no image", "recaption"]
    assert out[1]["messages"][-1]["content"] == "a red circle number 1" and out[1]["recaption"] is None
    assert out[0]["messages"][0]["content"] == "<image>\n请详细描述这张图片。"


# ---- the command ---------------------------------------------------------------------------------------------------


def _patch_engine(monkeypatch, make):
    monkeypatch.setattr(caption_run, "build_engine", make)


def cli_ok(cli, *args):
    code, out, err = cli("caption", *map(str, args), "--quiet")
    assert code == 0, err
    return out


def test_end_to_end_on_the_tiny_model(cli, tmp_path, tiny_model):
    model, synth = tiny_model
    out = cli_ok(
        cli,
        synth,
        "--model",
        model,
        "--out",
        tmp_path / "cap",
        "--max-new-tokens",
        "4",
        "--chunk-rows",
        "5",
        "--keep-original-on-reject",
    )
    assert "caption: 12 rows in, 12 out, 0 rejected" in out and "targets unchanged because concept recall" in out
    t = read_table(tmp_path / "cap")
    assert t.num_rows == 12
    for name in (
        "original_caption",
        "recaption",
        "caption_lang",
        "caption_model",
        "caption_status",
        "concepts",
        "lang",
    ):
        assert name in t.column_names
    source = read_table(synth)
    assert t.column("messages").to_pylist() == source.column("messages").to_pylist()  # targets kept
    assert t.column("original_caption").to_pylist() == [m[-1]["content"] for m in source.column("messages").to_pylist()]
    prov = json.loads((tmp_path / "cap" / "ovkit.json").read_text())
    m = prov["metrics"]
    assert prov["command"] == "caption" and m["generated_rows"] == 12 and m["new_tokens"] <= 12 * 4
    assert m["concept_recall"]["original"] > 0.8 and m["concept_recall"]["recaption"] < m["concept_recall"]["original"]
    assert set(m["languages"]) <= {"en", "zh"} and sum(m["languages"].values()) == 12
    assert not work_dir(tmp_path / "cap").exists()  # chunks are removed once the output is complete
    assert "skipped" in cli_ok(cli, synth, "--model", model, "--out", tmp_path / "cap")


def test_resume_after_a_crash_generates_no_row_twice(cli, tmp_path, tiny_model, monkeypatch):
    model, synth = tiny_model
    args = [synth, "--model", model, "--max-new-tokens", "3", "--chunk-rows", "4"]  # 12 rows: chunks of 4, 4, 4
    real = caption_run.build_engine
    engines = []

    def wrapped(crash_on_call):
        def make(cfg):
            engine, processor = real(cfg)
            engines.append(Counting(engine, crash_on_call))
            return engines[-1], processor

        return make

    _patch_engine(monkeypatch, wrapped(crash_on_call=3))
    code, _, err = cli("caption", *map(str, args), "--out", tmp_path / "cap", "--quiet")
    assert code == 1 and "simulated crash" in err
    assert not (tmp_path / "cap").exists()  # complete or absent
    assert len(list(work_dir(tmp_path / "cap").glob("chunk-*.parquet"))) == 2

    _patch_engine(monkeypatch, wrapped(crash_on_call=None))
    out = cli_ok(cli, *args, "--out", tmp_path / "cap")
    assert "12 rows in" in out
    assert engines[0].prompts == 8 and engines[1].prompts == 4  # the third chunk only: no row generated twice
    assert json.loads((tmp_path / "cap" / "ovkit.json").read_text())["metrics"]["resumed_rows"] == 8

    cli_ok(cli, *args, "--out", tmp_path / "again")  # uninterrupted
    assert engines[2].prompts == 12
    assert read_table(tmp_path / "cap").equals(read_table(tmp_path / "again"))


def test_changed_settings_start_over(cli, tmp_path, tiny_model, monkeypatch, processor):
    model, synth = tiny_model
    engine = FakeEngine(by_content, crash_on_call=2)
    _patch_engine(monkeypatch, lambda cfg: (engine, processor))
    base = [synth, "--model", model, "--chunk-rows", "4", "--out", tmp_path / "cap", "--quiet"]
    assert cli("caption", *map(str, base))[0] == 1
    engine.crash_on_call, engine.prompts = None, 0
    cli_ok(cli, *base, "--prompt", "en=Caption this image.")  # another prompt: the saved chunk is not reused
    assert engine.prompts == 12


def test_shards_read_back_as_the_single_machine_output(cli, tmp_path, tiny_model, monkeypatch, processor):
    model, synth = tiny_model
    _patch_engine(monkeypatch, lambda cfg: (FakeEngine(by_content), processor))
    # --no-replace-if-better: the replacement rule is decided per output, i.e. per shard (commands/caption.md)
    common = [synth, "--model", model, "--chunk-rows", "2", "--no-replace-if-better"]
    cli_ok(cli, *common, "--out", tmp_path / "one")
    for i in range(3):
        out = cli_ok(cli, *common, "--shard", f"{i}/3", "--out", tmp_path / "many")
        assert f"part-{i:05d}-of-00003" in out
    # the parts, and the dataset card that covers them all (ovkit.cards)
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == [
        "README.md",
        *(f"part-{i:05d}-of-00003" for i in range(3)),
    ]
    one, many = read_table(tmp_path / "one"), read_table(tmp_path / "many")
    assert many.num_rows == 12 and many.equals(one)


def test_help(cli):
    code, out, _ = cli("caption", "--help")
    assert code == 0 and "--min-chars" in out and "--repeat-limit" in out
