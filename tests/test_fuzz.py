"""Bad input never reaches an `internal error`: malformed sample tables, answers, parquet files, configs, rollout
tables, model directories and image paths, generated from a good input by seeded mutations, are fed to every command
that reads that kind of input. Each must exit 2 with one message naming the file (and the row and column where a row
is at fault), leave the --out path absent, and not load a model for a table it could have refused first.

One tiny model, one tiny CLIP and one good table are built per module; every run is in-process (tests/conftest.py's
`cli`). A control run of each command on the unmutated inputs shows the mutation, not the fixture, is what fails."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import bomb_png, micro_spec, truncated_jpeg
from PIL import Image, ImageDraw

from ovkit.data import REJECTS, image_cell, samples_table, write_samples

pytestmark = pytest.mark.usefixtures("one_thread")


N_ROWS = 6


def _picture(i: int) -> Image.Image:
    img = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(img).rectangle([4, 4, 16 + 8 * (i % 3), 20], fill=(200, 30, 30))
    return img


def good_rows() -> list[dict]:
    """RL-ready rows that also train (an assistant turn) and caption (one image each)."""
    return [
        {
            "id": f"r{i}",
            "images": [image_cell(_picture(i))],
            "messages": [
                {"role": "user", "content": "<image>How many squares?"},
                {"role": "assistant", "content": f"There are {1 + i % 3} red squares."},
            ],
            "source": "fuzz/count",
            "category": "counting",
            "answer": str(1 + i % 3),
            "answer_type": "number",
        }
        for i in range(N_ROWS)
    ]


@pytest.fixture(scope="module")
def fuzz_assets(tmp_path_factory):
    from ovkit.models.tiny import build_tiny
    from ovkit.models.tiny_clip import TinyClipSpec, build_tiny_clip

    root = tmp_path_factory.mktemp("fuzz")
    rows = good_rows()
    write_samples(samples_table(rows), root / "good")
    spec = micro_spec()
    build_tiny(
        root / "model", [m["content"] for r in rows for m in r["messages"]] * 4 + ["<answer>3</answer>"] * 8, spec=spec
    )
    clip = TinyClipSpec(
        steps=1,
        batch_size=8,
        vision_layers=1,
        text_layers=1,
        vision_hidden=32,
        text_hidden=32,
        heads=2,
        projection_dim=16,
        vocab_size=300,
    )
    corpus = [{**r, "id": f"{r['id']}-{k}"} for k in range(2) for r in rows]  # tiny-clip trains on 8 rows at least
    write_samples(samples_table(corpus), root / "clip-corpus")
    build_tiny_clip(root / "clip", [root / "clip-corpus"], spec=clip, quiet=True)
    (root / "concepts.txt").write_text("red\nsquare\n")
    return root


# ------------------------------------------------------------------------------------------------ the commands

TABLE_COMMANDS = [
    "pack",
    "balance-text",
    "balance-embed",
    "caption",
    "convert",
    "sft",
    "eval",
    "rl-curate",
    "rl-train",
    "mismatch-generate",
]
ANSWER_COMMANDS = ["eval", "rl-curate", "rl-train", "mismatch-generate"]  # read RL / eval rows: answers are checked
MODEL_COMMANDS = ["sft", "eval", "caption", "rl-curate", "rl-train", "mismatch-generate", "mismatch-rollouts"]


def command(name: str, a: Path, data: Path, out: Path, *, model=None, encoder=None, rollouts=None) -> list:
    """argv of `name` reading `data` (or `rollouts`) with the module's tiny model and CLIP (or `model`, `encoder`),
    writing `out`."""
    model, encoder = model or a / "model", encoder or a / "clip"
    tiny = ["--max-new-tokens", "3", "--quiet"]
    return {
        "pack": ["pack", data, "--model", model, "--max-len", "512", "--out", out, "--quiet"],
        "balance-text": [
            "balance",
            data,
            "--concepts",
            a / "concepts.txt",
            "--method",
            "text",
            "--out",
            out,
            "--quiet",
        ],
        "balance-embed": [
            "balance",
            data,
            "--concepts",
            a / "concepts.txt",
            "--encoder",
            encoder,
            "--out",
            out,
            "--quiet",
        ],
        "caption": ["caption", data, "--model", model, "--lang", "en", "--min-chars", "1", "--out", out, *tiny],
        "convert": ["convert", data, "--from", "ovkit", "--out", out, "--quiet"],
        "sft": ["sft", data, "--model", model, "--max-steps", "1", "--batch-size", "2", "--out", out, "--quiet"],
        "eval": ["eval", data, "--model", model, "--out", out, *tiny],
        "rl-curate": ["rl-curate", data, "--model", model, "--n", "2", "--reward-workers", "1", "--out", out, *tiny],
        "rl-train": [
            "rl-train",
            data,
            "--model",
            model,
            "--max-steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--reward-workers",
            "1",
            "--no-system-prompt",
            "--out",
            out,
            *tiny,
        ],
        "mismatch-generate": [
            "mismatch-report",
            "--generate",
            data,
            "--model",
            model,
            "--n",
            "1",
            "--sampler",
            "fp32",
            "--out",
            out,
            *tiny,
        ],
        "mismatch-rollouts": ["mismatch-report", rollouts or data, "--model", model, "--out", out, "--quiet"],
    }[name]


def refused(cli, argv: list, out: Path, *names: str) -> str:
    """Run argv: exit 2, the last stderr line one `error:` message containing every one of `names`, no internal
    error or traceback, and nothing at `out` (nor a temporary directory beside it)."""
    code, stdout, err = cli(*argv)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"exit {code}: {err[-2000:]}"
    assert "internal error" not in err and "Traceback" not in err, err[-2000:]
    assert lines and lines[-1].startswith("error: "), err[-2000:]
    for name in names:
        assert name in lines[-1], f"{name!r} not in: {lines[-1]}"
    assert not out.exists(), f"{out} was written"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f"{out.name}.tmp-")]
    return lines[-1]


# ------------------------------------------------------------------------------------------------ malformed tables


def _set(field, value):
    def mutate(rows, i):
        rows[i][field] = value

    return mutate


def _message(key, value):
    def mutate(rows, i):
        rows[i]["messages"][0][key] = value

    return mutate


# Row mutations: (mutate(rows, i), column at fault). The row is drawn by a seeded RNG per case.
ROW_CASES = {
    "truncated_jpeg": (_set("images", [{"bytes": truncated_jpeg(), "path": None}]), "images"),
    "garbage_image": (_set("images", [{"bytes": b"\xff\xd8\xff\xe0 not a jpeg", "path": None}]), "images"),
    "decompression_bomb": (_set("images", [{"bytes": bomb_png(), "path": None}]), "images"),
    "path_only_image": (_set("images", [{"bytes": None, "path": "/dev/zero"}]), "images"),
    "null_images": (_set("images", None), "images"),
    "marker_count": (_message("content", "no marker here"), "messages"),
    "extra_marker": (_message("content", "<image><image>two markers"), "messages"),
    "bad_role": (_message("role", "robot"), "messages"),
    "null_content": (_message("content", None), "messages"),
    "empty_id": (_set("id", ""), "id"),
    "duplicate_id": (lambda rows, i: rows[i].update(id=rows[i - 1 if i else 1]["id"]), "id"),
    "null_source": (_set("source", None), "source"),
}
# `convert` maps foreign data into the contract: a missing id becomes `<input>-<n>`, a repeated one `<id>-<n>` (with a
# warning), a missing source the input's name, images without any marker get one each (commands/convert.md). Every
# other case is refused by it too.
CONVERT_REPAIRS = {"empty_id", "duplicate_id", "null_source", "marker_count"}
CONVERT_COLUMN = {
    "null_images": "messages"
}  # convert reads a null images list as no images: the markers are then wrong
ANSWER_CASES = {
    "null_answer": (_set("answer", None), "answer"),
    "empty_answer": (_set("answer", "  "), "answer"),
    "unknown_answer_type": (_set("answer_type", "telepathy"), "answer_type"),
    "null_answer_type": (_set("answer_type", None), "answer_type"),
    "unparseable_number": (_set("answer", "many"), "answer"),
    "bad_bbox_answer": (lambda rows, i: rows[i].update(answer="[1, 2", answer_type="bbox"), "answer"),
    "reward_kwargs_not_json": (_set("reward_kwargs", "{rel_tol: 5"), "reward_kwargs"),
    "reward_kwargs_unknown_key": (_set("reward_kwargs", '{"tolerance": 1}'), "reward_kwargs"),
}


def mutated_table(directory: Path, case: str, cases: dict) -> tuple[Path, str, str]:
    """Write good rows with one row broken by `case` (the row drawn with a seed made from the case's name), as two
    part files (so a duplicate may sit in the other file). Returns (dataset, the bad row's id, its column)."""
    rows = good_rows()
    i = random.Random(zlib.crc32(case.encode())).randrange(1, N_ROWS)
    mutate, column = cases[case]
    mutate(rows, i)
    write_samples(samples_table(rows[:3]), directory, shard=(0, 2))
    write_samples(samples_table(rows[3:]), directory, shard=(1, 2))
    return directory, rows[i]["id"], column


def _typed(column: str, typ: pa.DataType, value):
    def build():
        t = samples_table(good_rows())
        t = t if column in t.column_names else t.append_column(column, pa.nulls(t.num_rows, pa.string()))
        return t.set_column(t.column_names.index(column), column, pa.array([value] * t.num_rows, typ))

    return build


def _messages_typed(role_type: pa.DataType, content_type: pa.DataType, role, content):
    typ = pa.list_(pa.struct([("role", role_type), ("content", content_type)]))
    return _typed("messages", typ, [{"role": role, "content": content}])


# Whole-column problems: (build() -> table, column, what `convert` does). The message names the file and the column.
# convert maps foreign data: ids and sources become text, a column that is not text is dropped and named in its
# metrics; what it cannot map (images, messages) it refuses like every stage. A table without `id` or `source` is
# TRL's layout, which every stage reads (ids and sources are made up), so those are not cases here.
COLUMN_CASES = {
    "id_int": (_typed("id", pa.int64(), 7), "id", "mapped"),
    "images_string": (_typed("images", pa.string(), "x.png"), "images", "refused"),
    "images_bytes_string": (
        _typed(
            "images",
            pa.list_(pa.struct([("bytes", pa.string()), ("path", pa.string())])),
            [{"bytes": "x", "path": None}],
        ),
        "images",
        "refused",
    ),
    "messages_string": (_typed("messages", pa.string(), "hello"), "messages", "refused"),
    "content_int": (_messages_typed(pa.string(), pa.int64(), "user", 7), "messages", "refused"),
    "role_int": (_messages_typed(pa.int64(), pa.string(), 1, "<image>hi"), "messages", "refused"),
    "source_int": (_typed("source", pa.int64(), 3), "source", "mapped"),
    "category_list": (_typed("category", pa.list_(pa.string()), ["a"]), "category", "mapped"),
    "answer_int": (_typed("answer", pa.int64(), 3), "answer", "mapped"),
    "answer_type_float": (_typed("answer_type", pa.float64(), 1.5), "answer_type", "mapped"),
    "reward_kwargs_struct": (
        _typed("reward_kwargs", pa.struct([("rel_tol", pa.float64())]), {"rel_tol": 0.1}),
        "reward_kwargs",
        "mapped",
    ),
    # no images column: the rows' <image> markers have no images (messages); no messages: not a sample table
    "missing_images": ((lambda: samples_table(good_rows()).drop_columns(["images"])), "messages", "refused"),
    "missing_messages": ((lambda: samples_table(good_rows()).drop_columns(["messages"])), "messages", "refused"),
}


def file_case(directory: Path, case: str, a: Path) -> Path:
    """A dataset whose second part file is zero bytes or cut short (its footer gone)."""
    good = (a / "good" / "part-00000-of-00001.parquet").read_bytes()
    directory.mkdir(parents=True)
    (directory / "part-00000-of-00002.parquet").write_bytes(good)
    (directory / "part-00001-of-00002.parquet").write_bytes(b"" if case == "zero_bytes" else good[: len(good) * 2 // 3])
    return directory


@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_bad_rows_exit_2_naming_file_row_and_column(cli, fuzz_assets, tmp_path, case):
    data, rid, column = mutated_table(tmp_path / "data", case, ROW_CASES)
    for name in TABLE_COMMANDS:
        out = tmp_path / f"out-{name}"
        if name == "convert" and case in CONVERT_REPAIRS:  # documented mappings of foreign data, not errors
            code, _, err = cli(*command(name, fuzz_assets, data, out))
            ids = pq.read_table(sorted(out.glob("part-*.parquet"))).column("id").to_pylist()
            assert code == 0 and len(set(ids)) == N_ROWS and all(ids), err
            assert case != "duplicate_id" or "repeat an earlier id and were renamed" in err, err
            continue
        named = CONVERT_COLUMN.get(case, column) if name == "convert" else column
        msg = refused(
            cli, command(name, fuzz_assets, data, out), out, "part-0000", f"column '{named}"
        )  # convert: 'images[0]'
        if name != "convert":  # convert names the input record by its index and id (before any renaming)
            assert f"row '{rid}'" in msg, msg


@pytest.mark.parametrize("case", sorted(ANSWER_CASES))
def test_unscorable_answers_exit_2_before_a_model_loads(cli, fuzz_assets, tmp_path, case, monkeypatch):
    import ovkit.models

    data, rid, column = mutated_table(tmp_path / "data", case, ANSWER_CASES)
    monkeypatch.setattr(
        ovkit.models, "load", lambda *a, **kw: pytest.fail("a model loaded before the table was checked")
    )
    for name in ANSWER_COMMANDS:
        out = tmp_path / f"out-{name}"
        refused(cli, command(name, fuzz_assets, data, out), out, "part-0000", f"row '{rid}'", f"column '{column}'")


@pytest.mark.parametrize("case", sorted(COLUMN_CASES))
def test_mistyped_or_missing_columns_exit_2_naming_file_and_column(cli, fuzz_assets, tmp_path, case):
    build, column, convert = COLUMN_CASES[case]
    f = tmp_path / "data" / "bad.parquet"
    f.parent.mkdir()
    pq.write_table(build(), f)
    for name in TABLE_COMMANDS:
        out = tmp_path / f"out-{name}"
        if name == "convert" and convert == "mapped":
            code, _, err = cli(*command(name, fuzz_assets, f, out))
            assert code == 0, err
            continue
        refused(
            cli,
            command(name, fuzz_assets, f, out),
            out,
            "bad.parquet",
            "column '" + ("prompt" if name == "convert" and case == "missing_messages" else column),
        )


@pytest.mark.parametrize("case", ["zero_bytes", "truncated"])
def test_broken_parquet_files_exit_2_naming_the_file(cli, fuzz_assets, tmp_path, case):
    data = file_case(tmp_path / "data", case, fuzz_assets)
    for name in TABLE_COMMANDS:
        out = tmp_path / f"out-{name}"
        refused(cli, command(name, fuzz_assets, data, out), out, "part-00001-of-00002.parquet")


def test_every_table_command_accepts_the_unbroken_inputs(cli, fuzz_assets, tmp_path):
    """The control: the same commands on the good table (and a good rollout table) succeed."""
    for name in TABLE_COMMANDS:
        code, _, err = cli(*command(name, fuzz_assets, fuzz_assets / "good", tmp_path / name))
        assert code == 0, f"{name}: {err[-2000:]}"
    rollouts = rollout_table(tmp_path / "rollouts.parquet", fuzz_assets)
    code, _, err = cli(
        *command("mismatch-rollouts", fuzz_assets, fuzz_assets / "good", tmp_path / "mm", rollouts=rollouts)
    )
    assert code == 0, err[-2000:]


@pytest.mark.parametrize("name", ["pack", "balance-text", "caption", "convert"])
def test_skip_moves_every_bad_row_to_rejects(cli, fuzz_assets, tmp_path, name):
    """--on-error skip: every broken row of every kind is a reject with its column named; rows in == out + rejects."""
    rows = good_rows()
    cases = [c for c in ROW_CASES if c != "duplicate_id" and not (name == "convert" and c in CONVERT_REPAIRS)]
    bad = []
    for k, case in enumerate(cases):
        row = {**good_rows()[k % N_ROWS], "id": f"bad-{case}"}
        row["messages"] = [dict(m) for m in row["messages"]]
        ROW_CASES[case][0]([row], 0)
        bad.append(row)
    rows += bad
    write_samples(samples_table(rows), tmp_path / "data")
    out = tmp_path / "out"
    extra = ["--keep-original-on-reject"] if name == "caption" else []  # only input rows are rejects here
    code, stdout, err = cli(*command(name, fuzz_assets, tmp_path / "data", out), "--on-error", "skip", *extra)
    assert code == 0, err[-2000:]
    rejects = pq.read_table(out / REJECTS).to_pylist()
    assert len(rejects) == len(bad)
    for case, r in zip(cases, sorted(rejects, key=lambda r: cases.index(r["id"].removeprefix("bad-") or "empty_id"))):
        column = CONVERT_COLUMN.get(case, ROW_CASES[case][1]) if name == "convert" else ROW_CASES[case][1]
        said = r["field"] if name == "convert" else r["reason"]  # convert's rejects name the record's field
        assert column in said, (case, r)
    if name != "pack":  # pack writes a plan, not rows: its stats say the same
        kept = pq.read_table(sorted(out.rglob("part-*.parquet"))).num_rows
        assert kept + len(rejects) == len(rows)
    else:
        stats = json.loads((out / "stats.json").read_text())
        assert stats["rows_in"] == len(rows) and stats["samples"] + sum(stats["rejects"].values()) == len(rows)


@pytest.mark.parametrize("seed", range(12))
def test_random_tables_split_into_rows_and_rejects(tmp_path, seed):
    """Seeded random tables (any number of rows broken, each by a random case, across 1-3 part files): --on-error
    skip keeps exactly the unbroken rows in order and rejects each broken one for its own column; fail names the
    first broken row. A repeat of a rejected row's id is no duplicate: only kept ids count."""
    from ovkit.data import read_samples
    from ovkit.errors import OvkitError

    rng = random.Random(seed)
    rows = [{**r, "id": f"{r['id']}-{k}"} for k in range(rng.randint(1, 3)) for r in good_rows()]
    cases = {i: rng.choice(sorted(ROW_CASES)) for i in rng.sample(range(len(rows)), rng.randint(0, len(rows)))}
    expected = {}
    for i, case in sorted(cases.items()):
        if case == "duplicate_id":  # of an earlier row that stays good (a rejected row's id is free)
            earlier = [j for j in range(i) if j not in cases]
            if not earlier:
                continue
            rows[i]["id"] = rows[rng.choice(earlier)]["id"]
        else:
            ROW_CASES[case][0](rows, i)
        expected[i] = ROW_CASES[case][1]
    cuts = sorted(rng.sample(range(1, len(rows)), rng.randint(0, 2)))
    for k, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, len(rows)])):
        write_samples(samples_table(rows[lo:hi]), tmp_path / "ds", shard=(k, len(cuts) + 1))
    s = read_samples(tmp_path / "ds", on_error="skip")
    assert s.table.column("id").to_pylist() == [r["id"] for i, r in enumerate(rows) if i not in expected]
    assert s.table.num_rows + s.n_rejects == len(rows)
    reasons = s.rejects.column("reason").to_pylist() if s.rejects is not None else []
    assert [r.split("column '")[1].split("'")[0] for r in reasons] == [expected[i] for i in sorted(expected)]
    if expected:
        first = min(expected)
        with pytest.raises(OvkitError, match=rf"row '{rows[first]['id']}' \(index \d+\), column '{expected[first]}'"):
            read_samples(tmp_path / "ds")


# ------------------------------------------------------------------------------------------------ other inputs


ALL_COMMANDS = [
    "synth",
    "convert",
    "init-model",
    "balance",
    "caption",
    "pack",
    "align",
    "midtrain",
    "sft",
    "eval",
    "rl-curate",
    "rl-train",
    "mismatch-report",
]


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00\x81binary\x00\x9c", b"max-len: [unclosed\n\x00\x01"], ids=["not-utf8", "control-bytes"]
)
def test_binary_yaml_config_exits_2_naming_the_file(cli, tmp_path, content):
    config = tmp_path / "bad.yaml"
    config.write_bytes(content)
    for name in ALL_COMMANDS:
        out = tmp_path / f"out-{name}"
        refused(cli, [name, "--config", config, "--out", out], out, str(config))


def test_binary_concepts_file_exits_2_naming_the_file(cli, fuzz_assets, tmp_path):
    concepts = tmp_path / "concepts.bin"
    concepts.write_bytes(bytes(range(256)))
    out = tmp_path / "out"
    refused(
        cli,
        ["balance", fuzz_assets / "good", "--concepts", concepts, "--method", "text", "--out", out],
        out,
        "concepts.bin",
    )


def rollout_table(path: Path, a: Path, mutate=None) -> Path:
    """A rollout table the tiny model re-scores (prompts encoded by its processor with their image, as eval and RL
    write them), one row optionally broken."""
    from transformers import AutoProcessor

    from ovkit.models.encode import encode_prompt
    from ovkit.rollouts.table import rollouts_table

    processor = AutoProcessor.from_pretrained(a / "model")
    rows = []
    for i in range(4):
        prompt = encode_prompt(
            processor, [{"role": "user", "content": "<image>How many squares?"}], [_picture(i)]
        ).input_ids
        response = processor.tokenizer(f"<answer>{i}</answer>")["input_ids"]
        rows.append(
            {
                "prompt_id": f"r{i}",
                "group": i // 2,
                "prompt_ids": prompt,
                "response_ids": response,
                "behave_logprobs": [-0.7] * len(response),
                "reward": 0.0,
                "reward_parts": {},
                "finish_reason": "stop",
                "category": "counting",
                "source": "fuzz",
                "answer": "1",
                "answer_type": "number",
                "images": [image_cell(_picture(i))],
            }
        )
    table = rollouts_table(rows)
    if mutate is not None:
        table = mutate(table)
    pq.write_table(table, path)
    return path


def _rollout_column(name, fn):
    """Replace column `name` by fn(values) (a list per row), keeping its type unless fn returns an arrow array."""

    def mutate(t):
        values = fn(t.column(name).to_pylist())
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, t.schema.field(name).type)
        return t.set_column(t.column_names.index(name), name, arr)

    return mutate


