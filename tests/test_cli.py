"""The command surface: --version, --help of every command, and a reference page per command listing its options."""

import re
from pathlib import Path

import pytest

from ovkit import __version__
from ovkit import cli as cli_mod

ROOT = Path(__file__).resolve().parents[1]
cli_mod._register()
COMMANDS = sorted(c.name for c in cli_mod.app.registered_commands)


def test_version(cli):
    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == f"ovkit {__version__}"


def test_top_level_help_lists_every_command(cli):
    code, out, _ = cli("--help")
    assert code == 0
    for name in COMMANDS:
        assert name in out


def test_unknown_option_is_a_usage_error(cli):
    code, _, err = cli("--no-such-flag")
    assert code == 2


def test_show_completion_prints_a_bash_script(cli, monkeypatch):
    # typer takes the shell as an argument only with detection off (its own tests do the same); detected, it is a flag
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    code, out, _ = cli("--show-completion", "bash")
    assert code == 0
    assert (
        "complete -o default -F _ovkit_completion ovkit" in out
    )  # the script's command is `ovkit`, not `python -m ovkit`
    assert "_OVKIT_COMPLETE=complete_bash" in out


def test_completion_offers_commands_and_options(cli, monkeypatch):
    monkeypatch.setenv("_OVKIT_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "ovkit rl")
    monkeypatch.setenv("COMP_CWORD", "1")
    _, out, _ = cli()
    assert out.split() == ["rl-curate", "rl-train"]
    monkeypatch.setenv("COMP_WORDS", "ovkit sft --max-s")
    monkeypatch.setenv("COMP_CWORD", "2")
    _, out, _ = cli()
    assert out.split() == ["--max-steps"]


def test_top_level_help_offers_completion(cli):
    code, out, _ = cli("--help")
    assert code == 0 and "--install-completion" in out and "--show-completion" in out


def options_in_help(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)) - {"--help"}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_and_a_page_listing_its_options(cli, name):
    code, out, _ = cli(name, "--help")
    assert code == 0, out
    page = ROOT / "commands" / f"{name}.md"
    assert page.is_file(), f"commands/{name}.md is missing"
    text = page.read_text()
    missing = sorted(o for o in options_in_help(out) if o not in text)
    assert not missing, f"commands/{name}.md does not document {missing}"


# -- one source of truth for defaults, --help layout ---------------------------------------------------------------

from ovkit.commands._common import config_defaults, stage_of  # noqa: E402
from ovkit.config import dump_yaml, to_plain  # noqa: E402
from ovkit.errors import OvkitError  # noqa: E402

INFO = {c.name: stage_of(c) for c in cli_mod.app.registered_commands}
# The fewest inputs each command's config accepts: what a user must type (or put in --config).
MINIMAL = {
    "synth": ["--out", "o"],
    "convert": ["in.json", "--out", "o"],
    "init-model": ["--out", "o", "--corpus", "d"],
    "balance": ["d", "--concepts", "c.txt", "--encoder", "e", "--out", "o"],
    "caption": ["d", "--model", "m", "--out", "o"],
    "pack": ["d", "--model", "m", "--out", "o"],
    "align": ["d", "--model", "m", "--out", "o"],
    "midtrain": ["d", "--model", "m", "--out", "o"],
    "sft": ["d", "--model", "m", "--out", "o"],
    "eval": ["d", "--model", "m", "--out", "o"],
    "rl-curate": ["d", "--model", "m", "--out", "o"],
    "rl-train": ["d", "--model", "m", "--out", "o"],
    "mismatch-report": ["r", "--model", "m", "--out", "o"],
    "science-report": ["r"],
}


def click_command(name: str):
    import typer.main

    return typer.main.get_command(cli_mod.app).commands[name]


def test_minimal_table_covers_every_command():
    assert set(MINIMAL) == set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_a_config_field_and_every_field_an_option(name):
    fields = set(config_defaults(INFO[name].config_class()))
    options = {p.name for p in click_command(name).params} - {"config", "help"}
    assert options == fields


@pytest.mark.parametrize("name", COMMANDS)
def test_no_optional_flag_means_the_dataclass_defaults(cli, monkeypatch, name):
    """Only what the user typed reaches the config: everything else is the dataclass's own default."""
    import ovkit.commands._common as common

    seen = {}

    def spy(cls, cli_values, from_cli, file_values, config_path=None):
        seen.update(cls=cls, typed=dict(cli_values), cfg=merge(cls, cli_values, from_cli, file_values, config_path))
        raise OvkitError("stop here")

    merge = common.merge
    monkeypatch.setattr(common, "merge", spy)
    code, _, err = cli(name, *MINIMAL[name])
    assert code == 2 and "stop here" in err, err
    given = {p.name for p in click_command(name).params if any(o in MINIMAL[name] for o in p.opts)}
    positional = (
        {p.name for p in click_command(name).params if p.param_type_name == "argument"}
        if not MINIMAL[name][0].startswith("--")
        else set()
    )
    assert set(seen["typed"]) == given | positional
    cls = seen["cls"]
    assert to_plain(seen["cfg"]) == to_plain(cls(**seen["typed"]))


