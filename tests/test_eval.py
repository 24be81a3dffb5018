"""ovkit eval: scoring and aggregation on a hand-built eval set with forced completions (a stub engine), pass@k,
the lmms-eval results layout, --save-logprobs rollouts, --compare, and the command end to end on the tiny model."""

import itertools
import json
import math
from pathlib import Path

import pytest
from helpers import EVAL_ROWS, EVAL_TEXTS

ROOT = Path(__file__).resolve().parents[1]
FORCED = {q: completion for _, _, _, q, _, _, _, completion, _ in EVAL_ROWS}


@pytest.fixture(scope="module")
def processor():
    from ovkit.models.tiny import tiny_processor, train_tokenizer

    return tiny_processor(train_tokenizer(EVAL_TEXTS))


class ForcedEngine:
    """Returns fixed completions: the i-th of n samples of a prompt is `answers[question][i]` (a stub for tests)."""

    def __init__(self, tokenizer, answers):
        self.tokenizer = tokenizer
        self.answers = answers
        self.calls = []

    def generate(self, prompts, *, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, images=None, seeds=None):
        from ovkit.generate import Completion

        self.calls.append({"prompts": len(prompts), "max_new_tokens": max_new_tokens, "n": n})
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p.input_ids)
            question = next(q for q in self.answers if q in text)
            texts = self.answers[question]
            texts = [texts] * n if isinstance(texts, str) else texts[:n]
            ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
            out.append([Completion(i, t, [-0.5] * len(i), "stop") for i, t in zip(ids, texts)])
        return out


def _run(tmp_path, eval_set, processor, answers=FORCED, **kw):
    from ovkit.evaluate import EvalConfig, run_eval

    cfg = EvalConfig(data=[eval_set], model=Path("models/tiny-sft"), out=tmp_path, **kw)
    engine = ForcedEngine(processor.tokenizer, answers)
    tmp_path.mkdir(parents=True, exist_ok=True)
    metrics = run_eval(cfg, tmp_path, engine=engine, processor=processor)
    return metrics, json.loads((tmp_path / "summary.json").read_text()), engine


def test_scores_and_aggregates_forced_completions(tmp_path, eval_set, processor):
    metrics, summary, _ = _run(tmp_path, eval_set, processor)
    rewards = [r[-1] for r in EVAL_ROWS]
    assert summary["overall"] == pytest.approx(sum(rewards) / len(rewards))  # mean over rows, not over categories
    assert summary["categories"] == pytest.approx(
        {"counting": 0.5, "spatial": 2 / 3, "grounding": 0.375, "uncategorized": 1.0}
    )
    assert summary["sources"]["synth/counting"] == 1.0 and summary["sources"]["other/counting"] == 0.0
    # accuracy = share with reward >= 0.5: the IoU-0.5 box counts, the IoU-0.25 one does not
    assert summary["accuracy"]["categories"]["grounding"] == 0.5
    assert summary["accuracy"]["overall"] == pytest.approx(5 / 8)
    assert summary["model"] == "models/tiny-sft" and summary["n"] == 1 and summary["rows"] == 8
    detail = summary["detail"]["categories"]["spatial"]
    assert detail["rows"] == 3 and detail["reward_stderr"] == pytest.approx(math.sqrt((1 / 3) / 3))
    assert metrics["overall"] == summary["overall"] and metrics["truncated"] == 0.0


