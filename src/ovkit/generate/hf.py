"""Batched generation with transformers: the engine that runs everywhere, CPU included.

How a batch is generated: prompts are sorted by length, cut into batches of `batch_size` sequences, left-padded
(`collate_prompts`: per-token tensors such as Qwen-VL's `mm_token_type_ids` are padded like `input_ids`; per-image
tensors such as `pixel_values` / `image_grid_thw` are concatenated in batch order) and handed to `model.generate`,
which computes the Qwen-VL 3D RoPE positions and rope deltas from the attention mask. Tests check that a batch gives
the same greedy tokens as one prompt at a time, and that generation with and without the KV cache agrees.

A prompt sampled n times (a GRPO group, rl-curate's n samples) is prefilled once: its images go through the vision
encoder once and its KV cache is copied to the n sequences before `generate` decodes them (`prefill="shared"`, the
default; `HFEngine._shared_prefill`). Batches without a repeated prompt (n=1 as eval and caption run by default,
greedy, multi-turn turns) take the plain path whatever the option says; eval --n > 1 shares too (same samples). On the
tiny model (CPU, one thread) it halves the engine's CPU time at n=4
and cuts it ~2.4x at n=8/16, with the same decode step (same ops, mask and cache shapes) as per-sequence prefill;
an earlier "decode ~9x slower" reading was two OpenMP threads on an oversubscribed box (BENCHMARKS.md).
`prefill="per-sequence"` prefills every sequence on its own, as `generate(num_return_sequences=n)` does.
`static_cache=True` asks `generate` for transformers' static KV cache (`cache_implementation="static"`), with which
transformers also compiles the decode step on CUDA; it applies to batches without repeated prompts (greedy, n=1),
since a shared prefill's cache is a dynamic one. Off by default: not measured yet, on CPU or GPU.

Where the log-probs come from: sampling is done by `generate` (`do_sample=True`, its own temperature/top-k/top-p
switched off) with one logits processor of ours, `_SampledDistribution`, that turns the fp32 logits into the
log-probabilities of the distribution we want (`sampling_logprobs`: temperature, then top-p renormalised) and
returns them as the scores `generate` samples from. So the distribution sampled from is ours by construction, and at
each step the processor gathers the log-prob of the token sampled at the step before (it is the last column of
`input_ids`), which keeps memory at one batch x vocab row instead of `output_scores`' steps x batch x vocab. The
model's own `generation_config` (repetition penalty, top-k, ... of a hub checkpoint) is set aside while we generate
so that nothing else reshapes the distribution. A test checks that, at temperature 1 and top-p 1, the logprobs equal
log_softmax of a teacher-forced forward pass of the same model. With per-prompt `seeds` the processor draws instead
(Gumbel-max: each sequence adds noise from its own stream, `generate` takes the argmax), so a sequence's draws do not
depend on its batch: what eval and rl-train need for N processes to sample what one samples.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ovkit.choices import QUANTS
from ovkit.errors import OvkitError
from ovkit.generate import Completion

# Tensors of an encoded prompt with one value per token; everything else in `Encoded.mm` is per image.
PER_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# "shared": a prompt sampled n times (a GRPO group) is prefilled once, its images encoded once, and its KV cache copied
# to the n sequences; "per-sequence": every sequence is prefilled on its own, as `generate(num_return_sequences=n)`
# does.
PREFILLS = ("shared", "per-sequence")


def sampling_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities (fp32) of the distribution a sampler draws from: logits / temperature, then the smallest
    set of tokens whose probability reaches `top_p` kept and renormalised (the rest get -inf). Temperature 0 means
    greedy decoding; the model's untempered distribution is returned (its argmax is the greedy token)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    if temperature > 0 and top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the top token always stays (mass before it is 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logp = torch.log_softmax(logits.masked_fill(drop, float("-inf")), dim=-1)
    return logp


class _SampledDistribution(LogitsProcessor):
    """The only logits processor in play: returns `sampling_logprobs` as the scores `generate` samples from, and
    records the log-prob of each sampled token (gathered one step later, when the token is in `input_ids`)."""

    def __init__(
        self,
        temperature: float,
        top_p: float,
        suppress_ids: Sequence[int] = (),
        streams: Sequence[torch.Generator] | None = None,
    ):
        self.temperature = temperature
        self.top_p = top_p
        self.suppress = list(suppress_ids)
        self.streams = streams  # one generator per sequence: sampled here (Gumbel-max), `generate` takes the argmax
        self.previous: torch.Tensor | None = None
        self.taken: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.taken.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        if self.suppress:
            scores = scores.float().index_fill(-1, torch.as_tensor(self.suppress, device=scores.device), float("-inf"))
        self.previous = sampling_logprobs(scores, self.temperature, self.top_p)
        if self.streams is None:
            return self.previous
        # argmax(log p + Gumbel noise) is a draw from p (the Gumbel-max trick); each row's noise comes from its own
        # stream, so a sequence's tokens do not depend on which other sequences share its batch (or its process).
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, device=g.device) for g in self.streams]).to(
            scores.device
        )
        return self.previous - torch.log(-torch.log(u.clamp_min(1e-20)))

    def logprobs(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(batch, steps) log-probs of `new_tokens` (the generated part of `generate`'s output)."""
        steps = new_tokens.shape[1]
        taken = list(self.taken[:steps])
        if len(taken) < steps:  # the last sampled token was never fed back through the processor
            taken.append(self.previous.gather(1, new_tokens[:, -1:]).squeeze(1))
        return torch.stack(taken, dim=1) if taken else new_tokens.new_zeros((new_tokens.shape[0], 0), dtype=torch.float)


