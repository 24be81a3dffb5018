"""rl-train's SFT mix (PPO-ptx, ovkit.rl.sftmix): at --sft-coef 0 a step is bit for bit the step without it; with
the RL advantages all zero the step's gradient is exactly C x the SFT gradient of the same rows as `ovkit sft`
computes it, and the logged loss that NLL per answer token; the rows depend on the seed and the step alone, and N
processes share one draw; bad combinations exit 2 naming both options; a tiny run finishes and logs sft/loss."""

import json
import math

import pytest
import torch
from helpers import TINY, rl_cfg, rl_groups, rl_rows

from ovkit.data import samples_table, write_samples

pytestmark = pytest.mark.usefixtures("one_thread")

COEF = 0.25


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    """The RL prompts as SFT rows: each prompt answered `<answer>N</answer>` (the tokenizer of rl_assets knows it)."""
    rows = []
    for r in rl_rows():
        messages = [*r["messages"], {"role": "assistant", "content": f"<answer>{r['answer']}</answer>"}]
        rows.append({k: v for k, v in r.items() if k not in ("answer", "answer_type")} | {"messages": messages})
    path = tmp_path_factory.mktemp("sft-mix") / "sft"
    write_samples(samples_table(rows), path)
    return path


class Recording(torch.optim.SGD):
    """SGD that keeps the gradient of every step it takes (what ppo_update accumulated, clipped or not)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _setup(rl_assets, tmp_path, rewards, **kw):
    from ovkit.models import load
    from ovkit.rl.loop import trainable

    model_dir, data = rl_assets
    cfg = rl_cfg(model_dir, data, tmp_path / "unused", max_grad_norm=0.0, **kw)
    model, processor = load(model_dir)
    model.eval()
    groups = rl_groups(model, processor, data, cfg, rewards)
    return cfg, model, processor, groups, trainable(model, cfg)


def _train(cfg, model, processor, groups, params, sft):
    from ovkit.rl.update import train_step

    optimizer = Recording(params, lr=1e-2)
    pad = processor.tokenizer.pad_token_id
    metrics = train_step(
        model, optimizer, params, groups, 0, pad, cfg.correction_config(), None, cfg.update_options(), sft=sft
    )
    return metrics, optimizer.grads


def _mixer(cfg, processor, model, data, coef, rows=4, **kw):
    from ovkit.pack.packed import PackLayout
    from ovkit.rl.sftmix import SFTMixer

    pad, layout = processor.tokenizer.pad_token_id, PackLayout.for_model(model)
    return SFTMixer(
        [data], processor, layout, coef=coef, rows_per_step=rows, seed=cfg.seed, micro_batch_size=8, pad_id=pad, **kw
    )


def test_coef_zero_is_the_step_without_it(rl_assets, sft_data, tmp_path):
    from ovkit.rl.sftmix import sft_mixer

    rewards = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    cfg, model, processor, groups, params = _setup(rl_assets, tmp_path, rewards)
    mixer = sft_mixer(cfg.sft_mix, processor, None, 0, seed=cfg.seed, micro_batch_size=cfg.micro_batch_size)
    assert mixer is None  # the option's default builds nothing: the code path is today's
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, plain = _train(cfg, model, processor, groups, params, None)
    after_plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    # a mixer at C = 0 still runs its forward/backward: its zero gradient leaves every bit of the step's as it was
    _, mixed = _train(cfg, model, processor, groups, params, _mixer(cfg, processor, model, sft_data, 0.0))
    assert len(plain) == len(mixed) == 1
    assert all(torch.equal(a, b) for a, b in zip(plain[0], mixed[0]))
    assert all(torch.equal(p, after_plain[n]) for n, p in model.named_parameters())
    assert any(not torch.equal(after_plain[n], start[n]) for n in start)  # the step did train


def test_zero_advantages_train_exactly_c_times_the_sft_gradient(rl_assets, sft_data, tmp_path):
    from ovkit.train.data import SampleSource
    from ovkit.train.loop import token_nll_sum

    rewards = [[1.0] * 4, [0.0] * 4]  # equal rewards in each group: every advantage is 0, the RL term trains nothing
    cfg, model, processor, groups, params = _setup(rl_assets, tmp_path, rewards)
    mixer = _mixer(cfg, processor, model, sft_data, COEF)
    rows = mixer.rows(0, 0)
    # the same rows as `ovkit sft` encodes, collates and scores them, and the gradient of C x their NLL per token
    source = SampleSource(sft_data, processor, max_len=10_000, model=model)
    batch = source.collate([source[i] for i in sorted(rows)], processor.tokenizer.pad_token_id)
    nll = token_nll_sum(model, batch, torch.device("cpu"))
    tokens = int(batch["num_targets"])
    expected = torch.autograd.grad(COEF * nll / tokens, params)

    metrics, grads = _train(cfg, model, processor, groups, params, mixer)
    assert metrics["advantage/abs_mean"] == 0.0
    assert metrics["sft/tokens"] == tokens > 0
    assert metrics["sft/loss"] == pytest.approx(float(nll.detach()) / tokens, rel=1e-6)
    assert len(grads) == 1
    for got, want in zip(grads[0], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_a_step_whose_rl_tokens_are_all_masked_still_trains_its_sft_rows(rl_assets, sft_data, tmp_path):
    """Every RL token masked by the correction: without the mix the step is skipped (nothing to train); with it the
    step is applied, and its gradient is C x the SFT rows' alone (the masked RL term contributes exactly zero)."""
    from ovkit.rl.correction import Correction
    from ovkit.rl.update import train_step

    rewards = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]]  # advantages nonzero: only the mask silences RL
    cfg, model, processor, groups, params = _setup(rl_assets, tmp_path, rewards)
    every = Correction(mode="token-mis", lower=10.0, upper=20.0)  # ratios near 1 are all outside [10, 20]
    pad = processor.tokenizer.pad_token_id

    def step(sft):
        optimizer = Recording(params, lr=1e-2)
        metrics = train_step(model, optimizer, params, groups, 0, pad, every, None, cfg.update_options(), sft=sft)
        return metrics, optimizer.grads

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics, grads = step(None)
    assert metrics["all_masked"] == 1.0 and metrics["skipped_updates"] == 1 and grads == []
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())

    mixer = _mixer(cfg, processor, model, sft_data, COEF)
    expected = _mixer(cfg, processor, model, sft_data, COEF)  # the same draw, scored alone
    model.zero_grad(set_to_none=True)
    expected.backward(model, 0, 0)
    want = [p.grad.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    metrics, grads = step(mixer)
    assert metrics["all_masked"] == 1.0 and metrics["skipped_updates"] == 0 and metrics["sft/tokens"] > 0
    assert len(grads) == 1
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())