def test_results_follow_the_lmms_eval_layout(tmp_path, eval_set, processor):
    _run(tmp_path, eval_set, processor)
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert folder.name == "models__tiny-sft"  # <out>/<model-name>/: not a local directory, so named like a hub id
    [results_file] = folder.glob("*_results.json")
    stamp = results_file.name[: -len("_results.json")]
    doc = json.loads(results_file.read_text())
    assert set(doc["results"]) == {"counting", "spatial", "grounding", "uncategorized"}
    assert doc["results"]["spatial"]["reward,none"] == pytest.approx(2 / 3)
    assert doc["results"]["spatial"]["alias"] == "spatial" and "reward_stderr,none" in doc["results"]["spatial"]
    assert doc["n-samples"]["spatial"] == {"original": 3, "effective": 3}
    assert doc["config"]["model_args"] == "pretrained=models/tiny-sft"
    assert {"configs", "versions", "git_hash", "date"} <= set(doc)
    for task, n in [("counting", 2), ("spatial", 3), ("grounding", 2), ("uncategorized", 1)]:
        lines = [json.loads(x) for x in (folder / f"{stamp}_samples_{task}.jsonl").read_text().splitlines()]
        assert [x["doc_id"] for x in lines] == list(range(n))
        assert {"doc_id", "target", "input", "filtered_resps", "resps", "reward"} <= set(lines[0])
    line = json.loads((folder / f"{stamp}_samples_counting.jsonl").read_text().splitlines()[1])
    assert line["target"] == "2" and line["filtered_resps"] == ["<answer>5</answer>"] and line["reward"] == 0.0
    assert "Put ONLY your final answer within <answer></answer>." in line["input"]  # the instruction was added


