"""One declaration per option: a stage config's dataclass field carries everything ovkit knows about the option.

`option(default, help=..., panel=...)` returns a `dataclasses.field` whose metadata holds the help text, the --help
panel, extra flag spellings (HF/TRL's `--learning-rate` for `lr`), what it accepts (choices, a range), whether a
resumed run may change it (`run_control`), and, only where the page needs more than the help, a `doc` for its
command page. Everything reads it: the typer command is built from the fields (ovkit.commands._common, as
HfArgumentParser / TRL's TrlParser build theirs), YAML keys and their aliases, `validate` at start, the resume rule
(`run_control_names`) and the option tables of commands/*.md (ovkit.pages).

The options several commands share are declared once below (`trust_remote_code()`, `precision()`, ...): a config
calls the function where it declares the field. Torch-free and typer-free: library configs import this module.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ovkit.choices import ATTENTION, OPTIMS, PRECISION_ALIASES, PRECISIONS  # torch-free
from ovkit.errors import OvkitError

# Help panels shared by every command (each command adds its own between inputs and run control).
IO = "Inputs/outputs"
RUNTIME = "Runtime/precision"
MULTI_TURN = "Multi-turn"
SAMPLING = "Sampling"
CHECKPOINTS = "Checkpoints & logging"
RUN = "Run control"
LORA = "LoRA"
EVALUATION = "Evaluation while training"
CORRECTIONS = "Mismatch corrections"

KEY = "ovkit"  # the metadata key of a field's Option

# What a stage does under a launcher (torchrun / accelerate launch): its config's `launcher` class attribute, read by
# ovkit.launch.check (the table of commands and policies is in ovkit.launch's docstring).
DATA_PARALLEL = "data-parallel"  # one run over N processes (align, midtrain, sft, rl-train)
RANK_SHARDED = "rank-sharded"  # process r runs --shard r/N (convert, balance, pack, caption, rl-curate)
ROW_SHARED = "row-shared"  # the processes share the rows, the main process writes (eval; --compare: one process)
ONE_PROCESS = "one-process"  # refused under a launcher (synth, init-model, mismatch-report)


@dataclasses.dataclass(frozen=True)
class Option:
    """What a field declares beyond its type and default (see `option`)."""

    help: str
    panel: str | None = None
    flag: str | None = None  # the flag's spelling where it is not the field's name (--keep-source for keep_sources)
    flags: tuple[str, ...] = ()  # other spellings of the flag (HF/TRL names); also accepted as YAML keys
    negatable: bool = False  # a bool that also takes --no-NAME (one whose default is on)
    choices: tuple[str, ...] | None = None  # the values accepted (each item, for a list)
    min: float | None = None  # the range of a number: min <= x, x <= max (inclusive bounds) ...
    max: float | None = None
    gt: float | None = None  # ... or gt < x, x < lt (exclusive bounds: --lr > 0, --eps-clip < 1)
    lt: float | None = None
    run_control: bool = False  # a resumed run may change it (it does not change the trajectory)
    argument: bool = False  # positional (the command's INPUT), not a --flag
    metavar: str | None = None
    # The command page's text where it needs more than the --help line (a link, a table, what one command does
    # differently); else the page prints the help. It names the same choices and defaults (tests/test_cli.py).
    doc: str | None = None
    default_doc: str | None = None  # the page's words for a default computed at run time (None in the dataclass)

    def cli_name(self, name: str) -> str:
        """How the command line spells field `name`: --lr, or DATA for an argument."""
        return name.upper() if self.argument else self.flag or f"--{name.replace('_', '-')}"

    def accepts(self) -> str | None:
        """The declared range as the pages and errors write it: `>= 1`, `> 0`, `[0, 1)`, `(0, 1]` (None: any)."""
        low = f"[{self.min:g}" if self.min is not None else f"({self.gt:g}" if self.gt is not None else None
        high = f"{self.max:g}]" if self.max is not None else f"{self.lt:g})" if self.lt is not None else None
        if low and high:
            return f"{low}, {high}"
        if low:
            return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
        if high:
            return f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}"
        return None

    def refuses(self, x: float) -> bool:
        """Whether number `x` is outside the declared range."""
        return (
            (self.min is not None and x < self.min)
            or (self.gt is not None and x <= self.gt)
            or (self.max is not None and x > self.max)
            or (self.lt is not None and x >= self.lt)
        )


def option(
    default: Any = None,
    *,
    help: str,
    panel: str | None = None,
    flag: str | None = None,
    flags: Sequence[str] = (),
    negatable: bool = False,
    choices: Sequence[str] | None = None,
    min: float | None = None,
    max: float | None = None,
    gt: float | None = None,
    lt: float | None = None,
    run_control: bool = False,
    argument: bool = False,
    metavar: str | None = None,
    doc: str | None = None,
    default_doc: str | None = None,
) -> Any:
    """A config field declaring one option (a list default is copied per instance). What it accepts: `choices`, and
    for a number inclusive `min` / `max` or exclusive `gt` / `lt` bounds (one of each side)."""
    if not help or not help.strip():
        raise TypeError("an option needs help text")
    if (min is not None and gt is not None) or (max is not None and lt is not None):
        raise TypeError("an option's range has one lower bound (min or gt) and one upper bound (max or lt)")
    meta = Option(
        help=help,
        panel=panel,
        flag=flag,
        flags=tuple(flags),
        negatable=negatable,
        choices=tuple(choices) if choices is not None else None,
        min=min,
        max=max,
        gt=gt,
        lt=lt,
        run_control=run_control,
        argument=argument,
        metavar=metavar,
        doc=doc,
        default_doc=default_doc,
    )
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={KEY: meta})
    return dataclasses.field(default=default, metadata={KEY: meta})


def spec(f: dataclasses.Field) -> Option:
    """A field's Option; a field declared without `option(...)` is a bug (every field is an option with help)."""
    meta = f.metadata.get(KEY)
    if meta is None:
        raise TypeError(f"field {f.name!r} is not declared with ovkit.options.option(..., help=...)")
    return meta


