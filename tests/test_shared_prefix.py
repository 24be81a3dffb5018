"""rl-train's `--shared-prefix` (ovkit.rollouts.shared): each group's prompt is forwarded once per learner micro-batch
and its completions attend to it, with the log-probs, entropies and every parameter's gradient of the plain learner
(one padded row per trajectory): on the attention alone (hand-made tensors, grouped-query heads), on groups with one
and with two images, with groups split across micro-batches and several groups in one, through a whole GRPO step
(the weights it moves), with LoRA adapters; and the fallback where a model cannot share. Multi-turn trajectories (only
the first turn shared) are in tests/test_multiturn.py, two processes in tests/test_rl_train.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_learner, learner_plans, logprobs_and_grads, rl_cfg, rl_groups, rl_image

from ovkit.data import image_cell, samples_table, write_samples
from ovkit.models.attention import SharedPrefixPlan, _shared_sdpa

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ the attention


def _reference(q, k, v, segments):
    """Each trajectory as its own causal sequence (its prompt, then its completion), and each prompt alone: what a
    plain learner computes, placed at the shared row's positions."""
    out = torch.zeros_like(q)
    attend = lambda idx: F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True)  # noqa: E731
    for start, length, suffixes in segments:
        prefix = torch.arange(start, start + length)
        out[:, :, prefix] = attend(prefix)
        for a, n in suffixes:
            own = torch.arange(a, a + n)
            out[:, :, own] = attend(torch.cat([prefix, own]))[:, :, length:]
    return out


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_attention_is_each_trajectorys_own_with_gradients(kv_heads):
    """Outputs and the gradients of queries, keys and values equal those of each trajectory's own causal attention,
    prompts of different lengths, completions of different lengths (one of a single token), grouped-query heads."""
    torch.manual_seed(0)
    segments = [(0, 5, [(5, 3), (8, 1), (9, 4)]), (13, 7, [(20, 2), (22, 6)])]
    total = 28
    q = torch.randn(1, 4, total, 8, requires_grad=True)
    k = torch.randn(1, kv_heads, total, 8, requires_grad=True)
    v = torch.randn(1, kv_heads, total, 8, requires_grad=True)
    weights = torch.randn(1, total, 4, 8)
    got = _shared_sdpa(_Module().eval(), q, k, v, SharedPrefixPlan.of(segments), None, 0.0)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    rep = 4 // kv_heads
    want = _reference(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), segments).transpose(1, 2)
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the learner


@pytest.fixture(scope="module")
def learner(rl_assets):
    """The tiny model as rl-train's learner loads it (ovkit's varlen attention), its processor and layout."""
    from ovkit.models import attention as attn
    from ovkit.models import load
    from ovkit.pack.packed import PackLayout

    model_dir, _ = rl_assets
    model, processor = load(model_dir)
    attn.apply(model, attn.resolve("sdpa", "cpu", train=True))
    model.eval()
    return model, processor, PackLayout.for_model(model)


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    """Two prompts with two images each."""
    rows = [
        {
            "id": f"pair-{i}",
            "images": [image_cell(rl_image(n, "red")), image_cell(rl_image(n + 1, "blue"))],
            "messages": [{"role": "user", "content": "<image><image>\nHow many squares are there?"}],
            "source": "test/count",
            "category": "counting",
            "answer": str(2 * n + 1),
            "answer_type": "number",
        }
        for i, n in enumerate((1, 2))
    ]
    data = tmp_path_factory.mktemp("two-images") / "data"
    write_samples(samples_table(rows), data)
    return data


def _batch(learner, data, tmp_path, rewards=([1, 0, 1, 0], [0, 1, 1, 0])):
    from ovkit.models.encode import multimodal_token_ids
    from ovkit.rollouts.trajectories import build_trajectories

    model, processor, _ = learner
    groups = rl_groups(model, processor, data, None, [list(r) for r in rewards])
    return groups, build_trajectories(groups, processor.tokenizer.pad_token_id, multimodal_token_ids(model.config))


