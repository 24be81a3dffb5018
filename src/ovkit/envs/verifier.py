"""Verifier feedback: a wrong answer is answered with "incorrect, try again" until the model gets it right or runs
out of attempts; the trajectory's reward is discounted per extra attempt, so answering right the first time is
still worth most. The check is the row's own verifiable reward (ovkit.rewards, with its sandbox and limits)."""

from __future__ import annotations

from typing import Any

FEEDBACK = "Your answer is incorrect. Try again."


class VerifierEnv:
    """env args: `max_attempts` (K, default 3), `discount` (reward x discount^(attempts - 1), default 0.8),
    `pass_threshold` (an attempt is right when its accuracy reaches this, default 1.0), `feedback` (the message)."""

    def __init__(
        self,
        task: dict[str, Any],
        max_attempts: int = 3,
        discount: float = 0.8,
        pass_threshold: float = 1.0,
        feedback: str = FEEDBACK,
    ):
        if max_attempts < 1 or not 0 <= discount <= 1:
            raise TypeError("max_attempts must be >= 1 and discount in [0, 1]")
        self.task = task
        self.max_attempts, self.discount, self.pass_threshold, self.feedback = (
            int(max_attempts),
            float(discount),
            float(pass_threshold),
            feedback,
        )
        self.attempts = 0

    def reset(self) -> None:
        self.attempts = 0

    def step(self, response_text: str) -> tuple[dict[str, Any] | None, bool, dict[str, Any]]:
        from ovkit.rewards import score

        self.attempts += 1
        t = self.task
        accuracy = score(
            response_text,
            t["answer"],
            t.get("answer_type"),
            t.get("source"),
            t.get("reward_kwargs"),
            prompt_type=t.get("mode", "answer"),
        ).parts["accuracy"]
        info = {"accuracy": accuracy, "attempts": self.attempts, "reward_scale": self.discount ** (self.attempts - 1)}
        if accuracy >= self.pass_threshold:
            return None, True, {**info, "reason": "completed"}
        if self.attempts >= self.max_attempts:
            return None, True, {**info, "reason": "env_done"}
        return {"text": self.feedback}, False, info

    def format_observation(self, observation: dict[str, Any]) -> dict[str, Any]:
        return {"role": "user", "content": observation["text"], "images": []}
