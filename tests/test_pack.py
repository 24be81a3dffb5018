"""ovkit pack: best-fit-decreasing against a reference implementation, plan statistics, and the command end to end
on the tiny model (plan content, rejects, shards, determinism, the lengths cache)."""

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from ovkit.pack.binpack import best_fit_decreasing, first_fit_decreasing, pack_loads
from ovkit.pack.stats import pack_stats, random_batch_padding

# --- bin packing ---------------------------------------------------------------------------------------------------


def reference_fit(lengths, capacity, best):
    """Textbook BFD / FFD, one item at a time (ties: the earliest-opened pack)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rooms, out = [], [0] * len(lengths)
    for i in order:
        s = lengths[i]
        fits = [b for b, r in enumerate(rooms) if r >= s]
        if not fits:
            rooms.append(capacity)
            b = len(rooms) - 1
        else:
            b = min(fits, key=lambda b: (rooms[b], b)) if best else fits[0]
        rooms[b] -= s
        out[i] = b
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("seed", range(40))
def test_bfd_and_ffd_equal_the_textbook_algorithms(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.integers(1, 80))
    n = int(rng.integers(0, 300))
    if seed % 3 == 0:  # few distinct lengths: large same-length groups, the grouped path's hard case
        lengths = rng.choice(rng.integers(1, capacity + 1, size=3), size=n)
    else:
        lengths = rng.integers(1, capacity + 1, size=n)
    assert np.array_equal(best_fit_decreasing(lengths, capacity), reference_fit(list(lengths), capacity, best=True))
    assert np.array_equal(first_fit_decreasing(lengths, capacity), reference_fit(list(lengths), capacity, best=False))


def test_bfd_invariants_on_a_large_input():
    rng = np.random.default_rng(0)
    capacity = 4096
    lengths = np.minimum(rng.lognormal(6, 1, 200_000).astype(np.int64) + 1, capacity)
    packs = best_fit_decreasing(lengths, capacity)
    loads = pack_loads(packs, lengths)
    assert loads.sum() == lengths.sum() and loads.max() <= capacity
    assert set(np.unique(packs)) == set(range(packs.max() + 1))  # packs numbered 0..P-1, none empty
    lower = math.ceil(lengths.sum() / capacity)
    assert packs.max() + 1 <= lower * 1.001  # within 0.1% of the lower bound on a realistic spread of lengths
    assert np.array_equal(packs, best_fit_decreasing(lengths.copy(), capacity))  # deterministic


def test_bfd_rejects_bad_input():
    with pytest.raises(ValueError):
        best_fit_decreasing([5, 11], 10)
    with pytest.raises(ValueError):
        best_fit_decreasing([0, 3], 10)
    assert best_fit_decreasing([], 10).size == 0
    assert list(best_fit_decreasing([10, 10, 10], 10)) == [0, 1, 2]


# --- statistics ----------------------------------------------------------------------------------------------------


def test_pack_stats_numbers():
    lengths = np.array([6, 4, 5, 5, 3])  # 23 tokens, L=10 -> lower bound 3
    packs = best_fit_decreasing(lengths, 10)
    s = pack_stats(lengths, packs, 10, batch=2, seed=0)
    assert s["samples"] == 5 and s["tokens"] == 23 and s["lower_bound"] == 3 and s["packs"] == 3
    assert s["efficiency"] == pytest.approx(23 / 30)
    assert s["padding"]["after"] == 7
    assert s["padding"]["pad_to_max_len"]["before"] == 50 - 23
    before = s["padding"]["pad_to_longest_in_random_batches"]["before"]
    assert before == random_batch_padding(lengths, 2, 0)
    assert s["padding"]["pad_to_longest_in_random_batches"]["compression"] == pytest.approx(before / 7)
    assert s["samples_per_pack"]["max"] == 2


def test_random_batch_padding_by_hand():
    lengths = np.array([1, 2, 3, 4, 5])
    shuffled = lengths[np.random.default_rng(3).permutation(5)]
    want = 2 * max(shuffled[:2]) + 2 * max(shuffled[2:4]) + shuffled[4] - 15
    assert random_batch_padding(lengths, 2, 3) == want
    assert random_batch_padding(lengths, 1, 3) == 0


# --- the command ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ovkit.models.tiny import build_tiny

    return build_tiny(
        tmp_path_factory.mktemp("tiny"), ["a red circle and a blue square", "Describe the image.", "how many"] * 20
    )


def make_rows(n, seed=0, *, bad_row=None, long_row=None):
    from PIL import Image

    from ovkit.data import image_cell

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(0, 3))
        sizes = [(int(rng.integers(20, 300)), int(rng.integers(20, 300))) for _ in range(k)]
        words = " ".join(["shape"] * int(rng.integers(1, 40)))
        user = "".join("<image>" for _ in range(k)) + "\nDescribe the image."
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": f"a red circle {words}"}]
        if i == bad_row:
            msgs = msgs[:1]  # no assistant turn: cannot be a training sample
        if i == long_row:
            msgs[1]["content"] = "circle " * 1200
        images = [image_cell(Image.new("RGB", s, (i % 255, 20, 30))) for s in sizes]
        rows.append({"id": f"r{i:03d}", "images": images, "messages": msgs, "source": "test"})
    return rows


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from ovkit.data import samples_table, write_samples

    d = tmp_path_factory.mktemp("data")
    write_samples(samples_table(make_rows(60, long_row=7)), d)
    return d


def run_pack(cli, data, model, out, *extra, max_len=1024):
    code, stdout, err = cli("pack", data, "--model", model, "--max-len", max_len, "--out", out, "--quiet", *extra)
    assert code == 0, err
    return stdout


def test_pack_writes_a_complete_plan(cli, tiny, dataset, tmp_path):
    from ovkit.data import read_table
    from ovkit.models import load
    from ovkit.models.encode import decode_images, encode_sample

    out = tmp_path / "plan"
    stdout = run_pack(cli, dataset, tiny, out, "--cache", tmp_path / "cache")
    assert "pack: 59 samples" in stdout
    plan = pq.read_table(out / "plan.parquet")
    assert plan.column_names == ["id", "shard", "row", "length", "pack"]
    rejects = pq.read_table(out / "rejects.parquet").to_pylist()
    assert (
        [r["id"] for r in rejects] == ["r007"]
        and rejects[0]["length"] > 1024
        and "--max-len 1024" in rejects[0]["reason"]
    )
    assert plan.num_rows + len(rejects) == 60
    stats = json.loads((out / "stats.json").read_text())
    assert stats["samples"] == 59 and stats["rows_in"] == 60 and stats["rejects"]["longer_than_max_len"] == 1
    lengths = plan.column("length").to_numpy()
    packs = plan.column("pack").to_numpy()
    assert stats["tokens"] == lengths.sum() and stats["packs"] == packs.max() + 1
    assert stats["lower_bound"] == math.ceil(lengths.sum() / 1024)
    assert pack_loads(packs, lengths).max() <= 1024
    assert stats["length_method"] == "sizes"
    assert (out / "fill.png").read_bytes()[:4] == b"\x89PNG"
    # every length is exactly what the processor produces for that row
    _, processor = load(tiny)
    data = read_table(dataset).to_pylist()
    for rec in plan.to_pylist()[::7]:
        row = data[rec["row"]]
        assert row["id"] == rec["id"]
        assert encode_sample(processor, row["messages"], decode_images(row["images"])).length == rec["length"]


def test_pack_is_deterministic_and_workers_and_exact_lengths_agree(cli, tiny, dataset, tmp_path):
    a = tmp_path / "a"
    run_pack(cli, dataset, tiny, a, "--cache", tmp_path / "c1")
    b = tmp_path / "b"
    run_pack(cli, dataset, tiny, b, "--cache", tmp_path / "c2", "--workers", "2")
    c = tmp_path / "c"
    run_pack(cli, dataset, tiny, c, "--cache", tmp_path / "c3", "--exact-lengths")
    assert (a / "plan.parquet").read_bytes() == (b / "plan.parquet").read_bytes()
    assert pq.read_table(a / "plan.parquet").equals(pq.read_table(c / "plan.parquet"))
    assert json.loads((c / "stats.json").read_text())["length_method"] == "processor"
    assert (a / "fill.png").read_bytes() == (b / "fill.png").read_bytes()


def test_lengths_cache_is_reused_for_another_max_len(cli, tiny, dataset, tmp_path):
    cache = tmp_path / "cache"
    run_pack(cli, dataset, tiny, tmp_path / "p1", "--cache", cache)
    assert len(list(cache.rglob("*.parquet"))) == 1
    run_pack(cli, dataset, tiny, tmp_path / "p2", "--cache", cache, max_len=4096)
    stats = json.loads((tmp_path / "p2" / "stats.json").read_text())
    assert stats["lengths_cached"] is True and stats["rejects"]["longer_than_max_len"] == 0


def test_shards_read_as_one_plan(cli, tiny, dataset, tmp_path):
    from ovkit.pack.plan import plan_stats, read_plan

    out = tmp_path / "plan"
    run_pack(cli, dataset, tiny, out, "--cache", tmp_path / "c", "--shard", "0/2")
    with pytest.raises(Exception, match="missing"):
        read_plan(out)
    run_pack(cli, dataset, tiny, out, "--cache", tmp_path / "c", "--shard", "1/2")
    plan, max_len = read_plan(out)
    assert max_len == 1024
    assert sorted(plan.column("row").to_pylist()) == [r for r in range(60) if r != 7]
    assert set(plan.column("shard").to_pylist()) == {0, 1}
    assert all(r < 30 for r, s in zip(plan.column("row").to_pylist(), plan.column("shard").to_pylist()) if s == 0)
    assert plan_stats(out)["samples"] == 59


def test_bad_rows_fail_or_go_to_rejects(cli, tiny, tmp_path):
    from ovkit.data import samples_table, write_samples

    d = tmp_path / "data"
    write_samples(samples_table(make_rows(10, bad_row=3)), d)
    code, _, err = cli(
        "pack", d, "--model", tiny, "--max-len", 1024, "--out", tmp_path / "p", "--cache", tmp_path / "c", "--quiet"
    )
    assert code == 2 and "'r003'" in err and "assistant" in err
    assert not (tmp_path / "p").exists()
    run_pack(cli, d, tiny, tmp_path / "p", "--cache", tmp_path / "c", "--on-error", "skip")
    rejects = pq.read_table(tmp_path / "p" / "rejects.parquet").to_pylist()
    assert [r["id"] for r in rejects] == ["r003"] and "assistant" in rejects[0]["reason"]
    assert pq.read_table(tmp_path / "p" / "plan.parquet").num_rows == 9


def test_a_kept_row_that_repeats_a_rejected_rows_id_points_at_itself(cli, tiny, tmp_path):
    """Only kept ids count as seen: a later row may reuse a rejected row's id, and the plan must name its own row."""
    from ovkit.data import samples_table, write_samples

    rows = make_rows(6)
    rows[1]["images"] = [{"bytes": b"not a picture", "path": None}]
    rows[4]["id"] = rows[1]["id"]
    write_samples(samples_table(rows), tmp_path / "data")
    run_pack(cli, tmp_path / "data", tiny, tmp_path / "p", "--cache", tmp_path / "c", "--on-error", "skip")
    plan = pq.read_table(tmp_path / "p" / "plan.parquet").to_pylist()
    assert {r["id"]: r["row"] for r in plan} == {"r000": 0, "r002": 2, "r003": 3, "r001": 4, "r005": 5}


def test_missing_options_are_usage_errors(cli, tmp_path):
    code, _, err = cli("pack", tmp_path, "--out", tmp_path / "p")
    assert code == 2 and "--model" in err
    code, _, err = cli("pack", tmp_path, "--model", tmp_path, "--out", tmp_path / "p", "--max-len", "0")
    assert code == 2 and "--max-len" in err
