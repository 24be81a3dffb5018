"""Multi-turn rollouts (ovkit.rollouts.episodes, ovkit.envs): the context is exactly the chat template's rendering of
the whole conversation (no repeated preamble, the model's tokens kept as sampled), loss masks and log-probs line up
with sampled vs observation tokens, budgets and termination reasons, failing and hanging environments, an image
returned on turn 2 really changes the model's turn-2 logits, and the learner re-reads the trajectories exactly."""

import time

import pyarrow as pa
import pytest
import torch
from helpers import torch_threads, torchrun

from ovkit.data import image_cell, samples_table
from ovkit.generate import Completion

TEXTS = [
    "<image>\nHow many squares are there? Put ONLY your final answer within <answer></answer>.",
    "<answer>3</answer> <zoom>[10,10,40,40]</zoom> Your answer is incorrect. Try again.",
    "Region [0,0,42,42] enlarged:",
] * 20


def _image(colour=(220, 40, 40), size=84):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).rectangle([10, 10, 40, 40], fill=colour)
    return img


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from ovkit.models import load
    from ovkit.models.tiny import build_tiny

    model, processor = load(build_tiny(tmp_path_factory.mktemp("mt"), TEXTS, seed=0))
    return model.eval(), processor


def _prompts(processor, n=1, answer="2", extra=""):
    from ovkit.rollouts.prompts import encode_prompts

    rows = [
        {
            "id": f"p{i}",
            "images": [image_cell(_image())],
            "messages": [{"role": "user", "content": "<image>\nHow many squares are there?"}],
            "source": "test/count",
            "category": "counting",
            "answer": answer,
            "answer_type": "number",
        }
        for i in range(n)
    ]
    return encode_prompts(samples_table(rows), processor, mode="answer", system=True, extra=extra)


class Scripted:
    """An engine that answers turn k of every trajectory with script[k] (text + end-of-turn), log-prob -0.5 each."""

    def __init__(self, processor, script, stop=True):
        from ovkit.generate.hf import stop_token_ids

        self.tok = processor.tokenizer
        self.script, self.stop = script, stop
        self.end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = stop_token_ids(self.tok)
        self.calls = []

    def generate(
        self, prompts, *, n, max_new_tokens, temperature, top_p, seed, images=None, suppress_ids=(), seeds=None
    ):
        self.calls.append([p.length for p in prompts])
        turn = len(self.calls) - 1
        text = self.script[min(turn, len(self.script) - 1)]
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.end] if self.stop else [])
        ids = ids[:max_new_tokens]
        reason = "stop" if ids and ids[-1] == self.end else "length"
        return [[Completion(ids, text, [-0.5] * len(ids), reason)] for _ in prompts]


def _runner(engine, processor, env, model=None, **kw):
    from ovkit.envs import EnvSpec, load_env
    from ovkit.rollouts.episodes import EpisodeRunner, MultiTurn

    args = kw.pop("env_args", {})
    spec = load_env(env, args) if isinstance(env, str) else EnvSpec(env.__name__, env, args)
    return EpisodeRunner(engine, processor, MultiTurn(env=spec, **kw), model=model)


def _run(runner, prompts, n=1, max_new_tokens=32):
    return runner.run(prompts, n=n, max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0, seed=0)


# ------------------------------------------------------------------------------------------------ token layout


def test_context_is_the_templates_rendering_of_the_whole_conversation(tiny):
    """No system prompt or preamble repeats, and the template's glue between turns is there: the prompt plus the
    trajectory's tokens equal the chat template applied to the conversation as a whole."""
    from ovkit.models.encode import encode_messages

    _, processor = tiny
    (prompt,) = _prompts(processor)
    engine = Scripted(processor, ["<answer>3</answer>", "<answer>2</answer>"])
    ((c,),) = _run(_runner(engine, processor, "verifier"), [prompt])
    assert (c.turns, c.termination, c.reward_scale) == (2, "completed", pytest.approx(0.8))
    conversation = [
        {"role": "system", "content": "You are a helpful AI assistant."},
        {
            "role": "user",
            "content": "<image>\nHow many squares are there?\nPut ONLY your final answer within <answer></answer>.",
        },
        {"role": "assistant", "content": "<answer>3</answer>"},
        {"role": "user", "content": "Your answer is incorrect. Try again."},
        {"role": "assistant", "content": "<answer>2</answer>"},
    ]
    whole = encode_messages(processor, conversation, [_image()], generation_prompt=False).input_ids
    ours = prompt.encoded.input_ids + c.token_ids
    assert (
        ours == whole[: len(ours)] and len(whole) - len(ours) <= 1
    )  # the template's trailing newline is never sampled
    assert processor.tokenizer.decode(ours).count("You are a helpful AI assistant.") == 1


