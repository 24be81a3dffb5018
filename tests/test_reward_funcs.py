"""`--reward-funcs PATH.py:NAME[:WEIGHT]`: the user's own reward functions, called with TRL's arguments in the reward
worker pool (its time and memory limits), their errors naming the file, the function and the row."""

from __future__ import annotations

import json
import math
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from ovkit.errors import OvkitError
from ovkit.rewards import custom

MODULE = """
import time

def length(prompts, completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]

def echo_columns(prompts, completions, answer, category, id, **kwargs):
    return [float(len(answer[0]) * 100 + len(category[0]) * 10 + len(prompts[0]))]

def not_applicable(prompts, completions, **kwargs):
    return [None]

def sleepy(prompts, completions, **kwargs):
    time.sleep(30)
    return [1.0]

def hungry(prompts, completions, **kwargs):
    block = bytearray(8 << 30)
    return [float(len(block))]

def broken(prompts, completions, **kwargs):
    return [1.0 / 0]

def two_values(prompts, completions, **kwargs):
    return [1.0, 2.0]

def no_kwargs(prompts, completions):
    return [1.0]
"""


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(MODULE))
    return path


def item(completion="four", **over):
    row = {
        "completion": completion,
        "messages": [{"role": "user", "content": "How many letters?"}],
        "id": "r1",
        "answer": "4",
        "answer_type": "number",
        "source": "synth",
        "category": "count",
        "reward_kwargs": None,
    }
    return {**row, **over}


def test_a_spec_reads_its_path_name_and_weight(module):
    f = custom.parse(f"{module}:length:0.5")
    assert (f.path, f.name, f.weight) == (module.resolve(), "length", 0.5)
    assert custom.parse(f"{module}:length").weight == 1.0


@pytest.mark.parametrize(
    "spec, says",
    [
        ("no_colon.py", "expected PATH.py:NAME"),
        ("{m}:", "not a Python function name"),
        ("{m}:length:heavy", "weight 'heavy'"),
        ("{m}:length:nan", "must be finite"),
        ("missing.py:length", "no such file"),
    ],
)
def test_a_bad_spec_is_one_clear_error_naming_the_option(module, spec, says):
    with pytest.raises(OvkitError, match="--reward-funcs") as e:
        custom.parse(spec.format(m=module))
    assert says in str(e.value)


def test_a_missing_function_lists_the_functions_of_the_file(module):
    with pytest.raises(OvkitError, match=r"no function 'lenght' \(functions in it: broken, echo_columns"):
        custom.parse_all([f"{module}:lenght"])


def test_a_function_without_kwargs_is_refused_at_start(module):
    with pytest.raises(OvkitError, match=r"must accept \*\*kwargs"):
        custom.parse_all([f"{module}:no_kwargs"])


