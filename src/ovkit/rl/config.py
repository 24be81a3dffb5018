"""`ovkit rl-train`'s options: one dataclass, defaults the published LLaVA-OneVision-1.5-RL values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ovkit import options as O
from ovkit import trl_names
from ovkit.choices import (  # torch-free: a bad option fails before torch imports
    AGGREGATIONS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    PRESCRIBED,
    PROX_LOGP,
    QUANTS,
    SAMPLER_ALIASES,
    SAMPLER_PRECISIONS,
    SCALE_REWARDS,
    canonical_precision,
    check_checkpointing,
    check_kernels,
    check_optim,
    sampler_dtype,
)
from ovkit.choices import (
    canonical_correction as canonical_mode,
)
from ovkit.config import trajectory_options
from ovkit.errors import OvkitError
from ovkit.generate import RL_ENGINES
from ovkit.options import option, run_control_names
from ovkit.runtime.log import check_trackers

if TYPE_CHECKING:
    from ovkit.rl.correction import Correction


STAGE_MODES = {1: "answer", 2: "think"}  # stage 1: answer-only prompts; stage 2: think prompts (ovkit.prompts)

STAGE_FORMAT_WEIGHT = {1: 0.0, 2: 0.1}

MAX_GEN_BATCHES = 64  # --max-num-gen-batches' bound: a group's redraws take stream positions of their own (rl.rollout)


# --help panels of this config's own options (ovkit.options holds the shared ones)
SAMPLING = O.SAMPLING
OPTIMISER = "Optimiser"
GRPO_LOSS = "GRPO loss"
MISMATCH_CORRECTIONS = O.CORRECTIONS
SFT_MIX = "SFT mix (PPO-ptx)"


@dataclass
class Sampling:
    """How rl-train samples each step's groups: the engine, the sampler's copy, groups per step and their size."""

    # hf | vllm (colocated) | vllm-server (ovkit.generate)
    engine: str = O.engine(
        help=(
            "Rollout engine: hf (transformers generate, any device: the GPU when there is one), vllm (a colocated "
            "vLLM engine) or vllm-server (a running vLLM server, see --vllm-server-url)."
        ),
        doc=(
            "`hf`: transformers `generate` on left-padded batches, any device (CUDA when available); `vllm`: a "
            "colocated vLLM engine (`pip install 'ovkit[vllm]'`; without a GPU, vLLM's CPU build: `make "
            "setup-vllm`); `vllm-server`: a running vLLM server (see `--vllm-server-url`)"
        ),
        choices=RL_ENGINES,
    )
    # sample from a copy in fp32 | bf16 | fp16 (bf16: a real mismatch on CPU)
    sampler_precision: str | None = option(
        None,
        help="Sample from a copy in another precision than the learner: fp32, bf16, fp16.",
        panel=SAMPLING,
        choices=(*SAMPLER_PRECISIONS, *SAMPLER_ALIASES),
        default_doc="learner's (an asynchronous run's own copy, and --engine vllm: its compute dtype)",
    )
    # a low-precision sampler (the INT8-rollout ablation of Yao et al.)
    sampler_quant: str | None = option(
        None,
        help=(
            "int8, fp8 or int4: sample from a quantised copy (hf engine: int8 is dynamic W8A8 on CPU, "
            "weight-only per-channel rounding on GPU; fp8 weight-only e4m3 on any device; int4 group-wise 4-bit "
            "weights; vllm: fp8, vLLM's own quantisation)."
        ),
        panel=SAMPLING,
        choices=QUANTS,
    )
    # GRPO groups per step (batch size 32)
    prompts_per_step: int = option(
        32,
        help="GRPO groups (prompts) per step.",
        panel=SAMPLING,
        min=1,
        doc=("prompts (groups) per step; a DATA with fewer prompts repeats them within a step, with a warning"),
    )
    group_size: int = option(
        16, help="Completions per prompt (G).", panel=SAMPLING, flags=("--n-samples", "--num-generations"), min=1
    )
    max_new_tokens: int = O.max_new_tokens(4096, flags=("--max-completion-length",))
    temperature: float = O.temperature(  # > 0: greedy groups have no spread, and the learner divides by it
        1.0,
        min=None,
        gt=0,
        help="Sampling temperature; the learner divides its logits by it too.",
    )
    top_p: float = O.top_p(
        doc="nucleus sampling mass (with T > 0); the learner does not truncate: top-p < 1 shows up as mismatch"
    )
    # DAPO's soft overlong punishment (verl's overlong_buffer.len / penalty_factor)
    overlong_buffer_len: int = option(
        0,
        help="Penalise completions in the last N tokens before --max-new-tokens (0: off).",
        panel=SAMPLING,
        min=0,
        doc=(
            "DAPO's overlong reward shaping (verl's overlong_buffer.len): a completion longer than max-new-tokens "
            "- N gets a penalty growing linearly to --overlong-penalty-factor at max-new-tokens, added to its reward "
            "before the advantages (`overlong/penalty_mean`, `overlong/frac`)"
        ),
    )
    # DAPO's dynamic sampling (verl's algorithm.filter_groups.enable / max_num_gen_batches)
    dynamic_sampling: bool = option(
        False,
        help="Draw again for a group whose rewards are all equal (DAPO), up to --max-num-gen-batches.",
        panel=SAMPLING,
        doc=(
            "DAPO's dynamic sampling (verl's algorithm.filter_groups): a group whose rewards are all equal is dropped "
            "and its place in the step draws a new prompt, until one carries a signal or its place has drawn "
            "--max-num-gen-batches groups (then the last one stays: it trains nothing). "
            "`dynamic_sampling/groups_filtered`, `/unfilled`, `/gen_batches_max`"
        ),
    )
    max_num_gen_batches: int = option(
        10,
        help="--dynamic-sampling: groups each place of a step may draw, the first included (verl's name).",
        panel=SAMPLING,
        min=1,
        max=MAX_GEN_BATCHES,
    )
    overlong_penalty_factor: float = option(
        1.0,
        help="The overlong penalty at --max-new-tokens (verl's overlong_buffer.penalty_factor).",
        panel=SAMPLING,
        min=0,
    )


@dataclass
class PPOLoss:
    """The GRPO objective (ovkit.rl.loss, ovkit.rl.advantages): clipping, reward shaping, advantages, KL."""

    eps_clip: float = option(
        0.2, help="PPO clip: ratio lower bound 1 - eps.", panel=GRPO_LOSS, flags=("--epsilon",), min=0, lt=1
    )
    eps_clip_high: float = option(
        0.28,
        help="PPO clip: ratio upper bound 1 + eps_high.",
        panel=GRPO_LOSS,
        flags=("--eps-clip-higher", "--epsilon-high"),
        min=0,
    )
    reward_bias: float = option(-0.5, help="r' = (r + bias) * scale.", panel=GRPO_LOSS)
    reward_scale: float = option(10.0, help="r' = (r + bias) * scale.", panel=GRPO_LOSS, flags=("--reward-scaling",))
    adv_eps: float = option(
        1e-6,
        help="A = (r' - group mean) / (group std + eps).",
        panel=GRPO_LOSS,
        doc="epsilon of the group normalisation",
    )
    adv_std: bool = option(
        True,
        help="Divide advantages by the group std (--no-adv-std: centre only, Dr. GRPO).",
        panel=GRPO_LOSS,
        negatable=True,
    )
    # TRL's scale_rewards, a superset of --adv-std (kept, verl's norm_adv_by_std_in_grpo): --no-adv-std reads as none
    scale_rewards: str = option(
        "group",
        help="Divide advantages by the group's std, the whole step's (batch) or none (centre only, Dr. GRPO).",
        panel=GRPO_LOSS,
        choices=SCALE_REWARDS,
        doc=(
            "group: the group's std; batch: the std of the step's rewards over every process (Liu et al. 2025); "
            "none: centred only (Dr. GRPO). TRL's scale_rewards; `--no-adv-std` (verl's norm_adv_by_std_in_grpo=false) "
            "is none, and refused with batch"
        ),
    )
    loss_agg: str = option(
        "token-mean",
        help=(
            "token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (constant "
            "normaliser = --max-new-tokens)."
        ),
        panel=GRPO_LOSS,
        choices=AGGREGATIONS,
    )
    # KL to the initial model (the recipe uses none)
    kl_coef: float = option(
        0.0,
        help="KL penalty to the initial model (0: none, as released).",
        panel=GRPO_LOSS,
        flags=("--beta",),
        min=0,
        doc="KL penalty to the initial model (a frozen copy is kept when > 0)",
    )
    kl_estimator: str = option("k3", help="k1 | k2 | k3.", panel=GRPO_LOSS, choices=KL_ESTIMATORS)
    loss_type: str = option(
        "grpo",
        help="The policy loss: grpo (clipped), dr_grpo, dapo, cispo (clipped weight) or sapo (soft gate).",
        panel=GRPO_LOSS,
        choices=LOSS_TYPES,
        doc=(
            "TRL's loss_type. grpo: the released clipped surrogate; dr_grpo implies --loss-agg "
            "seq-mean-token-sum-norm and --scale-rewards none, dapo "
            "--loss-agg token-mean (a different value given is refused); cispo caps its detached weight at "
            "1 + --eps-clip-high; sapo gates with --sapo-temperature-pos/-neg"
        ),
    )
    importance_sampling_level: str = option(
        "token",
        help="The ratio: token, sequence (GSPO) or sequence-token (GSPO-token).",
        panel=GRPO_LOSS,
        choices=IMPORTANCE_SAMPLING_LEVELS,
        doc=(
            "TRL's importance_sampling_level; sequence-token is verl's loss_mode gspo (the sequence ratio's value, "
            "each token's own gradient)"
        ),
    )
    sapo_temperature_pos: float = option(
        1.0, help="--loss-type sapo: the gate's temperature where the advantage is > 0.", panel=GRPO_LOSS, gt=0
    )
    sapo_temperature_neg: float = option(
        1.05, help="--loss-type sapo: the gate's temperature where the advantage is <= 0.", panel=GRPO_LOSS, gt=0
    )
    top_entropy_quantile: float = option(
        1.0,
        help="Train the policy term on the step's top share of tokens by entropy (1: every token).",
        panel=GRPO_LOSS,
        min=0,
        max=1,
        doc=(
            "TRL's top_entropy_quantile (Wang et al. 2025: 0.2). The threshold is the step's, over every response "
            "token of every process, from a no-grad pass before the gradient pass (one more forward when "
            "--ppo-minibatches is 1)"
        ),
    )
    mask_truncated_completions: bool = option(
        False,
        help="Train nothing on completions cut off by --max-new-tokens (or a multi-turn budget).",
        panel=GRPO_LOSS,
        doc="TRL's mask_truncated_completions (DAPO): their reward still counts in their group's advantages",
    )
    # AReaL's prox_logp_method (ovkit.rl.proximal); its "metrics" mode is not offered (loglinear logs abs_error free)
    prox_logp: str = option(
        "recompute",
        help="Decoupled PPO's pi_prox: recompute (a no-grad pass) or loglinear (AReaL's approximation, no pass).",
        panel=GRPO_LOSS,
        choices=PROX_LOGP,
        doc=(
            "AReaL's prox_logp_method. recompute: the learner's log-probs at the start of the step (a no-grad pass "
            "over the batch with --ppo-minibatches > 1; free with 1); loglinear: behave + alpha (current - behave), "
            "alpha from the sample's and the step's versions, no pass (saves one only with --ppo-minibatches > 1); "
            "needs --max-staleness 2 or more, refused with --top-entropy-quantile"
        ),
    )


@dataclass
class SFTMix:
    """PPO-ptx (Ouyang et al. 2022, InstructGPT): a supervised loss on SFT rows added to every optimiser step, so RL
    keeps what it does not train (ovkit.rl.sftmix). OpenRLHF's names are accepted (--ptx-coef, --pretrain-data)."""

    sft_data: list[Path] | None = option(
        None,
        help="SFT table(s) (as `ovkit sft` reads them) whose answer NLL each optimiser step adds. Repeatable.",
        panel=SFT_MIX,
        flags=("--pretrain-data",),
        doc=(
            "SFT table(s), as `ovkit sft` reads them (loss on the last assistant turn), mixed into RL with "
            "--sft-coef; repeatable. OpenRLHF's --pretrain_data (which trained every token of its rows)"
        ),
    )
    sft_coef: float = option(
        0.0,
        help="Weight C of the SFT loss: loss = RL loss + C x mean answer-token NLL of the step's SFT rows (0: off).",
        panel=SFT_MIX,
        flags=("--ptx-coef",),
        min=0,
        doc=(
            "C in loss = RL loss + C x (NLL summed over the SFT rows' answer tokens / their count), per optimiser "
            "step (OpenRLHF's --ptx_coef, default there 0.05); 0: off, the run is bit for bit the one without it. "
            "`sft/loss` (the NLL per answer token, before C), `sft/tokens`"
        ),
    )
    sft_rows_per_step: int = option(
        8,
        help="SFT rows drawn per optimiser step, from the seed and the step (a resumed run draws the same).",
        panel=SFT_MIX,
        min=1,
        doc=(
            "SFT rows per optimiser step, drawn without replacement from (--seed, step, minibatch) alone, so a "
            "resumed run draws the rows the uninterrupted one would; several processes: a multiple of their "
            "number, each process takes its share of the same draw, and the loss is normalised by the answer "
            "tokens of every process, so N processes train what one does"
        ),
    )

    def check(self) -> None:
        """The options together (each one's range is declared on its field); --sft-data as a list of paths."""
        if self.sft_data:
            data = self.sft_data
            self.sft_data = [Path(p) for p in (data if isinstance(data, (list, tuple)) else [data])]
        if self.sft_coef > 0 and not self.sft_data:
            raise OvkitError("--sft-coef needs --sft-data (the SFT table whose loss it weighs); give both or neither")
        if self.sft_data and self.sft_coef == 0:
            raise OvkitError("--sft-data is mixed in only with --sft-coef > 0; give both or neither")
        if self.sft_rows_per_step != 8 and self.sft_coef == 0:
            raise OvkitError("--sft-rows-per-step sizes the SFT mix: give --sft-coef and --sft-data too")


