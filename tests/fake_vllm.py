"""A stand-in for the `vllm` package with vLLM's call and return shapes, for the CPU tests of ovkit's vLLM engine.

`install(monkeypatch)` puts it in `sys.modules["vllm"]`. Its `LLM(model=DIR, ...)` loads DIR with transformers and
samples with ovkit's HFEngine, but it is driven and answers exactly as vLLM's offline API is and does:

- `generate(requests, sampling_params, use_tqdm)`: requests `{"prompt_token_ids": [...], "multi_modal_data":
  {"image": PIL or [PIL, ...]}}` (one placeholder token per image in the ids, expanded here from the image, and the
  images re-processed here, as vLLM does), one `SamplingParams` per request; returns `RequestOutput`s whose
  `.outputs` hold `.token_ids`, `.text`, `.finish_reason` and `.logprobs` = one `{token_id: Logprob(logprob=...)}`
  per sampled token;
- `llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(iterable of (name, tensor))`
  takes checkpoint names (what `save_pretrained` writes), as vLLM's model classes do, and rejects others;
- `sleep(level)`, `wake_up()`, `reset_prefix_cache()`; generating while asleep is an error (vLLM would crash).

Every call is recorded in `LLM.calls` for the tests.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

__version__ = "0.11.0-fake"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class SamplingParams:
    def __init__(self, **kw: Any):
        self.__dict__.update(kw)
        self.kwargs = kw


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _Model:
    """vLLM's model as load_weights sees it: checkpoint names in, the weights of the HF model out."""

    def __init__(self, llm: LLM):
        from transformers.core_model_loading import revert_weight_conversion

        self.llm = llm
        runtime = {n: p for n, p in llm.hf.named_parameters()}
        saved = revert_weight_conversion(llm.hf, dict(runtime))
        by_tensor = {id(t): n for n, t in runtime.items()}
        self.to_runtime = {ckpt: by_tensor[id(t)] for ckpt, t in saved.items()}

    def load_weights(self, weights) -> set[str]:
        params = dict(self.llm.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in self.to_runtime:
                raise KeyError(f"vLLM has no weight {name!r} (a runtime name instead of the checkpoint's?)")
            with torch.no_grad():
                params[self.to_runtime[name]].copy_(tensor.to(params[self.to_runtime[name]].dtype))
            loaded.add(name)
        self.llm.calls.append(("load_weights", len(loaded)))
        return loaded


class LLM:
    calls: list = []
    instance: LLM | None = None

    def __init__(self, model: str, dtype: str = "auto", seed: int = 0, **kwargs: Any):
        from ovkit.generate import HFEngine
        from ovkit.models import load

        self.kwargs = {"model": model, "dtype": dtype, "seed": seed, **kwargs}
        assert kwargs.get("logprobs_mode") == "processed_logprobs", (
            "ovkit must ask for the sampled distribution's log-probs"
        )
        torch_dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype
        ]
        self.hf, self.processor = load(model, dtype=torch_dtype)
        self.hf.eval()
        self.engine = HFEngine(self.hf, self.processor, batch_size=64)
        self.asleep = False
        LLM.calls, LLM.instance = [("init", self.kwargs)], self
        model_runner = types.SimpleNamespace(model=_Model(self))
        worker = types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=model_runner))
        config = types.SimpleNamespace(max_model_len=int(self.hf.config.text_config.max_position_embeddings))
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=worker), model_config=config
        )

    def get_tokenizer(self):
        return self.processor.tokenizer

    def sleep(self, level: int = 1) -> None:
        assert self.kwargs.get("enable_sleep_mode"), "sleep() needs enable_sleep_mode=True"
        self.asleep = True
        LLM.calls.append(("sleep", level))

    def wake_up(self, tags=None) -> None:
        self.asleep = False
        LLM.calls.append(("wake_up", tags))

    def reset_prefix_cache(self) -> None:
        LLM.calls.append(("reset_prefix_cache",))

    def generate(self, requests, sampling_params=None, use_tqdm: bool = False):
        assert not self.asleep, "vLLM generates nothing while asleep"
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(requests)
        LLM.calls.append(("generate", [r["prompt_token_ids"] for r in requests], [p.kwargs for p in params]))
        return [self._one(i, r, p) for i, (r, p) in enumerate(zip(requests, params))]

    def _one(self, i: int, request: dict, p: SamplingParams) -> RequestOutput:
        prompt = self._encoded(request)
        suppress = [t for t, bias in (getattr(p, "logit_bias", None) or {}).items() if bias <= -100]
        [completions] = self.engine.generate(
            [prompt],
            n=p.n,
            max_new_tokens=p.max_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            seed=p.seed,
            suppress_ids=suppress,
        )
        outs = []
        for k, c in enumerate(completions):
            logprobs = [{t: Logprob(lp)} for t, lp in zip(c.token_ids, c.logprobs)]
            outs.append(
                CompletionOutput(
                    k, c.text, list(c.token_ids), logprobs, "stop" if c.finish_reason == "stop" else "length"
                )
            )
        return RequestOutput(str(i), list(request["prompt_token_ids"]), outs)

    def _encoded(self, request: dict):
        """The request as ovkit's HF engine takes it: the given token ids, the images processed here."""
        from ovkit.models.encode import Encoded

        ids = list(request["prompt_token_ids"])
        mm: dict[str, Any] = {}
        image_id = self.hf.config.image_token_id
        if "multi_modal_data" in request:
            images = request["multi_modal_data"]["image"]
            images = images if isinstance(images, list) else [images]
            out = self.processor.image_processor(images=images, return_tensors="pt")
            mm = {k: v for k, v in out.items()}
            # vLLM's prompt update: each single placeholder becomes its image's tokens (an expanded run would be
            # expanded again, so the stand-in refuses one)
            sizes = [int(g.prod()) // self.processor.image_processor.merge_size**2 for g in mm["image_grid_thw"]]
            places = [i for i, t in enumerate(ids) if t == image_id]
            assert len(places) == len(sizes), f"{len(places)} image placeholders for {len(images)} images"
            for i, n in zip(reversed(places), reversed(sizes)):
                ids[i : i + 1] = [image_id] * n
        per_token = {"mm_token_type_ids": [1 if t == image_id else 0 for t in ids]}
        return Encoded(input_ids=ids, labels=[-100] * len(ids), mm=mm, per_token=per_token)


class _CudaPlatform:
    """`vllm.platforms.current_platform` of a CUDA machine: the stand-in exists for what vLLM's CPU build cannot do
    (sleep mode is one), so it answers as vLLM on a GPU does."""

    @staticmethod
    def is_sleep_mode_available() -> bool:
        return True

    @staticmethod
    def is_cpu() -> bool:
        return False


def install(monkeypatch) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.__version__ = __version__
    module.__path__ = []  # a package, so `vllm.platforms` below imports
    module.LLM, module.SamplingParams = LLM, SamplingParams
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _CudaPlatform()
    module.platforms = platforms
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    return module