# -- option groups: fields of a stage config that hold a dataclass of options --------------------------------------
# A stage config holds the groups its command shares (`loading: ModelLoading = group(ModelLoading, after=True)`) and
# those it keeps together for one consumer (rl-train's `ppo: PPOLoss = group(PPOLoss)`); the library below a stage's
# entry point takes the group, not the whole config (litgpt's `fit(train: TrainArgs, eval: EvalArgs)`, TRL's several
# dataclasses behind one parser). The user sees one flat surface: `flatten` is the one walk of a stage class into its
# options, and everything that lists options (specs, aliases, validate, the YAML loader, the command line, the pages,
# the resume rule) reads it, so a flag, YAML key and config.yaml key is the option's own name, wherever it is held.

GROUP = "ovkit-group"  # the metadata key of a group field: whether --help lists it after the command's own options


def group(cls: type, *, after: bool = False) -> Any:
    """A stage config's field holding option group `cls` (a dataclass of `option(...)` fields), a fresh one per config.
    `after`: --help and the page list its options after the command's own (the groups every loader or learner shares),
    else where the field is declared."""
    return dataclasses.field(default_factory=cls, metadata={GROUP: after})


@dataclasses.dataclass(frozen=True)
class Flat:
    """One option of a stage as `flatten` finds it: its field, where it is held and its declared type."""

    field: dataclasses.Field
    hint: Any
    held_by: str | None = None  # the group field holding it (None: the stage's own field)
    after: bool = False  # listed after the command's own options


@functools.cache
def flatten(cls: type) -> dict[str, Flat]:
    """{option name: Flat} of a stage config class in declaration order, each group field replaced by its options (one
    level: a group holds options only). Names are unique per stage: `cfg.lr` and `SFTConfig(lr=...)` reach the group
    holding `lr` (StageConfig), and YAML keys and flags are these names."""
    out: dict[str, Flat] = {}
    types = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if GROUP in f.metadata:
            kind = types[f.name]
            held = typing.get_type_hints(kind)
            items = [(g.name, Flat(g, held[g.name], f.name, f.metadata[GROUP])) for g in dataclasses.fields(kind)]
        else:
            items = [(f.name, Flat(f, types[f.name]))]
        for name, flat in items:
            if name in out:
                raise TypeError(f"{cls.__name__}: option {name!r} is declared twice (options are flat per stage)")
            out[name] = flat
    return out


def hints(cls: type) -> dict[str, Any]:
    """{option name: its declared type} of a config class (what the converter and the command line parse by)."""
    return {name: flat.hint for name, flat in flatten(cls).items()}


def specs(cls: type) -> dict[str, Option]:
    """{option name: Option} of a config class: its own options in declaration order (groups held in place among
    them), then those of the shared groups (`group(..., after=True)`: ModelLoading, the learners' groups), so --help
    and the page start with what is particular to the command, and the run-control panel (seed, overwrite, quiet)
    closes them."""
    flat = flatten(cls)
    order = sorted(flat, key=lambda name: (spec(flat[name].field).panel == RUN, flat[name].after))  # run control last
    return {name: spec(flat[name].field) for name in order}


def aliases(cls: type) -> dict[str, str]:
    """{other spelling as a config-file key: option}: `learning_rate` -> `lr`, `keep_source` -> `keep_sources`."""
    out = {}
    for name, flat in flatten(cls).items():
        meta = flat.field.metadata.get(KEY)
        if meta is not None and not meta.argument:
            for flag in (meta.flag, *meta.flags):
                if flag and flag.lstrip("-").replace("-", "_") != name:
                    out[flag.lstrip("-").replace("-", "_")] = name
    return out


