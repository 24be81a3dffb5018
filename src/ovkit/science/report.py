"""`ovkit science-report RUN`: the science report of `make science`, from the files ovkit's own commands wrote.

Nothing here trains or samples: the Makefile's `science` target runs rl-train (one directory per sampler/correction
variant and seed), eval, mismatch-report, and this module reads what they left under RUN/science/ (plus the
pipeline's pack plan and balanced split under RUN/) and writes RUN/science/report.md, report.html (self-contained,
figures inline) and report.json (every number the text quotes). Each finding of the seed write-ups gets one line:
what the source reports, what ovkit measured here, and whether they agree. Where `make science-algos` has run, its
section (rl-train's loss menu on the same footing) is also written alone to RUN/science/algos.md.

Layout read (absent parts are reported as absent, never filled in):

    science/rl/<variant>/s<seed>/metrics.jsonl     rl-train per-step metrics (reward, mismatch, grad_norm, ...)
    science/eval/<variant>/s<seed>/summary.json    held-out score of that run's final model (per-row scores beside it)
    science/algos/{rl,eval}/<algorithm>/s<seed>/   the same for `make science-algos`: GRPO vs GSPO, CISPO, SAPO
    science/buckets/report.json                    mismatch-report --generate, samplers bf16 / int8 / int4
    science/vllm-buckets/report.json               the same with vLLM's kernels, vllm-fp32 / vllm-bf16 (optional)
    science/turns/                                 mismatch-report --generate --env verifier (logprobs.parquet,
                                                   rollouts/)
    plans/pretrain/stats.json                      pack: padding compression, samples per pack
    data/pretrain, data/pretrain-balanced          balance: ground-truth concepts before / after
"""

from __future__ import annotations

import base64
import filecmp
import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ovkit.evaluate.metrics import paired_difference
from ovkit.evaluate.results import row_values
from ovkit.runtime.log import public_name
from ovkit.science.stats import gini, head_tail_ratio, matched_positions, mean_sd, seed_band, seed_interval, spikes

# The seed write-ups, cited by title (the keys are the numbers the findings below are filed under).
SOURCES = {
    "003": 'Feng Yao, Liyuan Liu, Dinghuai Zhang, Chengyu Dong, Jingbo Shang, Jianfeng Gao, "Your Efficient RL '
    'Framework Secretly Brings You Off-Policy RL Training" (2025)',
    "004": 'Jiacai Liu, Yingru Li, Yuqian Fu, Jiawei Wang, Qian Liu, Yu Shen, "When Speed Kills Stability: '
    'Demystifying RL Collapse from the Training-Inference Mismatch" (2025)',
    "ov": '"LLaVA-OneVision-1.5" and "LLaVA-OneVision-1.5-RL" project pages (offline packing, concept balancing)',
}
SHORT = {
    "003": "Yao et al., Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    "004": "Liu, Li et al., When Speed Kills Stability",
}

# Variant directory name -> (sampler, correction) as passed to rl-train.
VARIANTS = {
    "fp32": ("fp32", "none"),
    "int8": ("int8", "none"),
    "int8-tis": ("int8", "token-tis"),
    "int8-seqmis": ("int8", "seq-mis"),
    "int8-geors": ("int8", "geo-rs"),
    "int4": ("int4", "none"),
    "int4-tis": ("int4", "token-tis"),
    "int4-seqmis": ("int4", "seq-mis"),
    "int4-geors": ("int4", "geo-rs"),
}
TOKEN_LEVEL, SEQ_LEVEL = ("tis",), ("seqmis", "geors")

# `make science-algos`: algorithm directory name -> what the Makefile's sci_algo_flags pass to rl-train on top of
# examples/tiny/rl-science.yaml (commands/rl-train.md, "Algorithms"). GRPO first: the others are compared with it.
ALGOS = {
    "grpo": "the config's defaults: token ratio, clip 0.2 / 0.28",
    "gspo": "--importance-sampling-level sequence --eps-clip 0.0003 --eps-clip-high 0.0004",
    "cispo": "--loss-type cispo --eps-clip-high 4.0",
    "sapo": "--loss-type sapo (temperatures 1.0 / 1.05)",
}


@dataclass
class Run:
    variant: str
    seed: str
    steps: list[dict[str, Any]]
    eval: dict[str, Any] | None
    config: dict[str, Any] = field(default_factory=dict)  # the run's resolved options (its config.yaml)
    path: Path | None = None  # the rl-train output directory (its final weights)

    def curve(self, key: str) -> list[float]:
        """The per-step values of metric `key`, by its internal name (reward/mean), as metrics.jsonl stores it under
        its public one (reward)."""

        key = public_name(key)
        return [float(s.get(key, float("nan"))) for s in self.steps]


