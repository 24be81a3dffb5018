"""Every shipped YAML under examples/ loads and validates against its command's config (torchtune test_configs).

A file is checked against the command its name says (`examples/*/align.yaml` -> `ovkit align`); names that are not
a command name are mapped in FILE_COMMANDS. The command's config class is the one its `@stage(...)` declaration names,
so a new command's
examples need no test change.
Inputs and outputs are usually given on the command line, not in the file: options the config reports as required
get a placeholder, everything in the file goes through the same merge + `__post_init__` checks as a real run.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest

from ovkit import cli as cli_mod
from ovkit.config import load_yaml, merge
from ovkit.errors import OvkitError
from ovkit.options import flatten
from ovkit.options import hints as declared_types

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))
FILE_COMMANDS = {
    "rl-stage1": "rl-train",
    "rl-stage2": "rl-train",
    "rl-multiturn": "rl-train",
    "rl-science": "rl-train",
    "sft-lora": "sft",
    "rl-train-fsdp": "rl-train",
}  # file stem -> command, where they differ
ACCELERATE_CONFIGS = {
    "fsdp"
}  # file stems of `accelerate launch --config_file` files, validated as accelerate reads them

cli_mod._register()
CALLBACKS = {c.name: c.callback for c in cli_mod.app.registered_commands}
COMMANDS = {c.name: c for c in cli_mod.app.registered_commands}


def command_of(path: Path) -> str:
    if path.parent.name == "rl":  # examples/rl/<algorithm>.yaml: rl-train's algorithm menu
        return "rl-train"
    return FILE_COMMANDS.get(path.stem, path.stem)


def config_class(command: str) -> type:
    """The dataclass a command resolves its options into, as its `@stage(...)` declaration names it."""
    from ovkit.commands._common import stage_of

    return stage_of(COMMANDS[command]).config_class()


def placeholder(hint) -> object:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    hint = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and args else hint
    if typing.get_origin(hint) is list:
        return [placeholder(typing.get_args(hint)[0])]
    return Path("placeholder") if hint is Path or "Path" in str(hint) else "placeholder"


def build(cls: type, values: dict, path: Path):
    """merge() as `--config FILE` does it. Inputs and outputs are given on the command line in the examples, so
    when the config refuses, path-typed options the file leaves unset get placeholders, one at a time in
    declaration order, until it accepts; if it still refuses, the first error is the failure."""
    hints = declared_types(cls)
    unset = [
        name
        for name, flat in flatten(cls).items()
        if name not in values and flat.field.default is None and "Path" in str(hints[name])
    ]
    filled: dict = {}
    first = None
    for name in [None, *unset]:
        if name is not None:
            filled[name] = placeholder(hints[name])
        try:
            return merge(cls, filled, set(filled), values, path)
        except OvkitError as e:
            first = first or e
    raise first


def test_there_are_examples():
    names = {(p.parent.name, p.stem) for p in EXAMPLES}
    for scale in ("tiny", "8b"):
        for stage in ("align", "midtrain", "sft"):
            assert (scale, stage) in names, f"examples/{scale}/{stage}.yaml is missing"


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT / "examples")) for p in EXAMPLES])
def test_example_loads_and_validates(path):
    if path.stem in ACCELERATE_CONFIGS:
        return check_accelerate_config(path)
    command = command_of(path)
    assert command in CALLBACKS, f"{path.name}: no `ovkit {command}` command; map the file name in FILE_COMMANDS"
    cls = config_class(command)
    values = load_yaml(path)
    assert values, f"{path} is empty"
    cfg = build(cls, values, path)
    assert dataclasses.is_dataclass(cfg)


def check_accelerate_config(path: Path) -> None:
    """accelerate's own config class reads it (it refuses unknown keys), and the layer classes it wraps exist."""
    import importlib

    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))
    wrap = (config.fsdp_config or {}).get("fsdp_transformer_layer_cls_to_wrap", "")
    for name in filter(None, wrap.split(",")):
        module = importlib.import_module("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
        assert hasattr(module, name.strip()), (
            f"{path.name}: fsdp_transformer_layer_cls_to_wrap names {name}, which transformers does not define"
        )


def test_stage_examples_keep_the_stage_presets_where_published():
    """The 8B files carry the recipe's numbers; the tiny ones may deviate but must say so in a comment."""
    from ovkit.train import STAGE_CONFIGS

    published = {"align": (1e-4, 0.0), "midtrain": (1e-5, 0.01), "sft": (1e-5, 0.0)}
    for stage, (lr, wd) in published.items():
        cfg = build(
            STAGE_CONFIGS[stage],
            load_yaml(ROOT / "examples" / "8b" / f"{stage}.yaml"),
            ROOT / "examples" / "8b" / f"{stage}.yaml",
        )
        assert (cfg.lr, cfg.weight_decay, cfg.warmup_ratio, cfg.min_lr, cfg.max_grad_norm) == (lr, wd, 0.002, 1e-6, 1.0)
        tiny = ROOT / "examples" / "tiny" / f"{stage}.yaml"
        if build(STAGE_CONFIGS[stage], load_yaml(tiny), tiny).lr != lr:
            assert "deviat" in tiny.read_text().lower(), f"{tiny} changes the published lr without saying why"