@dataclass
class Corrections:
    """Sampler/learner mismatch corrections (`build()`: the Correction the update applies)."""

    behave_cap: float = O.behave_cap(flags=("--behav-imp-weight-cap",))  # AReaL's behav_imp_weight_cap
    behave_action: str = option(
        "mask",
        help="Above the cap: mask (train nothing) or clamp (weight = cap).",
        panel=MISMATCH_CORRECTIONS,
        choices=("mask", "clamp"),
    )
    behave_level: str = option(
        "token",
        help="token, or sequence (geometric mean of the sequence's ratios).",
        panel=MISMATCH_CORRECTIONS,
        choices=("token", "sequence"),
    )
    correction: str = option(
        "none",
        help=(
            "Mismatch correction: none | token-tis | seq-tis | token-mis | seq-mis | geo-rs (verl names "
            "accepted, e.g. token, sequence, seq_mean_k1)."
        ),
        panel=MISMATCH_CORRECTIONS,
    )
    correction_threshold: float = O.correction_threshold()
    correction_lower: float | None = O.correction_lower()
    geo_lower: float = O.geo_lower()
    geo_upper: float = O.geo_upper()
    veto_threshold: float | None = O.veto_threshold()

    def build(self) -> Correction:
        """The Correction these options describe (what the PPO update applies)."""
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


