"""The shared config helper: command line > --config file > defaults; unknown keys are named."""

from dataclasses import dataclass
from pathlib import Path

import typer
import yaml
from typer.testing import CliRunner

from ovkit.commands._common import CONFIG, OUT, SEED, resolve
from ovkit.errors import OvkitError


@dataclass
class ToyConfig:
    out: Path | None = None
    lr: float = 1e-3
    steps: int = 10
    seed: int = 0
    names: list[str] | None = None


def toy_app(seen: list) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    def toy(
        ctx: typer.Context,
        out: Path = OUT,
        lr: float = typer.Option(1e-3, "--lr"),
        steps: int = typer.Option(10, "--steps"),
        seed: int = SEED,
        names: list[str] = typer.Option(None, "--names"),
        config: Path = CONFIG,
    ) -> None:
        try:
            seen.append(resolve(ctx, ToyConfig))
        except OvkitError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)

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