def _first(fn):
    return lambda values: [fn(values[0]), *values[1:]]


ROLLOUT_CASES = {
    "token_id_out_of_vocab": (_rollout_column("response_ids", _first(lambda ids: [10**6, *ids[1:]])), "response_ids"),
    "negative_token_id": (_rollout_column("prompt_ids", _first(lambda ids: [-3, *ids[1:]])), "prompt_ids"),
    "nan_logprobs": (
        _rollout_column("behave_logprobs", _first(lambda lp: [float("nan")] * len(lp))),
        "behave_logprobs",
    ),
    "inf_logprob": (
        _rollout_column("behave_logprobs", _first(lambda lp: [*lp[:-1], float("-inf")])),
        "behave_logprobs",
    ),
    "short_loss_mask": (_rollout_column("loss_mask", _first(lambda m: m[:-1])), "loss_mask"),
    "long_logprobs": (_rollout_column("behave_logprobs", _first(lambda lp: [*lp, -1.0])), "behave_logprobs"),
    "empty_prompt": (_rollout_column("prompt_ids", _first(lambda ids: [])), "prompt_ids"),
    "bad_finish_reason": (_rollout_column("finish_reason", _first(lambda r: "exploded")), "finish_reason"),
    "truncated_image": (
        _rollout_column("images", _first(lambda cells: [{"bytes": truncated_jpeg(), "path": None}])),
        "images",
    ),
    "ids_as_strings": (
        _rollout_column(
            "response_ids", lambda v: pa.array([[str(x) for x in ids] for ids in v], pa.list_(pa.string()))
        ),
        "response_ids",
    ),
    "images_as_string": (_rollout_column("images", lambda v: pa.array(["x.png"] * len(v))), "images"),
    "missing_column": (lambda t: t.drop_columns(["behave_logprobs"]), "behave_logprobs"),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT_CASES))