def test_model_folder_name(tmp_path):
    from ovkit.evaluate.results import model_name

    (tmp_path / "runs" / "sft").mkdir(parents=True)
    assert model_name(tmp_path / "runs" / "sft") == "sft"  # a local checkpoint: its directory name
    assert model_name("Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen__Qwen2.5-VL-3B-Instruct"  # a hub id, as lmms-eval


def test_token_budget_per_category_fits_the_longest_gold_answer(tmp_path, eval_set, processor):
    _, summary, engine = _run(tmp_path, eval_set, processor)
    budgets = summary["max_new_tokens"]
    assert set(budgets) == {"counting", "spatial", "grounding", "uncategorized"} and min(budgets.values()) >= 32
    assert sum(c["prompts"] for c in engine.calls) == 8 and {c["max_new_tokens"] for c in engine.calls} == set(
        budgets.values()
    )
    from ovkit.evaluate.run import token_budgets

    rows = [{"category": "svg", "answer": "<svg>" + "x" * 300 + "</svg>"}]
    long = token_budgets(rows, processor, "answer", None)["svg"]
    assert long >= 1.25 * len(processor.tokenizer.encode("<answer>" + rows[0]["answer"] + "</answer>"))
    assert token_budgets(rows, processor, "think", None)["svg"] == long + 256
    assert token_budgets(rows, processor, "answer", 7) == {"svg": 7}


def test_prompt_auto_asks_each_row_in_the_mode_of_its_rl_stage(tmp_path, eval_set, processor):
    from ovkit.evaluate.run import row_mode, token_budgets
    from ovkit.prompts import ANSWER_PROMPT, THINK_PROMPT

    assert (
        row_mode({"category": "science"}, "auto") == "think" and row_mode({"category": "counting"}, "auto") == "answer"
    )
    assert row_mode({"category": "counting", "prompt_type": "default"}, "auto") == "think"  # the released column wins
    assert row_mode({"category": "science"}, "answer") == "answer"
    rows = [{"category": "svg", "answer": "<svg/>"}, {"category": "counting", "answer": "3"}]
    budgets = token_budgets(rows, processor, "auto", None)
    assert budgets["svg"] == budgets["counting"] + 256  # svg is a stage-2 (think) category, counting is not
    science = {q: f"<think>it tips left</think><answer>{a}</answer>" for _, _, _, q, a, _, _, _, _ in EVAL_ROWS}
    _, summary, _ = _run(tmp_path, eval_set, processor, answers=science, prompt="auto")
    lines = [json.loads(x) for f in tmp_path.glob("*/*_samples_*.jsonl") for x in f.read_text().splitlines()]
    assert all(
        ANSWER_PROMPT in x["input"] and THINK_PROMPT not in x["input"] for x in lines
    )  # none of these is stage 2
    assert summary["prompt"] == "auto"


def test_pass_at_k_matches_the_combinatorial_definition():
    from ovkit.evaluate import pass_at_k

    for n, c, k in itertools.product(range(1, 8), range(0, 8), range(1, 8)):
        if c > n or k > n:
            continue
        wrong = n - c
        exact = 1 - math.comb(wrong, k) / math.comb(n, k)  # comb(wrong, k) = 0 when wrong < k
        assert pass_at_k(n, c, k) == pytest.approx(exact), (n, c, k)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_n_samples_report_pass_at_k(tmp_path, eval_set, processor):
    answers = dict(FORCED)
    answers["Q-c1 how many?"] = ["<answer>1</answer>", "<answer>2</answer>", "<answer>0</answer>", "<answer>9</answer>"]
    _, summary, engine = _run(tmp_path, eval_set, processor, answers=answers, n=4)
    assert engine.calls[0]["n"] == 4 and summary["n"] == 4
    counting = summary["detail"]["categories"]["counting"]
    # c0: 4 of 4 right; c1: 1 of 4 right -> pass@1 = (1 + 0.25) / 2, pass@2 = (1 + 0.5) / 2, pass@4 = 1
    assert counting["reward"] == pytest.approx(0.625)
    assert (
        counting["pass@1"] == pytest.approx(0.625)
        and counting["pass@2"] == pytest.approx(0.75)
        and counting["pass@4"] == 1.0
    )


def test_limit_keeps_the_first_rows_of_each_category(tmp_path, eval_set, processor):
    _, summary, _ = _run(tmp_path, eval_set, processor, limit=1)
    assert summary["rows"] == 4 and summary["categories"]["spatial"] == 1.0  # s0 only
    doc = json.loads(next((tmp_path / "models__tiny-sft").glob("*_results.json")).read_text())
    assert doc["n-samples"]["spatial"] == {"original": 3, "effective": 1}


def test_shuffled_images_come_from_another_row_of_the_same_category():
    from ovkit.evaluate.run import shuffle_images

    rows = [
        {"id": f"{c}{i}", "category": c, "answer": f"{c}{i}", "images": [f"img-{c}{i}"]}
        for c, n in (("a", 5), ("b", 2), ("c", 1))
        for i in range(n)
    ]
    out = shuffle_images(rows, seed=3)
    assert [r["id"] for r in out] == [r["id"] for r in rows] and [r["answer"] for r in out] == [
        r["answer"] for r in rows
    ]
    for cat in "abc":
        mine = [(r, o) for r, o in zip(rows, out) if r["category"] == cat]
        assert sorted(o["images"][0] for _, o in mine) == sorted(r["images"][0] for r, _ in mine)  # a permutation
        assert all((o["images"] != r["images"]) == (len(mine) > 1) for r, o in mine)  # nobody keeps its own image
    assert out == shuffle_images(rows, seed=3) and out != shuffle_images(rows, seed=4)
    assert rows[0]["images"] == ["img-a0"]  # the input rows are not changed


def test_save_logprobs_writes_rollouts_mismatch_report_can_read(tmp_path, eval_set, processor):
    from ovkit.rollouts.table import read_rollouts

    _run(tmp_path, eval_set, processor, save_logprobs=True)
    table = read_rollouts(tmp_path)
    rows = {r["prompt_id"]: r for r in table.to_pylist()}
    assert len(rows) == 8 and rows["g0"]["reward"] == pytest.approx(0.5) and rows["g0"]["category"] == "grounding"
    r = rows["c0"]
    assert r["response_ids"] == processor.tokenizer.encode("<answer>3</answer>", add_special_tokens=False)
    assert r["behave_logprobs"] == [-0.5] * len(r["response_ids"]) and r["loss_mask"] == [1] * len(r["response_ids"])
    assert (
        r["finish_reason"] == "stop" and r["answer"] == "3" and r["answer_type"] == "number" and len(r["images"]) == 1
    )
    assert json.loads(r["reward_parts"])["accuracy"] == 1.0
    assert processor.tokenizer.decode(r["prompt_ids"]).endswith("<|im_start|>assistant\n")


def test_eval_asks_a_row_as_rl_train_and_rl_curate_encode_it(tmp_path, eval_set, processor):
    """One prompt encoder (ovkit.rollouts.prompts.encode_prompts): eval's prompt token ids are those rl-curate and
    rl-train give the row in the same mode (no system prompt), a gold assistant turn is never asked back, and a row
    without a category is `uncategorized` for both, the name of its eval task."""
    from ovkit.data import read_samples
    from ovkit.rollouts.prompts import UNCATEGORIZED, encode_prompts
    from ovkit.rollouts.table import read_rollouts

    _, summary, _ = _run(tmp_path, eval_set, processor, save_logprobs=True)
    asked = {r["prompt_id"]: r["prompt_ids"] for r in read_rollouts(tmp_path).to_pylist()}
    table = read_samples(eval_set, answers=True).table
    encoded = encode_prompts(table, processor, mode="answer", system=False)
    assert asked == {p.id: list(p.encoded.input_ids) for p in encoded}
    assert {p.category for p in encoded if p.id == "o0"} == {UNCATEGORIZED} and UNCATEGORIZED in summary["categories"]
    row = {
        **table.to_pylist()[0],
        "messages": [*table.to_pylist()[0]["messages"], {"role": "assistant", "content": "3"}],
    }
    (with_gold,) = encode_prompts([row], processor, mode="answer", system=False)
    assert with_gold.encoded.input_ids == encoded[0].encoded.input_ids and with_gold.messages[-1]["role"] == "user"
    first = table.to_pylist()[0]["messages"]  # a conversation: its earlier assistant turn is context, kept
    follow_up = {"role": "user", "content": "Are you sure?"}
    talk = {
        **row,
        "messages": [*first, {"role": "assistant", "content": "2"}, follow_up, {"role": "assistant", "content": "3"}],
    }
    (conversation,) = encode_prompts([talk], processor, mode="answer", system=False)
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "user"]