@dataclass
class Report:
    sections: list[tuple[str, str]] = field(default_factory=list)  # (title, markdown body)
    figures: dict[str, Path] = field(default_factory=dict)  # name -> png
    findings: list[dict[str, str]] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ reading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_runs(science: Path, names: Sequence[str] = tuple(VARIANTS)) -> dict[str, list[Run]]:
    """Every finished rl-train run under science/rl/<name>/s<seed>/, grouped by name (the given names only, in
    their order): the variants of `make science`, or with science/algos and ALGOS the algorithms of
    `make science-algos`."""
    runs: dict[str, list[Run]] = {}
    for variant in names:
        for d in sorted((science / "rl" / variant).glob("s*")):
            metrics = d / "metrics.jsonl"
            if not (d / "ovkit.json").is_file() or not metrics.is_file():
                continue  # unfinished
            summary = science / "eval" / variant / d.name / "summary.json"
            ev = json.loads(summary.read_text()) if summary.is_file() else None
            if ev is not None:
                ev["_path"] = str(summary)  # where row_values finds the per-row scores (as evaluate.load_run sets it)
            config = yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").is_file() else {}
            runs.setdefault(variant, []).append(Run(variant, d.name, read_jsonl(metrics), ev, config or {}, d))
    return runs


def concept_counts_of(data: Path) -> dict[str, int]:
    """Rows per ground-truth concept (the synth `concepts` column) of a dataset directory."""
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    from ovkit.data import read_samples

    table = read_samples(data).table
    counts: dict[str, int] = {}
    for text in table.column("concepts").to_pylist():
        for c in set(json.loads(text or "[]")):
            counts[c] = counts.get(c, 0) + 1
    return counts


# ------------------------------------------------------------------------------------------------ sections


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-2 or abs(x) >= 1e4 else f"{x:.{digits}f}"
    return str(x)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run_summary(runs: Sequence[Run], last: int = 4) -> dict[str, Any]:
    """Across seeds: final training reward (mean of the last `last` steps), held-out score, mismatch, spikes."""
    final = [sum(r.curve("reward/mean")[-last:]) / len(r.curve("reward/mean")[-last:]) for r in runs if r.steps]
    held = [r.eval["overall"] for r in runs if r.eval]
    kl = [sum(r.curve("mismatch/vllm_kl")) / max(len(r.steps), 1) for r in runs]
    spk = [spikes(r.curve("grad_norm")) for r in runs]
    return {
        "seeds": len(runs),
        "final_reward": mean_sd(final),
        "held_out": mean_sd(held) if held else (float("nan"), float("nan")),
        "vllm_kl": mean_sd(kl),
        "masked_frac": mean_sd([sum(r.curve("masked/token_frac")) / max(len(r.steps), 1) for r in runs]),
        "spikes": sum(s["spikes"] for s in spk),
        "max_grad_over_median": max((s["max_over_median"] for s in spk), default=float("nan")),
        "first_reward": mean_sd([r.curve("reward/mean")[0] for r in runs if r.steps]),
    }


def rl_section(rep: Report, runs: dict[str, list[Run]], out: Path) -> None:
    if not runs:
        rep.sections.append(("RL with mismatched samplers", "absent: no finished run under science/rl/.\n"))
        return
    summaries = {v: run_summary(rs) for v, rs in runs.items()}
    rep.numbers["rl"] = summaries
    rows = []
    for v, s in summaries.items():
        sampler, corr = VARIANTS[v]
        rows.append(
            [
                v,
                sampler,
                corr,
                str(s["seeds"]),
                f"{s['first_reward'][0]:.3f} -> {s['final_reward'][0]:.3f} (sd {s['final_reward'][1]:.3f})",
                f"{100 * s['held_out'][0]:.1f} (sd {100 * s['held_out'][1]:.1f})"
                if math.isfinite(s["held_out"][0])
                else "n/a",
                _fmt(s["vllm_kl"][0]),
                f"{s['masked_frac'][0]:.3f}",
                f"{s['spikes']} (max {s['max_grad_over_median']:.1f}x)",
            ]
        )
    body = (
        "Every run starts from the pipeline's SFT model on its rl-curate stage-1 prompts, with the same options except "
        "the sampler and the correction (examples/tiny/rl-science.yaml); the learner is always fp32. Training reward "
        "is the mean task reward of the step's rollouts (first step -> mean of the last 4 steps, mean over seeds); "
        "held-out is the eval overall x 100 of each run's final model (mean and sd over seeds); vllm-kl is the K3 "
        "sampler/learner gap averaged over steps; masked is the share of response tokens a correction or the "
        "behaviour cap removed; spikes counts steps whose gradient norm exceeds 3x that run's median.\n\n"
    )
    body += _table(
        [
            "variant",
            "sampler",
            "correction",
            "seeds",
            "training reward",
            "held-out",
            "vllm-kl",
            "masked",
            "grad-norm spikes",
        ],
        rows,
    )
    rep.figures["reward_curves"] = _plot_curves(
        runs, "reward/mean", "task reward (rollouts of the step)", out / "reward_curves.png"
    )
    rep.figures["mismatch_curves"] = _plot_curves(
        runs, "mismatch/vllm_kl", "vllm-kl (K3) per step", out / "mismatch_curves.png", log=True
    )
    rep.figures["grad_norms"] = _plot_curves(
        runs, "grad_norm", "gradient norm (before clipping)", out / "grad_norms.png", log=True
    )
    figures = (
        "reward](figures/reward_curves.png)",
        "mismatch](figures/mismatch_curves.png)",
        "grad](figures/grad_norms.png)",
    )
    body += "".join(f"\n![{f}\n" for f in figures)
    rep.sections.append(("RL with mismatched samplers: reward, held-out score, mismatch per step", body))


