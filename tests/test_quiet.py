"""`--quiet` means quiet: no progress bar reaches stderr, ovkit's own nor those transformers, huggingface_hub and
datasets draw (transformers' "Writing model shards" and "Loading weights" bars came through before); without
--quiet ovkit's bars are there, and the libraries' switches are back as they were after a quiet command."""

import json
import re

import pytest

BAR = re.compile(r"\d+%\||it/s\]|\?it/s")


@pytest.fixture(scope="module", autouse=True)
def library_bars_on():
    """Start from the libraries' defaults (bars on): earlier tests may have switched transformers' off for good."""
    import transformers.utils.logging as transformers_bars

    was = transformers_bars.is_progress_bar_enabled()
    transformers_bars.enable_progress_bar()
    yield
    (transformers_bars.enable_progress_bar if was else transformers_bars.disable_progress_bar)()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cli, library_bars_on):
    base = tmp_path_factory.mktemp("quiet")
    code, _, err = cli("synth", "--out", base / "data", "--scale", "0.02", "--quiet")
    assert code == 0 and not BAR.search(err), err
    code, _, err = cli("init-model", "--preset", "tiny", "--corpus", base / "data", "--out", base / "model", "--quiet")
    assert code == 0 and not BAR.search(err), err  # "Writing model shards" is transformers' bar
    return base


def test_eval_quiet_prints_no_bar_and_loud_does(cli, tiny):
    args = ["eval", tiny / "data" / "eval", "--model", tiny / "model", "--limit", "1", "--max-new-tokens", "2"]
    code, out, err = cli(*args, "--out", tiny / "eval-quiet", "--quiet")
    assert code == 0 and out.startswith("eval:")
    assert not BAR.search(err), err  # "Loading weights" is transformers' bar
    code, _, err = cli(*args, "--out", tiny / "eval-loud")
    assert code == 0 and BAR.search(err)  # ovkit's encode/generate bars


@pytest.mark.parametrize("transformers_on", [True, False])
def test_library_switches_are_restored_after_a_quiet_command(transformers_on):
    import datasets.utils as datasets_bars
    import huggingface_hub.utils as hub_bars
    import transformers.utils.logging as transformers_bars

    from ovkit.progress import silence_library_bars

    before = (
        transformers_bars.is_progress_bar_enabled(),
        hub_bars.are_progress_bars_disabled(),
        datasets_bars.are_progress_bars_disabled(),
    )
    try:
        (transformers_bars.enable_progress_bar if transformers_on else transformers_bars.disable_progress_bar)()
        hub_bars.enable_progress_bars()
        datasets_bars.enable_progress_bars()
        restore = silence_library_bars()
        assert (
            not transformers_bars.is_progress_bar_enabled()
            and hub_bars.are_progress_bars_disabled()
            and datasets_bars.are_progress_bars_disabled()
        )
        restore()
        assert transformers_bars.is_progress_bar_enabled() == transformers_on
        assert not hub_bars.are_progress_bars_disabled() and not datasets_bars.are_progress_bars_disabled()
    finally:
        (transformers_bars.enable_progress_bar if before[0] else transformers_bars.disable_progress_bar)()
        (hub_bars.disable_progress_bars if before[1] else hub_bars.enable_progress_bars)()
        (datasets_bars.disable_progress_bars if before[2] else datasets_bars.enable_progress_bars)()


def test_rl_train_quiet_prints_no_bar(cli, tiny):
    code, out, err = cli(
        "rl-train",
        tiny / "data" / "rl",
        "--model",
        tiny / "model",
        "--out",
        tiny / "rl",
        "--max-steps",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "2",
        "--reward-workers",
        "1",
        "--quiet",
    )
    assert code == 0 and out.startswith("rl-train stage 1: 1 steps"), err
    assert not BAR.search(err), err


def test_quiet_from_python_is_quiet_and_restores_the_library_switches(tiny, tmp_path, capfd):
    """run_eval(EvalConfig(..., quiet=True)) from Python draws no bar (transformers' "Loading weights" came through:
    only the CLI turned the libraries' switches off), and the switches are back on after it."""
    import transformers.utils.logging as transformers_bars

    from ovkit.evaluate import EvalConfig, run_eval

    out = tmp_path / "eval"
    out.mkdir()
    cfg = EvalConfig(
        data=[tiny / "data" / "eval"], model=tiny / "model", out=out, limit=1, max_new_tokens=2, quiet=True
    )
    capfd.readouterr()
    assert run_eval(cfg, out)["rows"] >= 1
    stdout, err = capfd.readouterr()
    assert not BAR.search(err) and not stdout, err
    assert transformers_bars.is_progress_bar_enabled()


def test_eval_draws_one_bar_over_every_token_budget_group(cli, tiny, tmp_path):
    """Without --max-new-tokens each category has its own token budget and is generated in its own call; the run
    still shows one bar, over every completion, with its ETA (the engine's bar per call is replaced)."""
    args = ["eval", tiny / "data" / "eval", "--model", tiny / "model", "--limit", "1", "--out", tmp_path / "e"]
    code, _, err = cli(*args)
    assert code == 0, err
    rows = json.loads((tmp_path / "e" / "ovkit.json").read_text())["metrics"]["rows"]
    budgets = json.loads((tmp_path / "e" / "summary.json").read_text())["max_new_tokens"]
    assert len(set(budgets.values())) > 1  # several groups, so several engine calls
    frames = err.replace("\r", "\n").splitlines()
    assert not [f for f in frames if f.startswith("generate")]
    eval_frames = [f for f in frames if re.match(r"eval: +\d+%\|", f)]
    totals = {re.search(r"\| *\d+/(\d+) \[", f)[1] for f in eval_frames}
    assert totals == {str(rows)} and any(f"{rows}/{rows}" in f for f in eval_frames)
    assert any(re.search(r"\[\d\d:\d\d<\d\d:\d\d", f) for f in eval_frames)  # elapsed<remaining: the ETA