def test_compare_prints_one_table_across_runs(tmp_path, eval_set, processor, cli):
    _run(tmp_path / "eval-sft", eval_set, processor)
    perfect = {q: f"<answer>{a}</answer>" for _, _, _, q, a, _, _, _, _ in EVAL_ROWS}
    _run(tmp_path / "eval-rl", eval_set, processor, answers=perfect)
    code, out, err = cli(
        "eval", "--compare", tmp_path / "eval-sft", f"rl={tmp_path / 'eval-rl'}", "--out", tmp_path / "final.md"
    )
    assert code == 0, err
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].split("|")[1:-1]] == ["category", "eval-sft", "rl"]  # labels: dir or LABEL=
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[2:]}
    assert list(cells) == ["counting", "grounding", "spatial", "uncategorized", "**overall**", "**change vs left**"]
    values = {k: [c.split(" ±")[0] for c in v] for k, v in cells.items()}
    assert values["spatial"] == ["66.7", "100.0"] and values["**overall**"] == ["59.4", "100.0"]
    assert all(" ±" in c for c in cells["**overall**"])  # every cell carries its interval
    assert cells["**change vs left**"][1].startswith("+40.6 ±")  # paired over the same 8 rows
    assert len({len(line) for line in table}) == 1  # aligned columns
    written = (tmp_path / "final.md").read_text()
    assert written.startswith("<!-- written by ovkit eval --compare") and written.split("\n", 1)[1] in out
    code, out, _ = cli("eval", "--compare", tmp_path / "eval-sft", "--metric", "accuracy")
    assert code == 0 and "accuracy" in out and "| **overall**" in out and "62.5 ±" in out
    lmms = next((tmp_path / "eval-rl").glob("*/*_results.json"))  # an lmms-eval results file reads too
    code, out, _ = cli("eval", "--compare", f"lmms={lmms}")
    assert code == 0
    header, *_, overall = [line for line in out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in header.split("|")[1:-1]] == ["category", "lmms"]
    assert overall.split("|")[2].strip().split(" ±")[0] == "100.0"


