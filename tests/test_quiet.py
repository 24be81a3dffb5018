"""`--quiet` means quiet: no progress bar reaches stderr, ovkit's own nor those transformers, huggingface_hub and
datasets draw (transformers' "Writing model shards" and "Loading weights" bars came through before); without
--quiet the bars are there, and the libraries' switches are back as they were after a quiet command."""

import re

import pytest

BAR = re.compile(r"\d+%\||it/s\]|\?it/s")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cli):
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
    assert code == 0 and "Loading weights" in err and BAR.search(err)  # the libraries' switches were restored


def test_rl_train_quiet_prints_no_bar(cli, tiny):
    code, out, err = cli(
        "rl-train", tiny / "data" / "rl", "--model", tiny / "model", "--out", tiny / "rl", "--max-steps", "1",
        "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2", "--reward-workers", "1", "--quiet",
    )
    assert code == 0 and out.startswith("rl-train stage 1: 1 steps"), err
    assert not BAR.search(err), err