def test_a_function_named_like_ovkit_s_own_rewards_is_refused(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def task(prompts, completions, **kw):\n    return [0.0]\n")
    with pytest.raises(OvkitError, match="share its metrics"):
        custom.parse_all([f"{path}:task"])


def test_two_functions_of_one_name_are_refused(module, tmp_path):
    other = tmp_path / "other.py"
    other.write_text(module.read_text())
    with pytest.raises(OvkitError, match="two reward functions named length"):
        custom.parse_all([f"{module}:length", f"{other}:length"])


def test_values_are_what_the_function_returns_with_trl_arguments(module):
    funcs = custom.parse_all([f"{module}:length", f"{module}:echo_columns"])
    out = custom.score(funcs, [item("four"), item("seventeen", answer="17", category="c")], timeout=60)
    assert out[0] == {"length": 4.0, "echo_columns": 100 + 50 + 1}
    assert out[1] == {"length": 9.0, "echo_columns": 200 + 10 + 1}


def test_trl_s_own_reward_function_gives_what_it_gives_under_trl(tmp_path):
    """TRL's think_format_reward, imported from TRL in the user's file, scores in the pool exactly as TRL calls it."""
    from trl.rewards import think_format_reward

    path = tmp_path / "use_trl.py"
    path.write_text("from trl.rewards import think_format_reward\n")
    texts = ["<think>\nsum\n</think>\n4", "4", "<think>x</think><think>y</think>4"]
    got = custom.score(custom.parse_all([f"{path}:think_format_reward"]), [item(t) for t in texts], timeout=120)
    want = think_format_reward([[{"role": "assistant", "content": t}] for t in texts])
    assert [v["think_format_reward"] for v in got] == want
    assert want == [1.0, 0.0, 0.0]  # the case holds both values, so the comparison means something


def test_none_means_not_applicable_and_counts_zero_in_the_weighted_sum(module):
    funcs = custom.parse_all([f"{module}:not_applicable", f"{module}:length:0.5"])
    values = custom.score(funcs, [item("four")], timeout=60)[0]
    assert math.isnan(values["not_applicable"])
    assert custom.weighted(funcs, values) == 2.0


def test_a_function_past_the_time_limit_scores_zero_and_says_so(module):
    funcs = custom.parse_all([f"{module}:sleepy"])
    start = time.monotonic()
    values = custom.score(funcs, [item()], timeout=2.0)[0]
    assert values == {"sleepy": 0.0, "sleepy/timeout": 1.0}
    assert time.monotonic() - start < 25  # killed at its deadline, not waited for


def test_a_function_past_the_memory_cap_scores_zero_and_says_so(module):
    funcs = custom.parse_all([f"{module}:hungry"])
    assert custom.score(funcs, [item()], timeout=60)[0] == {"hungry": 0.0, "hungry/memory": 1.0}


def test_an_exception_names_the_file_the_function_and_the_row(module):
    funcs = custom.parse_all([f"{module}:broken"])
    with pytest.raises(OvkitError, match=r"row 'r1': reward function .*my_rewards.py:broken raised ZeroDivisionError"):
        custom.score(funcs, [item()], timeout=60)


def test_a_wrong_number_of_values_is_an_error(module):
    funcs = custom.parse_all([f"{module}:two_values"])
    with pytest.raises(OvkitError, match="expected a list with one float per completion"):
        custom.score(funcs, [item()], timeout=60)


def test_a_changed_file_is_imported_anew(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def f(prompts, completions, **kw):\n    return [1.0]\n")
    assert custom.load(path, "f")(prompts=[[]], completions=[[{}]]) == [1.0]
    time.sleep(0.01)
    path.write_text("def f(prompts, completions, **kw):\n    return [2.0]\n")
    import os

    os.utime(path, (time.time() + 5, time.time() + 5))  # a coarse file-system clock still sees a new version
    assert custom.load(path, "f")(prompts=[[]], completions=[[{}]]) == [2.0]


def test_rl_rewards_add_the_weighted_functions_and_log_them_as_trl_does(module):
    """score_groups (rl-train, rl-curate): optimised = the built-in mix + sum of weight * value; rollout metrics carry
    rewards/<name>/mean and /std."""
    from ovkit.generate import Completion
    from ovkit.rl.metrics import rollout_metrics
    from ovkit.rollouts.groups import Group, score_groups
    from ovkit.rollouts.prompts import Prompt

    prompt = Prompt(
        id="p",
        encoded=None,
        answer="4",
        answer_type="number",
        source="s",
        category="count",
        messages=[{"role": "user", "content": "2+2?"}],
    )
    texts = ["<answer>4</answer>", "<answer>5</answer> and more"]
    group = Group(prompt, 0, 0, [Completion([1] * 3, t, [0.0] * 3, "stop") for t in texts])
    funcs = custom.parse_all([f"{module}:length:0.5", f"{module}:not_applicable"])
    score_groups([group], mode="answer", format_weight=0.0, workers=1, timeout=60, funcs=funcs)
    assert group.task_rewards == [1.0, 0.0]
    assert group.rewards == [1.0 + 0.5 * len(texts[0]), 0.0 + 0.5 * len(texts[1])]
    assert group.parts[0]["funcs"]["length"] == len(texts[0])
    from ovkit.runtime.log import public

    m = public(rollout_metrics([group]))
    lengths = [float(len(t)) for t in texts]
    assert m["rewards/length/mean"] == sum(lengths) / 2
    assert m["rewards/length/std"] == pytest.approx(abs(lengths[0] - lengths[1]) / 2)
    assert math.isnan(m["rewards/not_applicable/mean"])  # TRL's nanmean of a function that never applied


# -- the three commands ----------------------------------------------------------------------------------------------

LENGTH = 'def length(prompts, completions, **kwargs):\n    return [float(len(c[0]["content"])) for c in completions]\n'


@pytest.fixture
def length_file(tmp_path):
    path = tmp_path / "lengths.py"
    path.write_text(LENGTH)
    return path


def test_a_missing_function_exits_2_before_any_model_loads(rl_assets, tmp_path, cli, length_file):
    model_dir, data = rl_assets
    for command in (["rl-train", "--stage", "1"], ["rl-curate"], ["eval"]):
        code, _, err = cli(
            *command,
            data,
            "--model",
            tmp_path / "no-model",
            "--out",
            tmp_path / "o",
            "--reward-funcs",
            f"{length_file}:lenght",
        )
        assert code == 2 and "--reward-funcs" in err and "no function 'lenght'" in err and "length" in err, err


def test_rl_train_optimises_the_weighted_function_and_logs_it(rl_assets, tmp_path, cli, length_file, one_thread):
    from helpers import TINY

    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    out = tmp_path / "rl"
    code, _, err = cli(
        "rl-train",
        data,
        "--model",
        model_dir,
        "--out",
        out,
        "--stage",
        "1",
        "--max-steps",
        "1",
        "--max-staleness",
        "0",
        "--save-rollouts",
        "--quiet",
        "--reward-funcs",
        f"{length_file}:length:0.25",
        *TINY,
    )
    assert code == 0, err
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    rows = read_rollouts(out / "rollouts").to_pylist()
    parts = [json.loads(r["reward_parts"]) for r in rows]
    lengths = [float(len(r["completion"])) for r in rows]
    assert [p["funcs"]["length"] for p in parts] == lengths
    # stage 1: format weight 0, so what GRPO optimises is the task reward plus 0.25 x the length
    assert [p["optimised"] for p in parts] == pytest.approx([r["reward"] + 0.25 * n for r, n in zip(rows, lengths)])
    assert metrics["rewards/length/mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert (yaml.safe_load((out / "config.yaml").read_text())["reward-funcs"]) == [f"{length_file}:length:0.25"]


def test_rl_curate_keeps_the_values_in_its_rollouts(rl_assets, tmp_path, cli, length_file, one_thread):
    from ovkit.rollouts.table import read_rollouts

    model_dir, data = rl_assets
    out = tmp_path / "curated"
    code, _, err = cli(
        "rl-curate",
        data,
        "--model",
        model_dir,
        "--out",
        out,
        "--n",
        "2",
        "--max-new-tokens",
        "4",
        "--no-system-prompt",
        "--reward-workers",
        "1",
        "--quiet",
        "--reward-funcs",
        f"{length_file}:length",
    )
    assert code == 0, err
    rows = read_rollouts(out / "rollouts").to_pylist()
    assert rows and all(json.loads(r["reward_parts"])["funcs"] == {"length": len(r["completion"])} for r in rows)


def test_eval_reports_the_function_beside_the_score(rl_assets, tmp_path, cli, length_file, one_thread):
    model_dir, data = rl_assets
    out = tmp_path / "eval"
    code, _, err = cli(
        "eval",
        data,
        "--model",
        model_dir,
        "--out",
        out,
        "--max-new-tokens",
        "4",
        "--quiet",
        "--reward-funcs",
        f"{length_file}:length",
    )
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    samples = [json.loads(line) for f in sorted(out.glob("model/*_samples_*.jsonl")) for line in f.open()]
    assert samples and all(s["rewards/length"] == len(s["filtered_resps"][0]) for s in samples)
    assert all(s["reward_parts"][0]["funcs"] == {"length": len(s["filtered_resps"][0])} for s in samples)
    overall = summary["detail"]["overall"]
    assert overall["rewards/length"] == pytest.approx(sum(s["rewards/length"] for s in samples) / len(samples))
    assert overall["reward"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))  # the score unchanged


def test_the_worked_example_of_the_rewards_page_scores_as_it_says(tmp_path):
    """docs/rewards.md's my_rewards.py, run through the pool as `--reward-funcs` runs it."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "rewards.md").read_text()
    code = re.search(r"```python\n(# my_rewards\.py\n.*?)```", page, re.S).group(1)
    path = tmp_path / "my_rewards.py"
    path.write_text(code)
    funcs = custom.parse_all([f"{path}:brevity:0.1", f"{path}:cites_the_count:0.5"])
    short, long = "<answer>4</answer>", "I counted the squares one by one and there are 4 of them. " * 3
    got = custom.score(funcs, [item(short), item(long), item("five")], timeout=60)
    assert got[0] == {"brevity": 0.0, "cites_the_count": 1.0}
    assert got[1] == {"brevity": -1.0, "cites_the_count": 1.0}
    assert got[2] == {"brevity": 0.0, "cites_the_count": 0.0}
    assert custom.weighted(funcs, got[1]) == pytest.approx(-0.1 + 0.5)