def test_rows_follow_the_seed_and_step_and_processes_share_one_draw(rl_assets, sft_data, tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.models import load

    model_dir, data = rl_assets
    cfg = rl_cfg(model_dir, data, tmp_path / "unused", seed=3)
    model, processor = load(model_dir)
    one = _mixer(cfg, processor, model, sft_data, COEF)
    again = _mixer(cfg, processor, model, sft_data, COEF)
    assert [one.rows(s, k) for s in range(5) for k in range(2)] == [
        again.rows(s, k) for s in range(5) for k in range(2)
    ]
    assert len({tuple(one.rows(s, 0)) for s in range(5)}) > 1  # the step moves the draw
    other = _mixer(rl_cfg(model_dir, data, tmp_path / "unused", seed=4), processor, model, sft_data, COEF)
    assert [other.rows(s, 0) for s in range(5)] != [one.rows(s, 0) for s in range(5)]
    for s in range(5):
        drawn = one.rows(s, 0)
        assert len(set(drawn)) == 4 and all(0 <= r < 6 for r in drawn)  # without replacement, within the table
    # two processes: each takes its share of the one-process draw, together exactly it
    shares = [_mixer(cfg, processor, model, sft_data, COEF, rank=r, world=2) for r in (0, 1)]
    for s in range(3):
        mine = [sorted(shares[r].rows(s, 0)[r::2]) for r in (0, 1)]
        assert sorted(mine[0] + mine[1]) == sorted(one.rows(s, 0))
        got = [int(b["input_ids"].shape[0]) for r in (0, 1) for b in shares[r].batches(s, 0)]
        assert got == [2, 2]
    with pytest.raises(OvkitError, match="multiple of the 2 processes"):
        _mixer(cfg, processor, model, sft_data, COEF, rows=3, world=2)
    with pytest.raises(OvkitError, match="fewer than --sft-rows-per-step 7"):
        _mixer(cfg, processor, model, sft_data, COEF, rows=7)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--sft-coef", "0.1"], ("--sft-coef", "--sft-data")),
        (["--ptx-coef", "0.1"], ("--sft-coef", "--sft-data")),
        (["--sft-data", "SFT"], ("--sft-data", "--sft-coef")),
        (["--sft-rows-per-step", "4"], ("--sft-rows-per-step", "--sft-coef")),
        (["--sft-data", "SFT", "--sft-coef", "-1"], ("--sft-coef",)),
    ],
)
def test_bad_combinations_exit_2_naming_both(cli, rl_assets, sft_data, tmp_path, flags, named):
    model, data = rl_assets
    flags = [str(sft_data) if f == "SFT" else f for f in flags]
    code, _, err = cli("rl-train", data, "--model", model, "--out", tmp_path / "o", *TINY, "--max-steps", "1", *flags)
    assert code == 2, err
    assert all(name in err for name in named), err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_tiny_run_mixes_sft_rows_and_logs_their_loss(cli, rl_assets, sft_data, tmp_path):
    model, data = rl_assets
    out = tmp_path / "out"
    code, _, err = cli(
        "rl-train", data, "--model", model, "--out", out, *TINY, "--max-steps", "2", "--max-staleness", "0",
        "--pretrain-data", sft_data, "--ptx-coef", "0.05", "--sft-rows-per-step", "3", "--seed", "1",
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["ovkit/sft/loss"]) and row["ovkit/sft/loss"] > 0
        assert row["ovkit/sft/tokens"] > 0
        assert f"| sft {row['ovkit/sft/loss']:.3f} |" in err  # the console line shows it too
    config = (out / "config.yaml").read_text()
    assert "sft-coef: 0.05" in config and "sft-rows-per-step: 3" in config
    provenance = json.loads((out / "ovkit.json").read_text())
    assert str(sft_data) in json.dumps(provenance["inputs"])


