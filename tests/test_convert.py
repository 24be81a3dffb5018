"""`ovkit convert`: every input format written by the test itself, converted and checked row by row; bad records are
rejected with a reason (skip) or stop the run naming file, record and field (fail); rows in == rows out + rejects."""

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import jpeg, many_llava, png, write_json
from PIL import Image

from ovkit.data import formats, read_samples

HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def rows_of(out: Path) -> list[dict]:
    return read_samples(out).table.to_pylist()


def metrics(out: Path) -> dict:
    return json.loads((out / "ovkit.json").read_text())["metrics"]


def rejects_of(out: Path) -> list[dict]:
    return pq.read_table(out / "rejects.parquet").to_pylist()


# ---------------------------------------------------------------- each format, row by row


def test_llava_json(tmp_path, llava_images, cli):
    root, files = llava_images
    src = write_json(
        tmp_path / "llava.json",
        [
            {
                "id": "000001",
                "image": "coco/a.png",
                "model": "",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat colour?"},
                    {"from": "gpt", "value": "Red."},
                    {"from": "human", "value": "Sure?"},
                    {"from": "gpt", "value": "Yes."},
                ],
            },
            {
                "id": "000002",
                "image": "coco/b.jpg",  # no marker: one is inserted at the start of the first user turn
                "conversations": [
                    {"from": "system", "value": "Be brief."},
                    {"from": "human", "value": "Describe it."},
                    {"from": "gpt", "value": "Blue."},
                ],
            },
            {"id": "wgByO4Y_0", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
            {
                "id": "000004",
                "image": ["coco/a.png", "c.png"],
                "conversations": [
                    {"from": "human", "value": "<image> and <image>: same?"},
                    {"from": "gpt", "value": "No"},
                ],
            },
        ],
    )
    code, stdout, err = cli(
        "convert", src, "--from", "llava", "--image-root", root, "--out", tmp_path / "out", "--quiet"
    )
    assert code == 0, err
    assert "4 records -> 4 rows" in stdout
    rows = rows_of(tmp_path / "out")
    assert [r["id"] for r in rows] == ["000001", "000002", "wgByO4Y_0", "000004"]
    assert rows[0]["messages"] == [
        {"role": "user", "content": "<image>\nWhat colour?"},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    assert [i["bytes"] for i in rows[0]["images"]] == [files["coco/a.png"]]
    assert rows[0]["images"][0]["path"] == "coco/a.png"
    assert rows[1]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert rows[1]["messages"][1] == {"role": "user", "content": "<image>\nDescribe it."}
    assert rows[1]["images"][0]["bytes"] == files["coco/b.jpg"]  # the original JPEG bytes, not re-encoded
    assert rows[2]["images"] == [] and rows[2]["messages"][1]["role"] == "assistant"
    assert [i["bytes"] for i in rows[3]["images"]] == [files["coco/a.png"], files["c.png"]]
    assert all(r["source"] == "llava" for r in rows)  # no source in the input: the file name
    assert rows[0]["model"] == ""  # unknown string keys are kept as columns
    m = metrics(tmp_path / "out")
    assert (m["rows_in"], m["rows_out"], m["rejects"], m["inserted_markers"]) == (4, 4, 0, 1)


def test_sharegpt_json_and_jsonl(tmp_path, llava_images, cli):
    root, files = llava_images
    records = [
        {
            "messages": [
                {"role": "user", "content": "<image>What is it?"},
                {"role": "assistant", "content": "A square."},
            ],
            "images": ["coco/a.png"],
        },
        # LLaMA-Factory's sharegpt layout: conversations with from/value, a system key, images list
        {
            "conversations": [
                {"from": "human", "value": "<image><image>Compare."},
                {"from": "gpt", "value": "Different."},
            ],
            "system": "You are a helpful AI assistant.",
            "images": ["coco/b.jpg", "c.png"],
            "tools": "",
        },
        # OpenAI content parts: the image part becomes a marker where it stands
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " colour?"}]},
                {"role": "assistant", "content": "green"},
            ],
            "images": ["c.png"],
        },
    ]
    write_json(tmp_path / "sg.json", records)
    (tmp_path / "sg.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    for name in ("sg.json", "sg.jsonl"):
        out = tmp_path / f"out-{name}"
        code, stdout, err = cli("convert", tmp_path / name, "--image-root", root, "--out", out, "--source", "mine")
        assert code == 0, err
        assert "looks like --from sharegpt" in err and "(detected)" in stdout
        rows = rows_of(out)
        assert [r["id"] for r in rows] == ["sg-0", "sg-1", "sg-2"]
        assert rows[0]["messages"][0] == {"role": "user", "content": "<image>What is it?"}
        assert rows[1]["messages"] == [
            {"role": "system", "content": "You are a helpful AI assistant."},
            {"role": "user", "content": "<image><image>Compare."},
            {"role": "assistant", "content": "Different."},
        ]
        assert [i["bytes"] for i in rows[1]["images"]] == [files["coco/b.jpg"], files["c.png"]]
        assert rows[2]["messages"][0]["content"] == "<image> colour?"
        assert {r["source"] for r in rows} == {"mine"}
        assert rows[1]["tools"] == ""


@pytest.mark.parametrize("layout", ["hf-struct", "binary"])
def test_onevision_parquet(tmp_path, cli, layout):
    imgs = [png((1, 2, 3)), None, jpeg()]
    if layout == "hf-struct":  # as `datasets` writes an Image feature
        col = pa.array(
            [None if b is None else {"bytes": b, "path": f"img{k}.png"} for k, b in enumerate(imgs)], HF_IMAGE
        )
    else:
        col = pa.array(imgs, pa.binary())
    conversations = pa.array(
        [
            [{"from": "human", "value": "<image>\nQ1"}, {"from": "gpt", "value": "A1"}],
            [{"from": "human", "value": "text only"}, {"from": "gpt", "value": "ok"}],
            [{"from": "human", "value": "Q3 <image>"}, {"from": "gpt", "value": "A3"}],
        ]
    )
    table = pa.table(
        {
            "id": ["a", "b", "c"],
            "image": col,
            "conversations": conversations,
            "data_source": ["chartqa", "magpie", None],
            "n_tokens": [1, 2, 3],
        }
    )
    pq.write_table(table, tmp_path / "ov.parquet", row_group_size=2)
    code, stdout, err = cli("convert", tmp_path / "ov.parquet", "--out", tmp_path / "out")
    assert code == 0, err
    assert "--from onevision" in err and "dropping columns that are not text: n_tokens" in err
    rows = rows_of(tmp_path / "out")
    assert [r["source"] for r in rows] == ["chartqa", "magpie", "ov"]
    assert [[i["bytes"] for i in r["images"]] for r in rows] == [[imgs[0]], [], [imgs[2]]]
    assert rows[2]["messages"][0] == {"role": "user", "content": "Q3 <image>"}
    assert "n_tokens" not in rows[0] and metrics(tmp_path / "out")["dropped_columns"] == ["n_tokens"]


def test_midtrain_parquet(tmp_path, cli):
    a, b = png((9, 9, 9)), jpeg()
    table = pa.table(
        {
            "id": ["m0", "m1"],
            "image": pa.array([{"bytes": a, "path": None}, {"bytes": b, "path": None}], HF_IMAGE),
            "caption": ["A grey square.", "一个蓝色的长方形。"],
        }
    )
    pq.write_table(table, tmp_path / "mid.parquet")
    out = tmp_path / "out"
    code, _, err = cli(
        "convert", tmp_path / "mid.parquet", "--out", out, "--caption-prompt", "Caption this.", "--quiet"
    )
    assert code == 0, err
    rows = rows_of(out)
    assert rows[1]["messages"] == [
        {"role": "user", "content": "<image>\nCaption this."},
        {"role": "assistant", "content": "一个蓝色的长方形。"},
    ]
    assert [r["images"][0]["bytes"] for r in rows] == [a, b]
    assert metrics(out)["format"] == "ov-midtrain"


def test_ov_rl_parquet(tmp_path, cli):
    img = png((5, 5, 200))
    table = pa.table(
        {
            "id": ["r0", "r1", "r2", "r3"],
            "images": pa.array(
                [[{"bytes": img, "path": "x.png"}], [{"bytes": img, "path": None}], [], []], pa.list_(HF_IMAGE)
            ),
            "problem": ["<image>How many circles?", "Read the text.", "What is 2+3?", "Is 7 prime?"],
            "answer": [["3"], ["HELLO", "hello world"], ["5", "5.0"], ["yes"]],
            "problem_type": ["counting", "ocr", "stem", "stem"],
            "answer_type": ["number", "ocrtext", "math-expressions", "boolean"],
            "source": ["count_v1", "ocr_v2", "math", "math"],
            "prompt_type": ["normal", "default", "normal", "default"],
        }
    )
    pq.write_table(table, tmp_path / "rl.parquet")
    out = tmp_path / "out"
    code, _, err = cli("convert", tmp_path / "rl.parquet", "--out", out, "--quiet")
    assert code == 0, err
    rows = rows_of(out)
    assert rows[0]["messages"] == [{"role": "user", "content": "<image>How many circles?"}]  # prompt only
    assert rows[1]["messages"] == [{"role": "user", "content": "<image>\nRead the text."}]  # marker inserted
    # several answers: a JSON list where the scorer takes alternatives (ocr), else the first (math)
    assert [r["answer"] for r in rows] == ["3", json.dumps(["HELLO", "hello world"]), "5", "yes"]
    assert metrics(out)["answers_cut_to_first"] == 1
    assert [r["answer_type"] for r in rows] == ["number", "ocrtext", "math-expressions", "boolean"]  # released names
    assert [r["category"] for r in rows] == ["counting", "ocr", "stem", "stem"]
    assert [r["prompt_type"] for r in rows] == ["normal", "default", "normal", "default"]
    assert [r["source"] for r in rows] == ["count_v1", "ocr_v2", "math", "math"]
    assert rows[0]["images"][0]["bytes"] == img and rows[2]["images"] == []


def test_verl_parquet(tmp_path, cli):
    img = png((0, 128, 0), (40, 20))
    rm = pa.struct([("answer", pa.string()), ("ground_truth", pa.string()), ("accuracy_ratio", pa.float32())])
    table = pa.table(
        {
            "data_source": ["mm_math", "v3det_train"],
            "images": pa.array([[{"bytes": img, "path": None}], [{"bytes": img, "path": None}]], pa.list_(HF_IMAGE)),
            "prompt": [
                [{"content": "<image>What is AB?", "role": "user"}],
                [{"content": "Be careful.", "role": "system"}, {"content": "<image>\nLocate the dog.", "role": "user"}],
            ],
            "ability": ["math", "cv_detection"],
            "reward_model": pa.array(
                [
                    {"answer": "4", "ground_truth": "\\boxed{4}", "accuracy_ratio": 1.0},
                    {"answer": "[]", "ground_truth": "<answer>[]</answer>", "accuracy_ratio": 1.0},
                ],
                rm,
            ),
            "extra_info": pa.array([{"id": "q-17", "image_path": "a.png"}, {"id": None, "image_path": "b.png"}]),
        }
    )
    pq.write_table(table, tmp_path / "orsta.parquet")
    out = tmp_path / "out"
    code, _, err = cli("convert", tmp_path / "orsta.parquet", "--from", "roll", "--out", out, "--quiet")
    assert code == 0, err
    rows = rows_of(out)
    assert [r["id"] for r in rows] == ["q-17", "orsta-1"]
    assert [r["answer"] for r in rows] == ["\\boxed{4}", "<answer>[]</answer>"]
    assert [r["source"] for r in rows] == ["mm_math", "v3det_train"]
    assert [r["category"] for r in rows] == ["math", "cv_detection"]
    assert rows[1]["messages"] == [
        {"role": "system", "content": "Be careful."},
        {"role": "user", "content": "<image>\nLocate the dog."},
    ]
    assert rows[0]["images"][0]["bytes"] == img


# ---------------------------------------------------------------- bad records


def bad_llava(tmp_path, root) -> Path:
    return write_json(
        tmp_path / "bad.json",
        [
            {
                "id": "ok1",
                "image": "coco/a.png",
                "conversations": [{"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"}],
            },
            {
                "id": "missing",
                "image": "coco/nope.png",
                "conversations": [{"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"}],
            },
            {
                "id": "broken",
                "image": "broken.png",
                "conversations": [{"from": "human", "value": "<image>\nQ"}, {"from": "gpt", "value": "A"}],
            },
            {
                "id": "twomarks",
                "image": "c.png",
                "conversations": [{"from": "human", "value": "<image><image>\nQ"}, {"from": "gpt", "value": "A"}],
            },
            {"id": "role", "conversations": [{"from": "function_call", "value": "x"}]},
            {"id": "ok2", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        ],
    )


def test_bad_records_skip(tmp_path, llava_images, cli):
    root, _ = llava_images
    out = tmp_path / "out"
    code, stdout, err = cli(
        "convert", bad_llava(tmp_path, root), "--image-root", root, "--out", out, "--on-error", "skip", "--quiet"
    )
    assert code == 0, err
    assert "6 records -> 2 rows" in stdout and "4 rejects" in stdout
    assert [r["id"] for r in rows_of(out)] == ["ok1", "ok2"]
    rejects = {r["id"]: r for r in rejects_of(out)}
    assert set(rejects) == {"missing", "broken", "twomarks", "role"}
    assert rejects["missing"]["field"] == "image" and "not found" in rejects["missing"]["reason"]
    assert rejects["broken"]["field"] == "image" and "unreadable image" in rejects["broken"]["reason"]
    assert (
        rejects["twomarks"]["field"] == "conversations"
        and "2 <image> marker(s) but 1 image(s)" in rejects["twomarks"]["reason"]
    )
    assert rejects["role"]["field"] == "conversations" and "function_call" in rejects["role"]["reason"]
    assert json.loads(rejects["missing"]["record"])["image"] == "coco/nope.png"  # the raw record, as JSON
    assert rejects["broken"]["index"] == 2 and rejects["broken"]["file"].endswith("bad.json")
    m = metrics(out)
    assert m["rows_in"] == m["rows_out"] + m["rejects"] == 6


def test_bad_parquet_bytes_skip(tmp_path, cli):
    """Unreadable image bytes inside parquet: the reject keeps the raw record with the bytes as base64."""
    good, bad = png(), b"\xff\xd8\xffnot really a jpeg"
    table = pa.table({"id": ["g", "b"], "image": pa.array([good, bad], pa.binary()), "caption": ["c1", "c2"]})
    pq.write_table(table, tmp_path / "mid.parquet")
    out = tmp_path / "out"
    code, _, err = cli("convert", tmp_path / "mid.parquet", "--out", out, "--on-error", "skip", "--quiet")
    assert code == 0, err
    assert [r["id"] for r in rows_of(out)] == ["g"]
    (rej,) = rejects_of(out)
    assert rej["field"] == "image" and "unreadable" in rej["reason"]
    assert json.loads(rej["record"])["image"] == {"base64": __import__("base64").b64encode(bad).decode()}


@pytest.mark.parametrize(
    "first_bad, field",
    [("missing", "image"), ("broken", "image"), ("twomarks", "conversations")],
)
def test_bad_records_fail(tmp_path, llava_images, cli, first_bad, field):
    root, _ = llava_images
    records = json.loads(bad_llava(tmp_path, root).read_text())
    records = [r for r in records if r["id"] in ("ok1", first_bad)]
    src = write_json(tmp_path / "one_bad.json", records)
    out = tmp_path / "out"
    code, _, err = cli("convert", src, "--image-root", root, "--out", out)
    assert code == 2
    assert f"file {src}" in err and f"'{first_bad}' (index 1)" in err and f"column '{field}'" in err
    assert "--on-error skip" in err and "Traceback" not in err
    assert not out.exists()  # complete or absent


def test_bad_json_line_is_a_record_error(tmp_path, cli):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(good) + "\n{not json\n" + json.dumps(good) + "\n")
    out = tmp_path / "out"
    code, _, err = cli("convert", tmp_path / "d.jsonl", "--out", out, "--on-error", "skip", "--quiet")
    assert code == 0, err
    (rej,) = rejects_of(out)
    assert rej["index"] == 1 and rej["record"] == "{not json" and "not valid JSON" in rej["reason"]
    code, _, err = cli("convert", tmp_path / "d.jsonl", "--out", tmp_path / "o2")
    assert code == 2 and "index 1" in err and "column 'record'" in err


def test_duplicate_ids_are_renamed_and_said_so(tmp_path, llava_images, cli):
    root, _ = llava_images
    rec = {"id": "7", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    src = write_json(tmp_path / "dup.json", [rec, rec, {**rec, "id": 8}])
    code, _, err = cli("convert", src, "--out", tmp_path / "out", "--quiet")
    assert code == 0, err
    assert [r["id"] for r in rows_of(tmp_path / "out")] == ["7", "7-1", "8"]
    assert metrics(tmp_path / "out")["renamed_ids"] == 1
    assert (
        "warning: 1 record(s) repeat an earlier id and were renamed" in err and "'7' of record 1 became '7-1'" in err
    )  # even --quiet


# ---------------------------------------------------------------- detection


def test_auto_detection(tmp_path):
    k = formats.detect_format
    assert k(["id", "image", "conversations"])[0] == "llava"
    assert k(["id", "conversations"])[0] == "llava"
    assert k(["messages", "images"])[0] == "sharegpt"
    assert k(["conversations", "images", "system"])[0] == "sharegpt"
    assert k(["id", "image", "conversations", "data_source"])[0] == "onevision"
    assert k(["id", "image", "caption"])[0] == "ov-midtrain"
    assert (
        k(["id", "images", "problem", "answer", "answer_type", "problem_type", "source", "prompt_type"])[0] == "ov-rl"
    )
    assert k(["data_source", "images", "prompt", "ability", "reward_model", "extra_info"])[0] == "verl"
    with pytest.raises(formats.OvkitError, match="--from"):
        k(["conversations", "image", "images"])  # LLaVA's image and ShareGPT's images: ambiguous
    with pytest.raises(formats.OvkitError, match="--from"):
        k(["text", "label"])
    # ovkit's own table (e.g. from the Hub) and TRL's layouts are formats too
    assert k(["id", "images", "messages", "source", "category"])[0] == "ovkit"
    assert k(["id", "images", "messages", "source"], parts=True)[0] == "trl"
    assert k(["images", "messages"], parts=True)[0] == "trl"
    assert k(["image", "messages"])[0] == "trl"
    assert k(["images", "prompt", "completion"])[0] == "trl"
    assert k(["data_source", "images", "prompt", "reward_model"], parts=True)[0] == "verl"


def test_ambiguous_input_exits_2(tmp_path, cli):
    src = write_json(tmp_path / "x.json", [{"conversations": [], "image": "a.png", "images": ["a.png"]}])
    code, _, err = cli("convert", src, "--out", tmp_path / "out")
    assert code == 2 and "--from" in err and "llava" in err and "sharegpt" in err


# ---------------------------------------------------------------- output layout, shards, streaming


def test_part_files_and_shards_read_as_one_dataset(tmp_path, llava_images, cli):
    root, _ = llava_images
    src = many_llava(tmp_path, 11)
    whole = tmp_path / "whole"
    assert cli("convert", src, "--image-root", root, "--out", whole, "--rows-per-file", "4", "--quiet")[0] == 0
    names = sorted(p.name for p in whole.glob("*.parquet"))
    assert names == ["part-00000-of-00003.parquet", "part-00001-of-00003.parquet", "part-00002-of-00003.parquet"]
    assert [pq.ParquetFile(whole / n).metadata.num_rows for n in names] == [4, 4, 3]
    expected = read_samples(whole).table
    assert expected.column("id").to_pylist() == [f"r{i}" for i in range(11)]

    sharded = tmp_path / "sharded"
    for i in range(3):
        code, stdout, err = cli(
            "convert",
            src,
            "--image-root",
            root,
            "--out",
            sharded,
            "--shard",
            f"{i}/3",
            "--rows-per-file",
            "2",
            "--quiet",
        )
        assert code == 0, err
    assert (sharded / "part-00001-of-00003" / "ovkit.json").is_file()
    assert read_samples(sharded).table.equals(expected)
    assert sum(metrics(sharded / f"part-0000{i}-of-00003")["rows_in"] for i in range(3)) == 11
    code, stdout, _ = cli("convert", src, "--image-root", root, "--out", sharded, "--shard", "1/3")
    assert code == 0 and "skipped" in stdout


def test_load_dataset_decodes_pil_images(tmp_path, llava_images, cli):
    """The data layer's promise: `datasets` reads converted output with images decoded as PIL images."""
    datasets = pytest.importorskip("datasets")
    root, files = llava_images
    assert (
        cli(
            "convert",
            many_llava(tmp_path, 5),
            "--image-root",
            root,
            "--out",
            tmp_path / "out",
            "--rows-per-file",
            "2",
            "--quiet",
        )[0]
        == 0
    )
    data_files = sorted(str(p) for p in (tmp_path / "out").glob("part-*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=data_files, split="train", cache_dir=str(tmp_path / "hf-cache"))
    assert ds.num_rows == 5 and ds[0]["id"] == "r0"
    first = ds[0]["images"][0]
    assert isinstance(first, Image.Image) and first.size == Image.open(io.BytesIO(files["coco/a.png"])).size
    assert ds[1]["images"][0].size == (30, 8)
    assert ds[0]["messages"][0] == {"role": "user", "content": "<image>\nQ0"}


def test_json_list_is_streamed_in_small_chunks(tmp_path, monkeypatch):
    records = [
        {"id": i, "s": ']}[{,"' * (i % 4), "n": 12345 + i, "u": "中文 ✓", "x": [1.5, None, True]} for i in range(50)
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(records, indent=2, ensure_ascii=False))
    monkeypatch.setattr(formats, "CHUNK", 7)  # every record spans several reads
    assert [r for _, r, _ in formats._json_array(path)] == records
    path.write_text(json.dumps(records)[:-40])
    with pytest.raises(formats.OvkitError, match="index"):
        list(formats._json_array(path))


def test_every_option_is_on_the_page(cli):
    code, stdout, _ = cli("convert", "--help")
    assert code == 0
    page = (Path(__file__).parents[1] / "commands" / "convert.md").read_text()
    for flag in set(re.findall(r"--[a-z][a-z-]+", stdout)):
        assert flag in page, flag


def test_parquet_directory_shards_match_one_run(tmp_path, cli):
    """Several parquet files with small row groups: shard ranges cut across files and row groups."""
    src = tmp_path / "verl"
    src.mkdir()
    img = png()
    for f, n in (("a.parquet", 5), ("b.parquet", 4)):
        table = pa.table(
            {
                "data_source": [f"{f}-{i}" for i in range(n)],
                "images": pa.array([[{"bytes": img, "path": None}]] * n, pa.list_(HF_IMAGE)),
                "prompt": [[{"role": "user", "content": f"<image>q{i}"}] for i in range(n)],
                "reward_model": [{"ground_truth": str(i)} for i in range(n)],
            }
        )
        pq.write_table(table, src / f, row_group_size=2)
    whole = tmp_path / "whole"
    assert cli("convert", src, "--out", whole, "--quiet")[0] == 0
    expected = read_samples(whole).table
    assert expected.column("id").to_pylist() == [f"verl-{i}" for i in range(9)]
    assert expected.column("source").to_pylist()[4:6] == ["a.parquet-4", "b.parquet-0"]
    for i in range(4):
        assert cli("convert", src, "--out", tmp_path / "sh", "--shard", f"{i}/4", "--quiet")[0] == 0
    assert read_samples(tmp_path / "sh").table.equals(expected)


def test_options_from_config_file(tmp_path, llava_images, cli):
    root, _ = llava_images
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"from-format: llava\non-error: skip\nimage-root: {root}\nsource: from-yaml\n")
    code, stdout, err = cli("convert", bad_llava(tmp_path, root), "--out", tmp_path / "out", "--config", cfg, "--quiet")
    assert code == 0, err
    assert "(detected)" not in stdout and {r["source"] for r in rows_of(tmp_path / "out")} == {"from-yaml"}
    assert "from-format: llava" in (tmp_path / "out" / "config.yaml").read_text()


def _trl_grpo(path: Path, gold: str, typed: bool) -> Path:
    """TRL's GRPO dataset layout: image, prompt (a chat with an image part, or TRL's standard text), the gold answer
    under `gold` (TRL's `solution`, or `answer` after a rename)."""
    pic = {"bytes": png(size=(56, 56)), "path": None}
    text = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]
    rows = [{"image": pic, "prompt": text if typed else "How many squares?", gold: str(i + 1)} for i in range(3)]
    path.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), path / "train.parquet")
    return path


