"""ovkit.generate: batched generation equals one prompt at a time, KV cache changes nothing, the sampler's log-probs
are those of the distribution sampled from, low-precision samplers and weight sync, the rollout table."""

import math

import pytest
from helpers import PROMPT_IMAGES, marked_image, teacher_forced_logits


def _engine(spread_tiny, **kw):
    from ovkit.generate import HFEngine

    model, processor = spread_tiny
    return HFEngine(model, processor, **kw)


def test_batched_greedy_equals_one_prompt_at_a_time(spread_tiny, spread_prompts):
    batched = _engine(spread_tiny, batch_size=8).generate(spread_prompts, temperature=0, max_new_tokens=10)
    single = _engine(spread_tiny, batch_size=1).generate(spread_prompts, temperature=0, max_new_tokens=10)
    assert len({tuple(c[0].token_ids) for c in batched}) > 1  # the prompts really lead to different outputs
    for b, s in zip(batched, single):
        assert b[0].token_ids == s[0].token_ids
        assert b[0].logprobs == pytest.approx(s[0].logprobs, abs=1e-4)


def test_greedy_with_and_without_kv_cache_agree(spread_tiny, spread_prompts):
    cached = _engine(spread_tiny, use_cache=True).generate(spread_prompts, temperature=0, max_new_tokens=10)
    uncached = _engine(spread_tiny, use_cache=False).generate(spread_prompts, temperature=0, max_new_tokens=10)
    for a, b in zip(cached, uncached):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)


def test_shared_prefill_equals_prefilling_every_sequence(spread_tiny, spread_prompts):
    """A prompt sampled n times is prefilled once (images encoded once) and its KV cache copied: the same seeded
    samples and log-probs as prefilling each of the n sequences on its own, in a batch of mixed lengths."""
    from helpers import SyncCounter

    kw = dict(n=3, temperature=1.0, max_new_tokens=8, seed=5)
    with SyncCounter() as shared_syncs:
        shared = _engine(spread_tiny, batch_size=12).generate(spread_prompts, **kw)  # shared prefill is the default
    with SyncCounter() as own_syncs:
        own = _engine(spread_tiny, batch_size=12, prefill="per-sequence").generate(spread_prompts, **kw)
    assert len({tuple(c.token_ids) for cs in shared for c in cs}) > 4  # really different samples
    for a, b in zip(shared, own):
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
    assert shared_syncs.total < own_syncs.total  # 3D RoPE positions are computed once per prompt, not per sequence


def test_shared_prefill_greedy_equals_one_prompt_at_a_time(spread_tiny, spread_prompts):
    """The same prompt twice in one greedy batch (shared prefill) and each prompt alone give the same tokens."""
    repeated = [spread_prompts[2], spread_prompts[0], spread_prompts[2], spread_prompts[1]]
    shared = _engine(spread_tiny, batch_size=8, prefill="shared").generate(repeated, temperature=0, max_new_tokens=10)
    single = _engine(spread_tiny, batch_size=1).generate(repeated, temperature=0, max_new_tokens=10)
    for a, b in zip(shared, single):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)


def test_static_cache_gives_the_greedy_tokens_of_the_dynamic_cache(spread_tiny, spread_prompts):
    static = _engine(spread_tiny, static_cache=True).generate(spread_prompts, temperature=0, max_new_tokens=8)
    dynamic = _engine(spread_tiny).generate(spread_prompts, temperature=0, max_new_tokens=8)
    for a, b in zip(static, dynamic):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampler_logprobs_equal_teacher_forced_logprobs(spread_tiny, spread_prompts, temperature, top_p):
    import torch

    from ovkit.generate import sampling_logprobs

    model, _ = spread_tiny
    out = _engine(spread_tiny, batch_size=8).generate(
        spread_prompts, n=2, temperature=temperature, top_p=top_p, max_new_tokens=8, seed=3
    )
    for prompt, completions in zip(spread_prompts, out):
        assert len(completions) == 2
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) > 0
            logits = teacher_forced_logits(model, prompt, c.token_ids)
            if (temperature, top_p) == (1.0, 1.0):
                expected = torch.log_softmax(logits, dim=-1)  # the model's own distribution, nothing else
            else:
                expected = sampling_logprobs(logits, temperature, top_p)
            want = expected.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            assert torch.isfinite(want).all()  # every sampled token was inside the top-p set
            assert c.logprobs == pytest.approx(want.tolist(), abs=1e-4)