def _fabricated_run(path, rewards):
    """An eval output of known per-row rewards, {category: {row id: reward}}: summary.json and one
    `_samples_<task>.jsonl` per category (named by safe_name, as write_results names them)."""
    from ovkit.evaluate.metrics import row_metrics, summarize
    from ovkit.evaluate.results import safe_name

    records = [
        {"id": i, "category": c, "source": "synth", "metrics": row_metrics([r])}
        for c, rows in rewards.items()
        for i, r in rows.items()
    ]
    detail = summarize(records)
    (path / "m").mkdir(parents=True)
    for c in rewards:
        lines = [json.dumps({"id": r["id"], **r["metrics"]}) for r in records if r["category"] == c]
        (path / "m" / f"t_samples_{safe_name(c)}.jsonl").write_text("\n".join(lines) + "\n")
    summary = {
        "metric": "reward",
        "overall": detail["overall"]["reward"],
        "categories": {c: v["reward"] for c, v in detail["categories"].items()},
        "results": "m/t_results.json",
        "detail": detail,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _table(text, after=0):
    """{first cell: the other cells} of the markdown table that starts after the `after`-th blank line of `text`."""
    block = text.split("\n\n")[after + 1]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    split = [[c.strip() for c in line.split("|")[1:-1]] for line in rows]
    return {r[0]: r[1:] for r in [split[0], *split[2:]]}


def test_compare_paired_by_category_pairs_every_category(tmp_path, cli):
    """--paired-by category: a second table of each run's change against the one to its left in every category,
    paired over the rows both scored: caption drops 30 points, which the cells' own intervals cannot tell from
    noise; a category one run lacks is `-`; overall repeats the first table's `change vs left`."""
    from ovkit.evaluate import compare_table, load_run
    from ovkit.evaluate.metrics import paired_difference, wilson_interval

    caption = {"sft": [1.0] * 16 + [0.0] * 4, "rl1": [1.0] * 10 + [0.0] * 10, "rl2": [1.0] * 12 + [0.0] * 8}
    counting = {"sft": [0.0] * 10 + [0.5] * 10, "rl1": [1.0] * 5 + [0.0] * 5 + [0.5] * 10, "rl2": [1.0] * 20}
    ocr = {"rl1": [0.0, 1.0, 0.0, 1.0], "rl2": [1.0, 1.0, 0.0, 1.0]}  # sft has no ocr rows
    for label in ("sft", "rl1", "rl2"):
        rewards = {
            "caption": {f"cap{i}": r for i, r in enumerate(caption[label])},
            "counting": {f"cnt{i}": r for i, r in enumerate(counting[label])},
        }
        if label in ocr:
            rewards["ocr/zh"] = {f"ocr{i}": r for i, r in enumerate(ocr[label])}  # its file: t_samples_ocr_zh.jsonl
        _fabricated_run(tmp_path / label, rewards)
    specs = [f"{label}={tmp_path / label}" for label in ("sft", "rl1", "rl2")]
    code, out, err = cli("eval", "--compare", *specs, "--paired-by", "category")
    assert code == 0, err
    first, paired = _table(out), _table(out, 2)
    assert paired["category"] == ["rl1 vs sft", "rl2 vs rl1"]
    assert list(paired) == ["category", "caption", "counting", "ocr/zh", "**overall**"]
    # caption, by hand: 6 of 20 rows go 1 -> 0, so the mean change is -0.3 and the sd of the differences is
    # sqrt((6 * 0.7^2 + 14 * 0.3^2) / 19) = 0.4702: +- 1.96 x 0.4702 / sqrt(20) = 0.206
    assert paired["caption"][0] == "-30.0 ±20.6"
    lo_sft, hi_sft = wilson_interval(0.8, 20)
    lo_rl1, hi_rl1 = wilson_interval(0.5, 20)
    assert lo_sft < hi_rl1  # the two cells' intervals overlap; the paired change excludes 0
    for column, (before, after) in enumerate([("sft", "rl1"), ("rl1", "rl2")]):
        for name, values in (("caption", caption), ("counting", counting)):
            mean, half = paired_difference(values[after], values[before])
            assert paired[name][column] == f"{100 * mean:+.1f} ±{100 * half:.1f}", (name, column)
    # counting rl1 -> rl2, by hand: steps of 0 (5 rows), 1 (5) and 0.5 (10), mean 0.5, sd sqrt(2.5 / 19) = 0.3627
    assert paired["counting"][1] == "+50.0 ±15.9"
    mean, half = paired_difference(ocr["rl2"], ocr["rl1"])
    assert paired["ocr/zh"] == ["-", f"{100 * mean:+.1f} ±{100 * half:.1f}"]  # sft lacks the category
    assert paired["**overall**"] == first["**change vs left**"][1:]  # the same statistic over every row
    assert "`B vs A` = B minus A" in out.split("\n\n")[2]  # its one-line note above it
    # default (overall): the first table alone, exactly what --paired-by category prints before its second table
    runs = [load_run(spec) for spec in specs]
    default = compare_table(runs)
    assert default == compare_table(runs, paired_by="overall") and out.startswith(default)
    assert "vs sft" not in default and default.count("\n\n") == 1
    code, out_default, _ = cli("eval", "--compare", *specs)
    assert code == 0 and out_default == default


def test_compare_paired_by_category_says_where_per_row_values_are_missing(tmp_path, cli):
    a = _fabricated_run(tmp_path / "a", {"caption": {"x": 1.0, "y": 0.0}})
    b = _fabricated_run(tmp_path / "b", {"caption": {"x": 1.0, "y": 1.0}})
    c = _fabricated_run(tmp_path / "c", {"caption": {"x": 0.0, "y": 1.0}})
    for f in (b / "m").glob("*_samples_*"):  # b keeps its summary but not its per-row results
        f.unlink()
    code, out, err = cli("eval", "--compare", a, b, "--paired-by", "category")
    assert code == 0, err
    assert out.rstrip().splitlines()[-1].startswith("--paired-by category: no paired change to show, no per-row")
    assert "for b (no _samples_" in out and "change vs left" not in out
    code, out, err = cli("eval", "--compare", a, b, c, a, "--paired-by", "category")  # a then c: a pair to show
    assert code == 0, err
    paired = _table(out, 2)
    assert paired["caption"] == ["-", "-", "+0.0 ±196.0"] and "No per-row 'reward' for b" in out
    code, out, _ = cli("eval", "--compare", a, "--paired-by", "category")
    assert code == 0 and "needs at least two runs" in out
    code, _, err = cli("eval", "--compare", a, c, "--paired-by", "rows")
    assert code == 2 and "--paired-by must be one of overall, category, got 'rows'" in err


def test_wilson_interval_covers_the_binomial_truth_and_stays_inside_0_1():
    import random

    from ovkit.evaluate.metrics import wilson_interval

    assert wilson_interval(0.0, 40)[0] == 0.0 and 0.08 < wilson_interval(0.0, 40)[1] < 0.09  # not a point at 0%
    assert wilson_interval(1.0, 40)[1] == 1.0
    lo, hi = wilson_interval(0.5, 400)
    assert abs((hi - lo) / 2 - 0.049) < 0.001  # ~ 1.96 sqrt(0.25 / 400) near the middle
    rng = random.Random(0)
    covered = 0
    for _ in range(2000):  # nominal 95% coverage for p = 0.2, n = 100 (binomial draws)
        k = sum(rng.random() < 0.2 for _ in range(100))
        lo, hi = wilson_interval(k / 100, 100)
        covered += lo <= 0.2 <= hi
    assert 0.93 < covered / 2000 < 0.975


def test_paired_difference_is_tighter_than_two_intervals_when_runs_agree():
    from ovkit.evaluate.metrics import paired_difference, wilson_interval

    before = [1.0] * 100 + [0.0] * 300
    after = [1.0] * 110 + [0.0] * 290  # the same rows, 10 more right
    mean, half = paired_difference(after, before)
    assert abs(mean - 0.025) < 1e-12 and half < 0.016
    lo, hi = wilson_interval(0.25, 400)
    assert half < (hi - lo) / 2  # the unpaired intervals alone could not tell a 2.5-point change from noise
    with pytest.raises(ValueError):
        paired_difference([1.0], [])


def test_compare_errors_name_the_problem(tmp_path, cli):
    code, _, err = cli("eval", "--compare", tmp_path / "missing")
    assert code == 2 and "no such eval output" in err
    code, _, err = cli("eval", "--compare")
    assert code == 2 and "eval outputs to compare" in err


def test_config_errors_are_usage_errors(tmp_path, eval_set, cli):
    code, _, err = cli("eval", eval_set, "--out", tmp_path / "o")
    assert code == 2 and "--model is required" in err
    code, _, err = cli("eval", eval_set, "--model", tmp_path, "--out", tmp_path / "o", "--n", "2", "--temperature", "0")
    assert code == 2 and "--temperature" in err
    code, _, err = cli("eval", eval_set, "--model", tmp_path, "--out", tmp_path / "o", "--prompt", "chatty")
    assert code == 2 and "--prompt" in err


def test_example_config_is_valid():
    from ovkit.config import load_yaml, merge
    from ovkit.evaluate import EvalConfig

    values = load_yaml(ROOT / "examples" / "tiny" / "eval.yaml")
    cfg = merge(
        EvalConfig,
        {"data": [Path("data/eval")], "model": Path("runs/sft"), "out": Path("runs/eval-sft")},
        {"data", "model", "out"},
        values,
    )
    assert cfg.prompt in ("answer", "think", "auto") and cfg.engine == "hf"


def test_eval_command_end_to_end_on_the_tiny_model(tmp_path, eval_set, eval_tiny, cli):
    from ovkit.rollouts.table import read_rollouts

    model = eval_tiny
    out = tmp_path / "eval-tiny"
    args = ["eval", "--model", model, eval_set, "--out", out, "--max-new-tokens", "6", "--save-logprobs", "--quiet"]
    code, stdout, err = cli(*args)
    assert code == 0, err
    assert stdout.startswith("eval: reward") and "8 rows" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["categories"]) == {"counting", "spatial", "grounding", "uncategorized"}
    assert 0.0 <= summary["overall"] <= 1.0
    provenance = json.loads((out / "ovkit.json").read_text())
    assert provenance["command"] == "eval" and provenance["metrics"]["rows"] == 8
    table = read_rollouts(out)
    assert table.num_rows == 8
    for r in table.to_pylist():
        assert 0 < len(r["response_ids"]) <= 6 and all(lp <= 0 for lp in r["behave_logprobs"])
    code, stdout, _ = cli(*args)
    assert code == 0 and "skipped" in stdout