_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}{%- for part in "
    "message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- elif 'text' in part -%}"
    "{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
)
TOOLS_TEMPLATE = (  # Qwen2.5's shape: tool schemas in a system preamble, tool results as a user turn
    "{%- if tools -%}{{- '<|im_start|>system\\nYou may call these tools:\\n' -}}{%- for t in tools -%}{{- t | "
    "tojson -}}"
    "{{- '\\n' -}}{%- endfor -%}{{- '<|im_end|>\\n' -}}{%- endif -%}{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}{{- '<|im_start|>user\\n<tool_response>\\n' -}}"
    + _CONTENT
    + "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT + "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class CounterTool:
    """A tool-calling environment: its schema goes to the chat template, its results come back as "tool" turns."""

    tools = [
        {
            "type": "function",
            "function": {
                "name": "count",
                "description": "Count the squares.",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]

    def __init__(self, task):
        self.calls = 0

    def reset(self):
        self.calls = 0

    def step(self, text):
        self.calls += 1
        return ({"text": "2 squares"}, False, {}) if "<tool_call>" in text else (None, True, {})

    def format_observation(self, obs):
        return {"role": "tool", "content": obs["text"], "images": []}


def test_a_tool_preamble_is_rendered_once(tiny):
    """With an environment's tool schemas, the template's tool preamble is in the prompt once and never again: tool
    results join as the template's "tool" turns, the delta trims the preamble (slime's dummy-prefix trick)."""
    import copy

    from ovkit.models.encode import encode_messages
    from ovkit.rollouts.prompts import encode_prompts

    _, processor = tiny
    processor = copy.deepcopy(processor)
    processor.chat_template = TOOLS_TEMPLATE
    rows = [
        {
            "id": "t",
            "images": [image_cell(_image())],
            "messages": [{"role": "user", "content": "<image>\nHow many squares?"}],
            "source": "s",
            "category": "counting",
            "answer": "2",
            "answer_type": "number",
        }
    ]
    (prompt,) = encode_prompts(samples_table(rows), processor, mode="none", system=False, tools=CounterTool.tools)
    engine = Scripted(processor, ["<tool_call>count</tool_call>", "<tool_call>count</tool_call>", "<answer>2</answer>"])
    ((c,),) = _run(_runner(engine, processor, CounterTool), [prompt])
    assert (c.turns, c.termination) == (3, "completed")
    ours = processor.tokenizer.decode(prompt.encoded.input_ids + c.token_ids)
    assert ours.count("You may call these tools") == 1 and ours.count("<tool_response>") == 2
    conversation = [
        {"role": "user", "content": "<image>\nHow many squares?"},
        {"role": "assistant", "content": "<tool_call>count</tool_call>"},
        {"role": "tool", "content": "2 squares"},
        {"role": "assistant", "content": "<tool_call>count</tool_call>"},
        {"role": "tool", "content": "2 squares"},
        {"role": "assistant", "content": "<answer>2</answer>"},
    ]
    whole = encode_messages(
        processor, conversation, [_image()], generation_prompt=False, tools=CounterTool.tools
    ).input_ids
    assert prompt.encoded.input_ids + c.token_ids == whole[: len(whole) - 1]  # all but the template's trailing newline


def test_loss_mask_logprobs_and_turn_ids_line_up(tiny):
    _, processor = tiny
    prompts = _prompts(processor)
    engine = Scripted(processor, ["<answer>3</answer>", "<answer>4</answer>", "<answer>5</answer>"])
    ((c,),) = _run(_runner(engine, processor, "verifier", max_turns=3, env_args={"max_attempts": 5}), prompts)
    tok = processor.tokenizer
    sampled = [t for t, m in zip(c.token_ids, c.mask) if m]
    observed = [t for t, m in zip(c.token_ids, c.mask) if not m]
    per_turn = tok.encode("<answer>3</answer>", add_special_tokens=False) + [engine.end]
    assert len(sampled) == 3 * len(per_turn) and c.turns == 3 and c.termination == "max_turns"
    assert all(lp == -0.5 for lp, m in zip(c.logprobs, c.mask) if m)
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if not m)
    assert tok.decode(observed).count("Your answer is incorrect. Try again.") == 2
    assert "assistant" in tok.decode(observed)  # the next generation prompt is context, not a target
    runs = [(t, m) for t, m in zip(c.turn_ids, c.mask)]
    assert sorted(set(c.turn_ids)) == [0, 1, 2] and c.turn_ids == sorted(c.turn_ids)
    assert all(m == 1 for t, m in runs if t == 2)  # no observation after the last turn
    assert (
        c.turn_texts == ["<answer>3</answer>", "<answer>4</answer>", "<answer>5</answer>"]
        and c.text == "<answer>5</answer>"
    )


def test_observation_images_are_placed_and_their_tokens_typed(tiny):
    """A zoom observation: the image placeholders of the crop are in the context, typed as image tokens, and the
    crop's processor outputs are kept."""
    _, processor = tiny
    prompts = _prompts(processor)
    engine = Scripted(processor, ["<zoom>[0,0,42,42]</zoom>", "<answer>1</answer>"])
    ((c,),) = _run(_runner(engine, processor, "zoom"), prompts)
    assert (c.turns, c.termination) == (2, "completed")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    n_pad = sum(1 for t in c.token_ids if t == pad)
    assert n_pad > 0 and all(m == 0 for t, m in zip(c.token_ids, c.mask) if t == pad)
    assert [t == pad for t in c.token_ids] == [v == 1 for v in c.per_token["mm_token_type_ids"]]
    assert len(c.images) == 1 and c.images[0].size == (84, 84)  # 42 x 42 enlarged twice
    merge = processor.image_processor.merge_size**2
    assert int(c.mm["image_grid_thw"].prod(-1).sum()) == n_pad * merge


# ------------------------------------------------------------------------------------------------ budgets, reasons


def test_termination_reasons_and_budgets(tiny):
    _, processor = tiny
    prompts = _prompts(processor)
    answer_right = Scripted(processor, ["<answer>2</answer>"])
    ((c,),) = _run(_runner(answer_right, processor, "verifier"), prompts)
    assert (c.turns, c.termination, c.reward_scale) == (1, "completed", 1.0)
    always_wrong = Scripted(processor, ["<answer>3</answer>"])
    ((c,),) = _run(
        _runner(always_wrong, processor, "verifier", max_turns=5, env_args={"max_attempts": 2, "discount": 0.5}),
        prompts,
    )
    assert (c.turns, c.termination, c.reward_scale) == (2, "env_done", 0.5)
    ((c,),) = _run(
        _runner(
            Scripted(processor, ["<answer>3</answer>"]),
            processor,
            "verifier",
            max_turns=2,
            env_args={"max_attempts": 9},
        ),
        prompts,
    )
    assert (c.turns, c.termination) == (2, "max_turns")
    no_stop = Scripted(processor, ["<answer>3</answer>"], stop=False)
    ((c,),) = _run(_runner(no_stop, processor, "verifier"), prompts)
    assert (c.turns, c.termination, c.finish_reason) == (1, "truncated", "length")
    budget = 12  # one turn (7 tokens) fits; the observation does not
    ((c,),) = _run(
        _runner(Scripted(processor, ["<answer>3</answer>"]), processor, "verifier", max_response_tokens=budget), prompts
    )
    assert c.termination == "truncated" and len(c.token_ids) <= budget and c.turns == 1
    ((c,),) = _run(
        _runner(Scripted(processor, ["<answer>3</answer>"]), processor, "verifier", max_response_tokens=5),
        prompts,
        max_new_tokens=32,
    )
    assert c.termination == "truncated" and len(c.token_ids) == 5


class Flaky:
    """Fails (raises, or hangs) on its first `fails` step calls, then behaves like the verifier."""

    def __init__(self, task, fails=1, hang=0.0, calls=None):
        from ovkit.envs import VerifierEnv

        self.inner, self.fails, self.hang, self.calls = (
            VerifierEnv(task),
            fails,
            hang,
            calls if calls is not None else [],
        )

    def reset(self):
        self.inner.reset()

    def step(self, text):
        self.calls.append(text)
        if self.fails > 0:
            self.fails -= 1
            if self.hang:
                time.sleep(self.hang)
            raise RuntimeError("the tool server is down")
        return self.inner.step(text)

    def format_observation(self, obs):
        return self.inner.format_observation(obs)


def test_a_failing_environment_is_retried_then_ends_the_rollout(tiny):
    _, processor = tiny
    prompts = _prompts(processor)
    calls = []
    ((c,),) = _run(
        _runner(
            Scripted(processor, ["<answer>2</answer>"]),
            processor,
            Flaky,
            env_args={"fails": 2, "calls": calls},
            env_retries=2,
        ),
        prompts,
    )
    assert (c.termination, len(calls)) == ("completed", 3)  # two failures, then the retry budget's last try works
    calls = []
    runner = _runner(
        Scripted(processor, ["<answer>2</answer>"]),
        processor,
        Flaky,
        env_args={"fails": 5, "calls": calls},
        env_retries=1,
    )
    ((c,),) = _run(runner, prompts)
    assert (c.termination, c.finish_reason, len(calls)) == ("env_error", "error", 2)
    assert "the tool server is down" in runner.failures[0]


def _broken_factory(task):
    if task["id"] == "p1":
        raise ValueError("no such episode")
    from ovkit.envs import VerifierEnv

    return VerifierEnv(task)


def test_a_factory_that_raises_ends_only_its_trajectory(tiny):
    _, processor = tiny
    runner = _runner(Scripted(processor, ["<answer>2</answer>"]), processor, _broken_factory)
    outs = _run(runner, _prompts(processor, n=2))
    assert [c.termination for cs in outs for c in cs] == ["completed", "env_error"]
    assert outs[1][0].token_ids == [] and "no such episode" in runner.failures[0]


def test_a_hanging_environment_times_out(tiny):
    _, processor = tiny
    prompts = _prompts(processor)
    runner = _runner(
        Scripted(processor, ["<answer>2</answer>"]),
        processor,
        Flaky,
        env_args={"fails": 9, "hang": 30.0},
        env_retries=1,
        env_timeout=0.2,
    )
    t0 = time.perf_counter()
    ((c,),) = _run(runner, prompts)
    assert c.termination == "env_error" and time.perf_counter() - t0 < 5
    assert "timed out" in runner.failures[0]


def test_environment_calls_of_a_turn_run_concurrently(tiny):
    """Eight trajectories whose tool takes 0.4 s per call: a turn's calls overlap (about 0.4 s, not 3.2 s)."""
    _, processor = tiny
    prompts = _prompts(processor, n=4)
    runner = _runner(
        Scripted(processor, ["<answer>2</answer>"]),
        processor,
        Flaky,
        env_args={"fails": 1, "hang": 0.4},
        env_retries=1,
        env_timeout=5.0,
    )
    t0 = time.perf_counter()
    outs = _run(runner, prompts, n=2)
    assert all(c.termination == "completed" for cs in outs for c in cs)
    assert time.perf_counter() - t0 < 2.0


def test_bad_env_specs_fail_before_any_model_is_loaded(tmp_path):
    from ovkit.errors import OvkitError
    from ovkit.rl.config import RLTrainConfig

    base = dict(data=[tmp_path], model=tmp_path, out=tmp_path / "o")
    with pytest.raises(OvkitError, match="not one of zoom, verifier"):
        RLTrainConfig(**base, env="nope")
    with pytest.raises(OvkitError, match="cannot import"):
        RLTrainConfig(**base, env="no_such_module:make")
    with pytest.raises(OvkitError, match="--env-arg needs --env"):
        RLTrainConfig(**base, env_arg=["max_attempts=2"])
    with pytest.raises(OvkitError, match="expected key=value"):
        RLTrainConfig(**base, env="verifier", env_arg=["max_attempts"])
    with pytest.raises(OvkitError, match="--env-arg max_attemps"):
        RLTrainConfig(**base, env="verifier", env_arg=["max_attemps=2"])  # a misspelt argument, caught before loading
    assert RLTrainConfig(**base, env="verifier", env_arg=["max_attempts=2", "discount=0.5"]).env_arg == {
        "max_attempts": 2,
        "discount": 0.5,
    }
    assert RLTrainConfig(**base, env="ovkit.envs.zoom:ZoomEnv").env == "ovkit.envs.zoom:ZoomEnv"  # an import path


# ------------------------------------------------------------------------------------------------ environments


def test_zoom_env_parses_crops_and_bounds():
    from ovkit.envs import ZoomEnv

    env = ZoomEnv({"images": [_image(size=100)]}, max_zooms=1)
    env.reset()
    obs, done, info = env.step("<zoom>[10, 20, 30, 50]</zoom>")
    assert not done and info["zoom"] == "ok" and obs["image"].size == (40, 60)
    message = env.format_observation(obs)
    assert message["content"].count("<image>") == 1 and message["images"] == [obs["image"]]
    assert env.step("<zoom>[0,0,50,50]</zoom>")[2]["zoom"] == "exhausted"
    env = ZoomEnv({"images": [_image(size=100)]})
    assert env.step("<zoom>[90, 90, 500, 500]</zoom>")[0]["image"].size == (28, 28)  # clamped to the image, min side
    assert env.step("<zoom>[50, 50, 50, 80]</zoom>")[2]["zoom"] == "empty"
    assert env.step("<zoom>where?</zoom>")[2]["zoom"] == "unparsed"
    assert env.step("<answer>3</answer>") == (None, True, {"reason": "completed"})


def test_verifier_env_discounts_by_attempt():
    from ovkit.envs import VerifierEnv

    env = VerifierEnv({"answer": "4", "answer_type": "number", "source": "t"}, max_attempts=3, discount=0.5)
    env.reset()
    obs, done, info = env.step("<answer>3</answer>")
    assert not done and obs["text"].startswith("Your answer is incorrect") and info["accuracy"] == 0
    obs, done, info = env.step("<answer>4</answer>")
    assert done and info["reason"] == "completed" and info["reward_scale"] == 0.5


def test_multiturn_reward_is_the_last_answer_discounted(tiny):
    from ovkit.rollouts.groups import Group, score_groups

    _, processor = tiny
    prompts = _prompts(processor)
    (cs,) = _run(
        _runner(
            Scripted(processor, ["<answer>3</answer>", "<answer>2</answer>"]),
            processor,
            "verifier",
            env_args={"discount": 0.8},
        ),
        prompts,
    )
    group = Group(prompts[0], 0, 0, cs)
    score_groups([group], mode="answer", format_weight=0.0, workers=1)
    assert group.task_rewards == [pytest.approx(0.8)]
    assert (
        group.parts[0]["turns"] == 2
        and group.parts[0]["termination"] == "completed"
        and group.parts[0]["accuracy"] == 1.0
    )


# ------------------------------------------------------------------------------------------------ with a real model


class ColourEnv:
    """Answers the first turn with a 56x56 image of one colour, then accepts anything."""

    def __init__(self, task, colour="red"):
        self.colour, self.turn = colour, 0

    def reset(self):
        self.turn = 0

    def step(self, text):
        from PIL import Image

        self.turn += 1
        if self.turn > 1:
            return None, True, {}
        return {"image": Image.new("RGB", (56, 56), self.colour)}, False, {}

    def format_observation(self, obs):
        return {"role": "user", "content": "<image>\nLook again.", "images": [obs["image"]]}


@pytest.fixture(scope="module")
def spread(tiny):
    """The tiny model with weights spread wider than its init, so that inputs move its logits visibly."""
    import copy

    model, processor = tiny
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval(), processor


def _colour_run(model, processor, colour):
    prompts = _prompts(processor)
    engine = Scripted(processor, ["<zoom>[0,0,42,42]</zoom>", "<answer>2</answer>"])
    (cs,) = _run(_runner(engine, processor, ColourEnv, model=model, env_args={"colour": colour}), prompts)
    return prompts[0], cs[0]


def test_an_image_returned_on_turn_two_changes_the_turn_two_logits(spread):
    """The sampler's context (what the next generate call reads) and the learner's batch both see the new image:
    turn-2 logits move with its colour, turn-1 logits do not (causal), and the same colour gives the same logits."""
    from ovkit.rollouts.episodes import Episode
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.trajectories import build_trajectories, forward_all

    model, processor = spread
    runs = {c: _colour_run(model, processor, c) for c in ("red", "blue")}
    last = {}
    for colour, (prompt, c) in runs.items():
        ctx = Episode(prompt, None)
        ctx.append(c.token_ids, c.logprobs, 1, 0, c.per_token)
        ctx.add_images(c.mm, c.images)
        with torch.no_grad():
            last[colour] = model(**ctx.context().model_inputs(labels=False)).logits[0, -1]
    assert (last["red"] - last["blue"]).abs().max() > 1e-3
    (prompt, red), (_, blue) = runs["red"], runs["blue"]
    assert red.token_ids == blue.token_ids  # the same tokens (a 56x56 image either way): only the pixels differ
    batch = build_trajectories([Group(prompt, 0, 0, [red, blue], rewards=[0.0, 0.0])], processor.tokenizer.pad_token_id)
    logp, _ = forward_all(model, batch, 2, 1.0)
    turn2 = batch.mask[0] & (batch.turn_ids[0] == 1)
    turn1 = batch.mask[0] & (batch.turn_ids[0] == 0)
    assert turn2.any() and turn1.any()
    assert (logp[0][turn2] - logp[1][turn2]).abs().max() > 1e-3
    assert torch.allclose(logp[0][turn1], logp[1][turn1], atol=1e-5)
    again = _colour_run(model, processor, "red")[1]
    batch = build_trajectories(
        [Group(prompt, 0, 0, [red, again], rewards=[0.0, 0.0])], processor.tokenizer.pad_token_id
    )
    logp, _ = forward_all(model, batch, 2, 1.0)
    assert torch.allclose(logp[0], logp[1], atol=1e-5)


def _assert_learnt(model, examples, at_least=0.99):
    """Every assistant token of the taught conversation has probability >= `at_least` under the model, teacher-forced.

    What the engine tests below need from the zoomer, stated as a property of its weights rather than of what it
    happens to sample: with every scripted token at p >= 0.99, greedy decoding follows the script exactly (p > 0.5
    makes it the argmax), and sampling at temperature 0.5 (p_T proportional to p^2, so p_T >= 0.9999) leaves the
    22-token script with probability under 3e-3 per trajectory (measured: p >= 0.997). If training ever stops
    reaching this on some machine, this fails here, naming the weakest probability, instead of a test below failing
    on what was sampled."""
    with torch.no_grad():
        for k, e in enumerate(examples):
            inputs = e.model_inputs()
            labels = inputs.pop("labels")[0, 1:]
            logp = model(**inputs).logits[0, :-1].float().log_softmax(-1)
            taught = labels != -100
            p = logp[taught].gather(-1, labels[taught][:, None])[:, 0].exp()
            assert taught.any() and p.min() >= at_least, (
                f"example {k}: the zoomer learnt its script only to p={p.min():.3f}"
            )


@pytest.fixture(scope="module")
def zoomer(tmp_path_factory):
    """The tiny model taught (150 steps, ~15 s) to call the zoom tool on turn 1 and answer after the zoomed image:
    real two-turn rollouts with an image observation (the fixture checks it learnt the script, _assert_learnt).
    Saved, with a 2-prompt RL table, for the command tests, which sample from the scripted policy instead
    (`scripted_zoomer`): what they assert is then what the script says, on any machine."""
    from ovkit.data import write_samples
    from ovkit.envs import ZoomEnv
    from ovkit.models import load
    from ovkit.models.encode import encode_sample
    from ovkit.models.tiny import build_tiny
    from ovkit.prompts import ANSWER_PROMPT, SYSTEM_PROMPT

    base = tmp_path_factory.mktemp("zoomer")
    model, processor = load(build_tiny(base / "init", TEXTS, seed=0))
    question = f"<image>\nHow many squares are there?\n{ANSWER_PROMPT}\n{ZoomEnv.instruction}"
    img = _image()
    crop = img.crop((0, 0, 42, 42)).resize((84, 84))
    first = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "<zoom>[0,0,42,42]</zoom>"},
    ]
    second = [
        *first,
        {"role": "user", "content": "Region [0,0,42,42] enlarged:\n<image>"},
        {"role": "assistant", "content": "<answer>1</answer>"},
    ]
    examples = [encode_sample(processor, first, [img]), encode_sample(processor, second, [img, crop])]
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    with torch_threads(1):  # what it learns depends on the thread count: with 2, p reached 0.953, not 0.997
        for _ in range(150):
            loss = sum(model(**e.model_inputs()).loss for e in examples)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    _assert_learnt(model, examples)
    model.save_pretrained(base / "model")
    processor.save_pretrained(base / "model")
    rows = [
        {
            "id": f"q{i}",
            "images": [image_cell(_image())],
            "messages": [{"role": "user", "content": "<image>\nHow many squares are there?"}],
            "source": "test/count",
            "category": "counting",
            "answer": "1",
            "answer_type": "number",
        }
        for i in range(2)
    ]
    write_samples(samples_table(rows), base / "data")
    return model, processor, base