def test_sampling_logprobs_renormalise_the_top_p_set():
    import torch

    from ovkit.generate import sampling_logprobs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert sampling_logprobs(logits, 1.0, 1.0).exp().tolist()[0] == pytest.approx([0.5, 0.3, 0.2])
    kept = sampling_logprobs(logits, 1.0, 0.6).exp().tolist()[0]  # 0.5 < 0.6, so the 0.3 token joins; 0.2 is cut
    assert kept == pytest.approx([0.625, 0.375, 0.0])
    assert sampling_logprobs(logits, 1.0, 0.4).exp().tolist()[0] == pytest.approx([1.0, 0.0, 0.0])
    hot = sampling_logprobs(logits, 2.0, 1.0).exp()[0]
    want = torch.tensor([0.5, 0.3, 0.2]).sqrt()
    assert hot.tolist() == pytest.approx((want / want.sum()).tolist())


def test_seed_makes_sampling_reproducible_and_n_gives_n_completions(spread_tiny, spread_prompts):
    engine = _engine(spread_tiny)
    a = engine.generate(spread_prompts[:2], n=3, temperature=1.0, max_new_tokens=6, seed=7)
    b = engine.generate(spread_prompts[:2], n=3, temperature=1.0, max_new_tokens=6, seed=7)
    c = engine.generate(spread_prompts[:2], n=3, temperature=1.0, max_new_tokens=6, seed=8)
    assert [len(x) for x in a] == [3, 3]
    ids = lambda out: [[s.token_ids for s in x] for x in out]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    greedy = engine.generate(spread_prompts[:1], n=2, temperature=0, max_new_tokens=6)[0]
    assert greedy[0].token_ids == greedy[1].token_ids and greedy[0] is not greedy[1]


def test_per_prompt_seeds_sample_the_same_whatever_the_batch_or_the_split(spread_tiny, spread_prompts):
    """With `seeds`, completion k of prompt i draws from its own stream: the prompts split in two calls (two
    processes' shares) and cut into other batches sample the tokens and log-probs of one call over all of them, and
    top-p's dropped tokens are never drawn (the Gumbel-max draw is from the recorded distribution)."""
    seeds = [11 * i + 3 for i in range(len(spread_prompts))]
    kw = dict(n=2, temperature=1.0, top_p=0.9, max_new_tokens=6)
    whole = _engine(spread_tiny, batch_size=8).generate(spread_prompts, seeds=seeds, **kw)
    parts = [
        _engine(spread_tiny, batch_size=3).generate(spread_prompts[r::2], seeds=seeds[r::2], seed=r, **kw)
        for r in (0, 1)
    ]
    split = [None] * len(spread_prompts)
    split[0::2], split[1::2] = parts
    ids = lambda out: [[c.token_ids for c in x] for x in out]  # noqa: E731
    assert ids(split) == ids(whole)
    for a, b in zip(split, whole):
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)  # another padding: float noise
            assert all(math.isfinite(v) for v in x.logprobs)
    other = _engine(spread_tiny).generate(spread_prompts, seeds=[s + 1 for s in seeds], **kw)
    assert ids(other) != ids(whole)
    assert ids(whole)[0][0] != ids(whole)[0][1]  # the samples of a prompt are not one stream twice