def test_config_yaml_of_a_run_without_optional_flags_is_the_dataclass_defaults(cli, tmp_path):
    import json

    from ovkit.data.convert import ConvertConfig

    src = tmp_path / "in.json"
    src.write_text(
        json.dumps(
            [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
        )
    )
    code, _, err = cli("convert", src, "--out", tmp_path / "out")
    assert code == 0, err
    expected = ConvertConfig(input=str(src), out=tmp_path / "out")
    assert (tmp_path / "out" / "config.yaml").read_text() == dump_yaml(expected)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_the_dataclass_defaults(monkeypatch, name):
    """What --help prints as [default: ...] is read off the config dataclass when help is formatted."""
    import click
    from typer.core import TyperCommand

    shown = {}

    def record(self, ctx, formatter):
        shown.update({p.name: p.default for p in self.params})

    monkeypatch.setattr(TyperCommand, "format_help", record)
    command = click_command(name)
    command.format_help(click.Context(command), click.HelpFormatter())
    defaults = {k: v for k, v in config_defaults(INFO[name].config_class()).items() if v is not None}
    assert {k: shown[k] for k in defaults} == defaults
    assert all(p.default is None for p in command.params if p.name != "help")  # and restored after help


@pytest.mark.parametrize(
    "name, option, default",
    [
        ("rl-train", "--lr", "2e-06"),
        ("sft", "--min-lr", "1e-06"),
        ("mismatch-report", "--precision", "fp32"),
        ("eval", "--precision", "auto"),
        ("rl-train", "--adv-std", "adv-std"),
        ("rl-curate", "--stage2-category", "math, chart"),
    ],
)
def test_help_text_shows_defaults(cli, name, option, default):
    code, out, _ = cli(name, "--help")
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out).split())
    row = flat[re.search(re.escape(option) + "[ ,]", flat).start() :][
        :400
    ]  # the option's row: names (and aliases), type, help, [default: ...]
    assert f"[default: {default}" in row, row


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_a_worked_example_and_marks_required_inputs(cli, name):
    code, out, _ = cli(name, "--help")
    assert code == 0
    lines = [ln.strip(" │") for ln in out.splitlines()]
    assert any(ln.startswith(f"ovkit {name} ") for ln in lines), out
    assert out.count("[required]") >= len(INFO[name].required) + 1  # one per input, and the note on --config


def minimal_values(name: str) -> dict:
    """MINIMAL[name] as the command line's values by field (what `merge` takes)."""
    args = MINIMAL[name]
    values = {}
    for p in click_command(name).params:
        if p.param_type_name == "argument" and not args[0].startswith("--"):
            values[p.name] = [args[0]] if p.multiple or p.nargs == -1 else args[0]
        for o in p.opts:
            if o in args:
                v = args[args.index(o) + 1]
                values[p.name] = [v] if p.multiple else v
    return values


@pytest.mark.parametrize("name", COMMANDS)
def test_required_marks_are_what_the_config_enforces(name):
    from ovkit.config import merge

    cls = INFO[name].config_class()
    values = minimal_values(name)
    merge(cls, values, set(values), {})  # the minimal inputs are enough
    for required in INFO[name].required:
        rest = {k: v for k, v in values.items() if k != required}
        with pytest.raises(OvkitError):
            merge(cls, rest, set(rest), {})


def test_rl_train_help_groups_options_by_concern(cli):
    _, out, _ = cli("rl-train", "--help")
    panels = re.findall(r"╭─ (.+?) ─", out)
    assert len(panels) > 1
    for panel in (
        "Inputs/outputs",
        "Sampling",
        "Optimiser",
        "GRPO loss",
        "Mismatch corrections",
        "Multi-turn",
        "Runtime/precision",
        "Checkpoints & logging",
    ):
        assert panel in panels


@pytest.mark.parametrize("name", COMMANDS)
def test_help_example_is_a_valid_invocation(name, monkeypatch):
    """The example parses with the command's own options and resolves into a config (its --config file included)."""
    import shlex

    from ovkit.commands._common import resolve

    monkeypatch.chdir(ROOT)
    words = shlex.split(INFO[name].example)
    assert words[:2] == ["ovkit", name]
    command = click_command(name)
    with command.make_context(name, words[2:]) as ctx:
        cfg = resolve(ctx)
    assert isinstance(cfg, INFO[name].config_class())


