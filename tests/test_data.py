"""The sample table: round trip, shards, --shard splits, --on-error skip accounting, and bad input messages."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import bomb_png, truncated_jpeg
from PIL import Image

from ovkit.data import (
    REJECTS,
    image_cell,
    parse_shard,
    read_samples,
    read_table,
    samples_table,
    shard_bounds,
    write_rejects,
    write_samples,
)
from ovkit.errors import OvkitError


def png(color="red", size=(28, 28)):
    return image_cell(Image.new("RGB", size, color))


def row(i, n_images=1, **extra):
    markers = "<image>" * n_images
    return {
        "id": f"r{i}",
        "images": [png() for _ in range(n_images)],
        "messages": [{"role": "user", "content": f"{markers}what colour?"}, {"role": "assistant", "content": "red"}],
        "source": "test",
        "category": "general",
        **extra,
    }


def test_round_trip_keeps_unknown_columns(tmp_path):
    rows = [row(i, n_images=i % 3, extra=f"x{i}") for i in range(7)]
    write_samples(samples_table(rows), tmp_path / "ds")
    s = read_samples(tmp_path / "ds")
    assert s.table.num_rows == 7 and s.rejects is None
    assert s.table.column("extra").to_pylist() == [f"x{i}" for i in range(7)]
    got = s.table.to_pylist()
    assert [len(r["images"]) for r in got] == [i % 3 for i in range(7)]
    assert got[1]["images"][0]["bytes"] == rows[1]["images"][0]["bytes"]
    assert got[0]["messages"] == rows[0]["messages"]


def test_directory_of_shards_reads_as_one_dataset_in_order(tmp_path):
    rows = [row(i) for i in range(10)]
    for k in range(3):
        lo, hi = shard_bounds(10, (k, 3))
        write_samples(samples_table(rows[lo:hi]), tmp_path / "ds", shard=(k, 3))
    write_rejects(samples_table([row(99)]).append_column("reason", pa.array(["x"])), tmp_path / "ds")
    assert read_table(tmp_path / "ds").column("id").to_pylist() == [f"r{i}" for i in range(10)]


@pytest.mark.parametrize("n_rows,n", [(10, 3), (7, 7), (5, 8), (1000, 16)])
def test_shards_cover_every_row_exactly_once(n_rows, n):
    covered = []
    for i in range(n):
        lo, hi = shard_bounds(n_rows, (i, n))
        covered.extend(range(lo, hi))
    assert covered == list(range(n_rows))


def test_read_samples_shard_matches_slices(tmp_path):
    write_samples(samples_table([row(i) for i in range(10)]), tmp_path / "ds")
    parts = [read_samples(tmp_path / "ds", shard=(i, 4)).table.column("id").to_pylist() for i in range(4)]
    assert sum(parts, []) == [f"r{i}" for i in range(10)]


@pytest.mark.parametrize("text", ["3", "a/b", "8/8", "-1/4", "1/0"])
def test_bad_shard_spec(text):
    with pytest.raises(OvkitError, match="--shard"):
        parse_shard(text)


def bad_rows():
    good = [row(i) for i in range(6)]
    good[1]["images"] = [{"bytes": b"not an image", "path": None}]  # corrupt bytes
    good[3]["messages"] = [{"role": "user", "content": "no marker"}, {"role": "assistant", "content": "x"}]
    good[4]["id"] = "r0"  # duplicate
    return good


def test_skip_moves_bad_rows_to_rejects_with_reasons(tmp_path):
    write_samples(samples_table(bad_rows()), tmp_path / "ds")
    s = read_samples(tmp_path / "ds", on_error="skip")
    assert s.table.num_rows + s.n_rejects == 6
    assert s.table.column("id").to_pylist() == ["r0", "r2", "r5"]
    reasons = s.rejects.column("reason").to_pylist()
    assert "column 'images'" in reasons[0] and "unreadable image" in reasons[0]
    assert "column 'messages'" in reasons[1] and "0 <image> marker(s) but 1 image(s)" in reasons[1]
    assert "duplicate id 'r0'" in reasons[2]
    write_rejects(s.rejects, tmp_path / "out")
    assert pq.read_table(tmp_path / "out" / REJECTS).num_rows == 3


def test_fail_names_file_row_and_column(tmp_path):
    write_samples(samples_table(bad_rows()), tmp_path / "ds")
    with pytest.raises(OvkitError) as e:
        read_samples(tmp_path / "ds")
    msg = str(e.value)
    assert "part-00000-of-00001.parquet" in msg and "row 'r1' (index 1)" in msg and "column 'images'" in msg


def write_raw(path, table):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


@pytest.mark.parametrize(
    "case,expect",
    [
        ("empty_file", "not a readable parquet file"),
        ("zero_rows", "dataset is empty"),
        ("missing_column", "column 'messages': required column is missing"),
        ("wrong_type", "column 'images': type is string"),
        ("corrupt_image", "column 'images': image 0: unreadable image"),
        ("bomb", "column 'images': image 0: decompression bomb"),
        ("too_big", "column 'images': image 0: image is 9000x9000 = 81000000 pixels"),
    ],
)
def test_bad_inputs_give_one_clear_message(tmp_path, case, expect):
    f = tmp_path / "bad.parquet"
    if case == "empty_file":
        f.write_bytes(b"")
    elif case == "zero_rows":
        write_raw(f, samples_table([]))
    elif case == "missing_column":
        write_raw(f, samples_table([row(0)]).drop_columns(["messages"]))
    elif case == "wrong_type":
        t = samples_table([row(0)])
        write_raw(f, t.set_column(1, "images", pa.array(["x.png"])))
    elif case == "corrupt_image":
        write_raw(f, samples_table([row(0) | {"images": [{"bytes": b"\x89PNG garbage", "path": None}]}]))
    elif case == "bomb":
        write_raw(f, samples_table([row(0) | {"images": [{"bytes": bomb_png(), "path": None}]}]))
    elif case == "too_big":
        write_raw(f, samples_table([row(0) | {"images": [{"bytes": bomb_png(9000, 9000), "path": None}]}]))
    with pytest.raises(OvkitError) as e:
        read_samples(f)
    assert expect in str(e.value) and "bad.parquet" in str(e.value)


def test_datasets_library_reads_images_as_pil(tmp_path):
    datasets = pytest.importorskip("datasets")
    write_samples(samples_table([row(0, n_images=2), row(1, n_images=0)]), tmp_path / "ds")
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "ds" / "*.parquet"), split="train")
    first = ds[0]["images"]
    assert len(first) == 2 and isinstance(first[0], Image.Image) and first[0].size == (28, 28)
    assert ds[1]["images"] == [] and ds[0]["messages"][1] == {"role": "assistant", "content": "red"}


def test_metadata_has_no_timestamps(tmp_path):
    a = write_samples(samples_table([row(0)]), tmp_path / "a")
    b = write_samples(samples_table([row(0)]), tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(pq.read_schema(a).metadata[b"huggingface"])["info"]["features"]["images"]["_type"] == "List"


@pytest.mark.parametrize("case", ["empty_file", "missing_column", "wrong_type", "corrupt_image", "bomb"])
def test_bad_inputs_exit_2_through_a_command_and_write_nothing(cli, tmp_path, case):
    """The same bad files through a real data stage: exit code 2, one line naming the file (and row, column), and
    no output directory left behind."""
    f = tmp_path / "bad.parquet"
    good = row(0)
    if case == "empty_file":
        f.write_bytes(b"")
    elif case == "missing_column":
        write_raw(f, samples_table([good]).drop_columns(["messages"]))
    elif case == "wrong_type":
        write_raw(f, samples_table([good]).set_column(1, "images", pa.array(["x.png"])))
    elif case == "corrupt_image":
        write_raw(f, samples_table([good | {"images": [{"bytes": b"\x89PNG garbage", "path": None}]}]))
    elif case == "bomb":
        write_raw(f, samples_table([good | {"images": [{"bytes": bomb_png(), "path": None}]}]))
    (tmp_path / "concepts.txt").write_text("red\n")
    code, out, err = cli(
        "balance", f, "--concepts", tmp_path / "concepts.txt", "--method", "text", "--out", tmp_path / "o"
    )
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: file ") and "bad.parquet" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "o").exists()
    assert not list(tmp_path.glob("o.tmp-*"))
    if case not in ("empty_file",):
        assert "column '" in lines[0]
    if case in ("corrupt_image", "bomb"):
        assert "row 'r0' (index 0)" in lines[0]


def test_a_truncated_jpeg_passes_the_header_check_and_fails_the_decode(tmp_path):
    rows = [row(0), row(1) | {"images": [{"bytes": truncated_jpeg(), "path": None}]}]
    write_samples(samples_table(rows), tmp_path / "ds")
    assert read_samples(tmp_path / "ds", images="header").table.num_rows == 2  # what pack and training read with
    with pytest.raises(
        OvkitError,
        match=r"row 'r1' \(index 1\), column 'images': image 0: unreadable image: OSError: image file is truncated",
    ):
        read_samples(tmp_path / "ds")


def test_nested_types_are_checked_per_file(tmp_path):
    t = samples_table([row(0)])
    content_int = pa.array(
        [[{"role": "user", "content": 7}]], pa.list_(pa.struct([("role", pa.string()), ("content", pa.int64())]))
    )
    write_raw(tmp_path / "ds" / "part-00000-of-00002.parquet", t)
    write_raw(tmp_path / "ds" / "part-00001-of-00002.parquet", t.set_column(2, "messages", content_int))
    with pytest.raises(
        OvkitError,
        match=r"part-00001-of-00002.parquet, row every row, column 'messages': type is list<.*content: int64",
    ):
        read_samples(tmp_path / "ds", shard=(0, 2))  # a bad file is named even when this --shard part does not read it
    large = t.set_column(
        0, "id", t.column("id").cast(pa.large_string())
    )  # large_ variants and all-null columns are fine
    write_raw(tmp_path / "ok" / "a.parquet", large.append_column("answer", pa.nulls(1)))
    assert read_samples(tmp_path / "ok").table.column("id").to_pylist() == ["r0"]


def test_an_id_repeated_in_another_shard_part_is_a_duplicate_there(tmp_path):
    rows = [row(i) for i in range(6)]
    rows[4]["id"] = "r1"
    for k in range(2):
        write_samples(samples_table(rows[3 * k : 3 * k + 3]), tmp_path / "ds", shard=(k, 2))
    whole = read_samples(tmp_path / "ds", on_error="skip")
    parts = [read_samples(tmp_path / "ds", shard=(k, 3), on_error="skip") for k in range(3)]
    assert (
        sum((p.table.column("id").to_pylist() for p in parts), [])
        == whole.table.column("id").to_pylist()
        == ["r0", "r1", "r2", "r3", "r5"]
    )
    (reason,) = parts[2].rejects.column("reason").to_pylist()
    assert (
        reason
        == "part-00001-of-00002.parquet row 1, column 'id': duplicate id 'r1' (first at part-00000-of-00002.parquet "
        "index 1; ids are unique in a dataset)"
    )


def test_answers_are_checked_for_rl_and_eval_tables(tmp_path):
    rows = [row(i, answer="3", answer_type="number") for i in range(6)]
    rows[1]["answer"] = None
    rows[2]["answer_type"] = "telepathy"
    rows[3]["answer"] = "many"
    rows[4] |= {"answer_type": "bbox", "answer": "[1, 2"}
    rows[5]["reward_kwargs"] = "{not json"
    write_samples(samples_table(rows), tmp_path / "ds")
    assert read_samples(tmp_path / "ds").table.num_rows == 6  # a training table may carry anything there
    s = read_samples(tmp_path / "ds", answers=True, on_error="skip")
    assert s.table.column("id").to_pylist() == ["r0"] and s.n_rejects == 5
    columns = [r.split("column '")[1].split("'")[0] for r in s.rejects.column("reason").to_pylist()]
    assert columns == ["answer", "answer_type", "answer", "answer", "reward_kwargs"]
    write_samples(samples_table([row(0)]), tmp_path / "train")
    with pytest.raises(OvkitError, match="column 'answer': RL and eval rows need a gold answer"):
        read_samples(tmp_path / "train", answers=True)


@pytest.mark.parametrize("kind", ["dev_zero", "fifo", "directory", "too_big"])
def test_image_files_are_read_only_when_regular_and_small(tmp_path, kind):
    import os

    from ovkit.data.schema import read_image_file

    path = {"dev_zero": "/dev/zero", "fifo": tmp_path / "p", "directory": tmp_path, "too_big": tmp_path / "big.png"}[
        kind
    ]
    if kind == "fifo":
        os.mkfifo(path)
    if kind == "too_big":
        path.write_bytes(b"\0" * 2048)
    with pytest.raises(OSError, match="over the limit" if kind == "too_big" else "not a regular file"):
        read_image_file(path, limit=1024)
    (tmp_path / "ok.png").write_bytes(b"x" * 1024)
    assert read_image_file(tmp_path / "ok.png", limit=1024) == b"x" * 1024
