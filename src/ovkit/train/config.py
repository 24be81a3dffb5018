"""The supervised stages' configuration: one dataclass, three stage presets (align, midtrain, sft).

The stages differ only in what they train and their optimiser defaults (LLaVA-OneVision-1.5 quick-start values,
anchors section 1): alignment trains the projector at lr 1e-4 without weight decay; mid-training trains LLM,
projector and vision encoder at 1e-5 with weight decay 0.01; instruction tuning trains everything at 1e-5.
Every default is overridable; an option left unset (None) takes the stage's value in `__post_init__`, so the
resolved `config.yaml` always shows the numbers that were used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from ovkit import options as O
from ovkit.choices import (
    canonical_precision,
    check_checkpointing,
    check_kernels,
    check_optim,
)  # torch-free (#29)
from ovkit.config import trajectory_options
from ovkit.errors import OvkitError
from ovkit.launch import processes
from ovkit.models.groups import STAGE_TRAINABLE
from ovkit.options import option, run_control_names
from ovkit.runtime.log import check_trackers

# Stage presets: the recipe's published values (lr, weight decay). Cosine to a minimum lr of 1e-6, warmup 0.2% of
# the steps, Adam eps 1e-5 and gradient clipping at 1.0 are shared by all three stages.
STAGE_DEFAULTS: dict[str, dict[str, float]] = {
    "align": {"lr": 1e-4, "weight_decay": 0.0},
    "midtrain": {"lr": 1e-5, "weight_decay": 0.01},
    "sft": {"lr": 1e-5, "weight_decay": 0.0},
}


# --help panels of this config's own options (ovkit.options holds the shared ones)
OPTIMISER_SCHEDULE = "Optimiser & schedule"
BATCHES_LENGTH = "Batches & length"


# The shared groups where sft, midtrain and align say more than the other commands (their page text).


@dataclass
class TrainLoading(O.ModelLoading):
    """Model loading, with the supervised stages' page text for --precision."""

    precision: str = O.precision(
        doc=(
            "`auto` (bf16-mixed on a GPU with bf16, else fp32), `fp32`, `bf16-mixed` (bf16 weights in compute, "
            "fp32 master weights, gradients and AdamW state: no per-op casts), `bf16-true` (pure bf16); `bf16` = "
            "bf16-mixed, `32` = fp32 (ovkit.models.precision)"
        )
    )


@dataclass
class TrainCompute(O.Compute):
    """Memory and speed, with the supervised stages' page text (the loss's fused kernel, the checkpointing modes)."""

    activation_checkpointing: str = O.activation_checkpointing(
        doc=(
            "recompute activations in backward, in the LLM's decoder layers and the ViT's blocks alike "
            "(`ovkit.runtime.checkpointing`): `off`; `full` (every block keeps only its input); `every-K` (the "
            "K-th, 2K-th, ... block, torchtitan's selective layer checkpointing); `mlp` (only each block's MLP: "
            "its wide intermediate activations are recomputed, attention keeps what it saved); `auto`: off on "
            "CPU, on CUDA `full` when a micro-batch's estimated activations (bytes per token per block measured "
            "by `bench/activation_bytes.py` x tokens x blocks) exceed the memory free after weights and optimiser"
            " state, else off. The gradients are the same; the mode used and why are in ovkit.json "
            "`runtime.activation_checkpointing`; it may change on `--resume`"
        )
    )
    kernels: str = O.kernels(
        doc=(
            "`liger`: Liger-Kernel's Triton kernels (CUDA only; `pip install 'ovkit[liger]'`): RMSNorm, SwiGLU "
            "and RoPE patched into the model, and the supervised loss through its fused linear cross-entropy "
            "instead of ovkit's chunked head; `torch`: PyTorch ops and the chunked head; `auto`: liger on CUDA "
            "when liger-kernel is installed, else torch. `liger` on a machine without CUDA or without the package"
            " exits 2. What was applied is in ovkit.json `runtime.kernels`"
        )
    )