def test_generation_stops_at_a_stop_token(spread_tiny, spread_prompts):
    engine = _engine(spread_tiny)
    free = engine.generate(spread_prompts[:1], temperature=0, max_new_tokens=10)[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    k = next(i for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
    engine.stop_ids = [*engine.stop_ids, free.token_ids[k]]  # make the k-th greedy token a stop token
    stopped = engine.generate(spread_prompts[:1], temperature=0, max_new_tokens=10)[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]  # the stop token is kept (the learner trains on it)
    assert stopped.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-5)
    assert stopped.text == engine.tokenizer.decode(free.token_ids[:k], skip_special_tokens=True)


def test_stop_tokens_include_im_end(spread_tiny):
    from ovkit.generate.hf import stop_token_ids

    _, processor = spread_tiny
    assert processor.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_token_ids(processor.tokenizer)


def test_collate_left_pads_tokens_and_concatenates_images(spread_tiny, spread_prompts):
    from ovkit.generate.hf import collate_prompts

    batch = collate_prompts(spread_prompts, pad_id=0)
    width = max(p.length for p in spread_prompts)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["mm_token_type_ids"].shape == (4, width)
    for i, p in enumerate(spread_prompts):
        pad = width - p.length
        assert batch["attention_mask"][i].tolist() == [0] * pad + [1] * p.length
        assert batch["input_ids"][i, pad:].tolist() == p.input_ids
        assert batch["mm_token_type_ids"][i, pad:].tolist() == p.per_token["mm_token_type_ids"]
    grids = [g for p in spread_prompts if "image_grid_thw" in p.mm for g in p.mm["image_grid_thw"].tolist()]
    assert batch["image_grid_thw"].tolist() == grids  # images in batch order: 1 + 0 + 2 + 1
    assert batch["pixel_values"].shape[0] == sum(p.mm["pixel_values"].shape[0] for p in spread_prompts if p.mm)


def test_engine_samples_from_the_learner_itself_unless_asked_otherwise(spread_tiny):
    model, _ = spread_tiny
    assert _engine(spread_tiny).model is model
    assert _engine(spread_tiny, dtype="float32").model is model


def test_bfloat16_sampler_is_a_synced_copy(spread_tiny, spread_prompts):
    import copy

    import torch

    learner = copy.deepcopy(spread_tiny[0])
    from ovkit.generate import HFEngine

    engine = HFEngine(learner, spread_tiny[1], dtype="bfloat16")
    assert engine.model is not learner and next(engine.model.parameters()).dtype == torch.bfloat16
    assert next(learner.parameters()).dtype == torch.float32
    out = engine.generate(spread_prompts[:2], temperature=1.0, max_new_tokens=5)
    assert all(math.isfinite(x) for c in out for x in c[0].logprobs)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.01)
    engine.update_weights(learner)
    for (name, mine), theirs in zip(engine.model.named_parameters(), learner.parameters()):
        assert torch.equal(mine, theirs.to(torch.bfloat16)), name


def _quantised_sampler_differs_and_requantises(spread_tiny, spread_prompts, quant):
    """A quantised sampler is a copy (the learner untouched) whose log-probs differ from fp32 by less than 1 nat on
    the first greedy token, and `update_weights` rebuilds it from the learner's new weights."""
    import copy

    import torch

    from ovkit.generate import HFEngine

    learner = copy.deepcopy(spread_tiny[0])
    engine = HFEngine(learner, spread_tiny[1], quant=quant)
    assert engine.model is not learner
    assert all(torch.equal(a, b) for a, b in zip(learner.parameters(), spread_tiny[0].parameters()))
    fp32 = _engine(spread_tiny).generate(spread_prompts[:2], temperature=0, max_new_tokens=4)
    low = engine.generate(spread_prompts[:2], temperature=0, max_new_tokens=4)
    for a, b in zip(fp32, low):
        assert len(b[0].logprobs) == 4 and all(math.isfinite(x) for x in b[0].logprobs)
        assert a[0].logprobs[0] != b[0].logprobs[0]  # low precision really changes the distribution
        assert abs(a[0].logprobs[0] - b[0].logprobs[0]) < 1.0
    before = engine.model
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(0.5)
    engine.update_weights(learner)
    assert engine.model is not before
    after = engine.generate(spread_prompts[:1], temperature=0, max_new_tokens=4)[0][0]
    assert after.logprobs != low[0][0].logprobs
    return engine


def test_int8_sampler_is_close_to_fp32_and_requantises_on_update(spread_tiny, spread_prompts):
    import torch
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    engine = _quantised_sampler_differs_and_requantises(spread_tiny, spread_prompts, "int8")
    assert any(isinstance(m, DynamicQuantizedLinear) for m in engine.model.modules())
    assert not any(type(m) is torch.nn.Linear for m in engine.model.modules())