@dataclass(frozen=True)
class Update:
    """What one GRPO step's update reads (ovkit.rl.update), from rl-train's options: the loss, how the learner
    re-scores the samples (the sampler's temperature; --max-new-tokens, the constant normaliser of
    seq-mean-token-sum-norm), and how the step is cut into optimiser steps and passes, and clipped."""

    ppo: PPOLoss
    temperature: float
    max_new_tokens: int
    ppo_minibatches: int
    micro_batch_size: int
    max_grad_norm: float
    shared_prefix: bool  # asked for; the learner shares where the model can (ovkit.rollouts.shared.sharing)
    max_nonfinite_steps: int  # the guard's, where no Runtime holds one (a bare model in tests)


@dataclass
class RLCheckpoints(O.Checkpoints):
    """Checkpoints, with rl-train's default interval and wording."""

    save_every: int = O.save_every(
        250, help="Resumable checkpoint every N steps in OUT.partial/checkpoints (0: only the final model)."
    )
    resume: bool = O.resume(help="Continue the unfinished run in OUT.partial/ from its last checkpoint.")


@dataclass
class RLEvalDuring(O.EvalDuring):
    """Evaluation while training, as rl-train scores it (the stage's prompt mode, rewards)."""

    eval_data: list[Path] | None = O.eval_data(
        doc=(
            "held-out table(s) scored while training as `ovkit eval` scores them (answer-mode prompts, greedy, "
            "the learner's weights): the stage's prompt mode (`ovkit eval --prompt answer` for stage 1, `think` "
            "for stage 2; single-turn), every row needs a gold `answer`: `eval/reward`, `eval/accuracy`, "
            "`eval/reward/<category>`, `eval/accuracy/<category>`; repeatable"
        )
    )