def test_bad_rollout_tables_exit_2_before_the_model_loads(cli, fuzz_assets, tmp_path, case, monkeypatch):
    import ovkit.models

    mutate, column = ROLLOUT_CASES[case]
    path = rollout_table(tmp_path / "rollouts.parquet", fuzz_assets, mutate)
    monkeypatch.setattr(
        ovkit.models, "load", lambda *a, **kw: pytest.fail("a model loaded before the rollouts were checked")
    )
    out = tmp_path / "out"
    refused(
        cli,
        command("mismatch-rollouts", fuzz_assets, fuzz_assets / "good", out, rollouts=path),
        out,
        "rollouts.parquet",
        f"column '{column}'",
    )


def _model_dir(tmp_path: Path, source: Path, case: str) -> Path:
    d = tmp_path / f"model-{case}"
    shutil.copytree(source, d)
    weights = d / "model.safetensors"
    if case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size * 3 // 4])
    elif case == "weights_header_cut":
        weights.write_bytes(weights.read_bytes()[:100])
    elif case == "no_weights":
        weights.unlink()
    elif case == "no_config":
        (d / "config.json").unlink()
    elif case == "config_not_json":
        (d / "config.json").write_bytes(b"\x00\xff{not json")
    elif case == "no_tokenizer":
        for f in d.glob("tokenizer*"):
            f.unlink()
    return d