def _plot_curves(
    runs: dict[str, list[Run]],
    key: str,
    ylabel: str,
    path: Path,
    log: bool = False,
    groups: Sequence[tuple[str, list[str]]] | None = None,
) -> Path:
    """Per-step `key`, one line per name with its min-max band over seeds; `groups` = (title, names) per panel,
    by default one panel per low-precision sampler beside fp32."""
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib

    matplotlib.use("Agg")
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib.pyplot as plt

    if groups is None:
        groups = [
            (f"{q} sampler vs fp32", [v for v in runs if v == "fp32" or v.startswith(q)]) for q in ("int8", "int4")
        ]
        groups = [(name, vs) for name, vs in groups if any(v != "fp32" for v in vs)] or [("runs", list(runs))]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (name, variants) in zip(axes[0], groups):
        for v in variants:
            band = seed_band([r.curve(key) for r in runs[v]])
            xs = list(range(1, len(band["mean"]) + 1))
            line = ax.plot(xs, band["mean"], label=f"{v} ({len(runs[v])} seeds)")[0]
            ax.fill_between(xs, band["min"], band["max"], color=line.get_color(), alpha=0.15)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{name} (mean, min-max over seeds)")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return path


def _step_mean(run: Run, key: str) -> float:
    """Mean over a run's steps of metric `key` (nan where it never logged it)."""
    values = [v for v in run.curve(key) if math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def _seed_mean_rows(runs: Sequence[Run]) -> dict[str, float] | None:
    """Held-out reward per row id, averaged over the seeds' final models (the rows every seed scored); None when a
    seed's eval or its per-row scores are missing."""
    per_seed = [row_values(r.eval) if r.eval else None for r in runs]
    if not per_seed or any(v is None for v in per_seed):
        return None
    common = set.intersection(*(set(v) for v in per_seed))  # type: ignore[arg-type]
    return {i: sum(v[i][1] for v in per_seed) / len(per_seed) for i in sorted(common)}  # type: ignore[index]


def _leading_equal(a: Sequence[float], b: Sequence[float]) -> int:
    """How many first steps two reward curves share exactly (same seed: equal until the updates differ)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _same_weights(a: Run, b: Run) -> bool | None:
    """Whether two runs' final weights (their *.safetensors files) are byte for byte the same; None without them."""
    files_a = sorted(a.path.glob("*.safetensors")) if a.path else []
    files_b = sorted(b.path.glob("*.safetensors")) if b.path else []
    if not files_a or [f.name for f in files_a] != [f.name for f in files_b]:
        return None
    return all(filecmp.cmp(x, y, shallow=False) for x, y in zip(files_a, files_b))


def _grad_norm_gap(a: Run, b: Run) -> float:
    """The largest relative gap between two runs' per-step gradient norms (0: the same updates to the bit)."""
    gaps = [abs(x - y) / abs(y) for x, y in zip(a.curve("grad_norm"), b.curve("grad_norm")) if y]
    return max(gaps, default=float("nan"))


def algo_summary(runs: Sequence[Run], baseline: Sequence[Run] | None = None) -> dict[str, Any]:
    """run_summary plus what the algorithm study reads: the held-out mean with its 95% interval over seeds, the
    held-out change against `baseline` (GRPO) paired over rows (each row's reward averaged over seeds), the clip
    fractions and mismatch per step (means over steps, then over seeds), and against the baseline's run of the same
    seed: how many first steps' rewards it shares, whether the final weights are the same bytes, and the largest
    relative gap between their gradient norms."""
    s = run_summary(runs)
    held = [r.eval["overall"] for r in runs if r.eval]
    s["held_out_ci"] = seed_interval(held) if held else (float("nan"), float("nan"))
    for name, key in (
        ("clip_low", "clip/low_frac"),
        ("clip_high", "clip/high_frac"),
        ("log_ppl_abs_diff", "mismatch/log_ppl_abs_diff"),
        ("delta_logp_mean", "mismatch/delta_logp_mean"),
    ):
        s[name] = mean_sd([_step_mean(r, key) for r in runs])
    s["delta_logp_max"] = max((max(r.curve("mismatch/delta_logp_max"), default=0.0) for r in runs), default=0.0)
    rows = _seed_mean_rows(runs)
    s["rows"] = len(rows) if rows else 0
    if baseline is not None and baseline is not runs:
        base_rows = _seed_mean_rows(baseline)
        common = sorted(set(rows or {}) & set(base_rows or {}))
        if common:
            s["vs_grpo"] = paired_difference([rows[i] for i in common], [base_rows[i] for i in common])  # type: ignore[index]
            s["vs_grpo_rows"] = len(common)
        pairs = [(r, b) for r in runs for b in baseline if b.seed == r.seed]
        s["same_as_grpo"] = [_leading_equal(r.curve("reward/mean"), b.curve("reward/mean")) for r, b in pairs]
        s["same_weights"] = [_same_weights(r, b) for r, b in pairs]
        s["grad_norm_gap"] = max((_grad_norm_gap(r, b) for r, b in pairs), default=float("nan"))
    return s


def _shared_options(runs: Sequence[Run], keys: Sequence[str] = ("ppo-minibatches", "max-staleness")) -> str:
    """The on/off-policy settings of the runs as their config.yaml files record them (SCI_ALGO_FLAGS may change
    them), so a report says which regime its numbers come from."""
    found = {k: sorted({str(r.config[k]) for r in runs if k in r.config}) for k in keys}
    parts = [f"{k} {' / '.join(v)}" for k, v in found.items() if v]
    return f"\nEvery run's config.yaml: {', '.join(parts)}.\n" if parts else ""


def algos_section(rep: Report, runs: dict[str, list[Run]], out: Path) -> str | None:
    """`make science-algos`: GRPO against GSPO, CISPO and SAPO from the same SFT model on the same prompts. Returns
    the section's markdown (also added to the report), None when no run is there."""
    title = "RL algorithms: GRPO vs GSPO, CISPO, SAPO"
    if not runs:
        rep.sections.append((title, "absent: no finished run under science/algos/rl/ (`make science-algos`).\n"))
        return None
    baseline = runs.get("grpo")
    summaries = {a: algo_summary(rs, baseline) for a, rs in runs.items()}
    rep.numbers["algos"] = summaries
    rows = []
    for a, s in summaries.items():
        m, half = s["held_out_ci"]
        vs = s.get("vs_grpo")
        rows.append(
            [
                a,
                str(s["seeds"]),
                f"{s['first_reward'][0]:.3f} -> {s['final_reward'][0]:.3f} (sd {s['final_reward'][1]:.3f})",
                f"{100 * m:.1f} ±{100 * half:.1f}" if math.isfinite(m) else "n/a",
                f"{100 * vs[0]:+.1f} ±{100 * vs[1]:.1f} ({s['vs_grpo_rows']} rows)" if vs else "-",
                f"{s['clip_low'][0]:.4f} / {s['clip_high'][0]:.4f}",
                _fmt(s["vllm_kl"][0]),
                _fmt(s["delta_logp_max"]),
            ]
        )
    same_rows = [
        [
            a,
            " / ".join(str(n) for n in s["same_as_grpo"]),
            f"{sum(w is True for w in s['same_weights'])} of {len(s['same_weights'])}"
            + ("" if all(w is not None for w in s["same_weights"]) else " (weights missing)"),
            _fmt(s["grad_norm_gap"]),
        ]
        for a, s in summaries.items()
        if "same_as_grpo" in s
    ]
    every = [r for rs in runs.values() for r in rs]
    steps = max((len(r.steps) for r in every), default=0)
    body = (
        "rl-train's loss menu on one footing: every run starts from the pipeline's SFT model on its rl-curate "
        "stage-1 prompts with examples/tiny/rl-science.yaml (fp32 sampler and learner, synchronous) and one "
        'algorithm\'s options (commands/rl-train.md, "Algorithms"):\n\n'
        + "".join(f"- {a}: {ALGOS[a]}\n" for a in runs)
        + _shared_options(every)
        + "\nTraining reward: first step -> mean of the last 4 steps (mean and sd over seeds). Held-out: eval overall "
        "x 100 of each run's final model on the validation rows, mean over seeds ± the half-width of its 95% "
        "Student-t interval over seeds (the spread of training runs). vs grpo: the held-out change against GRPO paired "
        "over rows (each row's reward averaged over the seeds' final models), ± its 95% interval (the spread of rows, "
        "not of training runs). Clip low / high: share of trained tokens whose ratio to pi_prox was clipped (CISPO: "
        "whose weight was truncated; SAPO clips nothing), mean over steps and seeds. vllm-kl: the K3 sampler/learner "
        "gap, mean over steps and seeds; max abs dlogp: the largest sampler/learner log-prob gap of any token; with "
        "the fp32 sampler both measure float rounding, not a mismatch.\n\n"
    )
    body += _table(
        [
            "algorithm",
            "seeds",
            "training reward",
            "held-out",
            "held-out vs grpo (paired)",
            "clip low / high",
            "vllm-kl",
            "max abs dlogp",
        ],
        rows,
    )
    if same_rows:
        body += (
            "\nEach run against GRPO's run of the same seed (same SFT model, prompts and sampling seed): how many "
            f"first steps' rewards are exactly equal (of {steps}, per seed), whether the final weights are the same "
            "bytes, and the largest relative gap between the two runs' gradient norms at any step.\n\n"
        )
        body += _table(["algorithm", "steps equal to grpo's", "final weights = grpo's", "grad-norm gap"], same_rows)
    if all(r.config.get("ppo-minibatches") == 1 and r.config.get("max-staleness") == 0 for r in every):
        body += (
            "\nEvery run here made one optimiser step per batch of rollouts (ppo-minibatches 1) from a synchronous "
            "sampler (max-staleness 0). At that only gradient pass the learner is pi_prox itself, so every ratio is "
            "exactly 1 and no clip can bind, and GRPO's, GSPO's, CISPO's and SAPO's gradients all reduce to "
            "-A grad log p per token (GSPO's sequence ratio and SAPO's gate have slope 1 at ratio 1): the runs can "
            "differ only by float rounding (which sampling would amplify once it flipped a sampled token). The "
            "algorithms differ in earnest only off-policy: several optimiser steps per batch (--ppo-minibatches > 1) "
            "or stale rollouts.\n"
        )
    names = list(runs)
    rep.figures["algo_reward_curves"] = _plot_curves(
        runs,
        "reward/mean",
        "task reward (rollouts of the step)",
        out / "algo_reward_curves.png",
        groups=[("GRPO vs GSPO, CISPO, SAPO", names)],
    )
    body += "\n![algorithms](figures/algo_reward_curves.png)\n"
    rep.sections.append((title, body))
    return f"## {title}\n\n{body}"


def bucket_section(rep: Report, report_json: Path, out: Path, vllm_json: Path | None = None) -> None:
    """The HF samplers' buckets (bf16 / int8 / int4), and, where `make science` found the vLLM environment, vLLM's
    own kernels (fp32, bf16) on the same weights and prompts as rows beside them."""
    if not report_json.is_file():
        rep.sections.append(("Mismatch by sampler probability", f"absent: no {report_json}.\n"))
        return
    doc = json.loads(report_json.read_text())
    if vllm_json is not None and vllm_json.is_file():
        doc["runs"].update(json.loads(vllm_json.read_text())["runs"])
    runs = {name: r["by_sampler_prob"] for name, r in doc["runs"].items() if r.get("by_sampler_prob")}
    metrics = {name: r.get("metrics", {}) for name, r in doc["runs"].items()}
    rep.numbers["buckets"] = runs
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib

    matplotlib.use("Agg")
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in runs.items():
        xs = [r["mean_sampler_prob"] for r in rows]
        left.plot(xs, [r["mean_abs_log_ratio"] for r in rows], marker="o", label=name)
        right.plot(xs, [max(r["k3_kl"], 1e-12) for r in rows], marker="o", label=name)
    for ax, what in ((left, "mean |log p_learner - log p_sampler|"), (right, "K3 (vllm-kl) within the bucket")):
        ax.set(xscale="log", yscale="log", xlabel="sampler probability of the token (bucket mean)", ylabel=what)
        ax.legend()
    fig.suptitle("Mismatch by sampler-probability bucket (004, fig. 4 style)")
    fig.tight_layout()
    path = out / "mismatch_by_prob.png"
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    rep.figures["mismatch_by_prob"] = path
    rows = []
    for name, bins in runs.items():
        low = [b for b in bins if b["hi"] <= 0.1]
        high = [b for b in bins if b["lo"] >= 0.9]
        low_v = _weighted(low, "mean_abs_log_ratio")
        high_v = _weighted(high, "mean_abs_log_ratio")
        rows.append(
            [
                name,
                sum(b["tokens"] for b in bins),
                sum(b["tokens"] for b in low),
                _fmt(low_v),
                _fmt(high_v),
                _fmt(low_v / high_v if high_v else float("nan")),
                _fmt(metrics[name].get("k3_kl")),
                _fmt(metrics[name].get("rollout_probs_diff_mean")),
            ]
        )
        rep.numbers.setdefault("low_high_ratio", {})[name] = low_v / high_v if high_v else float("nan")
    body = (
        f"`mismatch-report --generate` from the SFT model, {', '.join(runs)} samplers against the fp32 learner, "
        f"tokens binned by the sampler's own probability (report: {report_json.parent.name}/report.html).\n\n"
    )
    body += _table(
        [
            "sampler",
            "tokens",
            "tokens with p_s < 0.1",
            "mean abs log-ratio, p_s < 0.1",
            "same, p_s >= 0.9",
            "low / high",
            "vllm-kl (K3)",
            "mean |p_s - p_l|",
        ],
        rows,
    )
    if any(name.startswith("vllm") for name in runs):
        body += (
            "\nThe `vllm-*` rows sample with vLLM's own kernels (its CPU build on a CPU box) from the same weights, "
            "against the same fp32 learner (report: vllm-buckets/report.html).\n"
        )
    body += "\n![buckets](figures/mismatch_by_prob.png)\n"
    rep.sections.append(("Mismatch by sampler probability (the low-probability-token trap)", body))


def _weighted(rows: Sequence[dict[str, Any]], key: str) -> float:
    n = sum(r["tokens"] for r in rows)
    return sum(r[key] * r["tokens"] for r in rows) / n if n else float("nan")


def turn_tokens(report_dir: Path, sampler: str) -> dict[str, Any] | None:
    """Flat per-token arrays (position in the context, turn, learner and sampler log-probs) of one sampler's
    rollouts in a mismatch-report directory: logprobs.parquet joined with rollouts/<sampler>.parquet."""
    # heavy: pyarrow loads on first use, not at CLI start or in config checks
    import pyarrow.parquet as pq

    lp_path, ro_path = report_dir / "logprobs.parquet", report_dir / "rollouts" / f"{sampler}.parquet"
    if not lp_path.is_file() or not ro_path.is_file():
        return None
    lp = pq.read_table(lp_path).to_pylist()
    ro = pq.read_table(ro_path, columns=["prompt_ids"]).to_pylist()
    pos, turn, lrn, smp = [], [], [], []
    for row in lp:
        if row["run"] != sampler:
            continue
        start = len(ro[row["index"]]["prompt_ids"])
        for j, (a, b, c, t) in enumerate(
            zip(row["learner_logprobs"], row["behave_logprobs"], row["compared"], row["turn_ids"] or [])
        ):
            if c:
                pos.append(start + j)
                turn.append(t)
                lrn.append(a)
                smp.append(b)
    return {
        "position": np.asarray(pos),
        "turn": np.asarray(turn),
        "learner": np.asarray(lrn),
        "sampler": np.asarray(smp),
    }


def turns_section(rep: Report, report_dir: Path, samplers: Sequence[str] = ("bf16", "int8", "int4")) -> None:
    rows, found = [], {}
    for s in samplers:
        tokens = turn_tokens(report_dir, s)
        if tokens is None:
            continue
        m = matched_positions(tokens)
        found[s] = m
        rows.append(
            [
                s,
                str(m["first_tokens"]),
                str(m["later_tokens"]),
                _fmt(m["first_k3"]),
                _fmt(m["later_k3"]),
                _fmt(m["ratio"]),
                _fmt(m["pooled_first_k3"]),
                _fmt(m["pooled_later_k3"]),
            ]
        )
    if not found:
        rep.sections.append(("First vs later turns", f"absent: no mismatch-report with --env under {report_dir}.\n"))
        return
    rep.numbers["turns"] = found
    body = (
        "`mismatch-report --generate --env verifier` (up to 3 attempts, 'incorrect, try again' after a wrong one) "
        "from the SFT model. Later turns sit deeper in the context than first turns, so the table compares them at "
        "matched positions: context positions in bands of 40 tokens, only bands holding both, each band weighted by "
        "its smaller token count. Pooled = all tokens of each side, positions not matched.\n\n"
    )
    body += _table(
        [
            "sampler",
            "first-turn tokens (matched bands)",
            "later-turn tokens",
            "K3 first",
            "K3 later",
            "later / first",
            "pooled K3 first",
            "pooled K3 later",
        ],
        rows,
    )
    rep.sections.append(("First vs later turns at matched context positions", body))


def packing_section(rep: Report, stats_path: Path) -> None:
    if not stats_path.is_file():
        rep.sections.append(("Packing", f"absent: no {stats_path}.\n"))
        return
    s = json.loads(stats_path.read_text())
    pad = s.get("padding", {})
    numbers = {
        "samples": s["samples"],
        "packs": s["packs"],
        "lower_bound": s["lower_bound"],
        "efficiency": s["efficiency"],
        "samples_per_pack": s["samples_per_pack"]["mean"],
        "compression_vs_max_len": pad.get("pad_to_max_len", {}).get("compression"),
        "compression_vs_random_batches": pad.get("pad_to_longest_in_random_batches", {}).get("compression"),
        "random_batch": pad.get("pad_to_longest_in_random_batches", {}).get("batch"),
    }
    rep.numbers["packing"] = numbers
    body = _table(
        [
            "samples",
            "packs (lower bound)",
            "efficiency",
            "samples per pack",
            "padding compression vs padding to L",
            "vs padding random batches to their longest",
        ],
        [
            [
                str(numbers["samples"]),
                f"{numbers['packs']} ({numbers['lower_bound']})",
                f"{numbers['efficiency']:.4f}",
                f"{numbers['samples_per_pack']:.1f}",
                f"{numbers['compression_vs_max_len']:.0f}x",
                f"{numbers['compression_vs_random_batches']:.1f}x (batch {numbers['random_batch']})",
            ]
        ],
    )
    rep.sections.append(
        ("Offline packing", f"`ovkit pack` of the pipeline's balanced pretraining split ({stats_path}).\n\n" + body)
    )


def balance_section(rep: Report, before_dir: Path, after_dir: Path, out: Path) -> None:
    if not (before_dir.is_dir() and after_dir.is_dir()):
        rep.sections.append(("Concept balancing", f"absent: no {before_dir} / {after_dir}.\n"))
        return
    before, after = concept_counts_of(before_dir), concept_counts_of(after_dir)
    concepts = sorted(before, key=lambda c: -before[c])
    b = [before[c] for c in concepts]
    a = [after.get(c, 0) for c in concepts]
    numbers = {
        "concepts": len(concepts),
        "gini_before": gini(b),
        "gini_after": gini(a),
        "head_tail_before": head_tail_ratio(b),
        "head_tail_after": head_tail_ratio(a),
        "rows_before": sum(1 for _ in range(0)) or None,
    }
    numbers.pop("rows_before")
    rep.numbers["balance"] = numbers
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib

    matplotlib.use("Agg")
    # optional: the package (or this name in it) may be missing; imported only where it is used
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(concepts))
    ax.bar([x - 0.2 for x in xs], b, width=0.4, label=f"before (Gini {numbers['gini_before']:.2f})")
    ax.bar([x + 0.2 for x in xs], a, width=0.4, label=f"after balance (Gini {numbers['gini_after']:.2f})")
    ax.set_xticks(list(xs), concepts, rotation=90, fontsize=7)
    ax.set(
        ylabel="rows showing the concept",
        title="Ground-truth concept frequency of the pretraining split, by rank before balancing",
    )
    ax.legend()
    fig.tight_layout()
    path = out / "long_tail.png"
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    rep.figures["long_tail"] = path
    body = (
        "Ground-truth concepts (the synth `concepts` column, not the tiny CLIP's guesses) of the pretraining split "
        "before and after `ovkit balance`. Gini: 0 = every concept equally frequent; head/tail: mean count of the "
        "most frequent fifth of concepts over the least frequent fifth.\n\n"
    )
    body += _table(
        ["concepts", "Gini before", "Gini after", "head/tail before", "head/tail after"],
        [
            [
                str(numbers["concepts"]),
                numbers["gini_before"],
                numbers["gini_after"],
                numbers["head_tail_before"],
                numbers["head_tail_after"],
            ]
        ],
    )
    body += "\n![long tail](figures/long_tail.png)\n"
    rep.sections.append(("Concept balancing: the long tail", body))


