"""Options every command shares, the one helper that turns a typer context into a stage config, and the click
command class that gives every command's --help its defaults, required marks and worked example.

One source of truth for defaults: the stage's config dataclass. Options are declared here and in the command
modules with a default of None and never repeat a value; `resolve` takes what the user typed, then the --config
file, and leaves everything else to the dataclass. `--help` shows the dataclass's defaults (StageCommand reads
them when help is asked for: several config modules import torch, which `ovkit --help` should not pay for).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
from typer.core import TyperCommand

from ovkit.config import CLI_ONLY, load_yaml, merge

F = TypeVar("F", bound=Callable[..., Any])

# Help panels shared by every command (each command adds its own between inputs and run control).
IO = "Inputs/outputs"
RUNTIME = "Runtime/precision"
MULTI_TURN = "Multi-turn"
CHECKPOINTS = "Checkpoints & logging"
RUN = "Run control"

# Declared once so every command spells them the same way. Required inputs are declared optional here and checked
# by the stage config, so that they can come from --config as well as from the command line; `stage(required=...)`
# marks them in --help. No default is repeated here: the stage's dataclass holds them all.
CONFIG = typer.Option(
    None, "--config", help="YAML file of option values (keys = option names); flags override it.", rich_help_panel=IO
)
OUT = typer.Option(
    None,
    "--out",
    "--output-dir",
    help="Output directory (written atomically: complete or absent). Also --output-dir (HF/TRL).",
    rich_help_panel=IO,
)
SEED = typer.Option(
    None, "--seed", help="Random seed; the same inputs and seed give byte-identical data outputs.", rich_help_panel=RUN
)
OVERWRITE = typer.Option(
    None, "--overwrite", help="Replace a complete output instead of skipping.", rich_help_panel=RUN
)
QUIET = typer.Option(
    None,
    "--quiet",
    help="No progress bars (ovkit's, nor those of transformers, huggingface_hub and datasets).",
    rich_help_panel=RUN,
)
SHARD = typer.Option(
    None, "--shard", help="Process only part I of N ('I/N', 0-based I), e.g. '3/8'.", rich_help_panel=RUN
)
# Every command that loads a model: how it computes (ovkit.runtime.precision, ovkit.runtime.attention).
PRECISION = typer.Option(
    None,
    "--precision",
    help="auto (bf16-mixed on a bf16 GPU, else fp32) | fp32 | bf16-mixed (bf16 compute, fp32 master weights) | bf16-true (pure bf16). Aliases: bf16 = bf16-mixed, 32 = fp32.",
    rich_help_panel=RUNTIME,
)
OPTIM = typer.Option(
    None,
    "--optim",
    help="adamw_torch_fused (fused AdamW; foreach where fused is unsupported) | adamw_torch (foreach) | adamw_8bit (bitsandbytes 8-bit state) | adamw_bf16 (bf16 weights and state with Kahan-compensated updates; implies --precision bf16-true).",
    rich_help_panel=RUNTIME,
)
ATTN_IMPLEMENTATION = typer.Option(
    None,
    "--attn-implementation",
    help="auto (flash_attention_2 on CUDA with flash-attn, else sdpa) | sdpa | flash_attention_2 | flex_attention | eager. The ViT attends varlen (one call per layer) except with eager.",
    rich_help_panel=RUNTIME,
)
ACTIVATION_CHECKPOINTING = typer.Option(
    None,
    "--activation-checkpointing",
    help="Recompute activations in backward, in the LLM's decoder layers and the ViT's blocks alike: off | full (every block) | every-K (every K-th block) | mlp (only each block's MLP) | auto (off on CPU; on CUDA full when a micro-batch's estimated activations exceed the memory free after weights and optimiser state). Less memory, more time; the same gradients.",
    rich_help_panel=RUNTIME,
)
GRADIENT_CHECKPOINTING = typer.Option(
    None,
    "--gradient-checkpointing",
    help="TRL/HF's spelling of --activation-checkpointing full.",
    rich_help_panel=RUNTIME,
)
COMPILE = typer.Option(
    None,
    "--compile",
    help="torch.compile each decoder layer and vision block (after activation checkpointing; symbolic shapes, the attention's varlen planning left eager). The same losses within float tolerance; pays off after the first steps' compilation.",
    rich_help_panel=RUNTIME,
)
KERNELS = typer.Option(
    None,
    "--kernels",
    help="auto (liger on CUDA when liger-kernel is installed, else torch) | liger (Liger-Kernel: fused RMSNorm, SwiGLU and RoPE in the model, fused linear cross-entropy for the supervised loss; CUDA only) | torch (PyTorch ops; the loss's chunked head).",
    rich_help_panel=RUNTIME,
)
USE_LIGER_KERNEL = typer.Option(
    None, "--use-liger-kernel", help="TRL/HF's spelling of --kernels liger.", rich_help_panel=RUNTIME
)
# LoRA (ovkit.runtime.lora) on every training command.
LORA = "LoRA"
LORA_R = typer.Option(
    None,
    "--lora-r",
    help="LoRA rank: train low-rank adapters on the selection's attention/MLP projections instead of every weight (0: full fine-tuning).",
    rich_help_panel=LORA,
)
LORA_ALPHA = typer.Option(
    None, "--lora-alpha", help="LoRA scale alpha (the update is alpha / r x B A).", rich_help_panel=LORA
)
LORA_DROPOUT = typer.Option(None, "--lora-dropout", help="Dropout on the LoRA branch.", rich_help_panel=LORA)
LOAD_IN_4BIT = typer.Option(
    None,
    "--load-in-4bit",
    help="QLoRA: load the language model's Linear weights in 4-bit NF4 (bitsandbytes) and train LoRA adapters on them; needs --lora-r > 0.",
    rich_help_panel=LORA,
)
LORA_TARGETS = typer.Option(
    None,
    "--lora-targets",
    help="Regex over module names to adapt instead of the per-architecture default; repeatable.",
    rich_help_panel=LORA,
)
# Evaluation while training (ovkit.evaluate.during) on align, midtrain, sft and rl-train.
EVALUATION = "Evaluation while training"
EVAL_DATA = typer.Option(
    None,
    "--eval-data",
    help="Held-out table(s) scored while training, as `ovkit eval` scores them (rows with a gold answer: eval/reward, eval/accuracy per category; supervised stages also eval/loss on the target turn). Repeatable.",
    rich_help_panel=EVALUATION,
)
EVAL_EVERY = typer.Option(
    None,
    "--eval-every",
    "--eval-steps",
    help="Evaluate on --eval-data every N steps and after the last (0: after the last only). Also --eval-steps (HF/TRL). Run control: the training trajectory is unchanged.",
    rich_help_panel=EVALUATION,
)
EVAL_LIMIT = typer.Option(
    None,
    "--eval-limit",
    help="At most this many --eval-data rows per category (the first ones, as `ovkit eval --limit`).",
    rich_help_panel=EVALUATION,
)
EVAL_MAX_NEW_TOKENS = typer.Option(
    None,
    "--eval-max-new-tokens",
    help="Generation budget of the eval. Default: per category, from its longest gold answer (as `ovkit eval`).",
    rich_help_panel=EVALUATION,
)
ON_ERROR = typer.Option(
    None,
    "--on-error",
    help="fail: stop at the first bad row; skip: move bad rows to OUT/rejects.parquet.",
    rich_help_panel=RUN,
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """What --help and `resolve` need to know about a command beyond its options."""

    config: type | str  # the stage config dataclass, or "module:Class" to import it only when needed
    example: str  # one worked example, as a user types it on the embedded default
    required: tuple[str, ...] = ()  # inputs the config refuses to go without (from the command line or --config)

    def config_class(self) -> type:
        if isinstance(self.config, type):
            return self.config
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)


def stage(config: type | str, *, example: str, required: Sequence[str] = ()) -> Callable[[F], F]:
    """Declare a command's stage config, worked example and required inputs (read by StageCommand and resolve)."""

    def declare(fn: F) -> F:
        fn.ovkit_stage = Stage(config, example, tuple(required))  # type: ignore[attr-defined]
        return fn

    return declare