# The shape lmms-eval (0.3+) writes: "<metric>,<filter>" keys, "N/A" stderrs, several metrics for some tasks, scores
# and percentages beside fractions, n-samples per task.
LMMS_RESULTS = {
    "results": {
        "mmmu_val": {"alias": "mmmu_val", "mmmu_acc,none": 0.41, "mmmu_acc_stderr,none": "N/A"},
        "ai2d": {"alias": "ai2d", "exact_match,flexible-extract": 0.73, "exact_match_stderr,flexible-extract": 0.008},
        "mmbench_en_dev": {"alias": "mmbench_en_dev", "gpt_eval_score,none": 68.2, "gpt_eval_score_stderr,none": "N/A"},
        "mme": {"alias": "mme", "mme_cognition_score,none": 312.5, "mme_percetion_score,none": 1480.2},
        "pope": {"alias": "pope", "pope_accuracy,none": 0.86, "pope_f1_score,none": 0.85, "pope_precision,none": 0.9},
    },
    "n-samples": {"mmmu_val": {"original": 900, "effective": 900}, "ai2d": {"original": 3088, "effective": 3088}},
    "config": {"model": "llava_onevision"},
    "date": "20261124_120000",
}


def test_compare_reads_a_real_lmms_eval_results_file_and_warns_on_tasks_it_cannot_map(tmp_path, cli):
    path = tmp_path / "llava" / "20261124_120000_results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LMMS_RESULTS))
    code, out, err = cli("eval", "--compare", path)
    assert code == 0, err
    cells = {
        line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()[3:] if line.startswith("|")
    }
    assert cells["mmmu_val"].startswith("41.0 ±") and cells["mmmu_val"].endswith("(mmmu_acc)")  # 900 rows: an interval
    assert cells["ai2d"].startswith("73.0 ±") and cells["ai2d"].endswith("(exact_match)")  # the filter does not matter
    assert cells["mmbench_en_dev"] == "68.2 (gpt_eval_score)"  # a percentage is shown as reported, not x 100
    assert cells["mme"] == "-" and cells["pope"] == "-" and cells["**overall**"] == "-"
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 2 and "'mme'" in warned[0] + warned[1] and "pope_f1_score" in "".join(warned)
    code, out, err = cli("eval", "--compare", path, "--metric", "pope_f1_score")
    assert code == 0 and "| pope " in out and "85.0" in out, err
    assert "warning: llava: lmms-eval task 'pope'" not in err


