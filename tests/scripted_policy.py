"""A scripted policy for RL tests: what each sample says is fixed by a script, not by what a barely trained model
happens to sample, so a test's rewards (and so its advantages and updates) are the same on every machine.

`ScriptedEngine` has the engine interface (`generate`, `update_weights`, `stop_ids`, `model`). At turn t, the i-th
sequence of a generate call (prompt-major: prompt j's samples are j*n .. j*n+n-1; a multi-turn rollout passes one
context per trajectory, a group's trajectories side by side) says `script(t, i)` (or `script(t, i, prompt)`); its
log-probs are the model's own, teacher-forced at the sampling temperature,
so the learner trains exactly on-policy. The turn is read off the context: the number of images beyond the
prompt's first (a zoom observation adds one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ovkit.generate import Completion
from ovkit.generate.hf import sampling_logprobs, stop_token_ids


class ScriptedEngine:
    def __init__(self, model: Any, processor: Any, script: Callable[[int, int], str]):
        self.model, self.processor, self.script = model, processor, script
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.stop_ids = stop_token_ids(self.tokenizer, model)

    def update_weights(self, model: Any) -> None:
        self.model = model

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Any],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        images: Any = None,
        suppress_ids: Sequence[int] = (),
        seeds: Any = None,
    ) -> list[list[Completion]]:
        out = []
        for j, prompt in enumerate(prompts):
            grid = prompt.mm.get("image_grid_thw")
            turn = (int(grid.shape[0]) if grid is not None else 1) - 1
            say = (
                (lambda i: self.script(turn, i, prompt))
                if self.script.__code__.co_argcount == 3
                else (lambda i: self.script(turn, i))
            )
            out.append([self._say(prompt, say(j * n + k), max_new_tokens, temperature, top_p) for k in range(n)])
        return out

    def _say(self, prompt: Any, text: str, max_new_tokens: int, temperature: float, top_p: float) -> Completion:
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: max_new_tokens - 1] + [self.stop_ids[0]]
        inputs = prompt.model_inputs(labels=False)
        length = prompt.length
        inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([ids])], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        for key in prompt.per_token:
            inputs[key] = torch.cat([inputs[key], torch.zeros(1, len(ids), dtype=inputs[key].dtype)], dim=1)
        device = next(self.model.parameters()).device
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        logits = self.model(**inputs, use_cache=False).logits[0, length - 1 : length - 1 + len(ids)]
        logp = sampling_logprobs(logits, temperature, top_p).gather(-1, torch.tensor(ids, device=device)[:, None])[:, 0]
        return Completion(token_ids=ids, text=text, logprobs=logp.tolist(), finish_reason="stop")