@pytest.mark.parametrize("micro", [8, 3])
def test_log_probs_and_gradients_are_the_plain_learners(learner, rl_assets, tmp_path, micro):
    """Two groups of 4 with an image each, in one micro-batch (both groups in one row) or in micro-batches of 3 (a
    group split across two rows, its prompt in both): the same log-probs, entropies and gradients, with each prompt
    and its image forwarded once per row."""
    model, _, layout = learner
    _, batch = _batch(learner, rl_assets[1], tmp_path)
    plain, shared = learner_plans(batch, layout, micro, False), learner_plans(batch, layout, micro, True)
    assert_same_learner(logprobs_and_grads(model, batch, plain), logprobs_and_grads(model, batch, shared))
    if micro == 8:
        (row,) = shared
        prompts = sorted(set(zip(batch.prompt_keys, batch.prompt_lengths)))
        responses = sum(batch.lengths[i] - batch.prompt_lengths[i] for i in range(batch.size) if batch.mask_cols[i])
        assert row.inputs["input_ids"].shape == (1, sum(n for _, n in prompts) + responses)
        assert row.inputs["image_grid_thw"].shape[0] == 2  # one image per group, not per sample
        assert plain[0].inputs["image_grid_thw"].shape[0] == 8


def test_several_images_per_prompt(learner, two_images, tmp_path):
    model, _, layout = learner
    _, batch = _batch(learner, two_images, tmp_path)
    plain, shared = learner_plans(batch, layout, 8, False), learner_plans(batch, layout, 8, True)
    assert shared[0].inputs["image_grid_thw"].shape[0] == 4  # 2 groups x 2 images
    assert_same_learner(logprobs_and_grads(model, batch, plain), logprobs_and_grads(model, batch, shared))


