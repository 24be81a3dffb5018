"""`ovkit rl-curate`: the selection rules and the stage split by hand, and an end-to-end run on the tiny model whose
outputs agree with each other (prompts in = curation rows; kept = stage1 + stage2 rows) and are byte-identical when
repeated with the same seed."""

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, **kw):
    from ovkit.rl.curate import CurateConfig

    return CurateConfig(data=tmp_path, model=tmp_path, out=tmp_path / "o", **kw)


def test_mean_rule_is_an_open_window(tmp_path):
    from ovkit.rl.curate import select

    cfg = _cfg(tmp_path)  # 0 < pass@1 < 0.6, as released
    assert [select(p1, 1.0, "s", cfg) for p1 in (0.0, 0.0625, 0.5, 0.6, 1.0)] == [False, True, True, False, False]


def test_gap_rule_keeps_latent_capability(tmp_path):
    from ovkit.rl.curate import select

    cfg = _cfg(tmp_path, select="gap", min_gap=0.5)
    assert select(0.25, 1.0, "s", cfg)  # solvable (pass@N 1) but unreliable (pass@1 0.25)
    assert not select(0.75, 1.0, "s", cfg)  # gap 0.25
    assert not select(0.0, 0.0, "s", cfg)  # never solved
    assert select(1.0, 1.0, "synth/svg", _cfg(tmp_path, keep_sources=["svg"]))  # kept whole by source


def test_stage_split_rule(tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.prompts import STAGE2_CATEGORIES, stage_of

    assert stage_of({"category": "counting"}, STAGE2_CATEGORIES) == 1
    assert stage_of({"category": "math"}, STAGE2_CATEGORIES) == 2
    assert stage_of({"category": "math", "prompt_type": "normal"}, STAGE2_CATEGORIES) == 1  # the released column wins
    assert stage_of({"category": "ocr", "prompt_type": "default"}, STAGE2_CATEGORIES) == 2
    with pytest.raises(OvkitError, match="prompt_type"):
        stage_of({"id": "x", "prompt_type": "weird"}, STAGE2_CATEGORIES)


def test_histogram_bins():
    from ovkit.rl.curate import histogram

    h = histogram([0.0, 0.05, 0.1, 0.99, 1.0], bins=10)
    assert h["0.0-0.1"] == 2 and h["0.1-0.2"] == 1 and h["0.9-1.0"] == 2 and sum(h.values()) == 5


def test_curate_end_to_end(rl_assets, tmp_path, cli, one_thread):
    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    args = [
        "rl-curate",
        data,
        "--model",
        model_dir,
        "--n",
        "3",
        "--max-new-tokens",
        "5",
        "--min-reward",
        "-0.01",
        "--max-reward",
        "0.5",
        "--no-system-prompt",
        "--reward-workers",
        "1",
        "--quiet",
    ]
    code, stdout, err = cli(*args, "--out", tmp_path / "a")
    assert code == 0, err
    code2, _, err2 = cli(*args, "--out", tmp_path / "b")
    assert code2 == 0, err2
    out = tmp_path / "a"
    assert re.search(r"rl-curate: 6 prompts, .*kept \d+ \(stage 1: \d+, stage 2: \d+\)", stdout)
    stats = json.loads((out / "stats.json").read_text())
    curation = pq.read_table(out / "curation.parquet").to_pylist()
    assert len(curation) == 6 == stats["prompts"]
    stage1 = pq.read_table(next((out / "stage1").glob("*.parquet")))
    stage2 = pq.read_table(next((out / "stage2").glob("*.parquet")))
    assert stage1.num_rows + stage2.num_rows == stats["kept"] == sum(c["kept"] for c in curation)
    assert set(stage2.column("category").to_pylist()) <= {"math"} and set(stage1.column("category").to_pylist()) <= {
        "counting"
    }
    assert {"pass_at_1", "pass_at_n"} <= set(stage1.column_names)
    for c in curation:
        assert c["pass_at_1"] <= c["pass_at_n"] and c["kept"] == (-0.01 < c["pass_at_1"] < 0.5)
    rollouts = read_rollouts(out / "rollouts")
    assert rollouts.num_rows == 6 * 3 and "images" in rollouts.column_names
    assert (out / "difficulty.png").stat().st_size > 1000
    for rel in ["stage1", "stage2", "rollouts", "curation.parquet", "stats.json"]:
        for f in sorted((out / rel).rglob("*")) if (out / rel).is_dir() else [out / rel]:
            assert f.read_bytes() == (tmp_path / "b" / f.relative_to(out)).read_bytes(), f  # same seed, same bytes


def test_an_excluded_category_is_not_sampled(rl_assets, tmp_path, cli):
    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    args = [
        "rl-curate",
        data,
        "--model",
        model_dir,
        "--n",
        "2",
        "--max-new-tokens",
        "3",
        "--min-reward",
        "-0.01",
        "--no-system-prompt",
        "--reward-workers",
        "1",
        "--quiet",
    ]
    code, stdout, err = cli(*args, "--exclude-category", "math", "--out", tmp_path / "a")
    assert code == 0, err
    stats = json.loads((tmp_path / "a" / "stats.json").read_text())
    assert stats["excluded"] == {"math": 3} and stats["prompts"] == 3 and set(stats["categories"]) == {"counting"}
    assert set(read_rollouts(tmp_path / "a" / "rollouts").column("category").to_pylist()) == {"counting"}
    assert pq.read_table(next((tmp_path / "a" / "stage2").glob("*.parquet"))).num_rows == 0
    code, _, err = cli(*args, "--exclude-category", "math", "--exclude-category", "counting", "--out", tmp_path / "b")
    assert code == 2 and "every prompt is in an excluded category" in err and not (tmp_path / "b").exists()


def test_help_options_are_documented(cli):
    code, out, _ = cli("rl-curate", "--help")
    assert code == 0
    page = (ROOT / "commands" / "rl-curate.md").read_text()
    missing = sorted({o for o in re.findall(r"--[a-z][a-z0-9-]+", out) if o not in page})
    assert not missing, missing