# ------------------------------------------------------------------------------------------------ findings


def findings(rep: Report) -> None:
    """One line per finding of the seed write-ups: what they report, what ovkit measured, agree or not."""
    rl, add = rep.numbers.get("rl", {}), rep.findings.append

    def held(v: str) -> float:
        return rl[v]["held_out"][0] if v in rl else float("nan")

    def reward(v: str) -> float:
        return rl[v]["final_reward"][0] if v in rl else float("nan")

    for q in ("int8", "int4"):
        if q in rl and "fp32" in rl:
            gap_r = reward(q) - reward("fp32")
            sd = max(rl[q]["final_reward"][1], rl["fp32"]["final_reward"][1])
            degraded = gap_r < -sd
            add(
                {
                    "source": "003",
                    "claim": f"{q.upper()} rollouts without correction degrade RL relative to a matched sampler",
                    "measured": f"final training reward {q} {reward(q):.3f} vs fp32 {reward('fp32'):.3f} (gap "
                    f"{gap_r:+.3f}, seed sd up to {sd:.3f}); held-out {100 * held(q):.1f} vs {100 * held('fp32'):.1f}",
                    "verdict": "agree" if degraded else "not reproduced at this scale (gap within seed spread)",
                }
            )
            tis = f"{q}-tis"
            if tis in rl:
                recovered = reward(tis) - reward(q)
                add(
                    {
                        "source": "003",
                        "claim": f"truncated importance sampling (TIS) recovers what the mismatched {q} sampler loses",
                        "measured": f"final reward {tis} {reward(tis):.3f} vs {q} {reward(q):.3f} ({recovered:+.3f}) "
                        f"and fp32 {reward('fp32'):.3f}",
                        "verdict": ("agree" if recovered > 0 else "disagree")
                        if degraded
                        else "nothing to recover (no degradation measured)",
                    }
                )
    for q in ("int4", "int8"):
        tok = [v for v in rl if v.startswith(q + "-") and v.split("-", 1)[1] in TOKEN_LEVEL]
        seq = [v for v in rl if v.startswith(q + "-") and v.split("-", 1)[1] in SEQ_LEVEL]
        if tok and seq:
            sd_tok = max(rl[v]["final_reward"][1] for v in tok)
            sd_seq = max(rl[v]["final_reward"][1] for v in seq)
            sp_tok = sum(rl[v]["spikes"] for v in tok)
            sp_seq = max(rl[v]["spikes"] for v in seq)
            less_stable = sd_tok > sd_seq and sp_tok >= sp_seq
            add(
                {
                    "source": "004",
                    "claim": f"under large mismatch ({q}), token-level correction is less stable than sequence-level",
                    "measured": f"seed sd of final reward: token-TIS {sd_tok:.3f} vs seq-MIS/Geo-RS up to "
                    f"{sd_seq:.3f}; "
                    f"grad-norm spikes {sp_tok} vs up to {sp_seq}",
                    "verdict": "agree" if less_stable else "not reproduced at this scale",
                }
            )
            break
    for name, ratio in rep.numbers.get("low_high_ratio", {}).items():
        add(
            {
                "source": "004",
                "claim": "the mismatch concentrates on tokens the sampler gave a low probability",
                "measured": f"{name}: mean |log-ratio| on tokens with p_s < 0.1 is {ratio:.1f}x that on p_s >= 0.9",
                "verdict": "agree" if ratio > 1 else "disagree",
            }
        )
    for name, m in rep.numbers.get("turns", {}).items():
        enough = min(m["first_tokens"], m["later_tokens"]) >= 1000
        add(
            {
                "source": "004",
                "claim": "later turns of multi-turn rollouts mismatch more than the first turn",
                "measured": f"{name}: K3 later/first {m['ratio']:.2f}x at matched positions ({m['first_tokens']} "
                f"first-turn, {m['later_tokens']} later-turn tokens)",
                "verdict": ("agree" if m["ratio"] > 1 else "disagree")
                + ("" if enough else " (fewer than 1,000 tokens a side: weak)"),
            }
        )
    if "packing" in rep.numbers:
        p = rep.numbers["packing"]
        add(
            {
                "source": "ov",
                "claim": "offline packing gives ~11x padding compression (stated for the 85M mid-training set)",
                "measured": f"{p['compression_vs_random_batches']:.1f}x against random batches of {p['random_batch']} "
                f"padded to their longest, {p['samples_per_pack']:.1f} samples per pack, efficiency "
                f"{p['efficiency']:.3f}",
                "verdict": "agree in kind (a different data set: the ratio depends on the length spread)",
            }
        )
    if "balance" in rep.numbers:
        b = rep.numbers["balance"]
        add(
            {
                "source": "ov",
                "claim": "concept-balanced resampling flattens the long tail of concept frequencies",
                "measured": f"Gini {b['gini_before']:.2f} -> {b['gini_after']:.2f}, head/tail "
                f"{b['head_tail_before']:.1f}x -> {b['head_tail_after']:.1f}x on ground-truth concepts",
                "verdict": "agree" if b["gini_after"] < b["gini_before"] else "disagree",
            }
        )


