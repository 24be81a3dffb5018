"""One way to build a stage's config: YAML supplies values, command-line flags override them.

Keys in the YAML file are option names (`max-len` or `max_len`); a key that is not an option of the command is an
error naming it. The resolved config is written next to the output as `config.yaml` so a run can be repeated with
`--config OUT/config.yaml`.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from ovkit.errors import OvkitError

# Options that steer the CLI itself rather than the stage; never part of a stage config or of config.yaml.
CLI_ONLY = frozenset({"config"})


def load_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise OvkitError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise OvkitError(f"config file {path} is not valid YAML: {e}") from None
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
) -> Any:
    """Build `cls` from values given on the command line (`from_cli` names those the user typed), then the file,
    then the dataclass defaults. Unknown file keys are an error naming the key."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(file_values) - names)
    if unknown:
        known = ", ".join("--" + n.replace("_", "-") for n in sorted(names))
        raise OvkitError(f"config file {config_path}: unknown key '{unknown[0]}' (this command's options: {known})")
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name in names:
        if name in from_cli:
            values[name] = cli_values[name]
        elif name in file_values:
            values[name] = _coerce(file_values[name], hints.get(name), name, config_path)
        elif name in cli_values and cli_values[name] is not None:
            values[name] = cli_values[name]  # the option's own default, which may differ from the dataclass's
    try:
        return cls(**values)
    except TypeError as e:
        raise OvkitError(str(e)) from None


def _coerce(value: Any, hint: Any, name: str, config_path: Path | None) -> Any:
    """YAML already gives ints, floats, bools and lists; turn strings into Paths and enums where the field wants."""
    if value is None or hint is None:
        return value
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return _coerce(value, args[0], name, config_path)
    if origin in (list, tuple) and args:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(v, args[0], name, config_path) for v in items]
    if hint is Path:
        return Path(value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in hint)
            raise OvkitError(f"config file {config_path}: key '{name}' must be one of {choices}, got {value!r}") from None
    if hint is float and isinstance(value, int):
        return float(value)
    return value


def to_plain(cfg: Any) -> dict[str, Any]:
    """A config as YAML-safe plain values (Paths and enums as strings)."""

    def plain(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {f.name.replace("_", "-"): plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_plain(cfg), sort_keys=False, allow_unicode=True)