@pytest.fixture
def scripted_zoomer(zoomer, monkeypatch):
    """The zoomer, with every HF engine (whichever command builds it) saying the zoom script instead of sampling
    (tests/scripted_policy.py: log-probs are the engine's model's own, teacher-forced at the sampling temperature).
    Samples 0 and 2 of every 4 zoom, then answer: each generate call has two-turn episodes, whatever the machine."""
    from scripted_policy import ScriptedEngine

    from ovkit.generate import HFEngine

    def generate(self, prompts, **kw):
        return ScriptedEngine(self.model, self.processor, _zoom_script).generate(prompts, **kw)

    monkeypatch.setattr(HFEngine, "generate", generate)
    return zoomer


def test_the_learner_re_reads_multi_turn_trajectories_exactly(zoomer):
    """fp32 sampler and learner on the same weights: every sampled token of every turn gets the same log-prob from
    the learner's batch (observation image, its rope positions and token types included) as from the sampler."""
    from ovkit.envs import ZoomEnv
    from ovkit.generate import HFEngine
    from ovkit.models.encode import multimodal_token_ids
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.trajectories import build_trajectories, forward_all

    model, processor, _ = zoomer
    prompts = _prompts(processor, n=2, answer="1", extra=ZoomEnv.instruction)
    runner = _runner(HFEngine(model, processor), processor, "zoom", model=model)
    outs = runner.run(prompts, n=3, max_new_tokens=16, temperature=0.5, top_p=1.0, seed=0)
    completions = [c for cs in outs for c in cs]
    assert sum(c.turns == 2 and len(c.images) == 1 for c in completions) >= 2  # the model zooms, then answers
    groups = [Group(p, i, 0, cs, rewards=[0.0] * len(cs)) for i, (p, cs) in enumerate(zip(prompts, outs))]
    batch = build_trajectories(groups, processor.tokenizer.pad_token_id, multimodal_token_ids(model))
    logp, _ = forward_all(model, batch, 4, 0.5)
    later = batch.mask & (batch.turn_ids > 0)
    assert later.sum() > 0
    assert (logp - batch.behave_logprobs)[batch.mask].abs().max() < 1e-3