def run_control_names(cls: type) -> frozenset[str]:
    """The options a resumed run may change (declared `run_control=True`); every other one shapes the trajectory."""
    return frozenset(name for name, o in specs(cls).items() if o.run_control)


class StageConfig:
    """The base of every stage config (a `@dataclass(init=False)`): built from flat keyword arguments
    (`SFTConfig(data=..., lr=1e-5)` fills the group holding `lr`), read and set flat (`cfg.lr`), and
    `dataclasses.replace(cfg, lr=...)` works; each config holds its own copy of every group. The generic machinery
    (validate, the YAML loader, config.yaml, the resume rule, the launcher check) takes any StageConfig."""

    def __init__(self, **values: Any) -> None:
        flat = flatten(type(self))
        moved: dict[str, dict[str, Any]] = {}
        for name in [n for n in values if flat.get(n) is not None and flat[n].held_by is not None]:
            moved.setdefault(flat[name].held_by, {})[name] = values.pop(name)
        for f in dataclasses.fields(self):
            if f.name in values:
                value = values.pop(f.name)
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[misc]  # every option has a default
            if GROUP in f.metadata:  # a copy: a config made by `replace` never shares a group with its source
                value = dataclasses.replace(value, **moved.get(f.name, {}))
            object.__setattr__(self, f.name, value)
        if values:
            raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {next(iter(values))!r}")
        self.__post_init__()

    def __post_init__(self) -> None:
        """A stage's checks across options (each option's own range and choices: `validate`)."""

    def __getattr__(self, name: str) -> Any:  # only names that are not the config's own fields arrive here
        flat = flatten(type(self)).get(name)
        if flat is None or flat.held_by is None or flat.held_by not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no option {name!r}")
        return getattr(self.__dict__[flat.held_by], name)

    def __setattr__(self, name: str, value: Any) -> None:
        flat = flatten(type(self)).get(name)
        if flat is not None and flat.held_by is not None:
            setattr(getattr(self, flat.held_by), name, value)
        else:
            object.__setattr__(self, name, value)


def validate(cfg: StageConfig) -> None:
    """Every option's declared choices and range, checked at start (before any model loads), naming the flag: a stage
    config calls it first in `__post_init__` (its own checks are those across options), and `ovkit.config.build` again
    on the values `__post_init__` filled in."""
    for name, flat in flatten(type(cfg)).items():
        meta, value = flat.field.metadata.get(KEY), getattr(cfg, name)
        if meta is None or value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if meta.choices is not None and str(item) not in meta.choices:
                raise OvkitError(f"{meta.cli_name(name)} must be one of {', '.join(meta.choices)}, got {item!r}")
            if isinstance(item, (int, float)) and not isinstance(item, bool) and meta.refuses(item):
                accepts = meta.accepts()
                accepts = f"in {accepts}" if accepts[0] in "[(" else accepts
                raise OvkitError(f"{meta.cli_name(name)} must be {accepts}, got {item}")


def check_corrections(cfg: StageConfig) -> None:
    """The mismatch-correction bounds across options (rl-train applies them, mismatch-report reports them): each
    bound's own range is declared on its field below."""
    if cfg.correction_lower is not None and cfg.correction_lower > cfg.correction_threshold:
        lower, threshold = cfg.correction_lower, cfg.correction_threshold
        raise OvkitError(f"need --correction-lower <= --correction-threshold, got {lower} > {threshold}")
    if cfg.geo_lower > cfg.geo_upper:
        raise OvkitError(f"need --geo-lower <= --geo-upper, got {cfg.geo_lower} > {cfg.geo_upper}")


# -- options several commands share, declared once -----------------------------------------------------------------
# A config declares one as `trust_remote_code: bool = O.trust_remote_code()`; a command whose default or wording
# differs says so in the call (`O.precision("fp32")`, `O.out(help=...)`).


def _shared(default: Any = None, **declared: Any) -> Any:
    def declare(default: Any = default, **override: Any) -> Any:
        return option(default, **{**declared, **override})

    return declare