def _step_delta(learner, groups, tmp_path, share, lora=False):
    """The weight change of one whole GRPO step (rl-train's update: advantages, fused proximal pass, clipped loss,
    micro-batches of 3) under SGD at lr 1 with no clipping: minus the step's gradient."""
    from ovkit.models import lora as ovlora
    from ovkit.models.groups import trainable_names
    from ovkit.rl.update import train_step

    model = copy.deepcopy(learner[0])
    processor = learner[1]
    if lora:
        torch.manual_seed(2)  # the same adapters in both runs
        ovlora.apply(model, trainable_names(model, ["llm"]), ovlora.LoraSpec(r=2))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, where A's gradient vanishes: give both a gradient
                p.data.normal_(0, 0.05)
    cfg = rl_cfg("unused", "unused", tmp_path / "unused", micro_batch_size=3, max_grad_norm=1e9, shared_prefix=share)
    params = [p for p in model.parameters() if p.requires_grad]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(
        model,
        torch.optim.SGD(params, lr=1.0),
        params,
        groups,
        0,
        processor.tokenizer.pad_token_id,
        cfg.correction_config(),
        None,
        cfg.update_options(),
        layout=learner[2],
    )
    return metrics, {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_grpo_step_moves_the_weights_as_the_plain_learner(learner, rl_assets, tmp_path, lora):
    groups, _ = _batch(learner, rl_assets[1], tmp_path)
    m_plain, d_plain = _step_delta(learner, groups, tmp_path, "off", lora)
    m_shared, d_shared = _step_delta(learner, groups, tmp_path, "on", lora)
    assert any(d.abs().max() > 0 for d in d_plain.values())
    for name, d in d_plain.items():
        assert (d_shared[name] - d).abs().max() <= 1e-4 * d.abs().max().clamp(min=1e-6), name
    for key in ("pg_loss", "entropy", "mismatch/delta_logp_max", "grad_norm"):
        assert m_shared[key] == pytest.approx(m_plain[key], rel=1e-4, abs=1e-6), key


def test_a_model_that_cannot_share_falls_back_and_says_so_once(learner, rl_assets, tmp_path, capsys):
    from ovkit.models import attention as attn
    from ovkit.rl.update import prepare_step
    from ovkit.rollouts import shared

    groups, _ = _batch(learner, rl_assets[1], tmp_path)
    model = copy.deepcopy(learner[0])
    attn.apply(model, attn.resolve("eager", "cpu", train=True))
    update = rl_cfg("unused", "unused", tmp_path / "unused").update_options()
    assert update.shared_prefix
    shared._say_once.cache_clear()
    for _ in range(2):
        sb = prepare_step(groups, 0, learner[1].tokenizer.pad_token_id, model.config, update)
        assert all(plan.hidden_index is None for mb in sb.minibatches for plan in mb)
    err = capsys.readouterr().err
    assert err.count("--shared-prefix on") == 1 and "eager" in err
    on = prepare_step(groups, 0, learner[1].tokenizer.pad_token_id, learner[0].config, update, learner[2])
    assert all(plan.hidden_index is not None for mb in on.minibatches for plan in mb)


def test_a_shared_row_refuses_an_attention_that_would_not_mask_it(learner, rl_assets, tmp_path):
    """Under SDPA's plain causal mask the completions of a shared row would attend to each other: refused, not
    silently wrong."""
    from ovkit.models import attention as attn
    from ovkit.rollouts.trajectories import sequence_logprobs

    _, batch = _batch(learner, rl_assets[1], tmp_path)
    (plan,) = learner_plans(batch, learner[2], 8, True)
    model = copy.deepcopy(learner[0])
    attn.apply(model, attn.resolve("sdpa", "cpu", train=False))
    with pytest.raises(ValueError, match="shared-prefix"):
        sequence_logprobs(model, batch, plan.rows, 1.0, plan=plan)


def test_a_text_only_model_falls_back():
    """transformers takes ovkit's varlen attention only in a VLM's text sub-config (a top-level name with "flash" in it
    is validated as a kernel to load), so a plain language model keeps sdpa, and its learner one row per trajectory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ovkit.models import attention as attn
    from ovkit.pack.packed import PackLayout
    from ovkit.rollouts import shared

    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    model = Qwen2ForCausalLM(config)
    attn.apply(model, attn.resolve("sdpa", "cpu", train=True))
    assert "sdpa" in shared.unsupported(model.config, PackLayout.for_model(model))


def test_auto_attention_shares_where_flash_attn_is_installed(cli, rl_assets, tmp_path, monkeypatch):
    """Under `--attn-implementation auto` a machine with flash-attn gives the learner's language model
    flash_attention_2, which cannot keep completions apart; with --shared-prefix on, rl-train gives it ovkit's varlen
    function instead (and says why in ovkit.json), so sharing is not off wherever flash-attn is installed. Stand-in:
    this CPU box has no CUDA and no flash-attn, so `resolve` is made to answer as it does on such a machine for the
    language model (the vision tower keeps what runs here)."""
    import json

    from helpers import TINY

    from ovkit.models import attention as attn

    asked = attn.Attention("auto", "flash_attention_2", "flash_attention_2")
    assert attn.for_shared_prefix(asked).text == attn.VARLEN
    assert attn.for_shared_prefix(asked).vision == "flash_attention_2"
    named = attn.Attention("flash_attention_2", "flash_attention_2", "flash_attention_2")
    assert attn.for_shared_prefix(named) is named  # asked for by name: kept, and the learner falls back as it says
    here = attn.resolve("auto", "cpu", train=True)
    assert attn.for_shared_prefix(here) is here  # no flash-attn: already the varlen function

    real = attn.resolve

    def with_flash_attn(requested, device, *, train=False):
        got = real(requested, device, train=train)
        return attn.Attention("auto", "flash_attention_2", got.vision) if train and requested == "auto" else got

    monkeypatch.setattr(attn, "resolve", with_flash_attn)
    model, data = rl_assets
    out = tmp_path / "out"
    code, _, err = cli(
        "rl-train", data, "--model", model, "--out", out, *TINY, "--max-steps", "1", "--max-staleness", "0",
        "--attn-implementation", "auto", "--quiet",
    )  # fmt: skip
    assert code == 0, err
    used = json.loads((out / "ovkit.json").read_text())["runtime"]["attention"]
    assert used["text"] == attn.VARLEN and used["note"].startswith("--shared-prefix on")
    assert "forwards one row per trajectory" not in err  # the learner shared