def test_compare_counts_an_lmms_eval_files_rows_from_its_n_samples(tmp_path):
    """An lmms-eval results file's row count is the sum of its tasks' n-samples (it records none for the whole run),
    and one it cannot know (a task without n-samples) is left out of the note on differing rows, never shown as 0."""
    from ovkit.evaluate import compare_table, load_run

    every = {t: {"original": 10, "effective": 10} for t in LMMS_RESULTS["results"]}
    complete, partial = tmp_path / "a" / "x_results.json", tmp_path / "b" / "x_results.json"
    for path, samples in ((complete, every), (partial, LMMS_RESULTS["n-samples"])):
        path.parent.mkdir()
        path.write_text(json.dumps({**LMMS_RESULTS, "n-samples": samples}))
    runs = [load_run(f"full={complete}"), load_run(f"part={partial}")]
    assert runs[0][1]["detail"]["overall"]["rows"] == 50 and "rows" not in runs[1][1]["detail"]["overall"]
    assert "Runs scored different rows" not in compare_table(runs, "mmmu_acc")
    half = {t: {"original": 5, "effective": 5} for t in LMMS_RESULTS["results"]}
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x_results.json").write_text(json.dumps({**LMMS_RESULTS, "n-samples": half}))
    table = compare_table([runs[0], load_run(f"half={tmp_path / 'c' / 'x_results.json'}")], "mmmu_acc")
    assert "Runs scored different rows: full 50, half 25." in table