def collate_prompts(prompts: Sequence[Any], pad_id: int) -> dict[str, Any]:
    """Left-pad encoded prompts into one batch for `generate`: input_ids, attention_mask, per-token tensors padded
    the same way (0 in the padding), per-image tensors concatenated in batch order."""
    width = max(p.length for p in prompts)
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    per_token_names = sorted({k for p in prompts for k in _per_token(p)})
    per_token = {k: torch.zeros((batch, width), dtype=torch.long) for k in per_token_names}
    for i, p in enumerate(prompts):
        start = width - p.length
        input_ids[i, start:] = torch.tensor(p.input_ids, dtype=torch.long)
        attention_mask[i, start:] = 1
        for k, values in _per_token(p).items():
            per_token[k][i, start:] = torch.as_tensor(values, dtype=torch.long).reshape(-1)
    out: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, **per_token}
    for key in sorted({k for p in prompts for k in p.mm}):
        parts = [p.mm[key] for p in prompts if key in p.mm]
        if not all(isinstance(t, torch.Tensor) for t in parts):
            raise OvkitError(f"cannot batch the processor output {key!r}: it is not a tensor")
        try:
            out[key] = torch.cat(parts, dim=0)
        except RuntimeError as e:
            raise OvkitError(
                f"cannot batch the processor output {key!r} of different shapes ({e}); use --batch-size 1"
            ) from None
    return out


def _per_token(prompt: Any) -> dict[str, Any]:
    """Per-token values of an Encoded prompt: its `per_token` dict, or per-token keys left in `mm` by older code."""
    found = dict(getattr(prompt, "per_token", None) or {})
    for k in PER_TOKEN_KEYS:
        if k in prompt.mm and k not in found:
            found[k] = prompt.mm[k]
    return found


def stop_token_ids(tokenizer: Any, model: Any = None) -> list[int]:
    """Tokens that end a completion: the model's eos ids, the tokenizer's eos and ChatML's <|im_end|>."""
    ids: list[int] = []
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    ids.append(getattr(tokenizer, "eos_token_id", None))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.append(vocab.get("<|im_end|>"))
    out = [int(i) for i in dict.fromkeys(ids) if i is not None]
    if not out:
        raise OvkitError("the model and tokenizer define no end-of-sequence token; generation could never stop")
    return out


