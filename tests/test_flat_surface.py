"""Every command's flat option surface, option by option, against the golden file written from the flat configs
before the option groups were composed as fields (tests/data/flat_surface.json): flags, their other spellings, YAML
keys and aliases, type, default, choices, bounds, help, page text, panel, run control, and the options a resumed run
must keep. Composing groups changes how configs are declared, never what a user types, reads or resumes.

Regenerate only for a deliberate change of the surface: `python tests/test_flat_surface.py >
tests/data/flat_surface.json` (tests/data/written_config.json: `sft_written` and `rl_written` below, as JSON).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "data" / "flat_surface.json"


def _plain(value):
    from ovkit.config import to_plain_values

    return to_plain_values({"v": value})["v"]


def surface() -> dict:
    """{command: {"options": {name: what the user sees of it}, "order": [...], "trajectory": [...] or None}}."""
    import importlib

    import typer

    from ovkit import cli
    from ovkit.commands._common import stage_of
    from ovkit.config import config_defaults
    from ovkit.options import aliases, hints, specs

    cli._register()
    out = {}
    for command in cli.app.registered_commands:
        cls = stage_of(command).config_class()
        types, defaults, spelt = hints(cls), config_defaults(cls), aliases(cls)
        options = {}
        for name, o in specs(cls).items():
            options[name] = {
                "cli": o.cli_name(name),
                "flags": list(o.flags),
                "yaml_key": name.replace("_", "-"),
                "aliases": sorted(a for a, target in spelt.items() if target == name),
                "type": str(types[name]),
                "default": _plain(defaults.get(name)),
                "choices": list(o.choices) if o.choices is not None else None,
                "bounds": {"min": o.min, "max": o.max, "gt": o.gt, "lt": o.lt},
                "help": o.help,
                "doc": o.doc,
                "default_doc": o.default_doc,
                "panel": o.panel,
                "run_control": o.run_control,
                "argument": o.argument,
                "negatable": o.negatable,
                "metavar": o.metavar,
            }
        module = importlib.import_module(cls.__module__)
        trajectory = getattr(module, "TRAJECTORY", None) if hasattr(module, "RUN_CONTROL") else None
        click = typer.main.get_command(cli.app).commands[command.name]
        params = [[p.name, sorted(p.opts), sorted(p.secondary_opts)] for p in click.params]
        out[command.name] = {
            "options": options,
            "order": list(options),
            "params": params,
            "trajectory": list(trajectory) if trajectory is not None else None,
        }
    return out


def _commands() -> list[str]:
    return sorted(json.loads(GOLDEN.read_text())) if GOLDEN.stat().st_size else []  # empty while it is regenerated


@pytest.fixture(scope="module")
def now():
    return surface()


@pytest.mark.parametrize("command", _commands())
def test_the_flat_surface_is_what_it_was_option_by_option(now, command):
    golden = json.loads(GOLDEN.read_text())[command]
    assert command in now, f"command {command} is gone"
    have = now[command]
    missing = sorted(set(golden["options"]) - set(have["options"]))
    added = sorted(set(have["options"]) - set(golden["options"]))
    assert not missing and not added, f"{command}: options missing {missing}, added {added}"
    for name, was in golden["options"].items():
        diff = {k: (v, have["options"][name].get(k)) for k, v in was.items() if have["options"][name].get(k) != v}
        assert not diff, f"{command} {name}: (golden, now) differ in {diff}"
    assert have["order"] == golden["order"], f"{command}: --help / page order changed"
    assert have["params"] == golden["params"], f"{command}: the command line's parameters changed"
    assert have["trajectory"] == golden["trajectory"], f"{command}: the options a resumed run must keep changed"


def test_no_command_came_or_went(now):
    assert sorted(now) == _commands()


# -- what a run writes: config.yaml and ovkit.json's config ---------------------------------------------------------

WRITTEN = Path(__file__).parent / "data" / "written_config.json"


def _written(out: Path, roots: dict[str, Path]) -> dict:
    """config.yaml and ovkit.json of OUT with the test's own paths as placeholders (ROOT names the fixture's)."""
    import yaml

    def anonymous(value):
        text = json.dumps(value)
        for name, root in roots.items():
            text = text.replace(str(root), name)
        return json.loads(text)

    provenance = json.loads((out / "ovkit.json").read_text())
    return {
        "config.yaml": anonymous(yaml.safe_load((out / "config.yaml").read_text())),
        "config.yaml keys in order": list(yaml.safe_load((out / "config.yaml").read_text())),
        "ovkit.json keys": sorted(provenance),
        "ovkit.json config": anonymous(provenance["config"]),
    }


def sft_written(assets: Path, tmp: Path) -> dict:
    from helpers import config

    from ovkit.train.loop import train

    train(config("SFTConfig", assets, tmp / "sft", max_steps=1))
    return _written(tmp / "sft", {"ASSETS": assets, "TMP": tmp})


def rl_written(rl_assets: tuple[Path, Path], tmp: Path) -> dict:
    from helpers import rl_cfg

    from ovkit.rl.loop import train_rl

    model, data = rl_assets
    train_rl(rl_cfg(model, data, tmp / "rl", max_steps=1, quiet=True))
    return _written(tmp / "rl", {"MODEL": model, "DATA": data, "TMP": tmp})


@pytest.mark.usefixtures("one_thread")
def test_a_tiny_sft_run_writes_the_same_config(assets, tmp_path):
    assert sft_written(assets, tmp_path) == json.loads(WRITTEN.read_text())["sft"]


@pytest.mark.usefixtures("one_thread")
def test_a_tiny_rl_train_run_writes_the_same_config(rl_assets, tmp_path):
    assert rl_written(rl_assets, tmp_path) == json.loads(WRITTEN.read_text())["rl-train"]


if __name__ == "__main__":
    json.dump(surface(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