def test_int4_sampler_has_16_levels_per_group_and_requantises_on_update(spread_tiny, spread_prompts):
    import torch

    from ovkit.generate.quant import INT4_GROUP, round_weights

    w = torch.randn(3, 2 * INT4_GROUP + 5)
    layer = torch.nn.Linear(w.shape[1], 3, bias=False)
    layer.weight.data.copy_(w)
    q = round_weights(torch.nn.Sequential(layer), "int4")[0].weight.data
    for row in range(3):  # every group holds at most 16 distinct values, within half a step of the original
        for start in range(0, w.shape[1], INT4_GROUP):
            group, orig = q[row, start : start + INT4_GROUP], w[row, start : start + INT4_GROUP]
            assert len(torch.unique(group)) <= 16
            assert float((group - orig).abs().max()) <= float(orig.abs().max()) / 7 / 2 + 1e-6
    _quantised_sampler_differs_and_requantises(spread_tiny, spread_prompts, "int4")


def test_bad_options_are_user_errors(spread_tiny, spread_prompts):
    from ovkit.errors import OvkitError
    from ovkit.generate.engines import build_engine

    with pytest.raises(OvkitError, match="--engine"):
        build_engine("nope", model=spread_tiny[0], processor=spread_tiny[1])
    with pytest.raises(OvkitError, match="--sampler-precision"):
        build_engine("hf", model=spread_tiny[0], processor=spread_tiny[1], precision="int4")
    with pytest.raises(OvkitError, match="dtype must be one of"):
        _engine(spread_tiny, dtype="int4")
    with pytest.raises(OvkitError, match="--sampler-quant"):
        _engine(spread_tiny, quant="int2")
    with pytest.raises(OvkitError, match="prefill must be one of"):
        _engine(spread_tiny, prefill="twice")
    with pytest.raises(OvkitError, match="--top-p"):
        _engine(spread_tiny).generate(spread_prompts[:1], top_p=0)
    with pytest.raises(OvkitError, match="--temperature"):
        _engine(spread_tiny).generate(spread_prompts[:1], temperature=-1)


def test_build_engine_loads_a_model_directory_in_the_asked_precision(spread_tiny, tmp_path):
    import torch

    from ovkit.generate import HFEngine
    from ovkit.generate.engines import build_engine

    model, processor = spread_tiny
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    engine = build_engine("hf", model_dir=tmp_path)
    assert isinstance(engine, HFEngine) and next(engine.model.parameters()).dtype == torch.float32
    engine = build_engine("hf", model_dir=tmp_path, precision="bf16-true", attn_implementation="eager")
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.model.config.vision_config._attn_implementation == "eager"


# -- the rollout table ----------------------------------------------------------------------------------------------


def _rollout(**kw):
    row = {
        "prompt_id": "p0",
        "group": 0,
        "prompt_ids": [1, 2, 3],
        "response_ids": [4, 5],
        "behave_logprobs": [-0.1, -0.2],
        "reward": 1.0,
        "reward_parts": {"accuracy": 1.0, "format": 1.0},
        "finish_reason": "stop",
        "category": "counting",
        "source": "synth/counting",
        "answer": "3",
        "answer_type": "number",
    }
    row.update(kw)
    return row


def test_rollouts_round_trip(tmp_path):
    import json

    from ovkit.rollouts.table import ROLLOUT_SCHEMA, read_rollouts, write_rollouts

    path = write_rollouts(
        [_rollout(), _rollout(prompt_id="p1", group=1, completion="<answer>3</answer>")], tmp_path / "rollouts.parquet"
    )
    table = read_rollouts(tmp_path)  # a run directory holding rollouts.parquet
    assert table.column_names[: len(ROLLOUT_SCHEMA)] == ROLLOUT_SCHEMA.names
    rows = table.to_pylist()
    assert rows[0]["loss_mask"] == [1, 1] and rows[0]["turns"] == 1 and rows[0]["version"] == 0
    assert json.loads(rows[0]["reward_parts"]) == {"accuracy": 1.0, "format": 1.0}
    assert rows[1]["completion"] == "<answer>3</answer>" and rows[0]["completion"] is None
    assert read_rollouts(path).num_rows == 2