@pytest.mark.parametrize(("gold", "typed"), [("solution", True), ("solution", False), ("answer", True)])
def test_trl_grpo_rows_convert_and_read_with_their_answer_scored_as_trl_does(tmp_path, cli, gold, typed):
    """TRL's GRPO rows (prompt, image, solution; or solution renamed answer) are RL rows: `ovkit convert` (detected,
    or --from trl) fills answer and answer_type math (TRL's accuracy_reward is a math_verify check), and an RL / eval
    reader takes the input as it is."""
    data = _trl_grpo(tmp_path / "grpo", gold, typed)
    code, _, err = cli("convert", data, "--out", tmp_path / "out", "--quiet")
    assert code == 0, err
    rows = rows_of(tmp_path / "out")
    assert [r["answer"] for r in rows] == ["1", "2", "3"] and {r["answer_type"] for r in rows} == {"math"}
    assert all(r["messages"][0]["content"].startswith("<image>") and len(r["images"]) == 1 for r in rows)
    code, _, err = cli("convert", data, "--from", "trl", "--out", tmp_path / "out2", "--quiet")
    assert code == 0 and [r["answer"] for r in rows_of(tmp_path / "out2")] == ["1", "2", "3"], err
    from ovkit.data.io import sample_files

    table = read_samples(sample_files(data)[0], answers=True).table
    assert table.column("answer_type").to_pylist() == ["math"] * 3


def test_rl_rows_without_any_scorer_are_named_once_with_the_fix(tmp_path, cli):
    """A table whose rows name no scorer at all is one error naming the column and what to add, not a first bad row
    with a convert --on-error skip that would reject every row."""
    data = _trl_grpo(tmp_path / "grpo", "solution", True)
    assert cli("convert", data, "--out", tmp_path / "out", "--quiet")[0] == 0
    table = pq.read_table(next((tmp_path / "out").glob("*.parquet"))).drop(["answer_type"])
    (tmp_path / "plain").mkdir()
    pq.write_table(table, tmp_path / "plain" / "part-00000-of-00001.parquet")
    with pytest.raises(
        formats.OvkitError, match=r"column .answer_type.: .*no row of this file does: add that column"
    ) as e:
        read_samples(tmp_path / "plain", answers=True)
    assert "--on-error skip" not in str(e.value) and "--from trl" in str(e.value)