@dataclass
class TrainEvalDuring(O.EvalDuring):
    """Evaluation while training, with the supervised stages' page text for --eval-every (losses, not rewards)."""

    eval_every: int = O.eval_every(
        doc=(
            "evaluate every N steps and after the last (0: after the last only); also `--eval-steps` (HF/TRL). "
            "Run control: the losses and weights are bit-identical with and without it"
        )
    )


@dataclass(init=False)
class TrainConfig(O.StageConfig):
    """Options of `ovkit align | midtrain | sft`. The stage (a class attribute, not an option) picks the presets."""

    launcher: ClassVar[str] = O.DATA_PARALLEL  # what it does under torchrun / accelerate launch (ovkit.launch)

    stage: ClassVar[str] = "sft"
    # Options that exclude each other: one given on the command line drops the config file's other (flags override the
    # file)
    exclusive: ClassVar[tuple[tuple[str, ...], ...]] = (("max_steps", "epochs"),)

    # the groups every learner shares, listed after the stage's own options
    loading: TrainLoading = O.group(TrainLoading, after=True)
    optimiser: O.Optimiser = O.group(O.Optimiser, after=True)
    compute: TrainCompute = O.group(TrainCompute, after=True)
    lora: O.Lora = O.group(O.Lora, after=True)
    checkpoints: O.Checkpoints = O.group(O.Checkpoints, after=True)
    trackers: O.Trackers = O.group(O.Trackers, after=True)
    eval_during: TrainEvalDuring = O.group(TrainEvalDuring, after=True)

    # sample tables (parquet files or dirs of shards), read as one; the last assistant turn is the target
    data: list[Path] | None = option(
        None,
        help=(
            "Sample table(s) (parquet file or directory of shards), read as one; the last assistant turn is the target."
        ),
        argument=True,
    )
    model: Path | None = option(
        None,
        help=(
            "Model directory to start from (save_pretrained layout, e.g. from `ovkit init-model` or the "
            "previous stage)."
        ),
        panel=O.IO,
    )
    out: Path | None = O.out(doc="final model directory; the run lives in `OUT.partial/` until done")
    plan: Path | None = option(
        None,
        help=("Pack plan of DATA (`ovkit pack`): train on packed rows instead of length-bucketed padded batches."),
        panel=O.IO,
    )
    # groups (projector, vision, llm, all) or regexes; None = the stage's preset
    trainable: list[str] | None = option(
        None,
        help=(
            "Group (projector, vision, llm, all) or parameter-name regex to train; repeat for several. "
            "Default: the stage's preset."
        ),
        panel=OPTIMISER_SCHEDULE,
        default_doc="stage preset",
    )
    # drop the vision encoder from the trainable set
    freeze_vision: bool = option(
        False,
        help="Keep the vision encoder frozen whatever --trainable selects.",
        panel=OPTIMISER_SCHEDULE,
        doc="remove the vision encoder from the trainable set",
    )
    lr: float | None = option(
        None,
        help=(
            "Peak learning rate. Default: the stage's preset (align 1e-4, midtrain 1e-5, sft 1e-5). Also "
            "--learning-rate (HF/TRL)."
        ),
        panel=OPTIMISER_SCHEDULE,
        flags=("--learning-rate",),
        gt=0,
        default_doc="stage preset",
    )
    vision_lr: float | None = option(
        None,
        help=("Peak learning rate of the vision encoder (LLaVA-OneVision's mm_vision_tower_lr). Default: --lr."),
        panel=OPTIMISER_SCHEDULE,
        gt=0,
        doc=(
            "peak learning rate of the vision encoder (LLaVA-OneVision's `mm_vision_tower_lr`); the same schedule"
            " scales it"
        ),
        default_doc="`--lr`",
    )
    # the cosine schedule ends here
    min_lr: float = option(
        1e-6,
        help="Learning rate at the end of the cosine schedule.",
        panel=OPTIMISER_SCHEDULE,
        min=0,
    )
    warmup_ratio: float = option(
        0.002,
        help="Fraction of the steps with linear warmup from 0.",
        panel=OPTIMISER_SCHEDULE,
        min=0,
        lt=1,
        doc="fraction of the steps warming up linearly from 0 (at least one step when > 0)",
    )
    # AdamW decoupled weight decay on matrices (not on biases/norms)
    weight_decay: float | None = option(
        None,
        help=("AdamW weight decay on weight matrices. Default: the stage's preset (midtrain 0.01, else 0)."),
        panel=OPTIMISER_SCHEDULE,
        min=0,
        default_doc="stage preset",
    )
    # gradient clipping (global L2 norm); 0 disables
    max_grad_norm: float = option(
        1.0,
        help="Clip the global gradient norm to this (0: no clipping).",
        panel=OPTIMISER_SCHEDULE,
        min=0,
    )
    batch_size: int = option(
        8,
        help=(
            "Samples (or packed rows with --plan) per micro-batch per process. Also "
            "--per-device-train-batch-size (HF/TRL)."
        ),
        panel=BATCHES_LENGTH,
        flags=("--per-device-train-batch-size",),
        min=1,
    )
    # micro-batches per optimiser step; global batch = batch_size * grad_accum * processes
    grad_accum: int = option(
        1,
        help=(
            "Micro-batches per optimiser step; global batch = batch size x this x processes. Also "
            "--gradient-accumulation-steps (HF/TRL)."
        ),
        panel=BATCHES_LENGTH,
        flags=("--gradient-accumulation-steps",),
        min=1,
    )
    max_steps: int | None = option(
        None,
        help="Optimiser steps to run (instead of --epochs).",
        panel=BATCHES_LENGTH,
        min=1,
    )
    epochs: float | None = option(
        None,
        help=("Passes over the data (default 1 when --max-steps is not given). Also --num-train-epochs (HF/TRL)."),
        panel=BATCHES_LENGTH,
        flags=("--num-train-epochs",),
        doc="passes over the data (fractions allowed)",
        gt=0,
        default_doc="1",
    )
    # samples longer than this many tokens are skipped (counted in the summary)
    max_len: int = option(
        8192,
        help="Skip samples longer than this many tokens (text + image tokens).",
        panel=BATCHES_LENGTH,
        min=1,
    )
    load_in_4bit: bool = O.load_in_4bit()
    seed: int = O.seed(doc="sample order, dropout; every process seeds with seed + rank")
    overwrite: bool = O.overwrite(doc="replace a complete OUT / discard OUT.partial")
    quiet: bool = O.quiet(
        doc=("no step lines, no progress bars (transformers', huggingface_hub's and datasets' bars included)")
    )

    def __post_init__(self) -> None:
        O.validate(self)  # each option's declared range and choices; the checks across options follow
        if not self.data:
            raise OvkitError("DATA is required: a sample table (parquet file or directory)")
        if self.model is None:
            raise OvkitError("--model is required: a Hugging Face model directory")
        if self.out is None:
            raise OvkitError("--out is required")
        self.data = [Path(p) for p in (self.data if isinstance(self.data, (list, tuple)) else [self.data])]
        self.model, self.out = Path(self.model), Path(self.out)
        self.plan = Path(self.plan) if self.plan is not None else None
        if self.plan is not None and len(self.data) != 1:
            raise OvkitError("--plan is the pack plan of one dataset: give exactly one DATA with it")
        preset = STAGE_DEFAULTS[self.stage]
        if self.lr is None:
            self.lr = preset["lr"]
        if self.weight_decay is None:
            self.weight_decay = preset["weight_decay"]
        if not self.trainable:
            self.trainable = list(STAGE_TRAINABLE[self.stage])
        self.report_to = [r for r in (self.report_to or []) if r != "none"]
        self._check()

    def _check(self) -> None:
        """The checks across options (each option's own range and choices are declared on its field)."""
        if self.max_steps is not None and self.epochs is not None:
            raise OvkitError("give --max-steps or --epochs, not both")
        if self.min_lr > self.lr:
            raise OvkitError(f"need --min-lr <= --lr, got lr {self.lr}, min-lr {self.min_lr}")
        self.precision = check_optim(self.optim, canonical_precision(self.precision))  # adamw_bf16: auto -> bf16-true
        if self.load_in_4bit and self.lora_r <= 0:
            raise OvkitError("--load-in-4bit trains LoRA adapters on a frozen 4-bit base: give --lora-r > 0")
        self.activation_checkpointing = check_checkpointing(self.activation_checkpointing, self.gradient_checkpointing)
        self.kernels = check_kernels(self.kernels, self.use_liger_kernel)
        check_trackers(self.report_to)
        self.eval_during.check()
        if self.optimizer_in_backward:
            self._check_optimizer_in_backward()

    def _check_optimizer_in_backward(self) -> None:
        """Each parameter steps as soon as backward completes its gradient (ovkit.runtime.optim.OptimizerInBackward):
        exact only when that gradient is the step's whole gradient and nothing global is needed first."""
        if self.grad_accum > 1:
            raise OvkitError(
                f"--optimizer-in-backward steps each parameter during the first micro-batch's backward, so it needs "
                f"--grad-accum 1 (got {self.grad_accum}); raise --batch-size instead, or drop --optimizer-in-backward"
            )
        if self.max_grad_norm > 0:
            raise OvkitError(
                f"--optimizer-in-backward cannot clip (--max-grad-norm {self.max_grad_norm:g}): clipping needs the "
                f"whole gradient's norm before any parameter is updated; set --max-grad-norm 0 (the norm is still "
                f"logged), or drop --optimizer-in-backward"
            )
        world = processes()[1]
        if world > 1:  # before torch loads; ovkit.runtime.Runtime also refuses what accelerate set up itself
            raise OvkitError(
                f"--optimizer-in-backward needs one process (this launcher started {world}): DDP, FSDP and DeepSpeed "
                f"reduce the gradients after each parameter's step would already have run; run it without the "
                f"launcher, or drop --optimizer-in-backward"
            )

    @property
    def partial(self) -> Path:
        """Where the run lives until it completes: checkpoints, metrics, logs (renamed to OUT at the end)."""
        return self.out.parent / f"{self.out.name}.partial"