def stage_of(command: Any) -> Stage:
    info = getattr(getattr(command, "callback", None), "ovkit_stage", None)
    if info is None:
        raise TypeError(f"command {getattr(command, 'name', command)!r} has no @stage(...) declaration")
    return info


def config_defaults(cls: type) -> dict[str, Any]:
    """Every field's default as the dataclass declares it (default_factory called)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


class StageCommand(TyperCommand):
    """A typer command whose --help ends its description with the worked example, shows the stage config's defaults
    and marks its required inputs. Parsing is untouched: defaults and marks exist only while help is formatted, so
    an option left out still means "the dataclass's value" and an input given in --config satisfies a mark."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        info = stage_of(self)
        self.help = f"{(self.help or '').rstrip()}\n\nExample:\n\n{info.example}"
        self.epilog = (
            "\\[required] inputs may also come from --config FILE; flags given on the command line override the file."
        )

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as e:  # NoSuchOption, of click or of typer's own copy: the nearest option as a question
            if type(e).__name__ == "NoSuchOption" and getattr(e, "possibilities", None):
                best = (difflib.get_close_matches(e.option_name, list(e.possibilities), n=1) or list(e.possibilities))[
                    0
                ]
                e.message, e.possibilities = f"No such option: {e.option_name}. Did you mean {best}?", None
            raise

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            option.rich_help_panel = RUN  # not a panel of its own
        return option

    def format_help(self, ctx: Any, formatter: Any) -> None:
        info = stage_of(self)
        defaults = config_defaults(info.config_class())
        saved = [(param, param.default, param.required) for param in self.params]
        try:
            for param in self.params:
                if defaults.get(param.name) is not None:
                    param.default = defaults[param.name]
                param.required = param.required or param.name in info.required
            super().format_help(ctx, formatter)
        finally:
            for param, default, required in saved:
                param.default, param.required = default, required