def test_rollouts_reject_misaligned_rows(tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.rollouts.table import write_rollouts

    with pytest.raises(OvkitError, match="behave_logprobs.*1 values for 2"):
        write_rollouts([_rollout(behave_logprobs=[-0.1])], tmp_path / "r.parquet")
    with pytest.raises(OvkitError, match="loss_mask"):
        write_rollouts([_rollout(loss_mask=[1])], tmp_path / "r.parquet")
    with pytest.raises(OvkitError, match="finish_reason"):
        write_rollouts([_rollout(finish_reason="eos")], tmp_path / "r.parquet")


# -- vLLM (GPU only) ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_vllm_engine_matches_hf_greedy_and_reports_sampled_logprobs(spread_tiny, spread_prompts, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA GPU")
    from ovkit.generate import HFEngine, VLLMEngine

    model, processor = spread_tiny
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    images = [
        [marked_image()],
        [],
        [marked_image(168, 84, (0, 90, 200)), marked_image()],
        [marked_image(colour=(20, 200, 20))],
    ]
    engine = VLLMEngine(tmp_path, processor, dtype="float32", gpu_memory_utilization=0.2, max_model_len=512)
    hf = HFEngine(model.to("cuda"), processor).generate(spread_prompts, temperature=0, max_new_tokens=8)
    out = engine.generate(spread_prompts, temperature=0, max_new_tokens=8, images=images)
    for a, b in zip(hf, out):
        assert b[0].token_ids == a[0].token_ids
        assert b[0].logprobs == pytest.approx(a[0].logprobs, abs=1e-2)
    sampled = engine.generate(spread_prompts, n=2, temperature=1.0, max_new_tokens=8, images=images)
    for prompt, completions in zip(spread_prompts, sampled):
        for c in completions:
            logits = teacher_forced_logits(model, prompt, c.token_ids)
            want = (
                torch.log_softmax(logits, -1)
                .gather(1, torch.tensor(c.token_ids, device=logits.device)[:, None])
                .squeeze(1)
            )
            assert c.logprobs == pytest.approx(want.tolist(), abs=1e-2)
    engine.update_weights(model)  # in-place reload keeps generating
    assert (
        engine.generate(spread_prompts[:1], temperature=0, max_new_tokens=8, images=images[:1])[0][0].token_ids
        == hf[0][0].token_ids
    )


def test_a_sampler_copy_is_built_in_its_own_dtype_and_follows_the_learner(spread_tiny, spread_prompts):
    """The asynchronous sampler's copy (and a bf16 one): parameters in the sampler's dtype, the tied embedding still
    tied (one tensor, not two), no gradients, the learner untouched; update_weights copies the learner in."""
    import torch

    from ovkit.generate.hf import cast_copy

    model, _ = spread_tiny
    copy16 = cast_copy(model, torch.bfloat16)
    assert {p.dtype for p in copy16.parameters()} == {torch.bfloat16} and {p.dtype for p in model.parameters()} == {
        torch.float32
    }
    assert copy16.get_output_embeddings().weight is copy16.get_input_embeddings().weight  # still tied
    assert not any(p.requires_grad for p in copy16.parameters())
    separate = _engine(spread_tiny, separate=True)
    assert separate.model is not model and next(separate.model.parameters()).dtype == torch.float32
    before = model.lm_head.weight.detach().clone()
    with torch.no_grad():
        model.lm_head.weight.add_(0.5)
    try:
        separate.update_weights(model)
        assert torch.equal(separate.model.lm_head.weight, model.lm_head.weight)
    finally:
        with torch.no_grad():
            model.lm_head.weight.copy_(before)


@pytest.mark.parametrize(
    "precision, learner_dtype, staleness, want",
    [
        ("bf16-mixed", "bfloat16", 2, 2.0),  # master weights: the learner computes in bf16 weights, the copy is bf16
        ("bf16-mixed", "float32", 2, 2.0),  # autocast over fp32 weights (DDP, adamw_8bit): the copy is still bf16
        ("fp32", "float32", 2, 4.0),
        ("bf16-mixed", "float32", 0, 0.0),  # synchronous: the learner itself, no copy
    ],
)
def test_the_async_sampler_copy_holds_the_learner_compute_dtype(
    spread_tiny, tmp_path, precision, learner_dtype, staleness, want
):
    """rl-train's asynchronous sampler holds its own weights in the learner's compute dtype: bytes per learner
    parameter of the copy (tied weights counted once)."""
    import torch

    from ovkit.generate.hf import cast_copy
    from ovkit.rl.config import RLTrainConfig
    from ovkit.rl.loop import make_sampler

    model, processor = spread_tiny
    learner = cast_copy(model, getattr(torch, learner_dtype))
    cfg = RLTrainConfig(
        data=[tmp_path], model=tmp_path, out=tmp_path / "out", precision=precision, max_staleness=staleness
    )
    sampler = make_sampler(cfg, learner, processor).model
    copy = 0 if sampler is learner else sum(p.numel() * p.element_size() for p in sampler.parameters())
    assert copy / sum(p.numel() for p in learner.parameters()) == want


# -- the vLLM engine, against a stand-in with vLLM's shapes (tests/fake_vllm.py) -------------------------------------


@pytest.fixture
def fake_vllm(monkeypatch, spread_tiny, tmp_path):
    import fake_vllm as fake

    fake.install(monkeypatch)
    # the colocated engine makes the process a distributed group of one (RANK, WORLD_SIZE, ... in os.environ, as it
    # must outside torchrun); left behind, every later test's accelerate would start a gloo group and wrap in DDP
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    model, processor = spread_tiny
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    return fake, tmp_path / "model"


@pytest.mark.parametrize(
    "precision,dtype",
    [("auto", "float32"), ("bf16-true", "bfloat16"), ("fp32", "float32"), (None, "auto")],
)
def test_a_vllm_engine_reads_precision_as_every_engine_does(fake_vllm, spread_tiny, precision, dtype):
    """`--precision auto` is ovkit's rule with --engine vllm too (bf16 on a GPU with bf16, else fp32: fp32 on this
    CPU), not vLLM's own (which downcasts an fp32 checkpoint to bf16 on a CPU); a named precision is that dtype; None
    (mismatch-report's `vllm` sampler) leaves the choice to vLLM."""
    from ovkit.generate.engines import build_engine

    fake, path = fake_vllm
    build_engine("vllm", model_dir=path, processor=spread_tiny[1], precision=precision)
    assert fake.LLM.calls[0][0] == "init" and fake.LLM.calls[0][1]["dtype"] == dtype


def test_vllm_requests_are_token_ids_images_and_the_sampled_distribution(fake_vllm, spread_tiny, spread_prompts):
    """prompt_token_ids = the encoded ids with one placeholder per image (vLLM expands it), images as multi_modal_data,
    processed log-probs of
    the sampled token only, one seed per prompt, suppressed ids as a -100 bias; log-probs come back aligned with
    the tokens, the stop token included."""
    from ovkit.generate import VLLMEngine
    from ovkit.generate.vllm import collapse_placeholders

    fake, path = fake_vllm
    engine = VLLMEngine(path, spread_tiny[1], dtype="float32")
    out = engine.generate(
        spread_prompts,
        n=2,
        max_new_tokens=6,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        images=PROMPT_IMAGES,
        suppress_ids=[5],
    )
    ((_, ids, params),) = [c for c in fake.LLM.calls if c[0] == "generate"]
    assert ids == [collapse_placeholders(p.input_ids, engine.placeholder_ids) for p in spread_prompts]
    assert [sum(t in engine.placeholder_ids for t in i) for i in ids] == [1, 0, 2, 1]  # one per image
    assert [p["seed"] for p in params] == [3 * 1_000_003 + i * 2 for i in range(4)]
    assert all(
        p["n"] == 2 and p["logprobs"] == 0 and p["temperature"] == 0.8 and p["top_p"] == 0.9 and p["max_tokens"] == 6
        for p in params
    )
    assert all(p["logit_bias"] == {5: -100.0} and set(engine.stop_ids) <= set(p["stop_token_ids"]) for p in params)
    for completions in out:
        assert len(completions) == 2
        for c in completions:
            assert (
                len(c.logprobs) == len(c.token_ids) > 0 and all(lp <= 0 for lp in c.logprobs) and 5 not in c.token_ids
            )
            assert (c.finish_reason == "stop") == (c.token_ids[-1] in engine.stop_ids)
    with pytest.raises(Exception, match="images"):
        engine.generate(spread_prompts[:1], max_new_tokens=2)  # a multimodal prompt without its images


def test_vllm_weight_updates_use_checkpoint_names_and_reach_the_model(fake_vllm, spread_tiny):
    import torch
    from safetensors import safe_open

    from ovkit.generate import VLLMEngine
    from ovkit.generate.vllm import checkpoint_weights

    fake, path = fake_vllm
    model, processor = spread_tiny
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {n for n, _ in checkpoint_weights(model)} == set(f.keys())  # the names vLLM loads
    engine = VLLMEngine(path, processor, dtype="float32")
    learner = type(model)(model.config)  # other weights: an update must overwrite every parameter
    engine.update_weights(learner)
    served = dict(engine.llm.hf.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in learner.named_parameters())
    assert [c[0] for c in fake.LLM.calls[-2:]] == ["load_weights", "reset_prefix_cache"]


def test_vllm_sleeps_while_the_learner_updates(fake_vllm, spread_tiny, spread_prompts):
    """sleep=True: each generate call ends with vLLM asleep; the weight update wakes it first."""
    from ovkit.generate import VLLMEngine

    fake, path = fake_vllm
    engine = VLLMEngine(path, spread_tiny[1], dtype="float32", sleep=True)
    assert fake.LLM.calls[0][1]["enable_sleep_mode"] is True
    engine.generate(spread_prompts[1:2], max_new_tokens=2)
    engine.update_weights(spread_tiny[0])
    engine.generate(spread_prompts[1:2], max_new_tokens=2)
    engine.generate(spread_prompts[1:2], max_new_tokens=2)
    names = [c[0] for c in fake.LLM.calls[1:]]
    assert names == [
        "generate",
        "sleep",
        "wake_up",
        "load_weights",
        "reset_prefix_cache",
        "generate",
        "sleep",
        "wake_up",
        "generate",
        "sleep",
    ]


def test_vllm_startup_output_hides_only_chatter_and_puts_everything_back(monkeypatch):
    """While vLLM starts (ovkit.generate.vllm.startup_output): quiet leaves the errors of vLLM's, torch's
    cpp_extension and transformers' loggers and hides their warnings and the FutureWarning vLLM's own code triggers
    (not another); not quiet, vLLM's warnings show; a VLLM_LOGGING_LEVEL the user set wins. Afterwards the
    environment, the loggers' levels and the warning filters are as they were."""
    import logging
    import os
    import warnings

    from ovkit.generate.vllm import startup_output

    for key in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.delenv(key, raising=False)
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [])  # vLLM has not configured its logging in this process
    loggers = [logging.getLogger(n) for n in ("vllm.platforms", "torch.utils.cpp_extension", "transformers.models")]
    before = [lg.getEffectiveLevel() for lg in loggers], list(warnings.filters), vllm_logger.level
    with startup_output(quiet=True):
        assert (os.environ["VLLM_LOGGING_LEVEL"], os.environ["VLLM_LOGGING_STREAM"]) == ("ERROR", "ext://sys.stderr")
        assert [(lg.isEnabledFor(logging.WARNING), lg.isEnabledFor(logging.ERROR)) for lg in loggers] == [
            (False, True)
        ] * 3
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", append=True)
            warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ...", FutureWarning, stacklevel=1)
            warnings.warn("another deprecation", FutureWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["another deprecation"]
    assert ([lg.getEffectiveLevel() for lg in loggers], list(warnings.filters), vllm_logger.level) == before
    assert "VLLM_LOGGING_LEVEL" not in os.environ and "VLLM_LOGGING_STREAM" not in os.environ
    with startup_output(quiet=False):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and all(lg.isEnabledFor(logging.WARNING) for lg in loggers)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "info")
    with startup_output(quiet=True):
        assert logging.getLogger("vllm.platforms").isEnabledFor(logging.INFO)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "info" and vllm_logger.level == before[2]