def _dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise OvkitError(f"sampler dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


class HFEngine:
    """Generation with a transformers model.

    The sampler is the learner model itself when no `dtype`/`quant` is asked for (colocated: nothing to sync), else a
    copy cast to `dtype`, or int8 / fp8 / int4 (ovkit.generate.quant: on CPU int8 is torch's dynamic quantisation,
    `torch.ao.quantization.quantize_dynamic` on every Linear, fp32 activations; fp8 and int4 (group-wise 4-bit) round
    the weights on any device) to reproduce low-precision sampling. `batch_size` counts sequences (prompts x n).
    """

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        dtype: Any = None,
        quant: str | None = None,
        separate: bool = False,
        batch_size: int = 32,
        use_cache: bool = True,
        prefill: str = "shared",
        static_cache: bool = False,
        progress: bool = False,
    ):
        if quant is not None and quant not in QUANTS:
            raise OvkitError(f"--sampler-quant must be one of {', '.join(QUANTS)} (or none), got {quant!r}")
        if batch_size < 1:
            raise OvkitError(f"--batch-size must be >= 1, got {batch_size}")
        if prefill not in PREFILLS:
            raise OvkitError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}")
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.dtype = _dtype(dtype)
        self.quant = quant
        self.separate = separate  # sample from an own copy even in the learner's dtype (asynchronous RL)
        self.batch_size = batch_size
        self.use_cache = use_cache
        self.prefill = prefill
        self.static_cache = static_cache
        self.progress = progress
        self.bar: Any = None  # a caller's bar over several calls (eval's one bar), advanced instead of a bar per call
        self.stop_ids = stop_token_ids(self.tokenizer, model)
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self.model = self._sampler(model)

    # -- weights ---------------------------------------------------------------------------------------------------

    def _sampler(self, model: Any) -> Any:
        """The model to sample from: `model` itself, or a cast / quantised copy of it."""
        param = next(model.parameters())
        if self.quant in ("fp8", "int4") or (self.quant == "int8" and param.device.type != "cpu"):
            from ovkit.generate.quant import round_weights  # weight-only rounding: any device

            return round_weights(cast_copy(model, self.dtype or param.dtype).eval(), self.quant)
        if self.quant == "int8":
            # heavy, and deprecated (a warning on import): loaded only when an int8 sampler is asked for
            from torch.ao.quantization import quantize_dynamic

            sampler = cast_copy(model, torch.float32).eval()
            with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao, still works
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", UserWarning)
                return quantize_dynamic(sampler, {torch.nn.Linear}, dtype=torch.qint8)
        if (self.dtype is None or self.dtype == param.dtype) and not self.separate:
            return model
        return cast_copy(model, self.dtype or param.dtype).eval()

    def update_weights(self, model: Any) -> None:
        """Copy the learner's current weights into the sampler (cast to its dtype, or re-quantised)."""
        if model is self.model:
            return
        if self.quant is not None:
            self.model = self._sampler(model)
            return
        mine = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name not in mine:
                    raise OvkitError(
                        f"update_weights: the sampler has no parameter {name!r}; was it built from another model?"
                    )
                mine[name].copy_(p.detach())

    def close(self) -> None:
        """Nothing to shut down: the weights are the caller's model or a copy that goes with this engine."""

    # -- generation ------------------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Any],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        images: Any = None,  # accepted for parity with VLLMEngine; the encoded prompts already hold the pixels
        suppress_ids: Sequence[int] = (),
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """Per prompt, `n` completions (temperature 0: greedy, computed once and repeated). `suppress_ids` are never
        sampled (multi-turn rollouts: image placeholders, which the next turn's forward would read as images).

        `seeds` (one per prompt) make the sampling per sequence: completion k of prompt i draws from its own stream
        seeded by (seeds[i], k), whatever else is in its batch, so prompts split over processes (or batches) sample
        what one call over all of them samples, up to the float noise of another padding. Without it, one `seed`
        seeds each batch's shared stream (a batch's draws depend on its make-up)."""
        _check_sampling(n, max_new_tokens, temperature, top_p)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        copies = n if temperature > 0 else 1
        order = sorted(range(len(prompts)), key=lambda i: -prompts[i].length)
        seqs = [(i, k) for i in order for k in range(copies)]  # (prompt, sample) in the order they are generated
        results: list[list[Completion | None]] = [[None] * copies for _ in prompts]
        chunks = [seqs[s : s + self.batch_size] for s in range(0, len(seqs), self.batch_size)]
        bar = self.bar if self.bar is not None else _progress(len(seqs), self.progress)
        for c, chunk in enumerate(chunks):
            batch = [prompts[i] for i, _ in chunk]
            streams = (
                None if seeds is None or temperature == 0 else [_stream(seeds[i], k, self.model) for i, k in chunk]
            )
            with _seeded(seed * 1_000_003 + c, self.model):
                done = self._generate_batch(batch, max_new_tokens, temperature, top_p, suppress_ids, streams)
            for (i, k), completion in zip(chunk, done):
                results[i][k] = completion
            bar.update(len(chunk))
        if bar is not self.bar:
            bar.close()
        if copies == n:
            return results  # type: ignore[return-value]
        return [
            [dataclasses.replace(r[0], token_ids=list(r[0].token_ids), logprobs=list(r[0].logprobs)) for _ in range(n)]
            for r in results
        ]

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: Sequence[Any],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        suppress_ids: Sequence[int] = (),
        streams: Any = None,
    ) -> list[Completion]:
        model = self.model
        device = next(model.parameters()).device
        if self._shares_prefill(prompts):
            inputs = self._shared_prefill(prompts, device)
        else:
            inputs = self._inputs(prompts, device)
        recorder = _SampledDistribution(temperature, top_p, suppress_ids, streams)
        sample = temperature > 0 and streams is None  # with streams the processor samples; `generate` takes the argmax
        sampling = dict(temperature=1.0, top_p=1.0, top_k=0) if sample else {}  # ours do the work
        static = dict(cache_implementation="static") if self.static_cache and "cache" not in inputs else {}
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            eos_token_id=self.stop_ids,
            pad_token_id=self.pad_id,
            use_cache=self.use_cache,
            **static,
            **sampling,
        )
        with _plain_generation_config(model), _eval_mode(model):
            out = model.generate(**inputs, generation_config=config, logits_processor=LogitsProcessorList([recorder]))
        new = out[:, inputs["input_ids"].shape[1] :]
        logprobs = recorder.logprobs(new).tolist()
        return [self._completion(row, lp) for row, lp in zip(new.tolist(), logprobs)]

    def _inputs(self, prompts: Sequence[Any], device: torch.device) -> dict[str, Any]:
        inputs = collate_prompts(prompts, self.pad_id)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        if self.dtype is not None and "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        return inputs

    def _shares_prefill(self, prompts: Sequence[Any]) -> bool:
        """Shared prefill pays when a prompt repeats in the batch (n > 1) and needs a KV cache to copy; a prompt of
        one token has nothing to prefill before the step that `generate` runs."""
        distinct = {id(p) for p in prompts}
        return (
            self.prefill == "shared"
            and self.use_cache
            and len(distinct) < len(prompts)
            and min(p.length for p in prompts) > 1
            and _continues_from_a_cache(self.model)
        )

    def _shared_prefill(self, prompts: Sequence[Any], device: torch.device) -> dict[str, Any]:
        """Run the vision encoder and the prompt through the model once per distinct prompt, copy the KV cache to each
        sequence that samples from it, and return `generate`'s inputs for continuing from that cache.

        All of each prompt but its last token is prefilled here; `generate` sees a cache one token shorter than its
        `input_ids`, so it runs only that last token and then decodes as usual (its log-probs processor and sampling
        unchanged). Models with 3D RoPE (the Qwen-VL family) keep the prompt's position offsets (`rope_deltas`) on
        the model after a prefill; they are copied to the sequences like the cache. A test checks that this gives the
        tokens and log-probs of prefilling every sequence on its own."""
        slot: dict[int, int] = {}  # id of a prompt -> its row among the distinct prompts
        distinct = []
        for p in prompts:
            if id(p) not in slot:
                slot[id(p)] = len(distinct)
                distinct.append(p)
        index = torch.tensor([slot[id(p)] for p in prompts], device=device)
        inputs = self._inputs(distinct, device)
        per_token = [
            k
            for k, v in inputs.items()
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == inputs["input_ids"].shape
        ]
        head = {k: (v[:, :-1] if k in per_token else v) for k, v in inputs.items()}
        if "position_ids" in _forward_parameters(self.model):
            # The positions `generate` would give this prefill (counted from each prompt's first real token, Qwen-VL's
            # 3D ones and rope deltas included); a forward without them counts from the left padding, which shifts
            # a padded prompt's positions against the decode steps' (LLaVA: log-probs off by ~1e-3).
            head["position_ids"] = self.model._prepare_position_ids_for_generation(head["input_ids"], dict(head))
        with _eval_mode(self.model):
            out = self.model(**head, use_cache=True, logits_to_keep=1)
        cache = out.cache
        cache.reorder_cache(index)
        inner = getattr(self.model, "model", None)
        deltas = getattr(inner, "rope_deltas", None)
        if isinstance(deltas, torch.Tensor) and deltas.shape[0] == len(distinct):
            inner.rope_deltas = deltas.index_select(0, index.to(deltas.device))
        return {**{k: inputs[k].index_select(0, index) for k in per_token}, "cache": cache}

    def _completion(self, tokens: list[int], logprobs: list[float]) -> Completion:
        stops = set(self.stop_ids)
        end = next((j for j, t in enumerate(tokens) if t in stops), None)
        if end is None:
            ids, reason, text_ids = tokens, "length", tokens
        else:
            ids, reason, text_ids = tokens[: end + 1], "stop", tokens[:end]
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        return Completion(
            token_ids=ids, text=text, logprobs=[float(x) for x in logprobs[: len(ids)]], finish_reason=reason
        )