def test_two_processes_mix_what_one_process_does(rl_assets, sft_data, tmp_path):
    """torchrun (gloo, CPU), 2 processes against 1 with a scripted policy (tests/rl_ddp_runner.py): each process
    trains its half of the step's SFT rows, normalised by every process's answer tokens, so the logged SFT loss and
    the weights are the one process's."""
    from helpers import ROOT, torchrun
    from safetensors.torch import load_file

    model_dir, data = rl_assets
    runner = ROOT / "tests" / "rl_ddp_runner.py"
    for n in (1, 2):
        run = torchrun(n, str(runner), model_dir, data, tmp_path / f"p{n}", "--sft-data", sft_data)
        assert run.returncode == 0, run.stderr[-3000:]
    m1, m2 = ([json.loads(x) for x in (tmp_path / p / "metrics.jsonl").read_text().splitlines()] for p in ("p1", "p2"))
    assert len(m1) == len(m2) == 2
    for a, b in zip(m1, m2):
        assert b["ovkit/sft/tokens"] == a["ovkit/sft/tokens"] > 0
        assert b["ovkit/sft/loss"] == pytest.approx(a["ovkit/sft/loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    w1, w2 = (load_file(tmp_path / p / "model.safetensors") for p in ("p1", "p2"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=2e-5, msg=k)
