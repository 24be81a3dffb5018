"""The science report (`ovkit science-report`): its statistics on hand-made values, and the whole report built
from a fake run directory laid out as `make science` leaves it (no training: invariants, not learned numbers)."""

import json
import math

import numpy as np
import pytest

from ovkit.science.stats import gini, head_tail_ratio, matched_positions, mean_sd, seed_band, spikes


def test_gini_and_head_tail_measure_flatness():
    assert gini([5, 5, 5, 5]) == pytest.approx(0.0)
    assert gini([0, 0, 0, 10]) == pytest.approx(0.75)  # (n - 1) / n for one concept holding everything
    assert gini([1, 2, 3, 4]) < gini([1, 1, 1, 20])
    assert head_tail_ratio([10, 10, 10, 10, 10]) == pytest.approx(1.0)
    assert head_tail_ratio([100, 50, 10, 5, 1]) == pytest.approx(100.0)  # top fifth 100 over bottom fifth 1


def test_seed_band_spikes_and_mean_sd():
    band = seed_band([[1, 2, 3], [3, 4], [2, 3, 9]])
    assert band["mean"] == [2.0, 3.0] and band["min"] == [1.0, 2.0] and band["max"] == [3.0, 4.0]
    s = spikes([1.0, 1.1, 0.9, 1.0, 5.0, None, float("nan")])
    assert s["steps"] == 5 and s["spikes"] == 1 and s["max_over_median"] == pytest.approx(5.0)
    assert mean_sd([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_sd([4.0]) == (4.0, 0.0)


def test_matched_positions_compares_turns_only_where_both_have_tokens():
    rng = np.random.default_rng(0)
    # first turns at positions 0-79 with a small gap, later turns at 40-159 with a 4x larger one; only 40-79 overlap
    pos_f, pos_l = np.arange(0, 80), np.arange(40, 160)
    lp_f, lp_l = -rng.random(80), -rng.random(120)
    tokens = {
        "position": np.concatenate([pos_f, pos_l]),
        "turn": np.concatenate([np.zeros(80, int), np.ones(120, int)]),
        "learner": np.concatenate([lp_f + 0.01, lp_l + 0.04]),
        "sampler": np.concatenate([lp_f, lp_l]),
    }
    m = matched_positions(tokens, band=40)
    assert [b["band"] for b in m["bands"]] == ["40-79"]
    assert m["first_tokens"] == 40 and m["later_tokens"] == 40
    k3 = lambda d: math.expm1(d) - d  # noqa: E731  (a constant log-ratio d on every token)
    assert m["ratio"] == pytest.approx(k3(0.04) / k3(0.01), rel=1e-6)  # ~16: K3 ~ d^2 / 2
    no_overlap = matched_positions({**tokens, "turn": np.concatenate([np.zeros(80, int), np.zeros(120, int)])})
    assert math.isnan(no_overlap["ratio"]) and no_overlap["bands"] == []


def _write_run(d, rewards, grad, kl):
    d.mkdir(parents=True)
    (d / "ovkit.json").write_text("{}")
    lines = [
        {"step": i + 1, "reward": r, "grad_norm": g, "ovkit/mismatch/vllm_kl": kl, "ovkit/masked/token_frac": 0.0}
        for i, (r, g) in enumerate(zip(rewards, grad))
    ]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def _fake_run(tmp_path):
    from PIL import Image

    from ovkit.data import image_cell, samples_table, write_samples

    run = tmp_path / "run"
    sci = run / "science"
    for variant, base, kl in [
        ("fp32", 0.6, 1e-9),
        ("int4", 0.3, 1e-2),
        ("int4-tis", 0.5, 1e-2),
        ("int4-seqmis", 0.55, 1e-2),
    ]:
        for seed in (1, 2, 3):
            rewards = [0.2 + (base - 0.2) * k / 7 + 0.01 * seed for k in range(8)]
            grad = [1.0] * 8 if variant != "int4-tis" else [1.0] * 7 + [9.0]
            _write_run(sci / "rl" / variant / f"s{seed}", rewards, grad, kl)
            ev = sci / "eval" / variant / f"s{seed}"
            ev.mkdir(parents=True)
            (ev / "summary.json").write_text(json.dumps({"overall": base / 2}))
    bins = [
        {
            "bin": "[0, 0.1)",
            "lo": 0.0,
            "hi": 0.1,
            "tokens": 10,
            "mean_sampler_prob": 0.05,
            "mean_abs_log_ratio": 0.2,
            "k3_kl": 0.02,
        },
        {
            "bin": "[0.9, 1]",
            "lo": 0.9,
            "hi": 1.0,
            "tokens": 90,
            "mean_sampler_prob": 0.97,
            "mean_abs_log_ratio": 0.01,
            "k3_kl": 1e-4,
        },
    ]
    (sci / "buckets").mkdir(parents=True)
    (sci / "buckets" / "report.json").write_text(
        json.dumps({"runs": {"bf16": {"by_sampler_prob": bins}, "int8": {"by_sampler_prob": bins}}})
    )
    plans = run / "plans" / "pretrain"
    plans.mkdir(parents=True)
    stats = {
        "samples": 100,
        "packs": 7,
        "lower_bound": 7,
        "efficiency": 0.98,
        "samples_per_pack": {"mean": 14.3},
        "padding": {
            "pad_to_max_len": {"compression": 900.0},
            "pad_to_longest_in_random_batches": {"batch": 8, "compression": 30.0},
        },
    }
    (plans / "stats.json").write_text(json.dumps(stats))
    cell = image_cell(Image.new("RGB", (28, 28), "white"))
    for name, concepts in [
        ("pretrain", ["red circle"] * 8 + ["blue star"] * 2),
        ("pretrain-balanced", ["red circle"] * 5 + ["blue star"] * 5),
    ]:
        rows = [
            {
                "id": f"{name}-{i}",
                "images": [cell],
                "messages": [{"role": "user", "content": "<image>\nDescribe."}, {"role": "assistant", "content": c}],
                "source": "synth/caption",
                "concepts": json.dumps([c]),
            }
            for i, c in enumerate(concepts)
        ]
        write_samples(samples_table(rows), run / "data" / name)
    return run


def test_report_reads_what_make_science_writes_and_says_one_line_per_finding(tmp_path):
    from ovkit.science import build_report

    run = _fake_run(tmp_path)
    rep = build_report(run)
    sci = run / "science"
    for name in ("report.md", "report.html", "report.json"):
        assert (sci / name).is_file()
    md = (sci / "report.md").read_text()
    html = (sci / "report.html").read_text()
    claims = {f["claim"] for f in rep.findings}
    assert any("INT4 rollouts without correction degrade" in c for c in claims)
    assert any("token-level correction is less stable" in c for c in claims)
    assert any("low probability" in c for c in claims)
    assert any("long tail" in c for c in claims) and any("packing" in c for c in claims)
    degrade = next(f for f in rep.findings if "INT4 rollouts" in f["claim"])
    assert degrade["verdict"] == "agree"  # 0.33 vs 0.63 final reward with a seed sd of 0.01
    tis = next(f for f in rep.findings if f["claim"].startswith("truncated importance sampling"))
    assert tis["verdict"] == "agree"
    bal = rep.numbers["balance"]
    assert bal["gini_after"] < bal["gini_before"]
    assert "## References" in md and "When Speed Kills Stability" in md and "Secretly Brings You Off-Policy" in md
    assert md.count("data:image") == 0 and html.count("data:image/png;base64,") == len(rep.figures) >= 4
    assert "absent" in md  # no turns report in the fake run: said, not invented
    doc = json.loads((sci / "report.json").read_text())
    assert doc["findings"] == rep.findings


def test_cli_entry_errors_on_a_missing_run(tmp_path, cli):
    code, _, err = cli("science-report", tmp_path / "missing")
    assert code == 2
    assert "no such run directory" in err


def test_vllm_kernel_rows_join_the_bucket_table_when_make_science_wrote_them(tmp_path):
    """science/vllm-buckets/report.json (mismatch-report --sampler vllm-fp32 --sampler vllm-bf16, written where the
    vLLM environment exists) adds its samplers as rows beside the HF ones, with their vllm-kl and mean |dp|."""
    from ovkit.science import build_report

    run = _fake_run(tmp_path)
    sci = run / "science"
    hf = json.loads((sci / "buckets" / "report.json").read_text())["runs"]["bf16"]["by_sampler_prob"]
    (sci / "vllm-buckets").mkdir()
    (sci / "vllm-buckets" / "report.json").write_text(
        json.dumps(
            {
                "runs": {
                    "vllm-bf16": {
                        "by_sampler_prob": hf,
                        "metrics": {"k3_kl": 1.68e-5, "rollout_probs_diff_mean": 5.4e-4},
                    }
                }
            }
        )
    )
    rep = build_report(run)
    md = (sci / "report.md").read_text()
    assert set(rep.numbers["buckets"]) == {"bf16", "int8", "vllm-bf16"}
    row = next(line for line in md.splitlines() if line.startswith("| vllm-bf16 |"))
    assert row.endswith("| 1.68e-05 | 0.00054 |")
    assert "vLLM's own kernels" in md


def test_seed_interval_is_students_t_over_seeds():
    from ovkit.science.stats import seed_interval

    m, half = seed_interval([0.25, 0.5, 0.75])
    assert m == pytest.approx(0.5)
    assert half == pytest.approx(4.303 * 0.25 / math.sqrt(3))  # t(2) = 4.303, not the normal's 1.96
    assert seed_interval([0.4]) == (0.4, math.inf)
    assert seed_interval([0.1] * 40)[1] == pytest.approx(0.0)


def _write_algo_run(sci, algo, seed, rewards, clip_high, row_rewards):
    d = sci / "algos" / "rl" / algo / f"s{seed}"
    d.mkdir(parents=True)
    (d / "ovkit.json").write_text("{}")
    (d / "config.yaml").write_text("loss-type: grpo\nppo-minibatches: 1\nmax-staleness: 0\n")
    (d / "model.safetensors").write_bytes(f"weights of seed {seed}".encode() + (b"!" if algo == "sapo" else b""))
    lines = [
        {
            "step": i + 1,
            "reward": r,
            "grad_norm": 1.0 + (1e-6 * i if algo == "sapo" else 0.0),
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": clip_high,
            "ovkit/mismatch/vllm_kl": 1e-13,
            "sampling/sampling_logp_difference/max": 4e-6 * seed,
            "ovkit/masked/token_frac": 0.0,
        }
        for i, r in enumerate(rewards)
    ]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ev = sci / "algos" / "eval" / algo / f"s{seed}"
    (ev / "m").mkdir(parents=True)
    summary = {"overall": sum(row_rewards) / len(row_rewards), "results": "m/t_results.json"}
    (ev / "summary.json").write_text(json.dumps(summary))
    rows = [{"id": f"r{i}", "reward": float(x)} for i, x in enumerate(row_rewards)]
    (ev / "m" / "t_samples_counting.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")


def test_algos_section_reads_make_science_algos_runs(tmp_path):
    """science/algos/ as `make science-algos` leaves it: the held-out mean with its t interval over seeds, the
    change against GRPO paired over rows (rows averaged over seeds, eval's own paired_difference), clip fractions,
    and the steps each seed's curve shares with GRPO's same seed."""
    from ovkit.evaluate.metrics import paired_difference
    from ovkit.science import build_report

    run = _fake_run(tmp_path)
    sci = run / "science"
    grpo_rows = {1: [1, 0, 1, 0], 2: [1, 1, 1, 0], 3: [1, 0, 0, 0]}  # held-out 0.5, 0.75, 0.25
    for seed in (1, 2, 3):
        base = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7]
        base = [r + 0.01 * seed for r in base]
        _write_algo_run(sci, "grpo", seed, base, 0.0, grpo_rows[seed])
        # CISPO: the same first 2 steps as GRPO's run of its seed, then 0.1 higher; every row right
        _write_algo_run(sci, "cispo", seed, base[:2] + [r + 0.1 for r in base[2:]], 0.02 * seed, [1, 1, 1, 1])
        _write_algo_run(sci, "sapo", seed, base, 0.0, grpo_rows[seed])  # GRPO's run but for its weights' bytes
    rep = build_report(run)
    algos = rep.numbers["algos"]
    assert list(algos) == ["grpo", "cispo", "sapo"]  # ALGOS order; GSPO absent: not invented
    g, c = algos["grpo"], algos["cispo"]
    assert g["held_out_ci"][0] == pytest.approx(0.5)
    assert g["held_out_ci"][1] == pytest.approx(4.303 * 0.25 / math.sqrt(3))
    assert c["held_out_ci"] == (pytest.approx(1.0), pytest.approx(0.0))
    # rows averaged over seeds: grpo (1, 1/3, 2/3, 0), cispo (1, 1, 1, 1)
    expected = paired_difference([1.0] * 4, [1.0, 1 / 3, 2 / 3, 0.0])
    assert c["vs_grpo"] == pytest.approx(expected) and c["vs_grpo"][0] == pytest.approx(0.5)
    assert c["vs_grpo_rows"] == 4 and "vs_grpo" not in g
    assert c["same_as_grpo"] == [2, 2, 2] and g.get("same_as_grpo") is None
    assert c["same_weights"] == [True] * 3 and c["grad_norm_gap"] == 0.0
    sp = algos["sapo"]
    assert sp["same_as_grpo"] == [6, 6, 6] and sp["same_weights"] == [False] * 3
    assert sp["grad_norm_gap"] == pytest.approx(5e-6)  # the last step's 1e-6 x 5 over GRPO's 1.0
    assert sp["vs_grpo"] == (0.0, 0.0) and sp["held_out_ci"] == pytest.approx(g["held_out_ci"])
    assert c["clip_high"][0] == pytest.approx(0.04) and c["clip_low"][0] == 0.0
    assert c["final_reward"][0] == pytest.approx(g["final_reward"][0] + 0.1)
    assert c["delta_logp_max"] == pytest.approx(1.2e-5)
    md = (sci / "report.md").read_text()
    alone = (sci / "algos.md").read_text()
    assert "## RL algorithms: GRPO vs GSPO, CISPO, SAPO" in md and "## RL algorithms" in alone
    row = next(line for line in alone.splitlines() if line.startswith("| cispo |"))
    assert (
        "| 100.0 ±0.0 | +50.0 ±" in row and "(4 rows)" in row and row.endswith("| 0.0000 / 0.0400 | 1e-13 | 1.2e-05 |")
    )
    same = next(line for line in alone.splitlines() if line.startswith("| sapo | 6 / 6 / 6 |"))
    assert same == "| sapo | 6 / 6 / 6 | 0 of 3 | 5e-06 |"
    assert (sci / "figures" / "algo_reward_curves.png").is_file() and "algo_reward_curves" in rep.figures
    assert "every ratio is exactly 1" in alone  # every run's config.yaml: ppo-minibatches 1, max-staleness 0
    assert "Every run's config.yaml: ppo-minibatches 1, max-staleness 0." in alone
    (sci / "algos" / "rl" / "cispo" / "s2" / "config.yaml").write_text("ppo-minibatches: 4\nmax-staleness: 0\n")
    build_report(run)
    alone = (sci / "algos.md").read_text()
    assert "every ratio is exactly 1" not in alone and "ppo-minibatches 1 / 4, max-staleness 0." in alone


def test_report_without_algos_runs_says_the_section_is_absent(tmp_path):
    from ovkit.science import build_report

    run = _fake_run(tmp_path)
    rep = build_report(run)
    assert "algos" not in rep.numbers and not (run / "science" / "algos.md").exists()
    assert "absent: no finished run under science/algos/rl/" in (run / "science" / "report.md").read_text()
