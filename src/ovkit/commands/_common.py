"""The builder of every command from its stage config, the one helper that turns a typer context into that config,
and the click command class that gives every command's --help its defaults, required marks and worked example.

One declaration per option: the stage config's dataclass field (ovkit.options.option) holds its type, default, help,
panel, flag spellings and what it accepts. A command module declares only what is special (`@stage`: the config,
a worked example, the required inputs; the body that calls the library); `signature` turns the fields into the
parameters typer reads, as HfArgumentParser / TRL's TrlParser build their parsers from dataclasses. Each option's
CLI default is None, so `resolve` takes what the user typed, then the --config file, and leaves everything else to the
dataclass; `--help` shows the dataclass's defaults. Every command's options are built when it is registered
(`register`, through typer's public `Typer.command`): the stage config modules import neither torch nor transformers,
so `ovkit --help` and a learner's input check stay well under a second (tests/test_cli.py and
tests/test_fast_errors.py hold both to it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
from typer.core import TyperCommand

from ovkit.config import CLI_ONLY, config_defaults, load_yaml, merge
from ovkit.options import IO, RUN, hints, specs

F = TypeVar("F", bound=Callable[..., Any])

CONFIG = typer.Option(
    None, "--config", help="YAML file of option values (keys = option names); flags override it.", rich_help_panel=IO
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


def stage_of_function(fn: Any) -> Stage:
    """The `@stage` declaration of a command function."""
    info = getattr(fn, "ovkit_stage", None)
    if info is None:
        raise TypeError(f"command function {getattr(fn, '__name__', fn)!r} has no @stage(...) declaration")
    return info


def stage_of(command: Any) -> Stage:
    """The `@stage` declaration of a built command (its callback carries it: `functools.wraps` copies it)."""
    info = getattr(getattr(command, "callback", None), "ovkit_stage", None)
    if info is None:
        raise TypeError(f"command {getattr(command, 'name', command)!r} has no @stage(...) declaration")
    return info


def cli_type(hint: Any) -> Any:
    """The type typer parses a field as: its declared type without None (`float | None` -> float). A field typed
    Any or dict (--env-arg) is a repeatable string option (key=value), converted by the config."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return cli_type(rest[0]) if len(rest) == 1 else str
    if hint is Any or hint is dict or origin is dict:
        return list[str]
    return hint


def signature(cls: type) -> tuple[inspect.Signature, dict[str, Any]]:
    """The command function's signature (and annotations) typer reads: `ctx`, one parameter per field of `cls`
    (default None: typer's value when not typed), then --config."""
    types = hints(cls)
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    for name, o in specs(cls).items():
        if o.argument:
            default = typer.Argument(None, help=o.help, show_default=False, metavar=o.metavar)
        else:
            flag = o.cli_name(name) + (f"/--no-{o.cli_name(name)[2:]}" if o.negatable else "")
            default = typer.Option(None, flag, *o.flags, help=o.help, rich_help_panel=o.panel, metavar=o.metavar)
        params.append(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=cli_type(types[name]))
        )
    params.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=CONFIG, annotation=Path))
    return inspect.Signature(params, return_annotation=None), {p.name: p.annotation for p in params}


def built_from(fn: Callable[[typer.Context], Any], cls: type) -> Callable[..., Any]:
    """`fn(ctx)` as the command function typer reads: the signature of `cls`'s options (the body reads them through
    `resolve(ctx)`, so their values as keyword arguments are dropped)."""

    @functools.wraps(fn)
    def command(ctx: typer.Context, **options: Any) -> Any:
        return fn(ctx)

    command.__signature__, command.__annotations__ = signature(cls)  # type: ignore[attr-defined]
    return command


def register(app: typer.Typer, name: str, fn: Callable[[typer.Context], Any]) -> None:
    """Add `fn` (declared with `@stage`) to `app` as command `name`, its options built now from the stage config's
    fields. Every config module is torch-free (tests/test_cli.py checks it), so building them all at start costs
    `ovkit --help` a few tenths of a second and needs only typer's public `Typer.command`."""
    app.command(name, cls=StageCommand)(built_from(fn, stage_of_function(fn).config_class()))


class StageCommand(TyperCommand):
    """A typer command whose --help ends its description with the worked example, shows the stage config's defaults
    and marks its required inputs. Parsing is untouched: defaults and marks exist only while help is formatted, so
    an option left out still means "the dataclass's value" and an input given in --config satisfies a mark.

    Only public surfaces are used: typer builds the options from the signature `register` gives the command function
    (`Typer.command(cls=...)`), and the overrides are click's documented `Command` methods."""

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
    )
    from ovkit.launch import check

    check(ctx.info_name, cfg)  # under torchrun / accelerate launch: refuse, or take this process's shard
    if getattr(cfg, "quiet", False):  # the libraries' bars too, until the command ends
        from ovkit.progress import silence_library_bars

        ctx.call_on_close(silence_library_bars())
    return cfg


def done(msg: str) -> None:
    """The one-line summary every command prints on stdout at the end."""
    typer.echo(msg)


def dropped(command: str, verb: str, counts: dict[str, int], where: str) -> None:
    """The line a stage prints after its summary when it skipped, rejected or truncated rows or samples (#34): how
    many, why, and where they are listed or counted. Nothing when there were none: a run that kept everything says
    nothing more."""
    counts = {why: n for why, n in counts.items() if n}
    if counts:
        detail = ", ".join(f"{n:,} {why}" for why, n in counts.items())
        typer.echo(f"{command}: {verb} {sum(counts.values()):,} ({detail}); {where}")


def skipped(out: Path) -> None:
    typer.echo(f"{out} is complete; skipped (use --overwrite to redo it)")
