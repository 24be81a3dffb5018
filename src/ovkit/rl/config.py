"""`ovkit rl-train`'s options: one dataclass, defaults the published LLaVA-OneVision-1.5-RL values."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ovkit.config import trajectory_options
from ovkit.errors import OvkitError
from ovkit.generate import RL_ENGINES
from ovkit.runtime.log import check_trackers
from ovkit.runtime.options import (  # torch-free: a bad option fails before torch imports (#29)
    AGGREGATIONS,
    ATTENTION,
    KL_ESTIMATORS,
    canonical_precision,
    check_checkpointing,
    check_eval_options,
    check_kernels,
    check_optim,
    sampler_dtype,
)
from ovkit.runtime.options import (
    canonical_correction as canonical_mode,
)

if TYPE_CHECKING:
    from ovkit.rl.correction import Correction


STAGE_MODES = {1: "answer", 2: "think"}  # stage 1: answer-only prompts; stage 2: think prompts (ovkit.prompts)

STAGE_FORMAT_WEIGHT = {1: 0.0, 2: 0.1}


# Options a resumed run may change: where it writes and reports, how it checkpoints, how many reward workers score,
# where a vLLM server listens, and how the same numbers are computed (learner micro-batches, attention kernel,
# activation checkpointing). Every other option shapes the trajectory (sampling, rewards, the loss, its corrections,
# the optimiser), so a resumed run must keep it: TRAJECTORY is derived below, and an option added later is covered
# without being listed (Runtime.resume exits 2 naming it).
RUN_CONTROL = frozenset(
    {
        "out",
        "resume",
        "overwrite",
        "quiet",
        "report_to",
        "save_every",
        "keep_checkpoints",
        "save_rollouts",
        "reward_workers",
        "trust_remote_code",
        "vllm_server_url",
        "vllm_server_timeout",
        "micro_batch_size",
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
class RLTrainConfig:
    """Options of `ovkit rl-train`. Defaults are the published LLaVA-OneVision-1.5-RL values (anchors.md section 1)."""

    # Options that exclude each other: one given on the command line drops the config file's other (flags override the file)
    exclusive: ClassVar[tuple[tuple[str, ...], ...]] = (("max_steps", "epochs"),)

    data: list[Path] | None = None  # RL sample tables (answer, answer_type): e.g. rl-curate's OUT/stage1
    model: Path | None = None  # HF model directory: the SFT model for stage 1, the stage-1 output for stage 2
    out: Path | None = None
    stage: int = 1  # 1: answer-only prompts; 2: think prompts + format reward (the curriculum)
    engine: str = "hf"  # hf | vllm (colocated) | vllm-server (ovkit.generate)
    precision: str = "auto"  # the learner's: auto | fp32 | bf16-mixed | bf16-true (ovkit.runtime.precision)
    optim: str = "adamw_torch_fused"  # adamw_torch_fused | adamw_torch | adamw_8bit | adamw_bf16 (x --precision: ovkit.runtime.optim)
    attn_implementation: str = "auto"  # auto | sdpa | flash_attention_2 | flex_attention | eager
    activation_checkpointing: str = "auto"  # auto | off | full | mlp | every-K: the learner's blocks recomputed in backward (ovkit.runtime.checkpointing)
    gradient_checkpointing: bool = False  # TRL's spelling of --activation-checkpointing full
    compile: bool = False  # torch.compile each decoder layer and vision block (ovkit.runtime.compiling); run control, not trajectory
    kernels: str = "auto"  # auto | liger | torch: Liger-Kernel's fused RMSNorm/SwiGLU/RoPE and linear cross-entropy on CUDA (ovkit.runtime.kernels)
    use_liger_kernel: bool = False  # TRL/HF's spelling of --kernels liger
    sampler_precision: str | None = None  # sample from a copy in fp32 | bf16 | fp16 (bf16: a real mismatch on CPU)
    sampler_quant: str | None = None  # int8 | fp8: a low-precision sampler (the INT8-rollout ablation of Yao et al.)
    prompts_per_step: int = 32  # GRPO groups per step (batch size 32)
    group_size: int = 16  # completions per prompt (G)
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    max_steps: int | None = None  # exclusive with --epochs
    epochs: float | None = None  # passes over the prompts (30 when neither is given)
    lr: float = 2e-6
    weight_decay: float = 0.01
    warmup_ratio: float = 0.001  # constant learning rate after a linear warmup over this fraction of the steps
    max_grad_norm: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    reward_bias: float = -0.5  # r' = (r + bias) * scale
    reward_scale: float = 10.0
    adv_eps: float = 1e-6  # A = (r' - mean) / (std + eps)
    adv_std: bool = True  # divide by the group std (--no-adv-std: centre only, Dr. GRPO)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    kl_coef: float = 0.0  # KL to the initial model (the recipe uses none)
    kl_estimator: str = "k3"  # k1 | k2 | k3
    behave_cap: float = 5.0  # behaviour-weight cap exp(prox - behave) (0: no cap)
    behave_action: str = "mask"  # mask: tokens above the cap train nothing; clamp: weight = cap
    behave_level: str = "token"  # token | sequence (geometric mean of the sequence's ratios)
    correction: str = "none"  # none | token-tis | seq-tis | token-mis | seq-mis | geo-rs (verl names accepted)
    correction_threshold: float = 2.0  # C: upper truncation (TIS) / rejection (MIS) bound
    correction_lower: float | None = None  # lower bound (MIS: mask below; TIS: clamp below)
    geo_lower: float = 0.999  # geo-rs bounds on the geometric-mean ratio
    geo_upper: float = 1.001
    veto_threshold: float | None = None  # mask a sequence with any token ratio below this
    max_staleness: int = 4  # ETA: max versions between the sampler that made a sample and the learner using it
    ppo_minibatches: int = 1  # optimizer steps per batch (AReaL ppo_n_minibatches)
    micro_batch_size: int = 8  # trajectories per learner forward (memory)
    rollout_batch_size: int = 64  # sequences per generate call of the hf engine
    vllm_gpu_memory_utilization: float = 0.3  # --engine vllm (colocated): the GPU share vLLM takes (TRL's default)
    vllm_server_url: str = "http://localhost:8000"  # --engine vllm-server: where `vllm serve` listens
    vllm_server_timeout: float = 240.0  # --engine vllm-server: seconds to wait for the server to answer at start
    format_weight: float | None = None  # weight of the format reward; None = 0 in stage 1, 0.1 in stage 2
    system_prompt: bool = True  # prepend "You are a helpful AI assistant." (the recipe's system prompt)
    max_pixels: int = 512 * 512  # images are downscaled to at most this many pixels (the recipe's 512x512 cap)
    freeze_vision: bool = False
    lora_r: int = (
        0  # LoRA rank (0: full fine-tuning); adapters on the selection's attention/MLP projections (ovkit.runtime.lora)
    )
    lora_alpha: float = 16.0  # LoRA scale alpha (the update is alpha / r * B A)
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None  # regexes over module names to adapt instead of the per-architecture default
    save_every: int = 250  # checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2
    save_rollouts: bool = False  # write every step's trajectories to OUT/rollouts/
    resume: bool = False  # continue the run in OUT.partial/ from its last checkpoint
    report_to: list[str] = field(default_factory=list)  # experiment trackers: tensorboard, wandb, mlflow, trackio
    eval_data: list[Path] | None = (
        None  # held-out tables scored while training (ovkit.evaluate.during): eval/reward, eval/accuracy, ...
    )
    eval_every: int = 0  # evaluate on --eval-data every N steps, and after the last (0: only after the last)
    eval_limit: int | None = None  # at most this many eval rows per category (the first ones, as `ovkit eval --limit`)
    eval_max_new_tokens: int | None = (
        None  # the eval's generation budget; default: per category (`ovkit eval`'s token_budgets)
    )
    reward_workers: int = 2
    env: str | None = None  # multi-turn: an environment (ovkit.envs: zoom, verifier, or package.module:factory)
    env_arg: Any = None  # its arguments: key=value strings (--env-arg, repeatable) or a mapping (YAML)
    max_turns: int = 3  # multi-turn: assistant turns at most
    max_response_tokens: int | None = None  # multi-turn: token budget after the prompt (sampled + observation)
    env_retries: int = 2  # multi-turn: extra tries of a failed environment call
    env_timeout: float = 30.0  # multi-turn: seconds per environment call
    trust_remote_code: bool = False
    seed: int = 0
    overwrite: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        from ovkit.rollouts.episodes import check_env_options

        if not self.data:
            raise OvkitError("DATA is required: RL sample tables (e.g. rl-curate's OUT/stage1)")
        check_env_options(self)
        self.data = [Path(p) for p in (self.data if isinstance(self.data, (list, tuple)) else [self.data])]
        for name in ("model", "out"):
            if getattr(self, name) is None:
                raise OvkitError(f"--{name} is required")
            setattr(self, name, Path(getattr(self, name)))
        if self.stage not in STAGE_MODES:
            raise OvkitError(f"--stage must be 1 or 2, got {self.stage}")
        if self.format_weight is None:
            self.format_weight = STAGE_FORMAT_WEIGHT[self.stage]
        try:
            self.correction = canonical_mode(self.correction)
        except ValueError as e:
            raise OvkitError(f"--correction: {e}") from None
        self.report_to = [r for r in (self.report_to or []) if r != "none"]
        self.precision = check_optim(self.optim, canonical_precision(self.precision))  # adamw_bf16: auto -> bf16-true
        check_trackers(self.report_to)
        if self.sampler_precision is not None:
            sampler_dtype(self.sampler_precision)  # a bad name fails here, naming the option
        self.activation_checkpointing = check_checkpointing(self.activation_checkpointing, self.gradient_checkpointing)
        self.kernels = check_kernels(self.kernels, self.use_liger_kernel)
        check_eval_options(self)
        self._check()

    def _check(self) -> None:
        positive = (
            "prompts_per_step",
            "group_size",
            "max_new_tokens",
            "ppo_minibatches",
            "micro_batch_size",
            "rollout_batch_size",
            "keep_checkpoints",
            "reward_workers",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise OvkitError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.epochs is not None:
            raise OvkitError("give --max-steps or --epochs, not both")
        if (self.max_steps is not None and self.max_steps < 1) or (self.epochs is not None and self.epochs <= 0):
            raise OvkitError("--max-steps must be >= 1 and --epochs > 0")
        if self.ppo_minibatches > self.prompts_per_step * self.group_size:
            raise OvkitError(
                "--ppo-minibatches cannot exceed the trajectories per step (prompts-per-step x group-size)"
            )
        checks = [
            (self.max_staleness >= 0, "--max-staleness must be >= 0 (0 = synchronous on-policy)"),
            (
                self.lr > 0 and self.weight_decay >= 0 and self.max_grad_norm >= 0,
                "need --lr > 0, --weight-decay >= 0, --max-grad-norm >= 0",
            ),
            (0 <= self.warmup_ratio < 1, "--warmup-ratio must be in [0, 1)"),
            (0 <= self.eps_clip < 1 and self.eps_clip_high >= 0, "need 0 <= --eps-clip < 1 and --eps-clip-high >= 0"),
            (self.behave_cap >= 0, "--behave-cap must be >= 0 (0 = no cap)"),
            (self.behave_action in ("mask", "clamp"), "--behave-action must be mask or clamp"),
            (self.behave_level in ("token", "sequence"), "--behave-level must be token or sequence"),
            (self.loss_agg in AGGREGATIONS, f"--loss-agg must be one of {', '.join(AGGREGATIONS)}"),
            (self.kl_estimator in KL_ESTIMATORS, f"--kl-estimator must be one of {', '.join(KL_ESTIMATORS)}"),
            (self.kl_coef >= 0, "--kl-coef must be >= 0"),
            (0 <= self.format_weight <= 1, "--format-weight must be in [0, 1]"),
            (self.correction_threshold > 0, "--correction-threshold must be > 0"),
            (
                self.correction_lower is None or 0 <= self.correction_lower <= self.correction_threshold,
                "need 0 <= --correction-lower <= --correction-threshold",
            ),
            (self.geo_lower <= self.geo_upper, "need --geo-lower <= --geo-upper"),
            (self.engine in RL_ENGINES, f"--engine must be one of {', '.join(RL_ENGINES)}"),
            (
                self.lora_r >= 0 and self.lora_alpha > 0 and 0 <= self.lora_dropout < 1,
                "need --lora-r >= 0, --lora-alpha > 0 and 0 <= --lora-dropout < 1",
            ),
            (self.attn_implementation in ATTENTION, f"--attn-implementation must be one of {', '.join(ATTENTION)}"),
            (self.save_every >= 0, "--save-every must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise OvkitError(message)

    @property
    def partial(self) -> Path:
        return self.out.parent / f"{self.out.name}.partial"

    @property
    def mode(self) -> str:
        return STAGE_MODES[self.stage]

    def correction_config(self) -> Correction:
        from ovkit.rl.correction import Correction

        return Correction(
            mode=self.correction,
            upper=self.correction_threshold,
            lower=self.correction_lower,
            geo_lower=self.geo_lower,
            geo_upper=self.geo_upper,
            veto=self.veto_threshold,
            behave_cap=self.behave_cap or None,
            behave_action=self.behave_action,
            behave_level=self.behave_level,
        )


TRAJECTORY = trajectory_options(RLTrainConfig, RUN_CONTROL)
