"""A stand-in for `vllm serve` speaking the HTTP endpoints TRL's VLLMClient uses, for the CPU tests of ovkit's
`--engine vllm-server`. It samples with tests/fake_vllm.py's LLM (the model directory loaded with transformers, ovkit's
HFEngine underneath) and answers in vLLM's shapes:

- `GET /health`, `GET /v1/models` (`data[0].id`, `max_model_len`), `GET /server_info?config_format=json`
  (`vllm_config` with `logprobs_mode` and `weight_transfer_config`), `GET /get_world_size`;
- `POST /v1/completions` with token-id prompts: choices prompt-major, each with `prompt_token_ids`, `token_ids` and
  completions-style `logprobs` (`tokens` as `"token_id:<id>"`, `token_logprobs`, `top_logprobs`);
- `POST /v1/chat/completions/render` (images in, `features` out) and `POST /inference/v1/generate` (token ids + those
  features, chat-style `logprobs.content`), the multimodal path;
- `POST /reset_prefix_cache`.

Weights travel over NCCL in the real server; `connect(client, server)` replaces the client's two NCCL calls with a
hand-over to the stand-in's `load_weights`, which takes checkpoint names only (as vLLM's model classes do).
Every request is recorded in `Server.requests`.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse


class Server:
    def __init__(self, model_dir, logprobs_mode: str = "processed_logprobs"):
        import fake_vllm

        self.llm = fake_vllm.LLM(str(model_dir), logprobs_mode="processed_logprobs")
        self.model_dir, self.logprobs_mode = str(model_dir), logprobs_mode
        self.requests: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what the endpoints do ----------------------------------------------------------------------------------

    def get(self, path: str) -> dict:
        if path == "/health":
            return {}
        if path == "/v1/models":
            return {"data": [{"id": self.model_dir, "max_model_len": self.llm.llm_engine.model_config.max_model_len}]}
        if path == "/server_info":
            return {
                "vllm_config": {
                    "model_config": {"logprobs_mode": self.logprobs_mode},
                    "weight_transfer_config": {"backend": "nccl"},
                }
            }
        if path == "/get_world_size":
            return {"world_size": 1}
        raise KeyError(path)

    def post(self, path: str, body: dict) -> dict:
        if path == "/v1/completions":
            choices = []
            for ids in body["prompt"]:
                for out in self._sample({"prompt_token_ids": ids}, body):
                    choices.append(
                        {
                            "prompt_token_ids": ids,
                            "token_ids": out.token_ids,
                            "finish_reason": out.finish_reason,
                            "logprobs": {
                                "tokens": [f"token_id:{t}" for t in out.token_ids],
                                "token_logprobs": [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)],
                                "top_logprobs": [None] * len(out.token_ids),
                            },
                        }
                    )
            return {"choices": choices}
        if path == "/v1/chat/completions/render":
            parts = [p for m in body["messages"] for p in m["content"] if p["type"] == "image_url"]
            return {"features": {"images": [p["image_url"]["url"].split(",", 1)[1] for p in parts]}}
        if path == "/inference/v1/generate":
            request = {"prompt_token_ids": body["token_ids"]}
            if body.get("features"):
                from PIL import Image

                images = [
                    Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in body["features"]["images"]
                ]
                request["multi_modal_data"] = {"image": images}
                # the server places rendered features at the expanded placeholders it is sent; the stand-in's engine
                # expands one placeholder per image itself, as vLLM's offline API does
                image_id = self.llm.hf.config.image_token_id
                request["prompt_token_ids"] = [
                    t
                    for i, t in enumerate(body["token_ids"])
                    if not (t == image_id and i and body["token_ids"][i - 1] == t)
                ]
            outs = self._sample(request, body["sampling_params"])
            return {
                "choices": [
                    {
                        "token_ids": o.token_ids,
                        "finish_reason": o.finish_reason,
                        "logprobs": {
                            "content": [
                                {"token": f"token_id:{t}", "logprob": lp[t].logprob, "top_logprobs": []}
                                for lp, t in zip(o.logprobs, o.token_ids)
                            ]
                        },
                    }
                    for o in outs
                ]
            }
        if path == "/reset_prefix_cache":
            return {"success": True}
        raise KeyError(path)

    def _sample(self, request: dict, params: dict):
        import fake_vllm

        keys = ("n", "temperature", "top_p", "max_tokens", "seed", "logit_bias", "stop_token_ids")
        p = fake_vllm.SamplingParams(**{k: params[k] for k in keys if k in params})
        if getattr(p, "logit_bias", None):
            p.logit_bias = {int(k): v for k, v in p.logit_bias.items()}
        with self.lock:  # one generation at a time: the requests of a batch arrive on several threads
            return self.llm._one(0, request, p).outputs


def _handler(server: Server):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _reply(self, call) -> None:
            try:
                payload, code = call(), 200
            except KeyError as e:
                payload, code = {"error": f"no endpoint {e}"}, 404
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            path = urlparse(self.path).path
            server.requests.append(("GET", path))
            self._reply(lambda: server.get(path))

        def do_POST(self):
            path = urlparse(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            server.requests.append((path, body))
            self._reply(lambda: server.post(path, body))

    return Handler


def connect(client, server: Server) -> None:
    """The NCCL side of weight updates, in process: the announced (name, dtype, shape) and the streamed tensors must
    agree, and go to the stand-in's load_weights."""
    import torch

    def init_communicator(device=0):
        client.communicator = object()

    def update_named_params(metadata, named_params):
        tensors = list(named_params)
        assert [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors] == [
            tuple(m) for m in metadata
        ]
        assert all(isinstance(t, torch.Tensor) for _, t in tensors)
        server.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(tensors)

    client.init_communicator = init_communicator
    client.update_named_params = update_named_params
