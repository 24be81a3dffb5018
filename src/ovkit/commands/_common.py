"""Options every command shares and the one helper that turns a typer context into a stage config."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import typer

from ovkit.config import CLI_ONLY, load_yaml, merge

T = TypeVar("T")

# Declared once so every command spells them the same way. Required inputs are declared optional here and checked
# by the stage config, so that they can come from --config as well as from the command line.
CONFIG = typer.Option(None, "--config", help="YAML file of option values (keys = option names); flags override it.")
OUT = typer.Option(None, "--out", help="Output directory (written atomically: complete or absent).")
SEED = typer.Option(0, "--seed", help="Random seed; the same inputs and seed give byte-identical data outputs.")
OVERWRITE = typer.Option(False, "--overwrite", help="Replace a complete output instead of skipping.")
QUIET = typer.Option(False, "--quiet", help="No progress bars.")
SHARD = typer.Option(None, "--shard", help="Process only part I of N ('I/N', 0-based I), e.g. '3/8'.")
# Every command that loads a model: how it computes (ovkit.runtime.precision, ovkit.runtime.attention).
PRECISION = typer.Option("auto", "--precision", help="auto (bf16-mixed on a bf16 GPU, else fp32) | fp32 | bf16-mixed (bf16 compute, fp32 master weights) | bf16-true (pure bf16). Aliases: bf16 = bf16-mixed, 32 = fp32.")
ATTN_IMPLEMENTATION = typer.Option("auto", "--attn-implementation", help="auto (flash_attention_2 on CUDA with flash-attn, else sdpa) | sdpa | flash_attention_2 | flex_attention | eager. The ViT attends varlen (one call per layer) except with eager.")
# LoRA (ovkit.runtime.lora) on every training command.
LORA_R = typer.Option(0, "--lora-r", help="LoRA rank: train low-rank adapters on the selection's attention/MLP projections instead of every weight (0: full fine-tuning).")
LORA_ALPHA = typer.Option(16.0, "--lora-alpha", help="LoRA scale alpha (the update is alpha / r x B A).")
LORA_DROPOUT = typer.Option(0.0, "--lora-dropout", help="Dropout on the LoRA branch.")
LORA_TARGETS = typer.Option(None, "--lora-targets", help="Regex over module names to adapt instead of the per-architecture default; repeatable.")
ON_ERROR = typer.Option("fail", "--on-error", help="fail: stop at the first bad row; skip: move bad rows to OUT/rejects.parquet.")


def resolve(ctx: typer.Context, cls: type[T]) -> T:
    """Build the stage config `cls` from this command's options: command line > --config file > defaults."""
    params: dict[str, Any] = dict(ctx.params)
    config_path = params.get("config")
    file_values = load_yaml(Path(config_path)) if config_path else {}
    # Compared by name: typer may ship its own copy of click's ParameterSource enum.
    from_cli = {name for name in params if getattr(ctx.get_parameter_source(name), "name", "") in ("COMMANDLINE", "ENVIRONMENT")}
    cli_values = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items() if k not in CLI_ONLY}
    for name in list(cli_values):  # an unset multi-value option arrives as (): treat it as "not given"
        if name not in from_cli and cli_values[name] == []:
            cli_values[name] = None
    return merge(cls, cli_values, from_cli, file_values, Path(config_path) if config_path else None)


def done(msg: str) -> None:
    """The one-line summary every command prints on stdout at the end."""
    typer.echo(msg)


def skipped(out: Path) -> None:
    typer.echo(f"{out} is complete; skipped (use --overwrite to redo it)")

# Multi-turn rollouts (ovkit.envs, ovkit.rollouts.episodes): the same six options on rl-train, rl-curate and eval.
ENV = typer.Option(None, "--env", help="Multi-turn rollouts with an environment: zoom, verifier, or package.module:factory (see docs/environments.md).")
ENV_ARG = typer.Option(None, "--env-arg", help="Environment argument key=value (repeatable), e.g. --env-arg max_attempts=3.")
MAX_TURNS = typer.Option(3, "--max-turns", help="Multi-turn: assistant turns at most (then the rollout ends as max_turns).")
MAX_RESPONSE_TOKENS = typer.Option(None, "--max-response-tokens", help="Multi-turn: token budget after the prompt, sampled + observation tokens (then truncated).")
ENV_RETRIES = typer.Option(2, "--env-retries", help="Multi-turn: extra tries of an environment call that raised or timed out (then env_error).")
ENV_TIMEOUT = typer.Option(30.0, "--env-timeout", help="Multi-turn: seconds per environment call.")