MODEL_CASES = ["truncated_weights", "weights_header_cut", "no_weights", "no_config", "config_not_json", "no_tokenizer"]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_damaged_model_directories_exit_2_naming_the_directory(cli, fuzz_assets, tmp_path, case):
    model = _model_dir(tmp_path, fuzz_assets / "model", case)
    rollouts = rollout_table(tmp_path / "rollouts.parquet", fuzz_assets)
    # pack reads the processor alone: damaged weights do not concern it, a missing tokenizer or bad config does
    names = MODEL_COMMANDS + (["pack"] if case in ("config_not_json", "no_tokenizer") else [])
    for name in names:
        out = tmp_path / f"out-{name}"
        refused(
            cli,
            command(name, fuzz_assets, fuzz_assets / "good", out, model=model, rollouts=rollouts),
            out,
            f"--model {model}",
        )


@pytest.mark.parametrize("case", ["truncated_weights", "no_config", "no_weights"])
def test_damaged_encoder_exits_2_naming_the_directory(cli, fuzz_assets, tmp_path, case):
    encoder = _model_dir(tmp_path, fuzz_assets / "clip", case)
    out = tmp_path / "out"
    refused(
        cli,
        command("balance-embed", fuzz_assets, fuzz_assets / "good", out, encoder=encoder),
        out,
        f"--encoder {encoder}",
    )