def _forward_parameters(model: Any) -> Any:
    return inspect.signature(model.forward).parameters


def _continues_from_a_cache(model: Any) -> bool:
    """Whether this transformers can continue `generate` from a cache we prefilled: its models take `cache` (5.x
    since the rename from `past_key_values`) and `generate` can tell the positions of a prefill
    (`_prepare_position_ids_for_generation`). Older versions (pyproject allows >= 4.57) prefill every sequence."""
    return "cache" in _forward_parameters(model) and hasattr(model, "_prepare_position_ids_for_generation")


def cast_copy(model: Any, dtype: torch.dtype) -> Any:
    """A copy of `model` whose parameters are `dtype`, built without an intermediate copy in the original dtype
    (deepcopy's memo gets each parameter already cast; tied parameters stay tied). The sampler of an asynchronous
    run, or one in another precision, costs its own weights in its own dtype and nothing more."""
    memo = {
        id(p): torch.nn.Parameter(p.detach().to(dtype=dtype, copy=True), requires_grad=False)
        for p in model.parameters()
    }
    return copy.deepcopy(model, memo)


def _check_sampling(n: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if n < 1:
        raise OvkitError(f"--n must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise OvkitError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise OvkitError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise OvkitError(f"--top-p must be in (0, 1], got {top_p}")


def _stream(seed: int, k: int, model: Any) -> torch.Generator:
    """The random stream of sample k of the prompt seeded `seed`, on the model's device."""
    g = torch.Generator(device=next(model.parameters()).device)
    g.manual_seed((int(seed) * 1_000_003 + k) % (2**63))
    return g


@contextmanager
def _seeded(seed: int, model: Any) -> Iterator[None]:
    """Seed torch's global generator (the one `generate` samples with) without disturbing the caller's stream."""
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed) % 2**63)  # any int: seeds of ovkit.rollouts.sample are 62-bit, x 1_000_003 here
        yield


@contextmanager
def _plain_generation_config(model: Any) -> Iterator[None]:
    """`generate` fills unset options from `model.generation_config` (a hub checkpoint's repetition penalty, top-k,
    min-p, ...). Set it aside so the only change to the logits is ours."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


@contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm  # imported on use, like the progress bar it draws

    return tqdm(total=total, desc="generate", unit="seq", leave=False, disable=not enabled)