def test_weight_rounding_for_low_precision_samplers_is_bounded_and_device_agnostic(spread_tiny, spread_prompts):
    """int8 (weight-only, the GPU path) and fp8 round every Linear weight to their grid, within the grid's step, the
    learner untouched; an fp8 sampler generates and its log-probs differ from fp32's, but not wildly."""
    import torch

    from ovkit.generate.hf import cast_copy
    from ovkit.generate.quant import FP8_MAX, round_weights

    model, _ = spread_tiny
    for kind, step in (("int8", 1 / 127), ("fp8", 2**-3)):
        rounded = round_weights(cast_copy(model, torch.float32), kind)
        for (name, a), (_, b) in zip(model.named_parameters(), rounded.named_parameters()):
            if a.dim() == 2 and "embed" not in name:
                scale = a.abs().amax(dim=1, keepdim=True)
                err = (a - b).abs() / scale
                assert float(err.max()) <= step + 1e-6, (kind, name)
                assert not torch.equal(a, b) or kind == "fp8"
        assert {tuple(v.shape) for v in rounded.parameters()} == {tuple(v.shape) for v in model.parameters()}
    assert FP8_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
    engine = _engine(spread_tiny, quant="fp8")
    out = engine.generate(spread_prompts[:2], n=2, max_new_tokens=6, seed=1)
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for cs in out for c in cs)
    inputs = spread_prompts[0].model_inputs(labels=False)
    with torch.no_grad():
        a = torch.log_softmax(model(**inputs).logits[0, -1], -1)
        b = torch.log_softmax(engine.model(**inputs).logits[0, -1], -1)
    gap = (a - b).abs().max()
    assert 0 < gap < float("inf")  # a real sampler/learner gap (its size is the model's: these weights are spread wide)