out = _shared(
    help="Output directory (written atomically: complete or absent). Also --output-dir (HF/TRL).",
    panel=IO,
    flags=("--output-dir",),
    run_control=True,
)
seed = _shared(
    0,
    help="Random seed; the same inputs and seed give byte-identical data outputs.",
    panel=RUN,
)
overwrite = _shared(
    False,
    help="Replace a complete output instead of skipping.",
    panel=RUN,
    run_control=True,
    doc="replace a complete OUT (and discard an unfinished OUT.partial)",
)
quiet = _shared(
    False,
    help="No progress bars (ovkit's, nor those of transformers, huggingface_hub and datasets).",
    panel=RUN,
    run_control=True,
    doc=("no progress bar and no notes on stderr (transformers', huggingface_hub's and datasets' bars included)"),
)
shard = _shared(
    help="Process only part I of N ('I/N', 0-based I), e.g. '3/8'.",
    panel=RUN,
    doc="`I/N`: pack only the I-th of N equal contiguous parts of DATA, independently",
)
on_error = _shared(
    "fail",
    help="fail: stop at the first bad row; skip: move bad rows to OUT/rejects.parquet.",
    panel=RUN,
    choices=("fail", "skip"),
)
trust_remote_code = _shared(
    False,
    help="Allow model code from the model directory (e.g. LLaVA-OneVision-1.5).",
    panel=RUNTIME,
    run_control=True,
)
precision = _shared(
    "auto",
    help="auto (bf16-mixed on a bf16 GPU, else fp32) | fp32 | bf16-mixed (bf16 compute, fp32 master weights) | "
    "bf16-true (pure bf16). Aliases: bf16 = bf16-mixed, 32 = fp32.",
    panel=RUNTIME,
    choices=(*PRECISIONS, *PRECISION_ALIASES),
    doc=(
        "the learner's: `auto` (bf16-mixed on a GPU with bf16, else fp32), `fp32`, `bf16-mixed` (bf16 weights"
        " in compute, fp32 master weights, gradients and AdamW state: no per-op casts), `bf16-true` (pure "
        "bf16); `bf16` = bf16-mixed, `32` = fp32 (ovkit.models.precision)"
    ),
)
attn_implementation = _shared(
    "auto",
    help="auto (flash_attention_2 on CUDA with flash-attn, else sdpa) | sdpa | flash_attention_2 | flex_attention | "
    "eager. The ViT attends varlen (one call per layer) except with eager.",
    panel=RUNTIME,
    choices=ATTENTION,
    doc=(
        "`auto` (flash_attention_2 on CUDA with flash-attn installed, else sdpa), `sdpa`, "
        "`flash_attention_2`, `flex_attention`, `eager`; the vision tower attends varlen, one call per layer "
        "(except `eager`); a missing kernel falls back to sdpa with one warning; the choice used is in "
        "ovkit.json `runtime.attention`"
    ),
)
optim = _shared(
    "adamw_torch_fused",
    help="adamw_torch_fused (fused AdamW; foreach where fused is unsupported) | adamw_torch (foreach) | adamw_8bit "
    "(bitsandbytes 8-bit state) | adamw_bf16 (bf16 weights and state with Kahan-compensated updates; implies "
    "--precision bf16-true).",
    panel=RUNTIME,
    choices=OPTIMS,
    doc=(
        "the AdamW implementation (transformers' Trainer names; EasyR1's for the last): `adamw_torch_fused` "
        "(torch's fused kernel, foreach where it is unsupported), `adamw_torch` (foreach), `adamw_8bit` "
        "(bitsandbytes' block-wise 8-bit state, CPU or CUDA; `pip install 'ovkit[qlora]'`; with bf16-mixed it"
        " runs over fp32 weights under bf16 autocast, no master copy), `adamw_bf16` (bf16 weights, m, v and a"
        " Kahan compensation buffer, 10 bytes per parameter, deterministic; implies `--precision bf16-true`, "
        "refused with fp32 or bf16-mixed). The precision x optimiser table and what each costs: "
        "ovkit.runtime.optim; the measured bytes per parameter are in ovkit.json `runtime.bytes_per_param`"
    ),
)
optimizer_in_backward = _shared(
    False,
    help="Step each parameter's optimiser inside backward, as soon as its gradient is complete, and free that gradient "
    "(torchtune's optimizer_in_bwd): the same weights as without it, no gradient memory (bf16-true + adamw_bf16: 8 "
    "bytes per parameter, not 10). Needs --max-grad-norm 0, --grad-accum 1 and one process; not in rl-train.",
    panel=RUNTIME,
    doc=(
        "one optimiser per trainable parameter (the same `--optim`, lr, weight decay, masters or Kahan "
        "compensation), stepped from a post-accumulate-grad hook as soon as the parameter's gradient is complete, "
        "the gradient freed right after (torchtune's `optimizer_in_bwd`; ovkit.runtime.optim.OptimizerInBackward): "
        "the same weights bit for bit, and gradients cost ~0 bytes per parameter (ovkit.json "
        "`runtime.bytes_per_param`). Exact only where each step needs nothing but its own parameter's complete "
        "gradient, so it exits 2 with `--max-grad-norm` > 0 (clipping needs the global norm first; the norm is "
        "still logged), `--grad-accum` > 1, several processes (DDP/FSDP reduce gradients after the hook) and in "
        "rl-train (its step spans several backward passes). A resumed run keeps it (the optimiser state is saved "
        "per parameter)"
    ),
)
activation_checkpointing = _shared(
    "auto",
    help="Recompute activations in backward, in the LLM's decoder layers and the ViT's blocks alike: off | full (every "
    "block) | every-K (every K-th block) | mlp (only each block's MLP) | auto (off on CPU; on CUDA full when a "
    "micro-batch's estimated activations exceed the memory free after weights and optimiser state). Less memory, more "
    "time; the same gradients.",
    panel=RUNTIME,
    run_control=True,
    doc=(
        "recompute activations in backward, in the LLM's decoder layers and the ViT's blocks alike "
        "(`ovkit.runtime.checkpointing`): `off`; `full` (every block keeps only its input); `every-K` (the "
        "K-th, 2K-th, ... block, torchtitan's selective layer checkpointing); `mlp` (only each block's MLP: "
        "its wide intermediate activations are recomputed, attention keeps what it saved); `auto`: off on "
        "CPU, on CUDA `full` when a learner micro-batch's (--micro-batch-size x (longest prompt + "
        "--max-new-tokens)) estimated activations (bytes per token per block measured by "
        "`bench/activation_bytes.py` x tokens x blocks) exceed the memory free after weights and optimiser "
        "state, else off. The gradients are the same; the mode used and why are in ovkit.json "
        "`runtime.activation_checkpointing`; it may change on `--resume`"
    ),
)
gradient_checkpointing = _shared(
    False,
    help="TRL/HF's spelling of --activation-checkpointing full.",
    panel=RUNTIME,
    run_control=True,
)
compile = _shared(
    False,
    help="torch.compile each decoder layer and vision block (after activation checkpointing; symbolic shapes, the "
    "attention's varlen planning left eager). The same losses within float tolerance; pays off after the first steps' "
    "compilation.",
    panel=RUNTIME,
    run_control=True,
    doc=(
        "`torch.compile` each decoder layer and vision block (`ovkit.runtime.compiling`, torchtitan's "
        "per-block compile) with symbolic shapes, after activation checkpointing (a checkpointed block's "
        "checkpoint calls the compiled block); the learner attention's varlen planning stays eager (one graph"
        " break per attention call); generation with a KV cache and the asynchronous sampler's copy run "
        "eager. The same losses as eager within float tolerance, so it may change on `--resume`; compiled "
        "blocks, graphs, graph breaks and compiled frames are in ovkit.json `runtime.compile`. The first "
        "steps pay the compilation (about 30-60 s for the tiny model on 2 CPU cores: BENCHMARKS.md)"
    ),
)
kernels = _shared(
    "auto",
    help="auto (liger on CUDA when liger-kernel is installed, else torch) | liger (Liger-Kernel: fused RMSNorm, SwiGLU "
    "and RoPE in the model, fused linear cross-entropy for the supervised loss; CUDA only) | torch (PyTorch ops; the "
    "loss's chunked head).",
    panel=RUNTIME,
    run_control=True,
    doc=(
        "`liger`: Liger-Kernel's Triton kernels (CUDA only; `pip install 'ovkit[liger]'`): RMSNorm, SwiGLU "
        "and RoPE patched into the model, (rl-train's token log-probs keep ovkit's chunked head: Liger's "
        "fused loss returns a reduced loss, not per-token log-probs); `torch`: PyTorch ops and the chunked "
        "head; `auto`: liger on CUDA when liger-kernel is installed, else torch. `liger` on a machine without"
        " CUDA or without the package exits 2. What was applied is in ovkit.json `runtime.kernels`"
    ),
)
use_liger_kernel = _shared(False, help="TRL/HF's spelling of --kernels liger.", panel=RUNTIME, run_control=True)
# LoRA (ovkit.models.lora) on every training command.
lora_r = _shared(
    0,
    min=0,
    help="LoRA rank: train low-rank adapters on the selection's attention/MLP projections instead of every weight (0: "
    "full fine-tuning).",
    panel=LORA,
    doc=(
        "LoRA rank: low-rank adapters (peft) on the attention/MLP projections of the selection instead of "
        "full fine-tuning; the projector, when selected, still trains in full; OUT holds the merged model and"
        " OUT/adapter/ the adapter (`peft.PeftModel.from_pretrained`)"
    ),
)
lora_alpha = _shared(
    16.0,
    gt=0,
    help="LoRA scale alpha (the update is alpha / r x B A).",
    panel=LORA,
)
lora_dropout = _shared(0.0, help="Dropout on the LoRA branch.", panel=LORA, min=0, lt=1)
lora_targets = _shared(
    help="Regex over module names to adapt instead of the per-architecture default; repeatable.",
    panel=LORA,
)
load_in_4bit = _shared(
    False,
    help="QLoRA: load the language model's Linear weights in 4-bit NF4 (bitsandbytes) and train LoRA adapters on them; "
    "needs --lora-r > 0.",
    panel=LORA,
    doc=(
        "QLoRA: the language model's Linear weights load as 4-bit NF4 with double quantisation (bitsandbytes,"
        " CPU or CUDA; `pip install 'ovkit[qlora]'`), the vision tower, projector and head stay full "
        "precision, and the `--lora-r` adapters train on top; OUT holds the merged model with the dequantised"
        " base (a plain checkpoint) and OUT/adapter/ the adapter, which applies to the 4-bit base too. Not in"
        " rl-train: its learner scores in eval mode, where bitsandbytes' CPU path repacks the weights"
    ),
)
# Checkpoints of the learners (align, midtrain, sft, rl-train): run control.
save_every = _shared(
    0,
    min=0,
    help="Write a resumable checkpoint every N steps into OUT.partial/checkpoints (0: only the final model).",
    panel=CHECKPOINTS,
    run_control=True,
)
keep_checkpoints = _shared(
    2,
    min=1,
    help="Keep the newest N intermediate checkpoints.",
    panel=CHECKPOINTS,
    run_control=True,
)
resume = _shared(
    False,
    help="Continue the unfinished run in OUT.partial/ from its last checkpoint (starts fresh if there is none).",
    panel=CHECKPOINTS,
    run_control=True,
)
report_to = _shared(
    [],
    help="Experiment tracker through accelerate: tensorboard, wandb, mlflow or trackio; repeatable (metrics.jsonl is "
    "always written).",
    panel=CHECKPOINTS,
    run_control=True,
    doc=(
        "`tensorboard`, `wandb`, `mlflow`, `trackio` (repeatable): accelerate's experiment trackers, offline "
        "where they allow (TensorBoard in OUT/trackers/, MLflow a file store in OUT/mlruns unless "
        "MLFLOW_TRACKING_URI is set, W&B in OUT/wandb: set WANDB_MODE=offline); metrics.jsonl is always "
        "written"
    ),
)
# Evaluation while training (ovkit.evaluate.during) on align, midtrain, sft and rl-train: run control (evaluation
# restores the RNG, so the trajectory is unchanged).
eval_data = _shared(
    help="Held-out table(s) scored while training, as `ovkit eval` scores them (rows with a gold answer: eval/reward, "
    "eval/accuracy per category; supervised stages also eval/loss on the target turn). Repeatable.",
    panel=EVALUATION,
    run_control=True,
    doc=(
        "held-out table(s) scored while training as `ovkit eval` scores them (answer-mode prompts, greedy, "
        "the learner's weights): `eval/loss` on each row's target (its last assistant turn; a prompt-only "
        "row's `<answer>ANSWER</answer>`), and for rows with a gold `answer` `eval/reward`, `eval/accuracy`, "
        "`eval/reward/<category>`, `eval/accuracy/<category>`; repeatable"
    ),
)
eval_every = _shared(
    0,
    min=0,
    help="Evaluate on --eval-data every N steps and after the last (0: after the last only). Also --eval-steps "
    "(HF/TRL). Run control: the training trajectory is unchanged.",
    panel=EVALUATION,
    flags=("--eval-steps",),
    run_control=True,
    doc=(
        "evaluate every N steps and after the last (0: after the last only); also `--eval-steps` (HF/TRL). "
        "Run control: the rewards, losses and weights are bit-identical with and without it"
    ),
)
eval_limit = _shared(
    min=1,
    help="At most this many --eval-data rows per category (the first ones, as `ovkit eval --limit`).",
    panel=EVALUATION,
    run_control=True,
)
eval_max_new_tokens = _shared(
    min=1,
    help="Generation budget of the eval. Default: per category, from its longest gold answer (as `ovkit eval`).",
    panel=EVALUATION,
    run_control=True,
    doc=("the eval's generation budget (default: `ovkit eval`'s, from the category's longest gold answer)"),
)
# Multi-turn rollouts (ovkit.envs, ovkit.rollouts.episodes) on rl-train, rl-curate, eval and mismatch-report.
env = _shared(
    help="Multi-turn rollouts with an environment: zoom, verifier, or package.module:factory (see "
    "docs/environments.md).",
    panel=MULTI_TURN,
    doc=(  # the page links the guide
        "multi-turn rollouts with an environment: `zoom`, `verifier` or `package.module:factory` "
        "([docs/environments.md](../docs/environments.md))"
    ),
)
env_arg = _shared(
    help="Environment argument key=value (repeatable), e.g. --env-arg max_attempts=3.",
    panel=MULTI_TURN,
    doc=(
        "environment argument `key=value`, value parsed as YAML (repeatable); in a config file a mapping "
        "`env-arg: {key: value}`"
    ),
)
max_turns = _shared(
    3,
    help="Multi-turn: assistant turns at most (then the rollout ends as max_turns).",
    panel=MULTI_TURN,
)
max_response_tokens = _shared(
    help="Multi-turn: token budget after the prompt, sampled + observation tokens (then truncated).",
    panel=MULTI_TURN,
)
env_retries = _shared(
    2,
    help="Multi-turn: extra tries of an environment call that raised or timed out (then env_error).",
    panel=MULTI_TURN,
)
env_timeout = _shared(
    30.0,
    help="Multi-turn: seconds per environment call.",
    panel=MULTI_TURN,
)
# Sampling (ovkit.generate, ovkit.rollouts) on eval, rl-curate, rl-train, mismatch-report and caption. Each command
# passes its default, and its own panel where it groups them otherwise (eval: Generation, caption: Captioning,
# mismatch-report: Fresh rollouts / Learner). What differs per command is said in its `doc`; a command overrides the
# `help` only where --help must say more: a default computed at run time (eval, mismatch-report: the dataclass has
# None) or a value only it accepts (rl-train's vllm-server engine).
engine = _shared(
    "hf",
    help="hf (transformers generate, any device: the GPU when there is one) or vllm (a colocated vLLM engine).",
    panel=RUNTIME,
    doc=(
        "`hf`: transformers `generate` on left-padded batches, any device (CUDA when available); `vllm`: a "
        "colocated vLLM engine (`pip install 'ovkit[vllm]'`; without a GPU, vLLM's CPU build: `make setup-vllm`)"
    ),
)
n = _shared(help="Completions sampled per prompt.", panel=SAMPLING, min=1, doc="completions sampled per prompt")
limit = _shared(
    min=1,
    help="At most this many prompt rows per category (the first ones).",
    panel=SAMPLING,
    doc="at most N prompt rows per category (the first ones)",
    default_doc="all",
)
max_new_tokens = _shared(help="Tokens per completion at most.", panel=SAMPLING, min=1)
reward_workers = _shared(
    2,
    min=1,
    help="Processes for the sandboxed scorers (math, svg, code).",
    panel=RUNTIME,
    run_control=True,
)
temperature = _shared(min=0, help="Sampling temperature (0 = greedy).", panel=SAMPLING)
top_p = _shared(
    1.0,
    gt=0,
    max=1,
    help="Nucleus sampling mass (with --temperature > 0).",
    panel=SAMPLING,
)
max_pixels = _shared(
    512 * 512,
    min=0,
    help="Downscale images to at most this many pixels, keeping the aspect ratio (512x512 in the recipe; 0: never).",
    panel=SAMPLING,
    doc=(
        "images (with `--env`: observation images too) downscaled to at most N pixels, keeping the aspect ratio "
        "(the recipe's 512x512; 0: never)"
    ),
)
system_prompt = _shared(
    True,
    help="Prepend 'You are a helpful AI assistant.' (the recipe's system prompt).",
    panel=SAMPLING,
    negatable=True,
)