@dataclass(init=False)
class RLTrainConfig(O.StageConfig):
    """Options of `ovkit rl-train`. Defaults are the published LLaVA-OneVision-1.5-RL values (its public repository)."""

    foreign_names: ClassVar[dict] = trl_names.GRPO  # TRL GRPOConfig keys: translated or refused (a page table)

    launcher: ClassVar[str] = O.DATA_PARALLEL  # what it does under torchrun / accelerate launch (ovkit.launch)

    # Options that exclude each other: one given on the command line drops the config file's other (flags override the
    # file)
    exclusive: ClassVar[tuple[tuple[str, ...], ...]] = (("max_steps", "epochs"),)

    # the groups every learner shares, listed after the stage's own options
    loading: O.ModelLoading = O.group(O.ModelLoading, after=True)
    optimiser: O.Optimiser = O.group(O.Optimiser, after=True)
    compute: O.Compute = O.group(O.Compute, after=True)
    lora: O.Lora = O.group(O.Lora, after=True)
    checkpoints: RLCheckpoints = O.group(RLCheckpoints, after=True)
    trackers: O.Trackers = O.group(O.Trackers, after=True)
    eval_during: RLEvalDuring = O.group(RLEvalDuring, after=True)

    data: list[Path] | None = option(
        None,
        help=(
            "RL sample tables with answer/answer_type (e.g. rl-curate's OUT/stage1, or OUT/part-*/stage1 of a"
            " sharded curate)."
        ),
        argument=True,
    )
    model: Path | None = option(
        None,
        help="Model directory: the SFT model for stage 1, the stage-1 output for stage 2.",
        panel=O.IO,
        doc="model to start from",
    )
    out: Path | None = O.out()
    stage: int = option(
        1,
        help="1: answer-only prompts; 2: think prompts + format reward (the curriculum).",
        panel=O.IO,
        min=1,
        max=2,
    )
    sampling: Sampling = O.group(Sampling)
    # exclusive with --epochs
    max_steps: int | None = option(None, help="GRPO steps to run (instead of --epochs).", panel=OPTIMISER, min=1)
    # passes over the prompts (30 when neither is given)
    epochs: float | None = option(
        None,
        help=("Passes over the prompts (default 30 when --max-steps is not given). Also --num-train-epochs (HF/TRL)."),
        panel=OPTIMISER,
        flags=("--num-train-epochs",),
        gt=0,
        default_doc="30",
    )
    lr: float = option(
        2e-6,
        help="Constant learning rate after warmup (AdamW). Also --learning-rate (HF/TRL).",
        panel=OPTIMISER,
        flags=("--learning-rate",),
        gt=0,
        doc="constant after warmup (AdamW, eps 1e-5)",
    )
    weight_decay: float = option(0.01, help="AdamW weight decay on weight matrices.", panel=OPTIMISER, min=0)
    # constant learning rate after a linear warmup over this fraction of the steps
    warmup_ratio: float = option(
        0.001,
        help="Fraction of the steps with linear warmup.",
        panel=OPTIMISER,
        min=0,
        lt=1,
    )
    max_grad_norm: float = option(
        1.0,
        help="Clip the global gradient norm (0: no clipping).",
        panel=OPTIMISER,
        min=0,
    )
    ppo: PPOLoss = O.group(PPOLoss)
    corrections: Corrections = O.group(Corrections)
    sft_mix: SFTMix = O.group(SFTMix)
    # ETA: max versions between the sampler that made a sample and the learner using it
    max_staleness: int = option(
        4,
        help=("ETA: rollouts run ahead of training by at most this many versions (0: synchronous on-policy)."),
        panel=SAMPLING,
        flags=("--max-head-offpolicyness",),
        min=0,
    )
    # optimizer steps per batch (AReaL ppo_n_minibatches)
    ppo_minibatches: int = option(1, help="Optimizer steps per batch (each on a slice of it).", panel=OPTIMISER, min=1)
    micro_batch_size: int = option(
        8,
        help="Trajectories per learner forward pass (memory).",
        panel=O.RUNTIME,
        run_control=True,
        min=1,
    )
    shared_prefix: str = option(
        "on",
        help="Forward each group's prompt once in the learner (on | off).",
        panel=O.RUNTIME,
        choices=("on", "off"),
        run_control=True,
        doc=(
            "the learner's micro-batch holds each group's prompt (text and images) once, followed by its "
            "completions, which attend to it and never to each other (ovkit.rollouts.shared): the gradient, "
            "proximal and reference passes run the vision tower and the prompt once per group instead of once per "
            "sample, with the same log-probs and gradients; under `--attn-implementation auto` the language model "
            "takes ovkit's varlen function even where flash-attn is installed; where the model cannot (its attention "
            "is not ovkit's varlen one: flash_attention_2 or eager asked for by name; soft-capped logits) it forwards "
            "one row per trajectory and says so once"
        ),
    )
    rollout_batch_size: int = option(
        64,
        help="Sequences per generate call of the hf engine.",
        panel=O.RUNTIME,
        min=1,
    )
    # --engine vllm (colocated): the GPU share vLLM takes (TRL's default)
    vllm_gpu_memory_utilization: float = option(
        0.3,
        help="--engine vllm: the GPU memory share the colocated vLLM takes.",
        panel=O.RUNTIME,
        doc=(
            "`--engine vllm`: the share of GPU memory the colocated vLLM takes (KV cache included); in "
            "synchronous runs vLLM sleeps (KV cache freed, weights offloaded) while the learner updates, and its "
            "weights are written in place after every step under their checkpoint names"
        ),
    )
    vllm_server_url: str = option(
        "http://localhost:8000",
        help="--engine vllm-server: the server's address (default http://localhost:8000).",
        panel=O.RUNTIME,
        flags=("--vllm-server-base-url",),
        run_control=True,
        doc="`--engine vllm-server`: where `vllm serve` listens",
    )
    vllm_server_timeout: float = option(
        240.0, help="--engine vllm-server: seconds to wait for the server at start.", panel=O.RUNTIME, run_control=True
    )
    format_weight: float | None = option(
        None,
        help="Weight of the format reward (default: 0 in stage 1, 0.1 in stage 2).",
        panel=GRPO_LOSS,
        min=0,
        max=1,
        default_doc="0 / 0.1",
    )
    system_prompt: bool = O.system_prompt()
    max_pixels: int = O.max_pixels()
    freeze_vision: bool = option(False, help="Keep the vision encoder frozen.", panel=OPTIMISER)
    save_rollouts: bool = option(
        False,
        help="Write every step's trajectories to OUT/rollouts/step-N.parquet.",
        panel=O.CHECKPOINTS,
        run_control=True,
    )
    reward_workers: int = O.reward_workers()
    reward_funcs: list[str] = O.reward_funcs()
    multi_turn: O.MultiTurnOptions = O.group(O.MultiTurnOptions)
    seed: int = O.seed(doc="prompt order and sampling seeds")
    overwrite: bool = O.overwrite()
    quiet: bool = O.quiet(doc="no console line (transformers', huggingface_hub's and datasets' bars included)")

    def __post_init__(self) -> None:
        from ovkit.rollouts.episodes import check_env_options

        O.validate(self)  # each option's declared range and choices; the checks across options follow
        if self.reward_funcs:  # the files and functions, before any model loads (user code: imported only if given)
            from ovkit.rewards.custom import parse_all

            parse_all(self.reward_funcs)
        if not self.data:
            raise OvkitError("DATA is required: RL sample tables (e.g. rl-curate's OUT/stage1)")
        check_env_options(self.multi_turn)
        self.data = [Path(p) for p in (self.data if isinstance(self.data, (list, tuple)) else [self.data])]
        for name in ("model", "out"):
            if getattr(self, name) is None:
                raise OvkitError(f"--{name} is required")
            setattr(self, name, Path(getattr(self, name)))
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
        self.eval_during.check()
        self.sft_mix.check()
        self._check()

    def _check(self) -> None:
        """The checks across options (each option's own range and choices are declared on its field)."""
        if self.max_steps is not None and self.epochs is not None:
            raise OvkitError("give --max-steps or --epochs, not both")
        if self.ppo_minibatches > self.prompts_per_step * self.group_size:
            raise OvkitError(
                "--ppo-minibatches cannot exceed the trajectories per step (prompts-per-step x group-size)"
            )
        if self.optimizer_in_backward:
            raise OvkitError(
                "rl-train does not take --optimizer-in-backward: its optimiser step spans a backward per "
                "--micro-batch-size slice, and a step whose tokens are all masked is skipped after its backward; "
                "drop the flag (align, midtrain and sft take it)"
            )
        O.check_corrections(self)
        self._check_algorithm()

    def _check_algorithm(self) -> None:
        """The loss menu's options together: what a loss type prescribes, and combinations with no meaning."""
        defaults = {"loss_agg": "token-mean", "scale_rewards": "group"}  # the fields' own, declared above
        if not self.adv_std:  # --no-adv-std is --scale-rewards none (verl's norm_adv_by_std_in_grpo=false)
            if self.scale_rewards == "batch":
                raise OvkitError("--no-adv-std and --scale-rewards batch contradict each other; give one")
            self.scale_rewards = "none"
        # dr_grpo and dapo fix the aggregation (and dr_grpo the scaling): a value left at its default takes the
        # prescribed one; a different value is refused rather than silently replaced
        for name, value in PRESCRIBED.get(self.loss_type, {}).items():
            given = getattr(self, name)
            if given != value and given != defaults[name]:
                flag = name.replace("_", "-")
                raise OvkitError(
                    f"--loss-type {self.loss_type} means --{flag} {value}, got --{flag} {given}; drop one of the two"
                )
            setattr(self, name, value)
        if self.loss_type != "sapo" and (self.sapo_temperature_pos, self.sapo_temperature_neg) != (1.0, 1.05):
            raise OvkitError(f"--sapo-temperature-pos/-neg apply to --loss-type sapo, not {self.loss_type}")
        # the clip bounds a loss type never reads (their defaults pass: they are every run's)
        unread = {"sapo": {"eps_clip": 0.2, "eps_clip_high": 0.28}, "cispo": {"eps_clip": 0.2}}
        for name, default in unread.get(self.loss_type, {}).items():
            if getattr(self, name) != default:
                raise OvkitError(
                    f"--loss-type {self.loss_type} does not clip at --{name.replace('_', '-')} (sapo gates with "
                    "--sapo-temperature-pos/-neg; cispo caps its weight at 1 + --eps-clip-high only): drop one of "
                    "the two"
                )
        self._check_prox_logp()
        if not self.dynamic_sampling and self.max_num_gen_batches != 10:
            raise OvkitError("--max-num-gen-batches bounds --dynamic-sampling; give --dynamic-sampling too")
        if self.dynamic_sampling and self.group_size < 2:
            raise OvkitError("--dynamic-sampling keeps groups whose rewards differ: it needs --group-size 2 or more")
        if self.overlong_buffer_len:
            if self.overlong_buffer_len > self.max_new_tokens:
                raise OvkitError(
                    f"--overlong-buffer-len ({self.overlong_buffer_len}) cannot exceed --max-new-tokens "
                    f"({self.max_new_tokens})"
                )
            if self.env is not None:
                raise OvkitError(
                    "--overlong-buffer-len penalises a single completion's length against --max-new-tokens; a "
                    "multi-turn --env episode has no such one length: drop one of the two"
                )

    def _check_prox_logp(self) -> None:
        """--prox-logp loglinear where it means something (ovkit.rl.proximal)."""
        if self.prox_logp != "loglinear":
            return
        if self.max_staleness < 2:
            raise OvkitError(
                f"--prox-logp loglinear interpolates by version age, and at --max-staleness {self.max_staleness} "
                "every sample is 0 or 1 versions old, where AReaL's weight (v_step - 1 - v) / (v_step - v) is 0: "
                "pi_prox would be the behaviour policy for every token. Give --max-staleness 2 or more, or drop "
                "--prox-logp loglinear"
            )
        if self.top_entropy_quantile < 1.0:
            raise OvkitError(
                "--prox-logp loglinear skips the no-grad proximal pass, which --top-entropy-quantile needs for its "
                "entropies (and which then gives the exact pi_prox): drop one of the two"
            )

    @property
    def partial(self) -> Path:
        return self.out.parent / f"{self.out.name}.partial"

    @property
    def mode(self) -> str:
        return STAGE_MODES[self.stage]

    def correction_config(self) -> Correction:
        return self.corrections.build()

    def update_options(self) -> Update:
        """What the PPO update reads of these options (ovkit.rl.update)."""
        return Update(
            ppo=self.ppo,
            temperature=self.temperature,
            max_new_tokens=self.max_new_tokens,
            ppo_minibatches=self.ppo_minibatches,
            micro_batch_size=self.micro_batch_size,
            max_grad_norm=self.max_grad_norm,
            shared_prefix=self.shared_prefix == "on",
            max_nonfinite_steps=self.max_nonfinite_steps,
        )


# Options a resumed run may change (declared `run_control=True` where the field is): where it writes and reports, how it
# checkpoints, how many reward workers score,
# where a vLLM server listens, and how the same numbers are computed (learner micro-batches, attention kernel,
# activation checkpointing). Every other option shapes the trajectory (sampling, rewards, the loss, its corrections,
# the optimiser), so a resumed run must keep it: TRAJECTORY is derived below, and an option added later is covered
# without being listed (Runtime.resume exits 2 naming it).
RUN_CONTROL = run_control_names(RLTrainConfig)
TRAJECTORY = trajectory_options(RLTrainConfig, RUN_CONTROL)
# What shrinks a learner micro-batch's memory, as the out-of-memory message names it (Runtime.out_of_memory).
SMALLER = ("--micro-batch-size", "--max-new-tokens")