# -- one declaration per option (ovkit.options) ----------------------------------------------------------------------


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_declared_with_help(name):
    """Every field of a command's config is an `option(...)` with help text and a panel (or is the INPUT)."""
    from ovkit.options import specs

    for field, declared in specs(INFO[name].config_class()).items():
        assert declared.help.strip(), f"{name}: --{field} has no help"
        assert declared.panel or declared.argument or field == "engine", f"{name}: --{field} has no help panel"


def _outside_and_inside(declared, integer: bool) -> tuple[list, list]:
    """Values just outside a declared range (refused) and on its edges, or just inside an exclusive one (accepted)."""
    step = 1 if integer else 1e-3
    outside, inside = [], []
    for bound, out, edge in (
        (declared.min, -step, 0),
        (declared.max, step, 0),
        (declared.gt, 0, step),
        (declared.lt, 0, -step),
    ):
        if bound is not None:
            outside.append(int(bound) + out if integer else bound + out)
            inside.append(int(bound) + edge if integer else bound + edge)
    return outside, inside


@pytest.mark.parametrize("name", COMMANDS)
def test_every_declared_range_and_choice_is_checked_at_start(name):
    """For every option that declares a range or choices: a value just outside is refused when the config is built
    (OvkitError naming the flag: exit 2 before any model loads), the edge of an inclusive range, just inside an
    exclusive one, and every listed choice pass `validate`."""

    from ovkit.config import merge
    from ovkit.options import hints as declared_types
    from ovkit.options import specs, validate

    cls = INFO[name].config_class()
    hints = declared_types(cls)
    base = minimal_values(name)
    cfg = merge(cls, base, set(base), {})
    checked = 0
    for field, declared in specs(cls).items():
        if declared.choices is None and declared.accepts() is None:
            continue
        flag, hint = declared.cli_name(field), str(hints[field])
        many = hint.startswith("list")
        integer = "int" in hint and "float" not in hint
        outside, inside = _outside_and_inside(declared, integer)
        if declared.choices is not None:
            outside.append("not-a-choice")
            inside.extend(declared.choices)
        for value in outside:
            typed = [value] if many else value
            values = {**base, field: [str(value)] if many else str(value)}
            with pytest.raises(OvkitError, match=re.escape(flag)) as e:
                merge(cls, values, set(values), {})
            assert "\n" not in str(e.value) and f"got {value!r}" in str(e.value) or f"got {value}" in str(e.value)
            with pytest.raises(OvkitError, match=rf"^{re.escape(flag)} must be .*, got "):
                validate(_with(cfg, field, typed))
        for value in inside:
            validate(_with(cfg, field, [value] if many else value))
        checked += 1
    assert checked or name == "science-report", f"{name}: no option declares a range or choices"


def _with(cfg, field: str, value):
    """A copy of a built config with one field set, past `__post_init__` (what `validate` alone sees)."""
    import copy

    out = copy.copy(cfg)
    setattr(out, field, value)
    return out


def test_an_option_without_help_is_refused():
    from ovkit.options import option

    with pytest.raises(TypeError, match="help"):
        option(1, help="")
    import dataclasses

    @dataclasses.dataclass
    class Bare:
        x: int = 1

    from ovkit.options import specs

    with pytest.raises(TypeError, match="not declared with ovkit.options.option"):
        specs(Bare)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_declares_its_launcher_policy(name):
    """ovkit.launch reads what a command does under torchrun / accelerate launch off its config class."""
    from ovkit import options

    cls = INFO[name].config_class()
    policies = (options.DATA_PARALLEL, options.RANK_SHARDED, options.ROW_SHARED, options.ONE_PROCESS)
    assert any("launcher" in vars(c) for c in cls.__mro__) and cls.launcher in policies


def test_every_page_option_table_is_the_generated_one():
    """commands/NAME.md's option table is generated from the declarations (make pages): a stale one, or one missing an
    option, a spelling or a default, fails here."""
    from ovkit.pages import stale_pages

    assert stale_pages(write=False) == [], "run `make pages` (python -m ovkit.pages)"


def test_a_changed_default_makes_the_page_table_stale(monkeypatch):
    from ovkit import pages

    command = click_command("sft")
    assert "| `--min-lr` | 1e-6 |" in pages.table(command)
    monkeypatch.setattr(pages, "config_defaults", lambda cls: {**config_defaults(cls), "min_lr": 2e-6})
    assert "| `--min-lr` | 2e-6 |" in pages.table(command)


# -- the CLI on typer's public API -----------------------------------------------------------------------------------