# Sampler/learner mismatch corrections (ovkit.rl.correction): rl-train applies them; mismatch-report reports what they
# would clip or mask at the same bounds (its panel: "rl-train corrections reported"). A bound means the same on both;
# mismatch-report says in its help or doc where what it does with it differs (--behave-cap 0, the veto). Only rl-train
# has --correction, --behave-action and --behave-level, and AReaL's spelling --behav-imp-weight-cap.
correction_threshold = _shared(
    2.0,
    gt=0,
    help="C: upper truncation (TIS) or rejection (MIS) bound of the sampler/learner ratio.",
    panel=CORRECTIONS,
    flags=("--rollout-is-threshold",),
    doc=(
        "`C`, the upper bound of the sampler/learner ratio: `token-tis` / `seq-tis` truncate at it, `token-mis` / "
        "`seq-mis` mask above it (verl's `rollout_is_threshold`)"
    ),
)
correction_lower = _shared(
    min=0,
    help="Lower bound of the ratio (MIS masks below it, TIS clamps to it).",
    panel=CORRECTIONS,
    doc="lower bound of the ratio: `token-mis` / `seq-mis` mask below it, `token-tis` / `seq-tis` clamp to it",
)
geo_lower = _shared(
    0.999,
    help="geo-rs: lower bound on the geometric-mean ratio.",
    panel=CORRECTIONS,
    doc="`geo-rs`: sequences whose geometric-mean ratio is below it are masked (the default: verl's Geo-RS preset)",
)
geo_upper = _shared(
    1.001,
    help="geo-rs: upper bound on the geometric-mean ratio.",
    panel=CORRECTIONS,
    doc="`geo-rs`: sequences whose geometric-mean ratio is above it are masked (the default: verl's Geo-RS preset)",
)
behave_cap = _shared(
    5.0,
    min=0,
    help="Cap of the behaviour weight exp(prox - behave) (0: no cap).",
    panel=CORRECTIONS,
    doc=(
        "cap of decoupled PPO's behaviour weight `exp(prox - behave)`, the outer guard of every correction: "
        "`--behave-action` says what happens above it (0: no cap)"
    ),
)
veto_threshold = _shared(
    help="Mask a whole sequence if any token ratio is below this.",
    panel=CORRECTIONS,
    flags=("--rollout-token-veto-threshold",),
    doc=(
        "per-token veto: a sequence with any token ratio below it is masked whole (verl's "
        "`rollout_token_veto_threshold`)"
    ),
)

