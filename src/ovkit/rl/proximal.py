"""AReaL's approximated proximal log-probs (`rl-train --prox-logp loglinear`): pi_prox from the behaviour log-probs,
the current log-probs and the policy versions, instead of the no-grad forward pass that recomputes them.

As AReaL's `compute_prox_logp_approximations` (method "loglinear") in areal/trainer/ppo/actor.py (inclusionAI/AReaL,
commit 4aef98d), which `_resolve_proximal_logp` applies in `grpo_loss_fn` when `prox_logp_method="loglinear"` has
skipped `compute_logp`:

    v_theta  = current_version                      AReaL: engine.get_version() in ppo_update; here: the step
    v_prox   = current_version - 1                  AReaL's assumption ("the last broadcast")
    v_behave = the version that sampled the token   AReaL: per token; here: per row (Group.version)
    alpha    = clamp((v_prox - v_behave) / (v_theta - v_behave), 0, 1)   where v_theta > v_behave, else 0
    log pi_prox ~= log pi_behave + alpha * (log pi_theta - log pi_behave)

`log pi_theta` is the detached log-probs of the minibatch's own gradient pass (AReaL's `logprobs.detach()` in
`grpo_loss_fn`), so alpha is fixed for the step while theta moves over its `--ppo-minibatches` optimiser steps.

Versions are counted alike: AReaL sets the actor's and the sampler's version to global_step + 1 after step
global_step's update; ovkit's learner is at version s during step s and the sampler gets version s + 1 after it
(ovkit.rl.staleness). So current_version is the step, and a sample d versions old gets alpha 0 for d <= 1 (pi_prox =
pi_behave) and (d - 1) / d beyond (1/2, 2/3, ...). AReaL's v_prox is one below the policy that the recompute
evaluates (the learner at the start of the step is version s, and is theta itself in the step's first minibatch);
ovkit keeps AReaL's arithmetic, with which AReaL measured its 1.27x at equal reward, and rl-train refuses loglinear
with --max-staleness below 2, where every alpha would be 0.

Where it saves a pass: the recompute is a no-grad forward over the whole batch only with --ppo-minibatches > 1; with
one minibatch the gradient pass gives the exact pi_prox for free (ovkit.rl.update), so loglinear saves nothing there
and only approximates (AReaL recomputes in a pass of its own whatever the minibatch count).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def loglinear_alpha(versions: Sequence[int], step: int) -> torch.Tensor:
    """[N] float32 on the host: each row's interpolation weight (module docstring) for a batch consumed at `step`."""
    v_behave = torch.tensor(list(versions), dtype=torch.float64)
    v_theta, v_prox = float(step), float(step - 1)
    gap = v_theta - v_behave
    alpha = torch.where(gap > 0, (v_prox - v_behave) / gap.clamp(min=1.0), torch.zeros_like(v_behave))
    return alpha.clamp(0.0, 1.0).float()


def loglinear_prox(behave: torch.Tensor, theta: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """log pi_behave + alpha * (log pi_theta - log pi_behave), in `behave`'s dtype; `alpha` broadcasts ([rows, 1]).
    torch.lerp computes it and is exact at both ends: alpha 0 gives `behave`, alpha 1 gives `theta`, bit for bit."""
    return torch.lerp(behave, theta.to(behave.dtype), alpha.to(behave.dtype))


@dataclass
class LoglinearProx:
    """One step's approximation on the learner's device: ppo_update asks it for each micro-batch's pi_prox and keeps
    the current log-probs it was given, for the step's metrics (`tensors`)."""

    alpha: torch.Tensor  # [N] per row
    theta: torch.Tensor  # [N, T-1] the gradient passes' detached log-probs
    exact: torch.Tensor  # [N] bool: rows of the first minibatch, where theta is the recomputed pi_prox

    @classmethod
    def of(cls, versions: Sequence[int], step: int, behave: torch.Tensor) -> LoglinearProx:
        alpha = loglinear_alpha(versions, step).to(behave.device, behave.dtype, non_blocking=True)
        exact = torch.zeros(behave.shape[0], dtype=torch.bool, device=behave.device)
        return cls(alpha, torch.zeros_like(behave), exact)

    def prox(self, rows: torch.Tensor, cols: slice, behave: torch.Tensor, theta: torch.Tensor, *, first: bool):
        """The approximated pi_prox of the micro-batch `rows` (its columns `cols`) from its gradient pass's detached
        log-probs `theta`; `first`: the step's first minibatch (no parameter has moved yet)."""
        self.theta[rows, cols] = theta
        if first:
            self.exact[rows] = True
        return loglinear_prox(behave[rows, cols], theta, self.alpha[rows, None])

    def tensors(self, prox: torch.Tensor, behave: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The step's approximation metrics as 0-dim device tensors (read with the step's others), means over the
        response tokens: AReaL's `loglinear/approx_logp`, `loglinear/behave_imp_weight` (pi_prox / pi_behave) and
        `loglinear/importance_weight` (pi_theta / pi_prox, theta at its gradient pass); `loglinear/alpha`; and
        `loglinear/abs_error`, |pi_prox - its approximation| in log space over the first minibatch's tokens, where
        theta is the recomputed pi_prox (up to batching noise): a measured error of the approximation, at no cost."""
        m = mask.bool()
        n = m.sum().clamp(min=1)
        mean = lambda x: torch.where(m, x, torch.zeros_like(x)).sum() / n  # noqa: E731
        first = m & self.exact[:, None]
        log_w = (prox - behave).clamp(-20, 20)  # as the behaviour weight (ovkit.rl.correction)
        log_r = (self.theta - prox).clamp(-20, 20)
        gap = torch.where(first, (self.theta - prox).abs(), torch.zeros_like(prox))
        return {
            "loglinear/approx_logp": mean(prox),
            "loglinear/behave_imp_weight": mean(log_w.exp()),
            "loglinear/importance_weight": mean(log_r.exp()),
            "loglinear/alpha": mean(self.alpha[:, None].expand_as(prox)),
            "loglinear/abs_error": gap.sum() / first.sum().clamp(min=1),
        }