# What ovkit uses of typer: the app and its option declarations, and two documented hooks (a command class given to
# `Typer.command(cls=...)`, `typer.main.get_command` for the click object). A name outside this list is a typer
# internal that may move between the versions `typer>=0.12` admits.
TYPER_PUBLIC = {
    "typer",
    "typer.Typer",
    "typer.Option",
    "typer.Argument",
    "typer.Context",
    "typer.Exit",
    "typer.echo",
    "typer.main.get_command",
    "typer.core.TyperCommand",
}


def test_src_uses_only_typers_public_api():
    used = set()
    for path in (ROOT / "src").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for module, names in re.findall(r"^\s*from (typer[\w.]*) import \(?([\w, ]+)", text, re.M):
            used |= {f"{module}.{n.strip()}" for n in names.split(",") if n.strip()}
        code = re.sub(r"^\s*(from|import) typer.*$", "", text, flags=re.M)
        used |= set(re.findall(r"(?<![\w.])(typer(?:\.\w+)+)", code))
    internal = sorted(u for u in used if u not in TYPER_PUBLIC)
    assert not internal, f"typer internals used in src/: {internal}"


def test_one_alias_table_and_one_default_reader():
    """--help's options and the config file's keys come from one declaration: a flag's other spellings are exactly
    the YAML aliases `merge` accepts (ovkit.options.aliases), for every command."""
    from ovkit.options import aliases

    for name in COMMANDS:
        command = click_command(name)
        spelt = {
            o.lstrip("-").replace("-", "_"): p.name
            for p in command.params
            for o in p.opts
            if o.startswith("--") and o.lstrip("-").replace("-", "_") != p.name
        }
        assert spelt == aliases(INFO[name].config_class()), name


# -- one text per option ---------------------------------------------------------------------------------------------


def _choices_named(text: str, choices) -> set[str]:
    return {c for c in choices if re.search(rf"(?<![\w.-]){re.escape(c)}(?![\w-])", text)}


def _defaults_stated(text: str, values) -> set[str]:
    """The values a text states as the default (`default: 0.5`, `fp32 (the default`, `tiny (default)`), among `values`
    (the choices, or any number)."""
    said = re.findall(r"\b[Dd]efault(?: is|:)?\s+`?([\w.+-]+?)`?[\s,;.)]", text + " ")
    said += re.findall(r"`?([\w.+-]+)`? \((?:the default\b|default[),])", text)
    number = re.compile(r"^-?[\d.]+(e-?\d+)?$")
    return {v for v in said if v in values or number.match(v)}


@pytest.mark.parametrize("name", COMMANDS)
def test_help_and_doc_name_the_same_choices_and_defaults(name):
    """A field keeps a `doc` beside its `help` only where its page needs more than the --help line: then a doc that
    names any declared choice names the same ones as the help (a doc may defer to a table on the page), and a default
    either text states is the declared one (a default computed at run time, None in the dataclass, has only its
    words)."""
    from ovkit.options import specs
    from ovkit.pages import shown

    defaults = config_defaults(INFO[name].config_class())
    for field, o in specs(INFO[name].config_class()).items():
        declared = {shown(defaults.get(field)), str(defaults.get(field)), o.default_doc}
        choices = o.choices or ()
        for text in (o.help, o.doc or "") if defaults.get(field) is not None else ():
            stated = _defaults_stated(text, choices) - declared
            assert not stated, f"{name} --{field}: states default {sorted(stated)}, declared {shown(defaults[field])}"
        if o.doc and _choices_named(o.doc, choices):
            help_names, doc_names = _choices_named(o.help, choices), _choices_named(o.doc, choices)
            assert help_names == doc_names, (
                f"{name} --{field}: only the help names {sorted(help_names - doc_names)}, "
                f"only the doc {sorted(doc_names - help_names)}"
            )


# Options whose help lists values (`a | b | c`) but that take an open set, checked at start by their own rule:
# every-K is any K; --correction also takes verl's names; --kernels is case-insensitive.
OPEN_ENDED = {"activation_checkpointing", "correction", "kernels"}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_choice_like_option_declares_its_choices(name):
    """An option whose help lists its values (`a | b | c`, or starts `a, b or c:`) declares them (`choices=`), so a
    typo is refused when the config is built, before any model loads, naming the flag."""
    from ovkit.options import specs

    listed = re.compile(r"^[\w-]+(, [\w-]+)*,? or [\w-]+[:.]")
    for field, o in specs(INFO[name].config_class()).items():
        if (" | " in o.help or listed.match(o.help)) and field not in OPEN_ENDED:
            assert o.choices, f"{name} --{field} lists values in its help but declares no choices"