SHARED = {
    name: fn for name, fn in globals().items() if getattr(fn, "__qualname__", "").startswith("_shared.")
}  # {field name: its declaration}, for the converter and the pages


# -- the groups several commands share (a stage config holds them: `loading: ModelLoading = group(...)`) -------------
# A command whose wording or default differs declares a subclass with the field redeclared (sft's --precision page
# text, rl-train's --save-every 250); a redeclared field keeps its place in the group.


@dataclasses.dataclass
class ModelLoading:
    """How a command loads a model and computes with it (align, midtrain, sft, rl-train, eval, caption, rl-curate,
    mismatch-report). A new model-loading option is one field here (and its use where the model loads): every such
    command, its --help, YAML keys, validation and page get it. Listed after a command's own options."""

    precision: str = precision()
    attn_implementation: str = attn_implementation()
    trust_remote_code: bool = trust_remote_code()


@dataclasses.dataclass
class GeneratorLoading(ModelLoading):
    """Model loading for a command that only generates with the model (eval, caption): --precision on its page is
    the weights' compute precision, without a learner's master weights."""

    precision: str = precision(
        doc=(
            "the weights' compute precision: `auto` (bf16 on a GPU with bf16, else fp32), `fp32`, `bf16-true` / "
            "`bf16-mixed` (bf16 weights); `bf16` = bf16-mixed, `32` = fp32"
        )
    )