def test_multi_turn_rollouts_through_vllm_are_token_in_token_out(zoomer, monkeypatch):
    """The vLLM engine (a stand-in with vLLM's shapes, tests/fake_vllm.py) gets each turn's whole context as token ids
    (placeholders expanded) plus every image so far, and gives the same greedy episodes as the HF engine: the same
    tokens, masks, turn ids and observation images, token for token."""
    import fake_vllm

    from ovkit.envs import ZoomEnv
    from ovkit.generate import HFEngine, VLLMEngine

    fake_vllm.install(monkeypatch)
    model, processor, base = zoomer
    prompts = _prompts(processor, n=2, answer="1", extra=ZoomEnv.instruction)
    runs = {}
    engines = {"hf": HFEngine(model, processor), "vllm": VLLMEngine(base / "model", processor, dtype="float32")}
    for name, engine in engines.items():
        runner = _runner(engine, processor, "zoom", model=model)
        runs[name] = [
            c for cs in runner.run(prompts, n=1, max_new_tokens=16, temperature=0, top_p=1.0, seed=0) for c in cs
        ]
    assert any(c.turns == 2 for c in runs["hf"])  # real two-turn episodes (the zoomer zooms, then answers)
    for a, b in zip(runs["hf"], runs["vllm"]):
        assert (a.token_ids, a.loss_mask, a.turn_ids, a.termination) == (
            b.token_ids,
            b.loss_mask,
            b.turn_ids,
            b.termination,
        )
        assert len(a.images) == len(b.images) and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    from ovkit.generate.vllm import collapse_placeholders

    firsts = [collapse_placeholders(p.encoded.input_ids, engines["vllm"].placeholder_ids) for p in prompts]
    second_turns = [
        ids
        for call in fake_vllm.LLM.calls
        if call[0] == "generate"
        for ids in call[1]
        if len(ids) > min(map(len, firsts))
    ]
    # each later turn's context starts with a prompt's ids as the first turn sent them (one placeholder per image)
    assert second_turns and all(any(ids[: len(f)] == f for f in firsts) for ids in second_turns)


