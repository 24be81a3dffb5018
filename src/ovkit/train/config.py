"""The supervised stages' configuration: one dataclass, three stage presets (align, midtrain, sft).

The stages differ only in what they train and their optimiser defaults (LLaVA-OneVision-1.5 quick-start values,
anchors section 1): alignment trains the projector at lr 1e-4 without weight decay; mid-training trains LLM,
projector and vision encoder at 1e-5 with weight decay 0.01; instruction tuning trains everything at 1e-5.
Every default is overridable; an option left unset (None) takes the stage's value in `__post_init__`, so the
resolved `config.yaml` always shows the numbers that were used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from ovkit.config import trajectory_options
from ovkit.errors import OvkitError
from ovkit.models.groups import STAGE_TRAINABLE
from ovkit.runtime.log import check_trackers
from ovkit.runtime.options import (
    ATTENTION,
    canonical_precision,
    check_checkpointing,
    check_eval_options,
    check_kernels,
    check_optim,
)  # torch-free (#29)

# Stage presets: the recipe's published values (lr, weight decay). Cosine to a minimum lr of 1e-6, warmup 0.2% of
# the steps, Adam eps 1e-5 and gradient clipping at 1.0 are shared by all three stages.
STAGE_DEFAULTS: dict[str, dict[str, float]] = {
    "align": {"lr": 1e-4, "weight_decay": 0.0},
    "midtrain": {"lr": 1e-5, "weight_decay": 0.01},
    "sft": {"lr": 1e-5, "weight_decay": 0.0},
}
# Options a resumed run may change: where it writes and reports, how it checkpoints, and how the same numbers are
# computed (memory and speed). Every other option shapes the trajectory, so a resumed run must keep it: TRAJECTORY is
# derived below, and an option added later is covered without being listed (Runtime.resume exits 2 naming it).
RUN_CONTROL = frozenset(
    {
        "out",
        "resume",
        "overwrite",
        "quiet",
        "report_to",
        "save_every",
        "keep_checkpoints",
        "trust_remote_code",
        "activation_checkpointing",
        "gradient_checkpointing",
        "compile",
        "kernels",
        "use_liger_kernel",
        "eval_data",
        "eval_every",
        "eval_limit",
        "eval_max_new_tokens",  # evaluation restores the RNG: same trajectory
    }
)


@dataclass
class TrainConfig:
    """Options of `ovkit align | midtrain | sft`. The stage (a class attribute, not an option) picks the presets."""

    stage: ClassVar[str] = "sft"
    # Options that exclude each other: one given on the command line drops the config file's other (flags override the file)
    exclusive: ClassVar[tuple[tuple[str, ...], ...]] = (("max_steps", "epochs"),)

    data: list[Path] | None = (
        None  # sample tables (parquet files or dirs of shards), read as one; the last assistant turn is the target
    )
    model: Path | None = None  # HF model directory (save_pretrained layout) to start from
    out: Path | None = None  # final model directory; checkpoints live in OUT.partial/ until the run completes
    plan: Path | None = None  # pack plan of DATA (`ovkit pack`): train on packed rows instead of padded batches
    trainable: list[str] | None = None  # groups (projector, vision, llm, all) or regexes; None = the stage's preset
    freeze_vision: bool = False  # drop the vision encoder from the trainable set
    lr: float | None = None  # peak learning rate; None = the stage's preset
    vision_lr: float | None = (
        None  # peak learning rate of the vision encoder (LLaVA-OneVision's mm_vision_tower_lr); None = --lr
    )
    min_lr: float = 1e-6  # the cosine schedule ends here
    warmup_ratio: float = 0.002  # fraction of the steps spent warming up linearly from 0
    weight_decay: float | None = None  # AdamW decoupled weight decay on matrices (not on biases/norms)
    max_grad_norm: float = 1.0  # gradient clipping (global L2 norm); 0 disables
    batch_size: int = 8  # samples (or packed rows) per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimiser step; global batch = batch_size * grad_accum * processes
    max_steps: int | None = None  # optimiser steps; exclusive with --epochs
    epochs: float | None = None  # passes over the data (default 1 when --max-steps is not given)
    max_len: int = 8192  # samples longer than this many tokens are skipped (counted in the summary)
    precision: str = "auto"  # auto | fp32 | bf16-mixed | bf16-true (ovkit.runtime.precision)
    optim: str = "adamw_torch_fused"  # adamw_torch_fused | adamw_torch | adamw_8bit | adamw_bf16 (x --precision: ovkit.runtime.optim)
    attn_implementation: str = (
        "auto"  # auto | sdpa | flash_attention_2 | flex_attention | eager (ovkit.runtime.attention)
    )
    lora_r: int = (
        0  # LoRA rank (0: full fine-tuning); adapters on the selection's attention/MLP projections (ovkit.runtime.lora)
    )
    lora_alpha: float = 16.0  # LoRA scale alpha (the update is alpha / r * B A)
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # regexes over module names to adapt instead of the per-architecture default
    load_in_4bit: bool = (
        False  # QLoRA: the language model's Linear weights in 4-bit NF4 (bitsandbytes), adapters on top
    )
    activation_checkpointing: str = (
        "auto"  # auto | off | full | mlp | every-K: blocks recomputed in backward (ovkit.runtime.checkpointing)
    )
    gradient_checkpointing: bool = False  # TRL/HF's spelling of --activation-checkpointing full
    compile: bool = False  # torch.compile each decoder layer and vision block (ovkit.runtime.compiling); run control, not trajectory
    kernels: str = "auto"  # auto | liger | torch: Liger-Kernel's fused RMSNorm/SwiGLU/RoPE and linear cross-entropy on CUDA (ovkit.runtime.kernels)
    use_liger_kernel: bool = False  # TRL/HF's spelling of --kernels liger
    save_every: int = 0  # write a checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2  # how many intermediate checkpoints to keep (oldest deleted first)
    resume: bool = False  # continue the run found in OUT.partial/ from its last checkpoint
    report_to: list[str] = field(default_factory=list)  # experiment trackers: tensorboard, wandb, mlflow, trackio
    eval_data: list[Path] | None = (
        None  # held-out tables scored while training (ovkit.evaluate.during): eval/loss, eval/reward, ...
    )
    eval_every: int = 0  # evaluate on --eval-data every N steps, and after the last (0: only after the last)
    eval_limit: int | None = None  # at most this many eval rows per category (the first ones, as `ovkit eval --limit`)
    eval_max_new_tokens: int | None = (
        None  # the eval's generation budget; default: per category (`ovkit eval`'s token_budgets)
    )
    trust_remote_code: bool = False
    seed: int = 0
    overwrite: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
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
        positive = {"batch_size": self.batch_size, "grad_accum": self.grad_accum, "max_len": self.max_len}
        for name, value in positive.items():
            if value < 1:
                raise OvkitError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_steps is not None and self.epochs is not None:
            raise OvkitError("give --max-steps or --epochs, not both")
        if self.max_steps is not None and self.max_steps < 1:
            raise OvkitError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise OvkitError(f"--epochs must be > 0, got {self.epochs}")
        if self.vision_lr is not None and self.vision_lr <= 0:
            raise OvkitError(f"--vision-lr must be > 0 (freeze the encoder with --freeze-vision), got {self.vision_lr}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise OvkitError(f"need --lr > 0 and 0 <= --min-lr <= --lr, got lr {self.lr}, min-lr {self.min_lr}")
        if not 0 <= self.warmup_ratio < 1:
            raise OvkitError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise OvkitError("--weight-decay and --max-grad-norm must be >= 0")
        self.precision = check_optim(self.optim, canonical_precision(self.precision))  # adamw_bf16: auto -> bf16-true
        if self.attn_implementation not in ATTENTION:
            raise OvkitError(
                f"--attn-implementation must be one of {', '.join(ATTENTION)}, got {self.attn_implementation!r}"
            )
        if self.load_in_4bit and self.lora_r <= 0:
            raise OvkitError("--load-in-4bit trains LoRA adapters on a frozen 4-bit base: give --lora-r > 0")
        if self.lora_r < 0 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise OvkitError("need --lora-r >= 0, --lora-alpha > 0 and 0 <= --lora-dropout < 1")
        if self.save_every < 0 or self.keep_checkpoints < 1:
            raise OvkitError("--save-every must be >= 0 and --keep-checkpoints >= 1")
        self.activation_checkpointing = check_checkpointing(self.activation_checkpointing, self.gradient_checkpointing)
        self.kernels = check_kernels(self.kernels, self.use_liger_kernel)
        check_trackers(self.report_to)
        check_eval_options(self)

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
TRAJECTORY = trajectory_options(TrainConfig, RUN_CONTROL)
