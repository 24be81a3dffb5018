"""report.md and report.html from report.json's content: the same tables, rendered twice.

report.html is one self-contained file (inline CSS, figures as base64 PNGs), so it opens offline and can be mailed.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# metric -> what it is (the rows of the headline table, in order)
HEADLINE = {
    "k3_kl": "K3 estimate of KL(sampler || learner), mean exp(r) - r - 1 (`vllm-kl`)",
    "kl": "k1 estimate of the same KL, mean logp_s - logp_l",
    "training_ppl": "learner PPL, mean over responses of exp(-mean logp_l)",
    "rollout_ppl": "sampler PPL, mean over responses of exp(-mean logp_s)",
    "log_ppl_diff": "mean over responses of log(learner PPL / sampler PPL)",
    "log_ppl_abs_diff": "mean abs of the same",
    "ppl_ratio": "mean learner PPL / sampler PPL",
    "chi2_token": "mean w^2 - 1, w = p_l / p_s per token",
    "chi2_seq": "mean (prod w)^2 - 1 per response",
    "rollout_probs_diff_mean": "mean abs(p_s - p_l) over tokens",
    "rollout_probs_diff_max": "max abs(p_s - p_l) over tokens",
    "rollout_actor_probs_pearson_corr": "Pearson correlation of p_s and p_l over tokens",
    "max_mismatch_mean": "per-response max abs(p_s - p_l), mean over responses",
    "max_mismatch_p90": "... 90th percentile over responses",
    "max_mismatch_frac_high": "share of responses whose max abs(p_s - p_l) > 0.5",
    "mean_mismatch_mean": "per-response mean abs(p_s - p_l), mean over responses",
    "token_is_eff_sample_size": "ESS of the token weights, (sum w)^2 / (n sum w^2)",
    "seq_is_eff_sample_size": "ESS of the sequence weights prod w",
}


def fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def pct(value: float) -> str:
    return f"{100 * value:.2f}%"


@dataclass
class Table:
    title: str
    columns: Sequence[tuple[str, str]]  # (key, header)
    rows: Sequence[dict[str, Any]]
    note: str = ""
    formats: dict[str, Callable[[Any], str]] | None = None

    def cells(self) -> list[list[str]]:
        formats = self.formats or {}
        return [[formats.get(k, fmt)(row.get(k)) for k, _ in self.columns] for row in self.rows]

    def markdown(self) -> str:
        def cell(text: str) -> str:
            return text.replace("|", "\\|")  # a bare pipe would split the markdown cell

        head = "| " + " | ".join(cell(h) for _, h in self.columns) + " |"
        rule = "|" + "|".join("---" for _ in self.columns) + "|"
        body = ["| " + " | ".join(map(cell, c)) + " |" for c in self.cells()]
        note = f"\n{self.note}\n" if self.note else ""
        return f"#### {self.title}\n{note}\n" + "\n".join([head, rule, *body]) + "\n"

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for _, h in self.columns)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in self.cells())
        note = f"<p class='note'>{html.escape(self.note)}</p>" if self.note else ""
        table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        return f"<h4>{html.escape(self.title)}</h4>{note}{table}"


def run_tables(run: dict[str, Any]) -> list[Table]:
    m = run["metrics"]
    weights = [
        {
            "weights": level,
            **{k: m[f"{prefix}_{k}"] for k in ("mean", "std", "min", "p01", "p50", "p99", "max", "eff_sample_size")},
        }
        for level, prefix in (("token w = p_l / p_s", "token_is"), ("sequence prod w", "seq_is"))
    ]
    corrections = [{"mode": mode, **row} for mode, row in run["corrections"].items()]
    return [
        Table(
            "Headline metrics",
            [("metric", "metric"), ("value", "value"), ("meaning", "meaning")],
            [{"metric": k, "value": m[k], "meaning": v} for k, v in HEADLINE.items()],
        ),
        Table(
            "Importance weights",
            [
                ("weights", "weights"),
                ("mean", "mean"),
                ("std", "std"),
                ("min", "min"),
                ("p01", "p1"),
                ("p50", "median"),
                ("p99", "p99"),
                ("max", "max"),
                ("eff_sample_size", "ESS"),
            ],
            weights,
            "Raw weights (log-ratio clamped to +-20), before any correction.",
        ),
        Table(
            "What rl-train's corrections would do",
            [
                ("mode", "mode"),
                ("action", "action"),
                ("rule", "rule"),
                ("token_frac", "tokens"),
                ("seq_frac", "responses"),
            ],
            corrections,
            "Share of compared tokens (and of responses with at least one such token) each mode would clip (TIS) or "
            "mask (MIS, geo-rs, behaviour cap, veto), computed with ovkit.rl.correction.",
            {"token_frac": pct, "seq_frac": pct},
        ),
        Table(
            "Mismatch by sampler probability",
            [
                ("bin", "p_sampler"),
                ("tokens", "tokens"),
                ("share", "share"),
                ("mean_log_ratio", "mean log ratio"),
                ("mean_abs_log_ratio", "mean |log ratio|"),
                ("k3_kl", "K3"),
                ("mean_abs_prob_diff", "mean |dp|"),
                ("learner_lower_frac", "learner lower"),
            ],
            run["by_sampler_prob"],
            "log ratio = log p_learner - log p_sampler. The low-probability-token trap [2, section 3.3]: the gap "
            "concentrates where the sampler's probability is small.",
            {"share": pct, "learner_lower_frac": pct},
        ),
        Table(
            "First turn vs later turns",
            [
                ("turn", "turn"),
                ("segments", "turn outputs"),
                ("tokens", "tokens"),
                ("k3_kl", "K3"),
                ("kl", "k1"),
                ("rollout_log_ppl", "sampler log-PPL"),
                ("training_log_ppl", "learner log-PPL"),
                ("log_ppl_abs_diff", "mean |log-PPL diff|"),
                ("mean_abs_prob_diff", "mean |dp|"),
                ("pearson", "Pearson"),
            ],
            run["by_turn"],
            "Later turns of multi-turn rollouts mismatch more [2, section 3.4.1]."
            + ("" if len(run["by_turn"]) > 1 else " These rollouts are single-turn: only the first turn exists."),
        ),
        Table(
            "Max mismatch by response length",
            [
                ("bucket", "compared tokens"),
                ("responses", "responses"),
                ("mean_length", "mean length"),
                ("max_mismatch_mean", "mean max |dp|"),
                ("max_mismatch_p90", "p90 max |dp|"),
                ("max_mismatch_frac_high", "max |dp| > 0.5"),
                ("mean_mismatch_mean", "mean mean |dp|"),
                ("k3_kl", "K3"),
            ],
            run["by_length"],
            "Longer responses have larger max mismatch while the mean mismatch barely moves [1].",
            {"max_mismatch_frac_high": pct},
        ),
        _group_table("By category", "category", run["by_category"]),
        _group_table("By source", "source", run["by_source"]),
    ]


def _group_table(title: str, key: str, rows: Sequence[dict[str, Any]]) -> Table:
    columns = [
        (key, key),
        ("responses", "responses"),
        ("tokens", "tokens"),
        ("k3_kl", "K3"),
        ("kl", "k1"),
        ("training_ppl", "learner PPL"),
        ("rollout_ppl", "sampler PPL"),
        ("chi2_token", "chi2 token"),
        ("max_mismatch_mean", "mean max |dp|"),
        ("mean_mismatch_mean", "mean mean |dp|"),
        ("reward_mean", "reward"),
    ]
    return Table(title, columns, rows)


def comparison_table(runs: dict[str, dict[str, Any]]) -> Table:
    rows = []
    for name, run in runs.items():
        m = run["metrics"]
        row = {
            "run": name,
            **{
                k: m[k]
                for k in (
                    "responses",
                    "tokens",
                    "k3_kl",
                    "kl",
                    "training_ppl",
                    "rollout_ppl",
                    "chi2_token",
                    "max_mismatch_mean",
                    "mean_mismatch_mean",
                )
            },
        }
        row.update({f"{mode}": c["token_frac"] for mode, c in run["corrections"].items()})
        rows.append(row)
    modes = list(next(iter(runs.values()))["corrections"])
    columns = [
        ("run", "run"),
        ("responses", "responses"),
        ("tokens", "tokens"),
        ("k3_kl", "K3 (vllm-kl)"),
        ("kl", "k1"),
        ("training_ppl", "learner PPL"),
        ("rollout_ppl", "sampler PPL"),
        ("chi2_token", "chi2 token"),
        ("max_mismatch_mean", "mean max |dp|"),
        ("mean_mismatch_mean", "mean mean |dp|"),
    ]
    columns += [(mode, f"{mode} tokens") for mode in modes]
    return Table(
        "Comparison",
        columns,
        rows,
        "Same prompts and seed for every sampler; the learner is the same forward pass each time.",
        {mode: pct for mode in modes},
    )


# The write-ups the notes cite as [1] and [2].
REFERENCES = (
    'Feng Yao, Liyuan Liu, Dinghuai Zhang, Chengyu Dong, Jingbo Shang, Jianfeng Gao, "Your Efficient RL Framework '
    'Secretly Brings You Off-Policy RL Training", 2025.',
    'Jiacai Liu, Yingru Li, Yuqian Fu, Jiawei Wang, Qian Liu, Yu Shen, "When Speed Kills Stability: Demystifying RL '
    'Collapse from the Training-Inference Mismatch", 2025.',
)


def header_lines(doc: dict[str, Any]) -> list[str]:
    lines = [
        f"learner: {doc['model']} ({doc['learner_precision']}, {doc['device']})",
        f"temperature: {doc['temperature']:g} ({doc['temperature_from']}); the learner divides its logits by it, as "
        f"rl-train does",
    ]
    if doc.get("top_p") is not None and doc["top_p"] < 1:
        lines.append(
            f"top-p {doc['top_p']:g}: the sampler's log-probs are renormalised over the nucleus and the learner's "
            f"are not, so part of the gap is the truncation (as in rl-train)"
        )
    th = doc["thresholds"]
    lines.append("correction thresholds: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in th.items()))
    return lines


def run_summary(run: dict[str, Any]) -> str:
    c = run["counts"]
    line = f"rollouts: {run['rollouts']}; {c['responses']:,} responses, {c['compared_tokens']:,} compared tokens"
    if c["cut_tokens"]:
        line += f", {c['cut_tokens']:,} sampled tokens at or after a multimodal placeholder not compared"
    return line


def markdown(doc: dict[str, Any], figure_paths: dict[str, dict[str, str]]) -> str:
    parts = ["# Sampler/learner mismatch report\n", *(f"- {line}" for line in header_lines(doc)), ""]
    runs = doc["runs"]
    if len(runs) > 1:
        parts += [comparison_table(runs).markdown(), "![compare](figures/compare.png)\n"]
    for name, run in runs.items():
        parts.append(f"## {name}\n")
        parts.append(run_summary(run) + "\n")
        parts += [t.markdown() for t in run_tables(run)]
        parts += [f"![{stem}]({path})\n" for stem, path in figure_paths.get(name, {}).items()]
    parts.append("## References\n")
    parts += [f"{i}. {ref}" for i, ref in enumerate(REFERENCES, 1)]
    return "\n".join(parts) + "\n"


CSS = """
body { font-family: -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1100px; color:
#222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
p.note { color: #555; font-size: 13px; margin: 0.2em 0; } img { max-width: 100%; margin: 0.5em 0; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 2em; }
"""


def _img(png: bytes, alt: str) -> str:
    return f"<img alt='{html.escape(alt)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"


def html_page(doc: dict[str, Any], figures: dict[str, dict[str, bytes]], compare_png: bytes | None) -> str:
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>mismatch "
        f"report</title><style>{CSS}</style></head><body>"
    ]
    parts.append(
        "<h1>Sampler/learner mismatch report</h1><ul>"
        + "".join(f"<li>{html.escape(line)}</li>" for line in header_lines(doc))
        + "</ul>"
    )
    runs = doc["runs"]
    if len(runs) > 1:
        parts.append(comparison_table(runs).html())
        if compare_png is not None:
            parts.append(_img(compare_png, "compare"))
    for name, run in runs.items():
        parts.append(f"<h2>{html.escape(name)}</h2><p>{html.escape(run_summary(run))}</p>")
        parts += [t.html() for t in run_tables(run)]
        parts += [_img(png, stem) for stem, png in figures.get(name, {}).items()]
    parts.append("<h2>References</h2><ol>" + "".join(f"<li>{html.escape(ref)}</li>" for ref in REFERENCES) + "</ol>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
