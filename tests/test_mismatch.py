"""`ovkit mismatch-report`: every metric against closed forms on hand-built log-probs, zero mismatch when sampler and
learner agree, a clear exit-2 message (not NaNs) for empty or all-masked rollouts, the analyses' binning and turn
logic, and end to end on the tiny model: an fp32 sampler re-scored by the learner agrees to float precision (so the
teacher-forced forward lines up token for token), int8 sampling mismatches more, and a saved rollout table re-read
with and without its images gives the same report."""

import base64
import json
import math
import re
import statistics

import numpy as np
import pyarrow.parquet as pq
import pytest

L = math.log


def _hand_scores():
    """Two rollouts. A: p_s (.5, .25), p_l (.25, .5). B: p_s (.8, .1), p_l (.4, .9), its second token masked."""
    from ovkit.mismatch.metrics import Scores

    return Scores.from_lists(
        learner=[[L(0.25), L(0.5)], [L(0.4), L(0.9)]],
        sampler=[[L(0.5), L(0.25)], [L(0.8), L(0.1)]],
        mask=[[1, 1], [1, 0]],
        meta={"category": ["a", "b"], "source": ["s", "s"], "reward": [1.0, 0.0]},
    )


def test_metrics_match_closed_forms():
    from ovkit.mismatch.metrics import mismatch_metrics

    m = mismatch_metrics(_hand_scores())
    # compared tokens (p_s, p_l): (.5, .25), (.25, .5), (.8, .4); w = p_l / p_s = .5, 2, .5
    pairs = [(0.5, 0.25), (0.25, 0.5), (0.8, 0.4)]
    w = [pl / ps for ps, pl in pairs]
    assert m["tokens"] == 3 and m["responses"] == 2
    assert m["k3_kl"] == pytest.approx(sum(x - 1 - L(x) for x in w) / 3)  # = ln(2) / 3
    assert m["k3_kl"] == pytest.approx(L(2) / 3)
    assert m["kl"] == pytest.approx(sum(L(ps) - L(pl) for ps, pl in pairs) / 3)
    # per response: A's mean log-probs are equal, B's differ by ln 2
    ppl_a = 1 / math.sqrt(0.25 * 0.5)
    assert m["training_ppl"] == pytest.approx((ppl_a + 1 / 0.4) / 2)
    assert m["rollout_ppl"] == pytest.approx((ppl_a + 1 / 0.8) / 2)
    assert m["training_log_ppl"] == pytest.approx((L(ppl_a) - L(0.4)) / 2)
    assert m["log_ppl_diff"] == pytest.approx(L(2) / 2)
    assert m["log_ppl_abs_diff"] == pytest.approx(L(2) / 2)
    assert (m["log_ppl_diff_max"], m["log_ppl_diff_min"]) == (pytest.approx(L(2)), pytest.approx(0.0, abs=1e-12))
    assert m["ppl_ratio"] == pytest.approx((1 + 2) / 2)
    assert m["chi2_token"] == pytest.approx((0.25 + 4 + 0.25) / 3 - 1)
    assert m["chi2_seq"] == pytest.approx(((0.5 * 2) ** 2 + 0.5**2) / 2 - 1)
    diffs = [abs(ps - pl) for ps, pl in pairs]
    assert m["rollout_probs_diff_max"] == pytest.approx(0.4)
    assert m["rollout_probs_diff_mean"] == pytest.approx(0.3)
    assert m["rollout_probs_diff_std"] == pytest.approx(statistics.stdev(diffs))
    assert m["rollout_actor_probs_pearson_corr"] == pytest.approx(
        statistics.correlation([p for p, _ in pairs], [q for _, q in pairs])
    )
    # per response max / mean |dp|: A (.25, .25), B (.4)
    assert m["max_mismatch_mean"] == pytest.approx((0.25 + 0.4) / 2)
    assert m["mean_mismatch_mean"] == pytest.approx((0.25 + 0.4) / 2)
    assert m["max_mismatch_max"] == pytest.approx(0.4) and m["max_mismatch_frac_high"] == 0.0
    # importance weights: token (.5, 2, .5), sequence (1, .5)
    assert m["token_is_mean"] == pytest.approx(1.0) and m["token_is_std"] == pytest.approx(statistics.pstdev(w))
    assert (m["token_is_min"], m["token_is_max"]) == (pytest.approx(0.5), pytest.approx(2.0))
    assert m["token_is_eff_sample_size"] == pytest.approx(sum(w) ** 2 / (3 * sum(x * x for x in w)))  # 2/3
    assert m["seq_is_eff_sample_size"] == pytest.approx(1.5**2 / (2 * (1 + 0.25)))  # 0.9


