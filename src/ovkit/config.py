"""One way to build a stage's config: YAML supplies values, command-line flags override them, the dataclass holds
the defaults (and only it does).

Keys in the YAML file are option names (`max-len` or `max_len`); a key that is not an option of the command is an
error naming it. Every value is converted by the type its dataclass field declares (`convert`, one rule for file
values and flags), and a value that does not convert is an error naming the key, the file and the type. The resolved
config is written next to the output as `config.yaml` so a run can be repeated with
`--config OUT/config.yaml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from ovkit.errors import OvkitError
from ovkit.hub import check_exists, check_model
from ovkit.options import StageConfig, flatten, hints, validate
from ovkit.options import aliases as declared_aliases

# Options that steer the CLI itself rather than the stage; never part of a stage config or of config.yaml.
CLI_ONLY = frozenset({"config"})


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise OvkitError(f"cannot read config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a binary file given as --config
        raise OvkitError(
            f"config file {path} is not UTF-8 text (byte {e.start}); it must be a YAML mapping of option names to "
            f"values"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise OvkitError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OvkitError(f"config file {path} must be a mapping of option names to values, got {type(data).__name__}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def merge(
    cls: type,
    cli_values: Mapping[str, Any],
    from_cli: set[str],
    file_values: Mapping[str, Any],
    config_path: Path | None = None,
) -> StageConfig:
    """Build `cls` from values given on the command line (`from_cli` names those the user typed), then the file,
    then the dataclass defaults: the dataclass is the only place a default is declared. Every value goes through
    `convert` by the field's declared type. A file key may be an option's other name (ovkit.options.aliases, the
    one table of them: `learning_rate` -> `lr`); an unknown key is an error naming it and the nearest option.
    Where `cls.exclusive` pairs options, one typed on the command line replaces the file's whole pair."""
    names = list(flatten(cls))
    file_values = _canonical_keys(file_values, names, declared_aliases(cls), config_path)
    for group in getattr(
        cls, "exclusive", ()
    ):  # `--max-steps 5` over a file with `epochs: 3`: the flag wins, as any flag does
        if from_cli & set(group):
            file_values = {k: v for k, v in file_values.items() if k not in group}
    types = hints(cls)
    values: dict[str, Any] = {}
    for name in names:
        if name in from_cli:
            values[name] = convert(cli_values[name], types.get(name), f"option --{name.replace('_', '-')}")
        elif name in file_values:
            values[name] = convert(file_values[name], types.get(name), f"config file {config_path}: key '{name}'")
    try:
        cfg = cls(**values)
    except TypeError as e:
        raise OvkitError(str(e)) from None
    validate(cfg)  # every declared choice and range, before any model loads
    return cfg


def _canonical_keys(
    values: Mapping[str, Any], names: list[str], aliases: Mapping[str, str], config_path: Path | None
) -> dict[str, Any]:
    """The file's keys as field names: an alias becomes its option's name; an unknown key, or an option given under two
    of its names, is an error (the unknown one names the nearest key: difflib, as click does for options)."""
    out: dict[str, Any] = {}
    spelt: dict[str, str] = {}
    for key, value in values.items():
        name = key if key in names else aliases.get(key)
        if name is None:
            raise OvkitError(f"config file {config_path}: unknown key '{key}'{nearest(key, [*names, *aliases])}")
        if name in out:
            raise OvkitError(f"config file {config_path}: '{spelt[name]}' and '{key}' are the same option; keep one")
        out[name], spelt[name] = value, key
    return out