def test_eval_output_loads_with_load_dataset_dir(tmp_path, eval_set, eval_tiny, cli, monkeypatch):
    """`datasets.load_dataset(DIR)` on an eval output returns its per-row samples, a split per task, from the card
    ovkit writes; `load_dataset(DIR, TASK)` one task; a same-named output elsewhere loads its own rows."""
    import shutil

    import datasets

    from ovkit.cards import CARD, write_card
    from ovkit.evaluate import load_run

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    model = eval_tiny
    a = tmp_path / "a" / "eval-tiny"
    code, _, err = cli("eval", "--model", model, eval_set, "--out", a, "--max-new-tokens", "6", "--quiet")
    assert code == 0, err
    samples = {f.stem.split("_samples_")[1]: f for f in a.glob("*/*_samples_*.jsonl")}
    lines = {t: f.read_text().splitlines() for t, f in samples.items()}
    assert set(samples) == {"counting", "spatial", "grounding", "uncategorized"}
    card = (a / CARD).read_text()
    assert "_results.json\n" not in card.split("\n---\n")[0]  # configs point at the samples files only

    ds = datasets.load_dataset(str(a))
    assert {k: v.num_rows for k, v in ds.items()} == {t: len(v) for t, v in lines.items()}
    for task, rows in lines.items():
        got = {r["id"]: r for r in ds[task]}
        for line in rows:
            rec = json.loads(line)
            assert got[rec["id"]]["target"] == rec["target"] and got[rec["id"]]["reward"] == rec["reward"]
            assert got[rec["id"]]["filtered_resps"] == rec["filtered_resps"]
            parts = got[rec["id"]]["reward_parts"][0]  # the union of the tasks' reward parts; this task's as written
            assert {k: parts[k] for k in rec["reward_parts"][0]} == rec["reward_parts"][0]
    one = datasets.load_dataset(str(a), "grounding")
    assert list(one) == ["grounding"] and one["grounding"].num_rows == len(lines["grounding"])

    # the results JSON stays lmms-eval's, and --compare still reads the output
    results = json.loads(next(a.glob("*/*_results.json")).read_text())
    assert {"results", "configs", "versions", "n-samples", "config", "date"} <= set(results)
    assert load_run(a)[1]["categories"].keys() == samples.keys()

    # same name, other rows: its own cache entry (the content key in each config's description)
    b = tmp_path / "b" / "eval-tiny"
    shutil.copytree(a, b)
    (b / CARD).unlink()
    f = next(b.glob("*/*_samples_counting.jsonl"))
    f.write_text(f.read_text().splitlines()[0] + "\n")
    write_card(b, json.loads((b / "ovkit.json").read_text()), b)
    assert datasets.load_dataset(str(b), "counting")["counting"].num_rows == 1
    assert datasets.load_dataset(str(b))["counting"].num_rows == 1
    assert datasets.load_dataset(str(a))["counting"].num_rows == len(lines["counting"])