def test_rl_train_with_the_zoom_env_and_its_mismatch_report(scripted_zoomer, cli, tmp_path):
    """`ovkit rl-train --env zoom` end to end: per-turn metrics are logged, the saved rollouts carry loss masks,
    turn ids, terminations and the observation images, and mismatch-report splits first vs later turns on them.
    The sampler says the zoom script (the first sample of every generate call zooms, then answers)."""
    import json

    from ovkit.rollouts.table import read_rollouts

    _, _, base = scripted_zoomer
    out = tmp_path / "rl"
    args = [
        "--prompts-per-step",
        "2",
        "--group-size",
        "3",
        "--max-new-tokens",
        "16",
        "--max-steps",
        "2",
        "--lr",
        "1e-4",
        "--warmup-ratio",
        "0",
        "--max-staleness",
        "0",
        "--temperature",
        "0.5",
        "--reward-workers",
        "1",
        "--quiet",
    ]
    code, stdout, err = cli(
        "rl-train",
        base / "data",
        "--model",
        base / "model",
        "--out",
        out,
        "--env",
        "zoom",
        "--max-turns",
        "3",
        "--save-rollouts",
        *args,
    )
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(
        sum(r[f"ovkit/termination/{k}"] for k in ("completed", "env_done", "max_turns", "truncated", "env_error"))
        == pytest.approx(1.0)
        for r in rows
    )
    assert all(sum(r["ovkit/turns/hist"].values()) == 6 for r in rows)
    assert all(r["ovkit/turns/max"] == 2 and r["ovkit/turns/hist"]["2"] > 0 for r in rows)  # the script zooms once
    assert any("ovkit/mismatch/later_turns/vllm_kl" in r for r in rows) and any(
        k.startswith("ovkit/reward/by_turns/") for k in rows[0]
    )
    table = read_rollouts(out / "rollouts" / "step-000001.parquet")
    for row in table.to_pylist():
        assert len(row["turn_ids"]) == len(row["response_ids"]) == len(row["loss_mask"])
        assert row["turns"] == max(row["turn_ids"]) + 1 and row["termination"] in (
            "completed",
            "max_turns",
            "truncated",
        )
        assert len(row["images"]) >= 1 and row["completion"].count("<|im_start|>assistant") == row["turns"] - 1
    from ovkit.errors import OvkitError
    from ovkit.rollouts.table import write_rollouts

    with pytest.raises(OvkitError, match="termination"):
        write_rollouts(
            table.set_column(
                table.column_names.index("termination"), "termination", pa.array(["finished"] * table.num_rows)
            ),
            tmp_path / "bad.parquet",
        )
    report = tmp_path / "report"
    code, stdout, err = cli("mismatch-report", out / "rollouts", "--model", base / "model", "--quiet", "--out", report)
    assert code == 0, err
    by_turn = json.loads((report / "report.json").read_text())["runs"]["rollouts"]["by_turn"]
    names = [r["turn"] for r in by_turn]
    assert names[:2] == ["first", "later"] and "2" in names
    assert all(r["tokens"] > 0 for r in by_turn)


