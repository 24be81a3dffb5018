"""`--engine vllm-server`: ovkit's client side of a `vllm serve` sampler, through TRL's VLLMClient, against a stand-in
server with vLLM's endpoints and return shapes (tests/fake_vllm_server.py): token ids in and out, images through the
render endpoint, the sampled token's processed log-prob at each position, weights pushed under checkpoint names, and
rl-train end to end on it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import PROMPT_IMAGES, rl_rows


@pytest.fixture
def server(monkeypatch, spread_tiny, tmp_path):
    pytest.importorskip("trl.generation.vllm_client")
    import fake_vllm
    import fake_vllm_server
    import trl.generation.vllm_client as client_module

    fake_vllm.install(monkeypatch)
    monkeypatch.setattr(client_module, "is_vllm_available", lambda *a, **k: True)  # the client checks at construction
    model, processor = spread_tiny
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    srv = fake_vllm_server.Server(tmp_path / "model")
    yield srv
    srv.close()


def _engine(server, processor):
    import fake_vllm_server

    from ovkit.generate import VLLMServerEngine

    engine = VLLMServerEngine(server.url, processor, timeout=5)
    fake_vllm_server.connect(engine.client, server)
    return engine


def test_requests_are_token_ids_and_log_probs_are_the_sampled_distributions(server, spread_tiny, spread_prompts):
    """Each prompt goes as its token ids (images through the render endpoint), n completions per prompt in order,
    each sampled token's log-prob equal to the learner's at the same temperature (the distribution actually sampled),
    finish reasons from the stop tokens, a suppressed token never sampled."""
    from ovkit.generate import sampling_logprobs

    model, processor = spread_tiny
    engine = _engine(server, processor)
    assert engine.max_model_len == model.config.text_config.max_position_embeddings
    out = engine.generate(spread_prompts, n=2, max_new_tokens=6, temperature=0.8, seed=3, images=PROMPT_IMAGES)
    sent = [body for path, body in server.requests if path == "/inference/v1/generate"]  # a batch with images
    assert sorted(map(tuple, (b["token_ids"] for b in sent))) == sorted(tuple(p.input_ids) for p in spread_prompts)
    assert all(
        b["sampling_params"]["n"] == 2 and b["sampling_params"]["logprobs"] == 0 and b["sampling_params"]["seed"] == 3
        for b in sent
    )
    assert sum(b["features"] is None for b in sent) == 1  # the text-only prompt
    renders = [b for path, b in server.requests if path == "/v1/chat/completions/render"]
    assert sorted(len([p for m in b["messages"] for p in m["content"]]) for b in renders) == [1, 1, 2]
    common = max(
        {t for cs in out for c in cs for t in c.token_ids},
        key=lambda t: sum(c.token_ids.count(t) for cs in out for c in cs),
    )
    again = engine.generate(
        spread_prompts[1:2], n=4, max_new_tokens=6, seed=3, suppress_ids=[common]
    )  # text only: completions
    [text_only] = [b for path, b in server.requests if path == "/v1/completions"]
    assert text_only["prompt"] == [list(spread_prompts[1].input_ids)] and text_only["return_tokens_as_token_ids"]
    assert text_only["logit_bias"] == {str(common): -100.0} and all(common not in c.token_ids for c in again[0])
    assert len(out) == 4 and all(len(cs) == 2 for cs in out)
    for prompt, completions in zip(spread_prompts, out):
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) > 0
            assert (c.finish_reason == "stop") == (c.token_ids[-1] in engine.stop_ids)
            inputs = prompt.model_inputs(labels=False)
            ids = torch.tensor([list(prompt.input_ids) + c.token_ids])
            extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
            types = inputs.get("mm_token_type_ids")
            if types is not None:
                extra["mm_token_type_ids"] = torch.cat([types, torch.zeros(1, len(c.token_ids), dtype=types.dtype)], 1)
            with torch.no_grad():
                logits = model(input_ids=ids, **extra).logits[0, len(prompt.input_ids) - 1 : -1]
            learner = sampling_logprobs(logits, temperature=0.8).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(learner, torch.tensor(c.logprobs), atol=2e-4, rtol=0)


def test_per_prompt_seeds_go_as_one_request_per_prompt_and_split_calls_agree(server, spread_tiny, spread_prompts):
    """The server's API seeds a request, so with `seeds` every prompt is its own request seeded from its seed
    (`request_seed`, the k-th of its n completions then samples with seed + k on a real server): the prompts sent
    in two calls (two processes' shares) come back as one call over all of them."""
    from ovkit.generate.vllm import request_seed

    _, processor = spread_tiny
    engine = _engine(server, processor)
    seeds = [101, 7, 2**61 + 5, 33]
    kw = dict(n=2, max_new_tokens=6, temperature=1.0)
    whole = engine.generate(spread_prompts, seeds=seeds, images=PROMPT_IMAGES, **kw)
    sent = [b for path, b in server.requests if path in ("/inference/v1/generate", "/v1/completions")]
    assert len(sent) == len(spread_prompts)
    assert sorted(b["sampling_params"]["seed"] if "sampling_params" in b else b["seed"] for b in sent) == sorted(
        request_seed(s) for s in seeds
    )
    assert all(0 <= request_seed(s) + 16 < 2**63 for s in seeds)
    split = [None] * len(spread_prompts)
    for r in (0, 1):
        split[r::2] = engine.generate(spread_prompts[r::2], seeds=seeds[r::2], images=PROMPT_IMAGES[r::2], **kw)
    assert [[c.token_ids for c in cs] for cs in split] == [[c.token_ids for c in cs] for cs in whole]


def test_a_server_reporting_raw_log_probs_is_refused_where_they_differ(server, spread_tiny, spread_prompts):
    from ovkit.errors import OvkitError

    server.logprobs_mode = "raw_logprobs"
    engine = _engine(server, spread_tiny[1])
    assert engine.generate(spread_prompts[1:2], max_new_tokens=3)  # temperature 1, top-p 1: raw = processed
    with pytest.raises(OvkitError, match="processed_logprobs"):
        engine.generate(spread_prompts[1:2], max_new_tokens=3, temperature=0.7)


def test_weight_updates_push_checkpoint_names_and_reach_the_server(server, spread_tiny):
    model, processor = spread_tiny
    engine = _engine(server, processor)
    learner = type(model)(model.config)  # other weights: the update must overwrite every parameter
    engine.weight_transport = "nccl"  # the CUDA learner's path; NCCL cannot run here, the stand-in replaces its calls
    engine.update_weights(learner)
    served = dict(server.llm.hf.named_parameters())
    assert all(torch.equal(served[n], p) for n, p in learner.named_parameters())
    assert [path for path, _ in server.requests][-1] == "/reset_prefix_cache"


def test_no_server_is_one_clear_error(monkeypatch, spread_tiny):
    pytest.importorskip("trl.generation.vllm_client")
    import trl.generation.vllm_client as client_module

    from ovkit.errors import OvkitError
    from ovkit.generate import VLLMServerEngine

    monkeypatch.setattr(client_module, "is_vllm_available", lambda *a, **k: True)
    with pytest.raises(OvkitError, match="no vLLM server at http://127.0.0.1:9"):
        VLLMServerEngine("http://127.0.0.1:9", spread_tiny[1], timeout=0)


def test_rl_train_runs_on_the_server_and_pushes_weights_every_step(server, spread_tiny, tmp_path, monkeypatch):
    """Two synchronous GRPO steps with rollouts from the server: weights pushed before each step's rollouts, the
    sampler/learner gap that of an fp32 sampler (the server samples from the pushed weights)."""
    import fake_vllm_server

    from ovkit.data.parts import write_samples
    from ovkit.data.schema import samples_table
    from ovkit.generate import vllm_server
    from ovkit.rl.config import RLTrainConfig
    from ovkit.rl.loop import train_rl

    real = vllm_server.VLLMServerEngine.__init__

    def connected(self, *a, **k):
        real(self, *a, **k)
        fake_vllm_server.connect(self.client, server)
        self.weight_transport = "nccl"  # a CUDA learner's path; the stand-in replaces its two NCCL calls

    monkeypatch.setattr(vllm_server.VLLMServerEngine, "__init__", connected)
    write_samples(samples_table(rl_rows()), tmp_path / "data")
    cfg = RLTrainConfig(
        data=[tmp_path / "data"],
        model=tmp_path / "model",
        out=tmp_path / "out",
        engine="vllm-server",
        vllm_server_url=server.url,
        vllm_server_timeout=5,
        max_steps=2,
        max_staleness=0,
        prompts_per_step=2,
        group_size=4,
        max_new_tokens=6,
        lr=1e-3,
        warmup_ratio=0.0,
        system_prompt=False,
        reward_workers=1,
        micro_batch_size=8,
        save_every=0,
        precision="fp32",
        quiet=True,
    )
    train_rl(cfg)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in rows)
    pushes = [c for c in server.llm.calls if c[0] == "load_weights"]
    assert len(pushes) >= 2  # the starting weights, then after step 1