# ------------------------------------------------------------------------------------------------ rendering


def render_markdown(rep: Report, header: str) -> str:
    parts = [header, "## Findings, one line each\n"]
    parts.append(
        _table(
            ["source", "what the source reports", "what ovkit measured", "agree?"],
            [[f"[{f['source']}]", f["claim"], f["measured"], f["verdict"]] for f in rep.findings],
        )
    )
    for title, body in rep.sections:
        parts.append(f"\n## {title}\n\n{body}")
    parts.append("\n## References\n\n" + "\n".join(f"- [{k}] {v}" for k, v in SOURCES.items()) + "\n")
    return "\n".join(parts)


def render_html(markdown: str, figures: dict[str, Path]) -> str:
    """A self-contained page: the markdown's tables and paragraphs as HTML, figures inline as base64 PNGs."""

    out, table = [], []

    def flush() -> None:
        if table:
            cells = [
                [c.strip() for c in row.strip().strip("|").split(" | ")]
                for row in table
                if not set(row.replace("|", "").strip()) <= {"-"}
            ]
            head, *body = cells
            out.append(
                "<table><tr>"
                + "".join(f"<th>{html.escape(c)}</th>" for c in head)
                + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
                + "</table>"
            )
            table.clear()

    by_file = {f"figures/{p.name}": p for p in figures.values()}
    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.startswith("!["):
            src = line[line.index("(") + 1 : line.rindex(")")]
            if src in by_file and by_file[src].is_file():
                data = base64.b64encode(by_file[src].read_bytes()).decode()
                out.append(f'<img src="data:image/png;base64,{data}" style="max-width:100%">')
        elif line.startswith("- "):
            out.append(f"<li>{html.escape(line[2:])}</li>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    style = (
        "body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse;margin:8px "
        "0}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>ovkit science "
        f"report</title><style>{style}</style></head><body>{''.join(out)}</body></html>\n"
    )


