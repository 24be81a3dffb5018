"""The shared config helper: command line > --config file > defaults; unknown keys are named; every value converts by
its field's declared type or the error names the key, the file and the type."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from ovkit import options as O
from ovkit.commands._common import built_from, resolve
from ovkit.config import load_yaml, merge
from ovkit.errors import OvkitError
from ovkit.options import option


@dataclass
class ToyConfig:
    out: Path | None = O.out()
    lr: float = option(1e-3, help="Learning rate.")
    steps: int = option(10, help="Steps.")
    seed: int = O.seed()
    names: list[str] | None = option(None, help="Names.")


def toy_app(seen: list) -> typer.Typer:
    app = typer.Typer()

    def toy(ctx: typer.Context) -> None:
        try:
            seen.append(resolve(ctx, ToyConfig))
        except OvkitError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e

    app.command()(built_from(toy, ToyConfig))  # the command built from the config, as ovkit's
    return app


def run(args, tmp_path, file_values=None):
    seen = []
    if file_values is not None:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump(file_values))
        args = [*args, "--config", str(cfg)]
    result = CliRunner().invoke(toy_app(seen), args)
    return result, (seen[0] if seen else None)


def test_defaults_when_nothing_given(tmp_path):
    _, cfg = run([], tmp_path)
    assert cfg == ToyConfig(lr=1e-3, steps=10, seed=0)


def test_file_overrides_defaults_and_flags_override_file(tmp_path):
    _, cfg = run(["--steps", "7"], tmp_path, {"lr": 0.5, "steps": 3, "out": "x"})
    assert cfg.lr == 0.5 and cfg.steps == 7 and cfg.out == Path("x")


def test_flag_equal_to_default_still_overrides_file(tmp_path):
    _, cfg = run(["--steps", "10"], tmp_path, {"steps": 3})
    assert cfg.steps == 10


def test_dashed_keys_and_lists(tmp_path):
    _, cfg = run([], tmp_path, {"names": ["a", "b"], "seed": 4})
    assert cfg.names == ["a", "b"] and cfg.seed == 4


def test_unknown_key_is_named(tmp_path):
    result, cfg = run([], tmp_path, {"lr": 0.1, "learning-rate": 0.2})
    assert cfg is None and result.exit_code == 2
    assert "unknown key 'learning_rate'" in result.output


def test_bad_yaml_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1, 2\n")
    seen = []
    result = CliRunner().invoke(toy_app(seen), ["--config", str(bad)])
    assert result.exit_code == 2 and "not valid YAML" in result.output


# -- every value converts by its field's declared type (ovkit.config.convert) ------------------------------------


@dataclass
class TypedConfig:
    lr: float = 1e-3
    steps: int = 10
    flag: bool = False
    name: str = "x"
    path: Path | None = None
    paths: list[Path] | None = None
    maybe: float | None = None
    extra: Any = None


def test_yaml_1_1_scientific_floats_and_quoted_numbers_convert(tmp_path):
    # PyYAML (YAML 1.1) reads 1e-3 as the string '1e-3': the field's type decides.
    text = "lr: 1e-3\nsteps: '12'\nflag: 'yes'\nname: 32\npath: out\npaths: one\nmaybe: 2\nextra: {a: 1}\n"
    (tmp_path / "run.yaml").write_text(text)
    cfg = merge(TypedConfig, {}, set(), load_yaml(tmp_path / "run.yaml"), tmp_path / "run.yaml")
    assert cfg == TypedConfig(
        lr=0.001, steps=12, flag=True, name="32", path=Path("out"), paths=[Path("one")], maybe=2.0, extra={"a": 1}
    )
    assert type(cfg.lr) is float and type(cfg.maybe) is float


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("lr", "abc", "a float"),
        ("steps", "2.5", "an integer"),
        ("steps", True, "an integer"),
        ("flag", "maybe", "true or false"),
        ("name", [1], "a string"),
        ("paths", {"a": 1}, "a list of paths"),
        ("lr", None, "a float"),
    ],
)
def test_a_value_that_does_not_convert_names_key_file_and_type(tmp_path, key, value, expected):
    path = tmp_path / "run.yaml"
    with pytest.raises(OvkitError) as e:
        merge(TypedConfig, {}, set(), {key: value}, path)
    assert (
        str(e.value)
        == f"config file {path}: key '{key}' must be {expected}, got {'null' if value is None else repr(value)}"
    )


def test_untyped_flag_values_go_through_the_same_rule():
    # a value typer hands over as text (a str option) still becomes the field's type, or names the flag
    assert merge(TypedConfig, {"lr": "1e-4"}, {"lr"}, {}).lr == 1e-4
    with pytest.raises(OvkitError, match=r"^option --lr must be a float, got 'fast'$"):
        merge(TypedConfig, {"lr": "fast"}, {"lr"}, {})


@pytest.mark.parametrize("command", ["sft", "rl-train"])
def test_bad_value_in_a_real_config_is_a_usage_error_naming_it(cli, tmp_path, command):
    (tmp_path / "run.yaml").write_text("lr: 1e-3\nmax-grad-norm: big\n")
    code, _, err = cli(
        command,
        tmp_path / "data",
        "--model",
        tmp_path / "m",
        "--out",
        tmp_path / "o",
        "--config",
        tmp_path / "run.yaml",
    )
    assert code == 2
    assert err.strip() == f"error: config file {tmp_path / 'run.yaml'}: key 'max_grad_norm' must be a float, got 'big'"


def test_scientific_lr_in_a_real_config_reaches_the_stage(tmp_path):
    from ovkit.rl.config import RLTrainConfig
    from ovkit.train import SFTConfig

    (tmp_path / "run.yaml").write_text("lr: 1e-3\n")
    io = {"data": [Path("d")], "model": Path("m"), "out": Path("o")}
    for cls in (SFTConfig, RLTrainConfig):
        assert merge(cls, io, set(io), load_yaml(tmp_path / "run.yaml"), tmp_path / "run.yaml").lr == 0.001


@pytest.mark.parametrize("flag, key", [("max_steps", "epochs"), ("epochs", "max_steps")])
def test_a_flag_replaces_the_files_other_half_of_an_exclusive_pair(tmp_path, flag, key):
    from ovkit.rl.config import RLTrainConfig
    from ovkit.train import SFTConfig

    (tmp_path / "run.yaml").write_text(f"{key}: 3\nlr: 1e-3\n")
    typed = {"data": [Path("d")], "model": Path("m"), "out": Path("o"), flag: 5}
    for cls in (SFTConfig, RLTrainConfig):
        cfg = merge(cls, typed, set(typed), load_yaml(tmp_path / "run.yaml"), tmp_path / "run.yaml")
        assert getattr(cfg, flag) == 5 and getattr(cfg, key) is None and cfg.lr == 1e-3  # the rest of the file holds
        with pytest.raises(OvkitError, match="give --max-steps or --epochs, not both"):  # both typed: still an error
            merge(cls, {**typed, key: 3}, {*typed, key}, {})


@pytest.mark.parametrize("command", ["sft", "rl-train"])
def test_max_steps_flag_over_a_config_with_epochs_is_no_usage_error(cli, tmp_path, command):
    (tmp_path / "run.yaml").write_text("epochs: 3\n")
    code, _, err = cli(
        command,
        tmp_path / "data",
        "--model",
        tmp_path / "m",
        "--out",
        tmp_path / "o",
        "--config",
        tmp_path / "run.yaml",
        "--max-steps",
        "1",
    )
    assert "not both" not in err and "data" in err  # gets as far as the missing DATA
