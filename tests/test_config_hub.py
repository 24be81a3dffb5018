"""The whole stage config is not a hub: below a stage's entry point the library takes the option groups and values it
uses (litgpt's `fit(train: TrainArgs, eval: EvalArgs)`), never the whole config or a `cfg: Any`.

Read from the source (ast), so a new function that takes a stage config, and the module it is called from, is caught
where it is written. The rules:
- a parameter named cfg / config / *_cfg annotated `Any` is refused everywhere (the allow-list: a transformers
  model's config, which is not a stage's);
- a parameter annotated with a stage config class lives only in a stage's own module (the entry point and the private
  steps it is cut into: `train`, `_train_rl`, `run_eval`, ...) or in the generic machinery that handles any stage
  config by design (validate, the YAML loader and writer, the launcher check, the run record);
- such a stage function is imported by no other library module (a command module calls the entry point);
- Runtime reads no config through getattr / hasattr (each value is a declared field of a group or of the run).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "ovkit"

# module (relative to src/ovkit) -> the functions that take any stage config by design (the generic machinery)
GENERIC = {
    "config.py": {"to_plain", "dump_yaml", "check_inputs"},
    "options.py": {"validate", "check_corrections"},
    "launch.py": {"check"},
    "runs.py": {"of", "__init__", "finished", "changed_options", "_left_at_default"},  # the run record, config.yaml /
    # ovkit.json, and whether a finished OUT was made with the same options
    "progress.py": {"run"},  # honours_quiet: an entry point's `quiet` over the libraries' bars
}
# the modules that hold a stage's entry point (called by its command) and the steps it is cut into
STAGE_MODULES = {
    "train/loop.py",
    "rl/loop.py",
    "evaluate/run.py",
    "caption/run.py",
    "rl/curate.py",
    "mismatch/run.py",
    "balance/run.py",
    "pack/plan.py",
    "data/convert.py",
    "data/synth.py",
    "models/presets.py",
}
# `config: Any` that is a transformers model config (PretrainedConfig), not a stage's
MODEL_CONFIG = {("models/attention.py", "text_implementation"), ("models/precompute.py", "vision_inputs")}
MODEL_CONFIG |= {("models/precompute.py", "varlen_boundaries"), ("rl/update.py", "prepare_step")}
MODEL_CONFIG |= {("rollouts/shared.py", "unsupported"), ("rollouts/shared.py", "sharing")}
MODEL_CONFIG |= {("runtime/loss.py", "head_unsupported")}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(SRC)): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(SRC.rglob("*.py"))}


def _stage_classes(modules: dict[str, ast.Module]) -> set[str]:
    """Every class deriving (directly or through another) from StageConfig, by name."""
    bases = {
        node.name: {ast.unparse(b).split(".")[-1] for b in node.bases}
        for tree in modules.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }
    found = {"StageConfig"}
    while True:
        more = {name for name, of in bases.items() if of & found} - found
        if not more:
            return found
        found |= more


def _parameters(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None:
                    yield node, arg, ast.unparse(arg.annotation)


def _names(annotation: str) -> set[str]:
    return {part.split(".")[-1] for part in annotation.replace("|", " ").replace("[", " ").replace("]", " ").split()}


def test_no_library_function_takes_cfg_any():
    bad = [
        f"{module}:{fn.lineno} {fn.name}({arg.arg}: Any)"
        for module, tree in _modules().items()
        for fn, arg, annotation in _parameters(tree)
        if annotation in ("Any", "typing.Any")
        and (arg.arg in ("cfg", "config") or arg.arg.endswith("_cfg"))
        and (module, fn.name) not in MODEL_CONFIG
    ]
    assert not bad, "take the option groups or values used, not a config typed Any:\n" + "\n".join(bad)


def test_only_a_stage_module_or_the_generic_machinery_takes_a_stage_config():
    modules = _modules()
    stage = _stage_classes(modules)
    bad = [
        f"{module}:{fn.lineno} {fn.name}({arg.arg}: {annotation})"
        for module, tree in modules.items()
        for fn, arg, annotation in _parameters(tree)
        if _names(annotation) & stage and module not in STAGE_MODULES and fn.name not in GENERIC.get(module, set())
    ]
    assert not bad, "pass the option groups (loading, ppo, eval_during, ...), not the stage config:\n" + "\n".join(bad)


def test_no_other_library_module_imports_a_function_that_takes_a_stage_config():
    modules = _modules()
    stage = _stage_classes(modules)
    takes = {
        (module, fn.name)
        for module, tree in modules.items()
        if module in STAGE_MODULES
        for fn, _, annotation in _parameters(tree)
        if _names(annotation) & stage and fn.col_offset == 0
    }
    dotted = {module.removesuffix(".py").replace("/", "."): module for module in modules}
    bad = []
    for module, tree in modules.items():
        if module.startswith("commands/") or module.endswith("__init__.py"):
            continue  # a command calls its stage's entry point; a package re-exports it
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ovkit."):
                source = dotted.get(node.module.removeprefix("ovkit."))
                for alias in node.names:
                    if source != module and (source, alias.name) in takes:
                        bad.append(f"{module}:{node.lineno} imports {alias.name} from {source}")
    assert not bad, "a stage's config-taking function is called from another module:\n" + "\n".join(bad)


def test_the_runtime_reads_no_config_through_getattr_or_hasattr():
    tree = ast.parse((SRC / "runtime" / "core.py").read_text(encoding="utf-8"))
    calls = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr")
        and any(isinstance(a, ast.Name) and a.id in ("cfg", "config") or "cfg" in ast.unparse(a) for a in node.args)
    ]
    assert not calls, "\n".join(calls)


def test_the_scan_sees_what_it_refuses():
    """The rules would catch the hub they replace (a scan that sees nothing passes vacuously)."""
    tree = ast.parse("def f(x, cfg: Any): ...\ndef g(cfg: SFTConfig): ...\n")
    found = [(fn.name, annotation) for fn, _, annotation in _parameters(tree)]
    assert found == [("f", "Any"), ("g", "SFTConfig")]
    assert "SFTConfig" in _stage_classes(_modules()) and "RLTrainConfig" in _stage_classes(_modules())