def test_one_sampler_draws_a_prompts_completions_from_its_key_not_its_call(spread_tiny, spread_prompts):
    """ovkit.rollouts.sample: a prompt's n completions are a function of (run seed, its key, sample index). The prompts
    sampled in two calls (two processes' shares, another batch size) give what one call over all of them gives, the
    same prompt under two keys draws two sets, and the run seed changes the draws."""
    from ovkit.rollouts.prompts import Prompt
    from ovkit.rollouts.sample import prompt_seed, sample

    rows = [
        Prompt(id=f"r{i}", encoded=p, answer="", answer_type=None, source="", category="")
        for i, p in enumerate(spread_prompts)
    ]
    kw = dict(n=2, max_new_tokens=6, temperature=1.0, top_p=0.9, seed=4)
    ids = lambda out: [[c.token_ids for c in cs] for cs in out]  # noqa: E731
    whole = sample(_engine(spread_tiny, batch_size=8), rows, **kw)
    split = [None] * len(rows)
    split[0::2], split[1::2] = (sample(_engine(spread_tiny, batch_size=3), rows[r::2], **kw) for r in (0, 1))
    assert ids(split) == ids(whole)
    reversed_ = sample(_engine(spread_tiny), rows[::-1], **kw)[::-1]  # another place in the call
    assert ids(reversed_) == ids(whole)
    again = sample(_engine(spread_tiny), rows[:1] * 2, **kw, keys=["r0", "other"])
    assert ids(again)[0] == ids(whole)[0] and ids(again)[1] != ids(whole)[0]
    assert ids(sample(_engine(spread_tiny), rows, **{**kw, "seed": 5})) != ids(whole)
    assert prompt_seed(0, 1) != prompt_seed(1, 0) and prompt_seed(0, "1") != prompt_seed(0, 1)
    assert all(0 <= prompt_seed(s, k) < 2**62 for s in (0, 7, 2**40) for k in (0, "x", (3, 1)))