@dataclasses.dataclass
class Optimiser:
    """Which AdamW implementation a learner steps with, and when (ovkit.runtime.optim); the learning rate and its
    schedule are the stage's own options."""

    optim: str = optim()
    optimizer_in_backward: bool = optimizer_in_backward()


@dataclasses.dataclass
class Compute:
    """How a learner computes the same numbers: activation checkpointing, compilation, kernels (memory and speed)."""

    activation_checkpointing: str = activation_checkpointing()
    gradient_checkpointing: bool = gradient_checkpointing()
    compile: bool = compile()
    kernels: str = kernels()
    use_liger_kernel: bool = use_liger_kernel()


@dataclasses.dataclass
class Lora:
    """LoRA adapters instead of full fine-tuning (ovkit.models.lora)."""

    lora_r: int = lora_r()
    lora_alpha: float = lora_alpha()
    lora_dropout: float = lora_dropout()
    lora_targets: list[str] | None = lora_targets(default_doc="per architecture")


@dataclasses.dataclass
class Checkpoints:
    """When a learner checkpoints, how many it keeps, whether it resumes, and when it gives up on a diverging run."""

    save_every: int = save_every()
    keep_checkpoints: int = keep_checkpoints()
    resume: bool = resume()
    max_nonfinite_steps: int = option(
        3,
        min=1,
        help="Stop the run (exit 2) after N optimiser steps in a row with a non-finite loss or gradient norm; each "
        "such step is skipped (not applied).",
        panel=CHECKPOINTS,
        run_control=True,
        doc=(
            "a step whose loss or gradient norm is not finite is not applied (weights and optimiser state unchanged); "
            "after N in a row the run stops with exit 2 naming the step, the loss and the usual causes (`--lr`, "
            "`--precision`), the newest checkpoint from before the divergence stays in `OUT.partial/` for `--resume` "
            "(which may then lower `--lr`), and OUT is not written"
        ),
    )