class AlignConfig(TrainConfig):
    """`ovkit align`: stage 1, projector only."""

    stage: ClassVar[str] = "align"


class MidtrainConfig(TrainConfig):
    """`ovkit midtrain`: stage 1.5, LLM + projector + vision encoder."""

    stage: ClassVar[str] = "midtrain"


class SFTConfig(TrainConfig):
    """`ovkit sft`: stage 2, every parameter."""

    stage: ClassVar[str] = "sft"


STAGE_CONFIGS: dict[str, type[TrainConfig]] = {"align": AlignConfig, "midtrain": MidtrainConfig, "sft": SFTConfig}
# Options a resumed run may change, declared `run_control=True` where each field is: where it writes and reports, how
# it checkpoints, and how the same numbers are computed (memory and speed). Every other option shapes the trajectory,
# so a resumed run must keep it: TRAJECTORY is derived below, and an option added later is covered without being listed
# (Runtime.resume exits 2 naming it).
RUN_CONTROL = run_control_names(TrainConfig)
TRAJECTORY = trajectory_options(TrainConfig, RUN_CONTROL)
# What shrinks a micro-batch's memory, as the out-of-memory message names it (ovkit.runtime.Runtime.out_of_memory).
SMALLER = ("--batch-size (with --grad-accum for the same global batch)", "--max-len")