def build_report(run: Path, science: Path | None = None) -> Report:
    """Read everything under `run` (the pipeline's RUN) and `science` (default RUN/science), write the report there."""
    run = Path(run)
    science = Path(science) if science else run / "science"
    figs = science / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    rep = Report()
    rl_section(rep, load_runs(science), figs)
    algos = algos_section(rep, load_runs(science / "algos", tuple(ALGOS)), figs)
    bucket_section(rep, science / "buckets" / "report.json", figs, science / "vllm-buckets" / "report.json")
    turns_section(rep, science / "turns")
    packing_section(rep, run / "plans" / "pretrain" / "stats.json")
    balance_section(rep, run / "data" / "pretrain", run / "data" / "pretrain-balanced", figs)
    findings(rep)
    header = (
        "# ovkit science report: the seed write-ups' findings, rerun with ovkit's own commands\n\n"
        f"Inputs: `{run}` (the pipeline's outputs) and `{science}` (`make science`). Every number below is read from "
        "those files; report.json holds them all.\n"
    )
    markdown = render_markdown(rep, header)
    (science / "report.md").write_text(markdown)
    (science / "report.html").write_text(render_html(markdown, rep.figures))
    if algos is not None:  # `make science-algos` alone: its section, readable without the rest of the report
        (science / "algos.md").write_text(
            "# ovkit science report: RL algorithms (`make science-algos`)\n\n"
            f"Inputs: `{run}` (the pipeline's outputs) and `{science / 'algos'}`; every number is read from those "
            "files (report.json, under numbers.algos).\n\n" + algos
        )
    (science / "report.json").write_text(
        json.dumps({"findings": rep.findings, "numbers": rep.numbers}, indent=1, default=_plain) + "\n"
    )
    return rep


def _plain(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)