@dataclasses.dataclass
class Trackers:
    """Where a learner reports its metrics besides metrics.jsonl."""

    report_to: list[str] = report_to()


@dataclasses.dataclass
class EvalDuring:
    """Evaluation while training (ovkit.evaluate.during)."""

    eval_data: list[Path] | None = eval_data()
    eval_every: int = eval_every()
    eval_limit: int | None = eval_limit(default_doc="all")
    eval_max_new_tokens: int | None = eval_max_new_tokens(default_doc="per category")

    def check(self) -> None:
        """The options are consistent (messages name the flags; each one's range is declared on its field), and
        --eval-data a list of paths."""
        data = self.eval_data
        if data:
            self.eval_data = [Path(p) for p in (data if isinstance(data, (list, tuple)) else [data])]
        elif self.eval_every:
            raise OvkitError("--eval-every needs --eval-data (the held-out rows to evaluate on)")


@dataclasses.dataclass
class MultiTurnOptions:
    """Multi-turn rollouts with an environment (ovkit.envs, ovkit.rollouts.episodes)."""

    env: str | None = env()
    env_arg: Any = env_arg()
    max_turns: int = max_turns()
    max_response_tokens: int | None = max_response_tokens()
    env_retries: int = env_retries()
    env_timeout: float = env_timeout()