@pytest.mark.parametrize(
    "name", ["./missing-model", "runs/a/missing-model", "~/missing-model", "missing-org/missing-model"]
)
def test_missing_model_paths_are_never_sent_to_the_hub(cli, fuzz_assets, tmp_path, name, monkeypatch):
    """A local-looking name that does not exist is an error at once; an ORG/NAME id is looked up in the HF cache
    only (HF_HUB_OFFLINE=1 here): nothing reaches the network or transformers' retries."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_session", lambda: pytest.fail("the Hub was contacted"))
    monkeypatch.chdir(tmp_path)
    for cmd in ["pack", "sft", "eval"]:
        out = tmp_path / f"out-{cmd}"
        msg = refused(
            cli,
            command(
                cmd, fuzz_assets, fuzz_assets / "good", out, model=Path(name) if not name.startswith("./") else name
            ),
            out,
            "--model",
        )
        assert "no such directory" in msg, msg


def test_a_hub_id_without_a_reachable_hub_fails_after_one_probe(cli, fuzz_assets, tmp_path, monkeypatch):
    import huggingface_hub

    class Down:
        def head(self, *a, **kw):
            raise ConnectionError("Name or service not known")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_session", lambda: Down())
    out = tmp_path / "out"
    refused(
        cli,
        command("sft", fuzz_assets, fuzz_assets / "good", out, model="missing-org/missing-model"),
        out,
        "cannot be reached",
    )


# ------------------------------------------------------------------------------------------------ image paths in
# convert


class _Hang(Exception):
    pass


@pytest.mark.parametrize("target", ["dev_zero", "fifo", "directory"])
def test_convert_never_reads_special_files_as_images(cli, tmp_path, target):
    """An image path naming /dev/zero would be read until memory runs out, a FIFO would block forever: both are
    refused after one stat of what was opened (exit 2, or a reject with --on-error skip), within seconds."""
    root = tmp_path / "images"
    root.mkdir()
    _picture(0).save(root / "ok.png")
    if target == "dev_zero":
        special = "/dev/zero"
    elif target == "fifo":
        os.mkfifo(root / "pipe.png")
        special = "pipe.png"
    else:
        (root / "dir.png").mkdir()
        special = "dir.png"
    records = [
        {
            "id": "ok",
            "image": "ok.png",
            "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A square."}],
        },
        {
            "id": "special",
            "image": special,
            "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A square."}],
        },
    ]
    src = tmp_path / "llava.json"
    src.write_text(json.dumps(records))

    def hang(*_):
        raise _Hang

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(30)
    try:
        out = tmp_path / "out"
        refused(
            cli,
            ["convert", src, "--from", "llava", "--image-root", root, "--out", out, "--quiet"],
            out,
            "llava.json",
            "'special'",
            "not a regular file",
        )
        code, _, err = cli(
            "convert", src, "--from", "llava", "--image-root", root, "--out", out, "--quiet", "--on-error", "skip"
        )
    except _Hang:
        pytest.fail(f"convert hung on {special}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert code == 0, err
    rejects = pq.read_table(out / REJECTS).to_pylist()
    assert [r["id"] for r in rejects] == ["special"] and "not a regular file" in rejects[0]["reason"]