def test_eval_and_rl_curate_run_the_same_loop(scripted_zoomer, cli, tmp_path, monkeypatch):
    """`eval --env` and `rl-curate --env` roll out through the environment: records and rollouts carry the turns,
    and the multi-turn summary adds up. eval samples the zoom script (2 of its 4 episodes zoom, then answer);
    rl-curate samples the zoomer itself: what it asserts holds whatever is sampled."""
    import json

    from ovkit.rollouts.table import read_rollouts

    _, _, base = scripted_zoomer
    code, _, err = cli(
        "eval",
        base / "data",
        "--model",
        base / "model",
        "--out",
        tmp_path / "ev",
        "--env",
        "zoom",
        "--max-new-tokens",
        "16",
        "--n",
        "2",
        "--temperature",
        "0.5",
        "--save-logprobs",
        "--quiet",
    )
    assert code == 0, err
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())["multiturn"]
    assert summary["turns/max"] == 2 and sum(summary["turns/hist"].values()) == 4
    assert {k: v for k, v in summary["turns/hist"].items() if v} == {"1": 2, "2": 2}
    rollouts = read_rollouts(tmp_path / "ev" / "rollouts.parquet").to_pylist()
    assert sum(r["turns"] == 2 and 0 in r["loss_mask"] and len(r["images"]) == 2 for r in rollouts) == 2
    assert all(len(r["images"]) >= 1 for r in rollouts)
    monkeypatch.undo()  # rl-curate below samples from the model
    code, _, err = cli(
        "rl-curate",
        base / "data",
        "--model",
        base / "model",
        "--out",
        tmp_path / "cu",
        "--env",
        "verifier",
        "--env-arg",
        "max_attempts=2",
        "--n",
        "2",
        "--max-new-tokens",
        "16",
        "--reward-workers",
        "1",
        "--quiet",
    )
    assert code == 0, err
    curated = read_rollouts(tmp_path / "cu" / "rollouts").to_pylist()
    assert len(curated) == 4 and all(
        r["termination"] in ("completed", "env_done", "truncated", "max_turns") for r in curated
    )
    assert all(json.loads(r["reward_parts"])["turns"] == r["turns"] for r in curated)