def nearest(key: str, candidates: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest candidate, or a hint to list the options when none is close."""
    match = difflib.get_close_matches(key, candidates, n=1)
    if match:
        return f"; did you mean '{match[0]}'?"
    return "; keys are the command's option names (see its --help)"


# -- the one typed rule ------------------------------------------------------------------------------------------
# Written here rather than borrowed (pydantic's TypeAdapter, click's types) because the rule must fit YAML 1.1 as
# PyYAML reads it: `1e-3` arrives as the string '1e-3' (YAML 1.1 floats need a dot), `precision: 32` as an int that
# a str field wants as '32', and a lone value where a list is declared means a list of one. pydantic's lax mode
# refuses int -> str, and its messages would need translating into "key 'lr' must be a float".

_TRUE = frozenset({"true", "yes", "on", "y", "1"})
_FALSE = frozenset({"false", "no", "off", "n", "0"})


class _Mismatch(Exception):
    """A value that does not convert to the declared type (turned into an OvkitError naming the key)."""


def convert(value: Any, hint: Any, where: str) -> Any:
    """`value` converted to the declared type `hint` (bool, int, float, str, Path, enums, list[...], X | None;
    Any and dict pass through), or an OvkitError: "<where> must be a float, got 'abc'"."""
    try:
        return _convert(value, hint)
    except _Mismatch:
        raise OvkitError(f"{where} must be {describe(hint)}, got {'null' if value is None else repr(value)}") from None


def _convert(value: Any, hint: Any) -> Any:
    if hint is None or hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if origin in (list, tuple):
        item = args[0] if args else Any
        return [_convert(v, item) for v in (value if isinstance(value, (list, tuple)) else [value])]
    if hint is dict or origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise _Mismatch
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise _Mismatch from None
    convert_scalar = _SCALARS.get(hint)
    return convert_scalar(value) if convert_scalar else value


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise _Mismatch


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            pass  # '1e3' or '2.0': through float, if it is a whole number
    number = _to_float(value)
    if not number.is_integer():
        raise _Mismatch
    return int(number)


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            raise _Mismatch from None
    raise _Mismatch


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `precision: 32`, `lang-ratio: 0.5`
    if isinstance(value, Path):
        return str(value)
    raise _Mismatch


def _to_path(value: Any) -> Path:
    if isinstance(value, (str, Path)) and str(value):
        return Path(value)
    raise _Mismatch


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str, Path: _to_path}
_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a float",
    str: "a string",
    Path: "a path",
    dict: "a mapping",
}


def describe(hint: Any) -> str:
    """The declared type in words, for messages: 'a float', 'a list of paths', 'an integer or null'."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None))  # None is "unset", not worth naming
    if origin in (list, tuple):
        item = describe(args[0]) if args else "value"
        plural = {
            "a string": "strings",
            "a path": "paths",
            "an integer": "integers",
            "a float": "floats",
            "true or false": "booleans",
        }
        return f"a list of {plural.get(item, item)}"
    if origin is dict:
        return "a mapping"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in hint)
    return _NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _plain(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def to_plain(cfg: StageConfig) -> dict[str, Any]:
    """A config as YAML-safe plain values (Paths and enums as strings), keyed by option name (dashes), flat: the
    options held in groups under their own names, in declaration order."""
    return {name.replace("_", "-"): _plain(getattr(cfg, name)) for name in flatten(type(cfg))}


def to_plain_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` ({field name: value}) as to_plain writes them."""
    return {k.replace("_", "-"): _plain(v) for k, v in values.items()}


def dump_yaml(cfg: StageConfig) -> str:
    return yaml.safe_dump(to_plain(cfg), sort_keys=False, allow_unicode=True)


def trajectory_options(cls: type, run_control: frozenset[str]) -> tuple[str, ...]:
    """The options of a learner's config a resumed run must keep: every field except the run-control ones. A name in
    `run_control` that is not a field is a typo that would silently protect nothing, so it fails at import."""
    names = list(flatten(cls))
    unknown = set(run_control) - set(names)
    if unknown:
        raise TypeError(f"{cls.__name__}: run-control names that are not options: {sorted(unknown)}")
    return tuple(n for n in names if n not in run_control)


def config_defaults(cls: type) -> dict[str, Any]:
    """Every field's default as the dataclass declares it (default_factory called): the one reader of declared
    defaults (--help, the pages, a resumed run's missing keys)."""
    out: dict[str, Any] = {}
    for name, flat in flatten(cls).items():
        if flat.field.default is not dataclasses.MISSING:
            out[name] = flat.field.default
        elif flat.field.default_factory is not dataclasses.MISSING:
            out[name] = flat.field.default_factory()
    return out


def option_default(cls: type, name: str) -> Any:
    """A field's declared default (what a config written before the option existed behaved as)."""
    return config_defaults(cls).get(name)


def check_inputs(cfg: StageConfig) -> None:
    """A learner's DATA and --model exist (or name a Hub dataset / model): checked with the options, so a typo is
    reported in a fraction of a second instead of after torch and transformers import. The Hub is asked only
    when the stage loads them."""
    check_exists(cfg.data, "DATA")
    check_model(cfg.model, "--model")