def test_correction_fractions_by_hand():
    from ovkit.mismatch.metrics import Thresholds, correction_fractions

    s = _hand_scores()  # token ratios A (.5, 2), B (.5); sequence ratios A 1, B .5; geometric A 1, B .5
    c = correction_fractions(s, Thresholds(correction_threshold=1.5, behave_cap=1.5, veto_threshold=None))
    assert c["token-tis"] == {
        "action": "clip",
        "rule": "token ratio > 1.5",
        "token_frac": pytest.approx(1 / 3),
        "seq_frac": 0.5,
    }
    assert c["seq-tis"]["token_frac"] == 0.0
    assert c["token-mis"]["action"] == "mask" and c["token-mis"]["token_frac"] == pytest.approx(1 / 3)
    assert c["seq-mis"]["token_frac"] == 0.0
    assert (
        c["geo-rs"]["token_frac"] == pytest.approx(1 / 3) and c["geo-rs"]["seq_frac"] == 0.5
    )  # B's .5 is outside [.999, 1.001]
    assert c["behave-cap"]["token_frac"] == pytest.approx(1 / 3)
    c = correction_fractions(
        s, Thresholds(correction_threshold=1.5, correction_lower=0.6, behave_cap=None, veto_threshold=0.6)
    )
    assert c["token-tis"]["token_frac"] == pytest.approx(1.0)  # .5 -> .6 twice, 2 -> 1.5 once
    assert c["token-mis"]["token_frac"] == pytest.approx(1.0)
    assert c["seq-mis"]["token_frac"] == pytest.approx(1 / 3) and c["seq-mis"]["seq_frac"] == 0.5  # B: .5 < .6
    assert c["veto"]["token_frac"] == pytest.approx(1.0)  # both responses hold a token ratio of .5 < .6
    assert "behave-cap" not in c


