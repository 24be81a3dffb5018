"""PPO-ptx (Ouyang et al. 2022, InstructGPT section 3.5): a supervised loss on SFT rows in every RL optimiser step.

RL trains what its prompts reward and nothing else; what it does not train drifts (on the embedded default, stage 2
took held-out caption, which curation keeps out of RL, 5.7 points below the SFT model). InstructGPT's remedy mixes
the pretraining log-likelihood back into the PPO objective; here the SFT table's, as `ovkit sft` trains it:

    loss = rl_loss + C * (NLL summed over the answer tokens of the step's SFT rows) / (their count)

per optimiser step (each of --ppo-minibatches), C = --sft-coef. The rows are --sft-rows-per-step rows drawn without
replacement from (--seed, step, minibatch) alone, so a resumed run draws the rows the uninterrupted one would. A row
is encoded as `ovkit sft` encodes it (ovkit.train.data.encode_row: the loss on the last assistant turn), when first
drawn (memoised), and the NLL is the supervised loop's (TokenScorer's `labels=` forward, ovkit.runtime.loss.nll_sum).
Its forward/backward joins the RL micro-batches' accumulation: under DDP's no_sync, so the one all-reduce of the
optimiser step carries both gradients, and the clip and the skip guard see their sum. A step whose RL tokens are all
masked (the corrections, --mask-truncated-completions) still trains its SFT rows.

Several processes: each process takes its share of the same draw (rows k, k + N, ...: --sft-rows-per-step must be a
multiple of the processes) and the sum is divided by the answer tokens of every process (one all-reduce), times N
to undo DDP's mean, so a step over N processes trains what one process does on the same rows.

OpenRLHF (its PPO trainer until 2025) added `ptx_coef` (default 0.05) times the mean token NLL of one micro-batch of
`--pretrain_data` to each micro-batch's backward, every token of its rows trained; here the rows are SFT rows and only
their answers train, as in `ovkit sft`.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ovkit.data.io import read_samples
from ovkit.errors import OvkitError
from ovkit.models.precompute import model_inputs, on_device
from ovkit.pack.batches import collate_padded, target_tokens
from ovkit.pack.packed import PackLayout
from ovkit.runtime.loss import TokenScorer, nll_sum
from ovkit.train.data import Memo, encode_row

if TYPE_CHECKING:
    from ovkit.rl.config import SFTMix


class SFTMixer:
    """The SFT rows of every optimiser step and their weighted loss's backward (module docstring)."""

    def __init__(
        self,
        data: list[Path],
        processor: Any,
        layout: PackLayout,
        *,
        coef: float,
        rows_per_step: int,
        seed: int,
        micro_batch_size: int,
        pad_id: int,
        rank: int = 0,
        world: int = 1,
    ):
        if rows_per_step % world:
            raise OvkitError(
                f"--sft-rows-per-step {rows_per_step} must be a multiple of the {world} processes (each trains an "
                f"equal share of the step's rows)"
            )
        # images="header": a row's pictures are decoded when it is first drawn, and a bad one is named then
        samples = [read_samples(p, images="header") for p in data]
        self.origin = [(s, i) for s in samples for i in range(s.table.num_rows)]
        if len(self.origin) < rows_per_step:
            raise OvkitError(
                f"--sft-data {', '.join(map(str, data))} has {len(self.origin)} rows, fewer than "
                f"--sft-rows-per-step {rows_per_step}; lower it"
            )
        self.memo = Memo(lambda row: encode_row(processor, *self.origin[row]))
        self.layout = layout  # the learner's (rl-train builds it once)
        self.coef, self.rows_per_step, self.seed = coef, rows_per_step, seed
        self.micro_batch_size, self.pad_id, self.rank, self.world = micro_batch_size, pad_id, rank, world

    def rows(self, step: int, minibatch: int) -> list[int]:
        """Every process's rows of optimiser step (`step`, `minibatch`), from the seed and those two alone."""
        rng = random.Random(f"ovkit-sft-mix/{self.seed}/{step}/{minibatch}")  # str seeds hash with sha512: stable
        return rng.sample(range(len(self.origin)), self.rows_per_step)

    def batches(self, step: int, minibatch: int) -> list[dict[str, Any]]:
        """This process's share of the rows, sorted by length and collated as `ovkit sft` collates a micro-batch,
        --micro-batch-size rows at most each."""
        mine = sorted(self.rows(step, minibatch)[self.rank :: self.world], key=lambda r: (self.memo(r).length, r))
        cut = range(0, len(mine), self.micro_batch_size)
        return [
            collate_padded([self.memo(r) for r in mine[c : c + self.micro_batch_size]], self.pad_id, self.layout)
            for c in cut
        ]

    def backward(self, model, step: int, minibatch: int, rt: Any = None) -> tuple[torch.Tensor, int, torch.Tensor]:
        """Backpropagate C x this step's SFT NLL per answer token of every process (accumulated into the gradients
        the RL micro-batches then add to; all-reduced with their last). Returns this process's NLL sum (a detached
        device tensor), the answer tokens of every process and the loss term backpropagated (detached)."""
        device = next(model.parameters()).device
        batches = self.batches(step, minibatch)
        tokens = sum(target_tokens(b) for b in batches)
        if self.world > 1:
            acc = rt.accelerator
            tokens = int(acc.reduce(torch.tensor([tokens], dtype=torch.float64, device=acc.device), "sum").item())
        scale = self.coef * self.world / max(tokens, 1)  # DDP averages gradients over processes: undo it
        total = torch.zeros((), dtype=torch.float32, device=device)
        for batch in batches:
            with rt.no_sync(model, sync=False) if rt is not None else nullcontext():
                with rt.autocast() if rt is not None else nullcontext():
                    nll = _nll(model, batch, device)
                if rt is not None:
                    rt.backward(nll * scale)
                else:
                    (nll * scale).backward()
            total += nll.detach().float()
        return total, tokens, total * scale

    def metrics(self, nll_sum: float, tokens: int) -> dict[str, float]:
        """`sft/loss` (the NLL per answer token, before C) and `sft/tokens`, from this process's NLL sum and every
        process's tokens: x N over the processes' mean (ovkit.rl.loop.combine), so the logged loss is every
        process's sum over every process's tokens."""
        return {"sft/loss": nll_sum * self.world / max(tokens, 1), "sft/tokens": float(tokens)}