def test_asynchronous_multi_turn_rl_train(zoomer, cli, tmp_path):
    """Multi-turn rollouts run in the rollout thread too (--max-staleness 1), with the verifier's feedback loop."""
    import json

    _, _, base = zoomer
    out = tmp_path / "rl-async"
    code, _, err = cli(
        "rl-train",
        base / "data",
        "--model",
        base / "model",
        "--out",
        out,
        "--env",
        "verifier",
        "--env-arg",
        "max_attempts=2",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "12",
        "--max-steps",
        "3",
        "--lr",
        "1e-4",
        "--warmup-ratio",
        "0",
        "--max-staleness",
        "1",
        "--reward-workers",
        "1",
        "--quiet",
    )
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and max(r["ovkit/staleness/max"] for r in rows) <= 1
    assert all(sum(r["ovkit/turns/hist"].values()) == 4 and r["ovkit/turns/max"] <= 2 for r in rows)


def test_mismatch_report_generates_multi_turn_rollouts_per_sampler(scripted_zoomer, cli, tmp_path):
    """`mismatch-report --generate DATA --env zoom`: each sampler rolls out the same episodes' prompts through the
    environment (saying the zoom script, so every run has zooms), and every run's by-turn table has first and later
    turns."""
    import json

    _, _, base = scripted_zoomer
    out = tmp_path / "mm"
    code, stdout, err = cli(
        "mismatch-report",
        "--generate",
        base / "data",
        "--model",
        base / "model",
        "--env",
        "zoom",
        "--sampler",
        "fp32",
        "--sampler",
        "bf16",
        "--n",
        "3",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.5",
        "--quiet",
        "--out",
        out,
    )
    assert code == 0, err
    runs = json.loads((out / "report.json").read_text())["runs"]
    for name in ("fp32", "bf16"):
        names = [r["turn"] for r in runs[name]["by_turn"]]
        assert names[:2] == ["first", "later"], (name, names)
    fp32 = {r["turn"]: r for r in runs["fp32"]["by_turn"]}
    assert fp32["later"]["k3_kl"] < 1e-6  # fp32 sampler, fp32 learner: later turns re-read exactly too
    code, _, err = cli(
        "mismatch-report",
        out / "rollouts" / "fp32.parquet",
        "--model",
        base / "model",
        "--env",
        "zoom",
        "--out",
        tmp_path / "x",
    )
    assert code == 2 and "--env goes with --generate" in err


def _zoom_script(turn: int, k: int) -> str:
    """Samples 0 and 2 zoom, then answer 1 (right, two turns); sample 1 answers 1 at once (right); sample 3 answers 2
    (wrong): every group has reward spread, so every step has advantages and a gradient, on any machine."""
    if turn == 0:
        return "<zoom>[0,0,42,42]</zoom>" if k % 2 == 0 else f"<answer>{1 if k % 4 == 1 else 2}</answer>"
    return "<answer>1</answer>"


