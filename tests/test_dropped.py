"""What was dropped is said: a stage that skips, rejects or truncates rows or samples prints one line after its
summary with how many, why and where they are listed; a stage that kept everything prints no such line."""

import pyarrow.parquet as pq
import pytest
from helpers import make_rows

from ovkit.data import samples_table, write_samples

pytestmark = pytest.mark.usefixtures("one_thread")


def _with_a_long_answer(path, chars=200_000):
    rows = make_rows(8)
    rows[3]["messages"][-1]["content"] = "<answer>" + "word " * (chars // 5) + "</answer>"
    write_samples(samples_table(rows), path)
    return rows[3]["id"]


def test_sft_says_it_skipped_an_over_long_sample(assets, tmp_path, cli):
    data = tmp_path / "data"
    _with_a_long_answer(data)
    out = tmp_path / "sft"
    args = ["--model", assets / "model", "--out", out, "--batch-size", "2", "--max-steps", "1", "--max-len", "512"]
    code, stdout, err = cli("sft", data, *args, "--precision", "fp32", "--quiet")
    assert code == 0, err
    summary, line = stdout.strip().splitlines()[-2:]
    assert summary.startswith("sft: 1 steps")
    assert line == (
        f"sft: skipped 1 (1 sample(s) longer than --max-len 512 tokens); not trained on; counted in {out}/ovkit.json "
        f"(metrics.skipped_too_long); a larger --max-len keeps them"
    )
    import json

    assert json.loads((out / "ovkit.json").read_text())["metrics"]["skipped_too_long"] == 1


def test_a_run_that_kept_everything_says_nothing_more(assets, tmp_path, cli):
    code, stdout, err = cli("convert", assets / "data", "--out", tmp_path / "c", "--quiet")
    assert code == 0, err
    assert len(stdout.strip().splitlines()) == 1 and "rejected" not in stdout.replace("rejects", "")


def test_pack_says_what_it_left_out_of_the_plan_and_where(assets, tmp_path, cli):
    data = tmp_path / "data"
    long_id = _with_a_long_answer(data, chars=5_000)
    out = tmp_path / "plan"
    code, stdout, err = cli("pack", data, "--model", assets / "model", "--max-len", "512", "--out", out, "--quiet")
    assert code == 0, err
    rejects = pq.read_table(out / "rejects.parquet")
    assert rejects.column("id").to_pylist() == [long_id]
    assert stdout.strip().splitlines()[-1] == (
        f"pack: left out of the plan 1 (1 longer than --max-len 512 tokens); listed with their reason in "
        f"{out}/rejects.parquet"
    )


def test_convert_says_how_many_records_it_rejected_and_where(tmp_path, cli):
    import json

    src = tmp_path / "llava.json"
    good = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    bad = {"id": "b", "conversations": "not a list"}
    src.write_text(json.dumps([good, bad]))
    out = tmp_path / "out"
    code, stdout, err = cli("convert", src, "--on-error", "skip", "--out", out, "--quiet")
    assert code == 0, err
    line = stdout.strip().splitlines()[-1]
    assert line.startswith("convert: rejected 1 (1 bad in ") and line.endswith(f"in {out}/rejects.parquet"), line
    assert pq.read_table(out / "rejects.parquet").num_rows == 1


def test_balance_says_how_many_rows_matched_no_concept(tmp_path, cli):
    from PIL import Image

    from ovkit.data import image_cell

    cell = image_cell(Image.new("RGB", (28, 28), "red"))
    rows = [
        {
            "id": f"r{i}",
            "images": [cell],
            "messages": [
                {"role": "user", "content": "<image>what?"},
                {"role": "assistant", "content": "a red square" if i % 2 else "a blue circle"},
            ],
            "source": "t",
        }
        for i in range(6)
    ]
    write_samples(samples_table(rows), tmp_path / "data")
    (tmp_path / "concepts.txt").write_text("red\nsquare\n")
    out = tmp_path / "out"
    args = ["--concepts", tmp_path / "concepts.txt", "--method", "text", "--out", out, "--quiet"]
    code, stdout, err = cli("balance", tmp_path / "data", *args)
    assert code == 0, err
    assert stdout.strip().splitlines()[-1] == (
        f"balance: dropped 3 (3 rows that match no concept); rows that match no concept have weight 0 in "
        f"{out}/plan.parquet (report.json: unmatched_rows)"
    )


def test_eval_says_how_many_rows_limit_left_out(eval_set, eval_tiny, tmp_path, cli):
    from helpers import EVAL_ROWS

    out = tmp_path / "ev"
    args = ["--model", eval_tiny, "--out", out, "--limit", "1", "--max-new-tokens", "2", "--quiet"]
    code, stdout, err = cli("eval", eval_set, *args)
    assert code == 0, err
    categories = {cat or "uncategorized" for _, cat, *_ in EVAL_ROWS}
    left_out = len(EVAL_ROWS) - len(categories)
    assert stdout.strip().splitlines()[-1] == (
        f"eval: left out {left_out} ({left_out} row(s) beyond --limit 1 per category); not scored; counted in "
        f"{out}/ovkit.json (metrics.rows_beyond_limit)"
    )


def test_rl_train_says_what_share_it_cut_or_masked(tmp_path):
    import json

    from ovkit.rl.metrics import cut_or_masked

    path = tmp_path / "metrics.jsonl"
    steps = [
        {"step": 1, "completions/clipped_ratio": 0.5, "ovkit/masked/seq_frac": 0.0},
        {"step": 2, "completions/clipped_ratio": 0.25, "ovkit/masked/seq_frac": 0.25},
    ]
    path.write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert cut_or_masked(path, 6) == (
        f"mean per step, 37.5% of completions cut at --max-new-tokens 6 (trained on as cut), 12.5% of sequences "
        f"masked out whole by the mismatch corrections (no gradient); per step in {path} (completions/clipped_ratio, "
        f"ovkit/masked/seq_frac)"
    )
    path.write_text(json.dumps({"step": 1, "completions/clipped_ratio": 0.0}) + "\n")
    assert cut_or_masked(path, 6) is None  # nothing cut, nothing masked: no line
    assert cut_or_masked(tmp_path / "missing.jsonl", 6) is None


def test_rl_train_prints_that_line_after_its_summary(rl_assets, tmp_path, cli):
    from helpers import TINY

    from ovkit.rl.metrics import cut_or_masked

    model, data = rl_assets
    out = tmp_path / "rl"
    code, stdout, err = cli("rl-train", data, "--model", model, "--out", out, "--max-steps", "1", *TINY, "--quiet")
    assert code == 0, err
    line = cut_or_masked(out / "metrics.jsonl", 6)
    lines = stdout.strip().splitlines()
    assert lines[-1] == f"rl-train: {line}" if line else lines[-1].startswith("rl-train stage 1:")