def _nll(model, batch: dict[str, Any], device) -> torch.Tensor:
    """The supervised loss's numerator of one collated batch: a prepared TokenScorer's `labels=` forward (DDP's
    hooks included), or nll_sum on a bare model."""
    labels, index = on_device(batch["labels"], device), on_device(batch.get("target_index"), device)
    if isinstance(getattr(model, "module", model), TokenScorer):
        return model(model_inputs(batch, device), labels=labels, target_index=index)
    return nll_sum(model, model_inputs(batch, device), labels, index=index)


def sft_mixer(
    mix: SFTMix,
    processor: Any,
    layout: PackLayout,
    pad_id: int,
    *,
    seed: int,
    micro_batch_size: int,
    rank: int = 0,
    world: int = 1,
) -> SFTMixer | None:
    """rl-train's mixer for its `SFTMix` options (None at --sft-coef 0: the update is then exactly the one without the
    option); `layout`: the learner's ovkit.pack.PackLayout; `seed` draws the rows, `micro_batch_size` rows go
    through each forward."""
    if not mix.sft_coef:
        return None
    return SFTMixer(
        mix.sft_data,
        processor,
        layout,
        coef=mix.sft_coef,
        rows_per_step=mix.sft_rows_per_step,
        seed=seed,
        micro_batch_size=micro_batch_size,
        pad_id=pad_id,
        rank=rank,
        world=world,
    )