def test_an_interrupted_multi_turn_run_resumes_on_the_same_trajectory(zoomer, tmp_path, monkeypatch):
    """The run dies after its step-1 checkpoint; --resume finishes it exactly as a straight run: the episodes (their
    seeds and the environments' answers) are a function of the seed and the step, like single-turn rollouts. The
    policy is scripted (tests/scripted_policy.py), so the groups have reward spread whatever the machine samples."""
    import json

    from safetensors.torch import load_file
    from scripted_policy import ScriptedEngine

    from ovkit.rl import loop as trainer
    from ovkit.rl.config import RLTrainConfig
    from ovkit.runtime import Runtime

    _, _, base = zoomer
    monkeypatch.setattr(
        trainer, "make_sampler", lambda cfg, model, processor: ScriptedEngine(model, processor, _zoom_script)
    )

    def cfg(out, **kw):
        return RLTrainConfig(
            data=[base / "data"],
            model=base / "model",
            out=out,
            env="zoom",
            max_turns=3,
            prompts_per_step=2,
            group_size=4,
            max_new_tokens=16,
            temperature=1.3,
            lr=1e-3,
            warmup_ratio=0.0,
            max_staleness=0,
            max_steps=2,
            save_every=1,
            keep_checkpoints=1,
            reward_workers=1,
            quiet=True,
            **kw,
        )

    trainer.train_rl(cfg(tmp_path / "straight"))
    save = Runtime.save_checkpoint

    def save_then_die(*args, **kwargs):
        save(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Runtime, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        trainer.train_rl(cfg(tmp_path / "cut"))
    monkeypatch.setattr(Runtime, "save_checkpoint", save)
    assert trainer.train_rl(cfg(tmp_path / "cut", resume=True))["resumed_from"].endswith("step-000001")
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("straight", "cut")
    }
    straight = rows["straight"]
    assert [r["reward"] for r in straight] == [0.75, 0.75] and all(r["frac_reward_zero_std"] == 0 for r in straight)
    assert all(r["grad_norm"] > 0 for r in straight) and all(
        r["ovkit/turns/hist"] == {"1": 4, "2": 4} for r in straight
    )
    assert [r["grad_norm"] for r in straight] == pytest.approx([r["grad_norm"] for r in rows["cut"]], rel=1e-5)
    a, b = load_file(tmp_path / "straight" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_a_multi_turn_trajectory_does_not_depend_on_the_prompts_beside_it(zoomer):
    """Every turn of trajectory k of a prompt draws from (run seed, the prompt's key, k, turn), so the prompts
    rolled out in two calls (two processes' shares, another batch size) give the trajectories of one call over all of
    them: tokens, masks, turn ids, observation images; prompts alike but for their id draw apart."""
    from ovkit.envs import ZoomEnv
    from ovkit.generate import HFEngine
    from ovkit.rollouts.sample import sample

    model, processor, _ = zoomer
    prompts = _prompts(processor, n=3, answer="1", extra=ZoomEnv.instruction)

    def roll(chosen, batch_size):
        engine = HFEngine(model, processor, batch_size=batch_size)
        runner = _runner(engine, processor, "zoom", model=model)
        return sample(engine, chosen, n=2, max_new_tokens=16, temperature=1.6, top_p=1.0, seed=3, episodes=runner)

    whole = roll(prompts, 8)
    split = [None] * len(prompts)
    split[0::2], split[1::2] = roll(prompts[0::2], 2), roll(prompts[1::2], 3)
    flat = lambda out: [c for cs in out for c in cs]  # noqa: E731
    assert any(c.turns == 2 for c in flat(whole))  # real two-turn trajectories
    for a, b in zip(flat(whole), flat(split)):
        assert (a.token_ids, a.loss_mask, a.turn_ids, a.termination) == (
            b.token_ids,
            b.loss_mask,
            b.turn_ids,
            b.termination,
        )
        assert len(a.images) == len(b.images) and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert len({tuple(c.token_ids) for c in flat(whole)}) > 2  # the same prompt under 3 ids x 2 samples draws apart


def test_multi_turn_eval_over_two_processes_samples_what_one_process_samples(zoomer, tmp_path):
    """#29: `ovkit eval --env zoom` under torchrun (gloo, CPU) with 2 processes against 1 at the same seed: every turn
    of every trajectory draws from its own stream, so the rollouts (tokens, masks, turns, terminations) and the
    multi-turn summary are one process's, with real two-turn trajectories among them."""
    import json

    from ovkit.rollouts.table import read_rollouts

    _, _, base = zoomer
    (tmp_path / "eval.yaml").write_text("n: 2\ntemperature: 1.6\n")  # torchrun's parser takes `--n` for its own
    args = [
        "eval",
        base / "data",
        "--model",
        base / "model",
        "--env",
        "zoom",
        "--max-new-tokens",
        "16",
        "--config",
        tmp_path / "eval.yaml",
        "--save-logprobs",
        "--quiet",
    ]
    for n in (1, 2):
        run = torchrun(n, "-m", "ovkit", *args, "--out", str(tmp_path / f"p{n}"))
        assert run.returncode == 0, run.stderr[-3000:]
    keys = ("prompt_id", "response_ids", "loss_mask", "turn_ids", "termination", "reward")
    one, two = (
        sorted(
            tuple(json.dumps(r[k]) for k in keys) for r in read_rollouts(tmp_path / d / "rollouts.parquet").to_pylist()
        )
        for d in ("p1", "p2")
    )
    assert one == two and len(one) == 4
    multiturn = lambda d: json.loads((tmp_path / d / "summary.json").read_text())["multiturn"]  # noqa: E731
    assert multiturn("p1") == multiturn("p2") and multiturn("p1")["turns/max"] >= 2


def test_the_shared_prefix_learner_shares_only_the_first_turn(zoomer):
    """rl-train's --shared-prefix on two-turn zoom episodes: each group's prompt (the first turn, its image) is
    forwarded once, each episode's later turn and its observation image stay with the episode, and the log-probs,
    entropies and every gradient are the plain learner's (ovkit.rollouts.shared)."""
    import copy

    from helpers import assert_same_learner, learner_plans, logprobs_and_grads

    from ovkit.envs import ZoomEnv
    from ovkit.generate import HFEngine
    from ovkit.models import attention as attn
    from ovkit.models.encode import multimodal_token_ids
    from ovkit.pack.packed import PackLayout
    from ovkit.rollouts.groups import Group
    from ovkit.rollouts.trajectories import build_trajectories

    model, processor, _ = zoomer
    model = copy.deepcopy(model)
    attn.apply(model, attn.resolve("sdpa", "cpu", train=True))  # the learner's attention, as rl-train loads it
    prompts = _prompts(processor, n=2, answer="1", extra=ZoomEnv.instruction)
    runner = _runner(HFEngine(model, processor), processor, "zoom", model=model)
    outs = runner.run(prompts, n=3, max_new_tokens=16, temperature=0.5, top_p=1.0, seed=0)
    observed = sum(len(c.images) for cs in outs for c in cs)
    assert observed >= 2  # the model zooms, then answers
    groups = [Group(p, i, 0, cs, rewards=[0.0] * len(cs)) for i, (p, cs) in enumerate(zip(prompts, outs))]
    batch = build_trajectories(groups, processor.tokenizer.pad_token_id, multimodal_token_ids(model))
    layout = PackLayout.for_model(model)
    plain, shared = learner_plans(batch, layout, 8, False), learner_plans(batch, layout, 8, True)
    assert shared[0].inputs["image_grid_thw"].shape[0] == len(groups) + observed
    assert plain[0].inputs["image_grid_thw"].shape[0] == batch.size + observed
    with torch_threads(1):
        assert_same_learner(logprobs_and_grads(model, batch, plain), logprobs_and_grads(model, batch, shared))