def test_identical_sampler_and_learner_give_zero_mismatch():
    from ovkit.mismatch.analyses import analyse
    from ovkit.mismatch.metrics import Scores, Thresholds

    rng = np.random.default_rng(0)
    logp = [list(np.log(rng.uniform(0.001, 1.0, size=n))) for n in (3, 7, 12, 1)]
    a = analyse(Scores.from_lists(logp, logp), Thresholds(veto_threshold=0.5))
    m = a["metrics"]
    for key in (
        "k3_kl",
        "kl",
        "chi2_token",
        "chi2_seq",
        "log_ppl_diff",
        "log_ppl_abs_diff",
        "rollout_probs_diff_max",
        "max_mismatch_mean",
        "mean_mismatch_mean",
    ):
        assert m[key] == pytest.approx(0.0, abs=1e-12), key
    assert m["training_ppl"] == m["rollout_ppl"] and m["ppl_ratio"] == 1.0
    assert m["token_is_eff_sample_size"] == pytest.approx(1.0) and m["seq_is_eff_sample_size"] == pytest.approx(1.0)
    assert m["rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert all(row["token_frac"] == 0.0 and row["seq_frac"] == 0.0 for row in a["corrections"].values())
    assert all(row["k3_kl"] == 0.0 for row in a["by_sampler_prob"])


def test_empty_or_all_masked_is_a_clear_error():
    from ovkit.errors import OvkitError
    from ovkit.mismatch.analyses import analyse
    from ovkit.mismatch.metrics import Scores, Thresholds, correction_fractions, mismatch_metrics

    for scores in (Scores.from_lists([], []), Scores.from_lists([[-1.0, -2.0]], [[-1.0, -2.5]], mask=[[0, 0]])):
        for fn in (
            mismatch_metrics,
            lambda s: correction_fractions(s, Thresholds()),
            lambda s: analyse(s, Thresholds()),
        ):
            with pytest.raises(OvkitError, match="no sampled response tokens"):
                fn(scores)


def test_pearson_is_undefined_not_nan_for_constant_probabilities():
    from ovkit.mismatch.metrics import Scores, mismatch_metrics

    m = mismatch_metrics(Scores.from_lists([[L(0.5)] * 3], [[L(0.5)] * 3]))
    assert m["rollout_actor_probs_pearson_corr"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in m.values())


def test_sampler_probability_bins():
    from ovkit.mismatch.analyses import by_sampler_prob
    from ovkit.mismatch.metrics import Scores

    # p_s .0005 (bin [0, .001)), .05 twice ([.01, .1)), .95 ([.9, .99)), 1.0 (last bin, closed)
    sampler = [[L(0.0005), L(0.05), L(0.05), L(0.95), 0.0]]
    learner = [[L(0.00005), L(0.1), L(0.025), L(0.95), 0.0]]
    rows = {r["bin"]: r for r in by_sampler_prob(Scores.from_lists(learner, sampler))}
    assert set(rows) == {"[0, 0.001)", "[0.01, 0.1)", "[0.9, 0.99)", "[0.99, 1]"}
    assert rows["[0, 0.001)"]["mean_log_ratio"] == pytest.approx(L(0.1))
    assert rows["[0.01, 0.1)"]["tokens"] == 2 and rows["[0.01, 0.1)"]["mean_log_ratio"] == pytest.approx(0.0)
    assert rows["[0.01, 0.1)"]["mean_abs_log_ratio"] == pytest.approx(L(2))
    assert rows["[0.01, 0.1)"]["k3_kl"] == pytest.approx(((2 - 1 - L(2)) + (0.5 - 1 + L(2))) / 2)
    assert rows["[0, 0.001)"]["learner_lower_frac"] == 1.0 and sum(r["share"] for r in rows.values()) == pytest.approx(
        1.0
    )


def test_turns_from_the_loss_mask_and_first_vs_later():
    from ovkit.mismatch.analyses import by_turn
    from ovkit.mismatch.metrics import Scores
    from ovkit.mismatch.score import turn_ids

    mask = [1, 1, 0, 0, 1, 1, 0, 1]
    assert turn_ids(mask) == [0, 0, 0, 0, 1, 1, 1, 2]
    assert turn_ids([1, 1, 1]) == [0, 0, 0]
    assert turn_ids(mask, explicit=[0, 0, 0, 0, 1, 1, 1, 1]) == [0, 0, 0, 0, 1, 1, 1, 1]
    # first turn agrees exactly, later turns have w = 2 on every token
    sampler = [[L(0.4)] * 8]
    learner = [[L(0.4), L(0.4), 0.0, 0.0, L(0.8), L(0.8), 0.0, L(0.8)]]
    rows = {r["turn"]: r for r in by_turn(Scores.from_lists(learner, sampler, [mask], [turn_ids(mask)]))}
    assert list(rows) == ["first", "later", "2", "3"]
    assert rows["first"]["k3_kl"] == 0.0 and rows["first"]["segments"] == 1 and rows["first"]["tokens"] == 2
    assert rows["later"]["segments"] == 2 and rows["later"]["tokens"] == 3
    assert rows["later"]["k3_kl"] == pytest.approx(2 - 1 - L(2))
    assert rows["later"]["log_ppl_abs_diff"] == pytest.approx(L(2))
    assert rows["3"]["tokens"] == 1


def test_length_buckets():
    from ovkit.mismatch.analyses import by_length, length_bucket
    from ovkit.mismatch.metrics import Scores

    assert [length_bucket(n) for n in (1, 2, 3, 4, 7, 8)] == [(1, 2), (2, 4), (2, 4), (4, 8), (4, 8), (8, 16)]
    learner = [[L(0.5)] * 1, [L(0.5)] * 3, [L(0.5)] * 2 + [L(0.9)]]
    sampler = [[L(0.5)] * 1, [L(0.5)] * 3, [L(0.5)] * 3]
    rows = by_length(Scores.from_lists(learner, sampler))
    assert [(r["bucket"], r["responses"]) for r in rows] == [("[1, 2)", 1), ("[2, 4)", 2)]
    assert rows[1]["max_mismatch_mean"] == pytest.approx(0.4 / 2) and rows[1]["mean_mismatch_mean"] == pytest.approx(
        0.4 / 3 / 2
    )


def test_group_tables_per_category():
    from ovkit.mismatch.analyses import by_key

    rows = {r["category"]: r for r in by_key(_hand_scores(), "category")}
    assert rows["a"]["tokens"] == 2 and rows["a"]["k3_kl"] == pytest.approx(((0.5 - 1 - L(0.5)) + (2 - 1 - L(2))) / 2)
    assert rows["b"]["tokens"] == 1 and rows["b"]["reward_mean"] == 0.0


# ------------------------------------------------------------------------------------------------ the command


def _rollout_row(i, loss_mask):
    n = len(loss_mask)
    return {
        "prompt_id": f"p{i}",
        "group": i,
        "prompt_ids": [1, 2, 3],
        "response_ids": [4] * n,
        "loss_mask": loss_mask,
        "behave_logprobs": [-0.5] * n,
        "reward": 0.0,
        "reward_parts": {},
        "finish_reason": "stop",
        "category": "c",
        "source": "s",
        "answer": "1",
        "answer_type": "number",
    }


@pytest.mark.parametrize("rows", [[], [_rollout_row(0, [0, 0, 0]), _rollout_row(1, [])]], ids=["empty", "all-masked"])
def test_cli_empty_or_all_masked_rollouts_exit_2(cli, tmp_path, rows):
    from ovkit.rollouts.table import write_rollouts

    path = write_rollouts(rows, tmp_path / "r.parquet")
    code, out, err = cli("mismatch-report", path, "--model", tmp_path / "no-model", "--out", tmp_path / "o")
    assert code == 2 and "no sampled response tokens" in err and "nan" not in (out + err).lower()
    assert not (tmp_path / "o").exists()


def test_cli_option_errors(cli, tmp_path):
    code, _, err = cli("mismatch-report", "--model", tmp_path, "--out", tmp_path / "o")
    assert code == 2 and "ROLLOUTS" in err
    code, _, err = cli(
        "mismatch-report", tmp_path / "r.parquet", "--model", tmp_path, "--out", tmp_path / "o", "--sampler", "int8"
    )
    assert code == 2 and "--generate" in err
    code, _, err = cli(
        "mismatch-report", "--generate", tmp_path, "--model", tmp_path, "--out", tmp_path / "o", "--sampler", "fp4"
    )
    assert code == 2 and "--sampler must be one of" in err


def test_end_to_end_on_the_tiny_model(rl_assets, tmp_path, cli, one_thread):
    from ovkit.rollouts.table import read_rollouts, write_rollouts

    model, data = rl_assets
    out = tmp_path / "gen"
    base = ["--model", model, "--n", "2", "--max-new-tokens", "8", "--no-system-prompt", "--quiet"]
    code, stdout, err = cli(
        "mismatch-report", "--generate", data, "--sampler", "fp32", "--sampler", "int8", *base, "--out", out
    )
    assert code == 0, err
    assert re.search(r"mismatch-report: vllm-kl \(K3\) fp32 \S+, int8 \S+ over [\d,]+ tokens", stdout)
    doc = json.loads((out / "report.json").read_text())
    fp32, int8 = doc["runs"]["fp32"]["metrics"], doc["runs"]["int8"]["metrics"]
    # fp32 sampling re-scored by the same fp32 model: float noise only, so learner and sampler tokens line up
    assert fp32["k3_kl"] < 1e-8 and fp32["rollout_probs_diff_max"] < 1e-4
    assert int8["k3_kl"] > fp32["k3_kl"]
    assert set(doc["runs"]["fp32"]["corrections"]) == {
        "token-tis",
        "seq-tis",
        "token-mis",
        "seq-mis",
        "geo-rs",
        "behave-cap",
    }
    assert doc["runs"]["fp32"]["by_turn"][0]["turn"] == "first"
    # the figures exist, and report.html embeds every one of them and needs nothing from outside
    page = (out / "report.html").read_text()
    pngs = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(pngs) == 2 * 4 + 1 and all(base64.b64decode(p)[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    assert not re.search(r"(src|href)=['\"]https?:", page)
    for run in ("fp32", "int8"):
        for stem in ("prob_vs_logratio", "prob_scatter", "max_mismatch_by_length", "turns"):
            assert (out / "figures" / run / f"{stem}.png").stat().st_size > 0
    assert "| k3_kl |" in (out / "report.md").read_text()
    for text in ((out / "report.md").read_text(), page):  # cited sources are listed by title, not by file number
        assert (
            "References" in text and "When Speed Kills Stability" in text and "Secretly Brings You Off-Policy" in text
        )
    lp = pq.read_table(out / "logprobs.parquet")
    assert set(lp.column("run").to_pylist()) == {"fp32", "int8"}

    # The saved rollouts, re-read as ROLLOUTS: same numbers; without images they need --data
    saved = out / "rollouts" / "int8.parquet"
    code, _, err = cli("mismatch-report", saved, "--model", model, "--quiet", "--out", tmp_path / "again")
    assert code == 0, err
    again = json.loads((tmp_path / "again" / "report.json").read_text())["runs"]["rollouts"]["metrics"]
    assert again["k3_kl"] == pytest.approx(int8["k3_kl"], rel=1e-9) and again["tokens"] == int8["tokens"]
    bare = tmp_path / "bare.parquet"
    write_rollouts(read_rollouts(saved).drop_columns(["images"]), bare)
    code, _, err = cli("mismatch-report", bare, "--model", model, "--quiet", "--out", tmp_path / "bare")
    assert code == 2 and "--data" in err
    code, _, err = cli("mismatch-report", bare, "--model", model, "--data", data, "--quiet", "--out", tmp_path / "bare")
    assert code == 0, err
    via_data = json.loads((tmp_path / "bare" / "report.json").read_text())["runs"]["rollouts"]["metrics"]
    assert via_data["k3_kl"] == pytest.approx(int8["k3_kl"], rel=1e-9)


def test_multi_turn_rollouts_split_first_and_later_turns(rl_assets, tmp_path, cli, one_thread):
    """A two-turn trajectory built by hand: turn 1, an observation (loss_mask 0, read as context), turn 2 whose
    sampler log-probs are made up. The report finds the turns from the loss mask and puts the gap in the later turn."""
    from ovkit.rollouts.table import read_rollouts, write_rollouts

    model, data = rl_assets
    first = tmp_path / "first"
    code, _, err = cli(
        "mismatch-report",
        "--generate",
        data,
        "--sampler",
        "fp32",
        "--model",
        model,
        "--n",
        "1",
        "--max-new-tokens",
        "6",
        "--no-system-prompt",
        "--quiet",
        "--out",
        first,
    )
    assert code == 0, err
    rows = read_rollouts(first / "rollouts" / "fp32.parquet").to_pylist()
    observation = rows[0]["prompt_ids"][-4:]  # any text tokens will do as the environment's reply
    for r in rows:
        resp, lp = r["response_ids"], r["behave_logprobs"]
        r["response_ids"] = resp + observation + resp
        r["loss_mask"] = [1] * len(resp) + [0] * len(observation) + [1] * len(resp)
        r["behave_logprobs"] = lp + [0.0] * len(observation) + [x - 0.5 for x in lp]
        r["turns"] = 2
    write_rollouts(rows, tmp_path / "multi.parquet")
    code, _, err = cli(
        "mismatch-report", tmp_path / "multi.parquet", "--model", model, "--quiet", "--out", tmp_path / "multi"
    )
    assert code == 0, err
    run = json.loads((tmp_path / "multi" / "report.json").read_text())["runs"]["rollouts"]
    turns = {row["turn"]: row for row in run["by_turn"]}
    assert list(turns) == ["first", "later", "2"]
    n_tokens = sum(len(r["response_ids"]) - len(observation) for r in rows) // 2
    assert turns["first"]["tokens"] == turns["later"]["tokens"] == n_tokens == run["metrics"]["tokens"] // 2
    assert turns["first"]["k3_kl"] < 1e-8 < turns["later"]["k3_kl"]