def resolve(ctx: typer.Context, cls: type | None = None) -> Any:
    """Build the command's stage config (`@stage`, or `cls`): command line > --config file > dataclass defaults.
    With `quiet`, the progress bars of transformers, huggingface_hub and datasets are off while the command runs."""
    cls = cls or stage_of(ctx.command).config_class()
    config_path = ctx.params.get("config")
    file_values = load_yaml(Path(config_path)) if config_path else {}
    # Only what the user typed counts; an option's own default (None) never shadows the file or the dataclass.
    # Compared by name: typer may ship its own copy of click's ParameterSource enum.
    typed = {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in ctx.params.items()
        if name not in CLI_ONLY
        and getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")
    }
    cfg = merge(
        cls,
        typed,
        set(typed),
        file_values,
        Path(config_path) if config_path else None,
        aliases=option_aliases(ctx.command),
    )
    from ovkit.launch import check

    check(ctx.info_name, cfg)  # under torchrun / accelerate launch: refuse, or take this process's shard
    if getattr(cfg, "quiet", False):  # the libraries' bars too, until the command ends
        from ovkit.progress import silence_library_bars

        ctx.call_on_close(silence_library_bars())
    return cfg


def option_aliases(command: Any) -> dict[str, str]:
    """{other name: field} of a command's options as config-file keys: `--learning-rate` of `lr` is `learning_rate`."""
    aliases = {}
    for param in getattr(command, "params", []):
        for opt in getattr(param, "opts", []):
            key = opt.lstrip("-").replace("-", "_")
            if opt.startswith("--") and key != param.name:
                aliases[key] = param.name
    return aliases


def done(msg: str) -> None:
    """The one-line summary every command prints on stdout at the end."""
    typer.echo(msg)


def skipped(out: Path) -> None:
    typer.echo(f"{out} is complete; skipped (use --overwrite to redo it)")


# Multi-turn rollouts (ovkit.envs, ovkit.rollouts.episodes): the same six options on rl-train, rl-curate, eval and
# mismatch-report.
ENV = typer.Option(
    None,
    "--env",
    help="Multi-turn rollouts with an environment: zoom, verifier, or package.module:factory (see docs/environments.md).",
    rich_help_panel=MULTI_TURN,
)
ENV_ARG = typer.Option(
    None,
    "--env-arg",
    help="Environment argument key=value (repeatable), e.g. --env-arg max_attempts=3.",
    rich_help_panel=MULTI_TURN,
)
MAX_TURNS = typer.Option(
    None,
    "--max-turns",
    help="Multi-turn: assistant turns at most (then the rollout ends as max_turns).",
    rich_help_panel=MULTI_TURN,
)
MAX_RESPONSE_TOKENS = typer.Option(
    None,
    "--max-response-tokens",
    help="Multi-turn: token budget after the prompt, sampled + observation tokens (then truncated).",
    rich_help_panel=MULTI_TURN,
)
ENV_RETRIES = typer.Option(
    None,
    "--env-retries",
    help="Multi-turn: extra tries of an environment call that raised or timed out (then env_error).",
    rich_help_panel=MULTI_TURN,
)
ENV_TIMEOUT = typer.Option(
    None, "--env-timeout", help="Multi-turn: seconds per environment call.", rich_help_panel=MULTI_TURN
)
