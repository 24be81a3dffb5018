"""The option table of every command page (commands/NAME.md), generated from the options' declarations (the stage
config's fields, ovkit.options): flags and their other spellings, the dataclass default, and the field's `doc` (else
its help). The table sits between two marker comments; the rest of the page is written by hand.

    python -m ovkit.pages            rewrite the tables (make pages)
    python -m ovkit.pages --check    exit 1 naming each page whose table is stale (tests/test_cli.py)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import typer.main

from ovkit import cli
from ovkit.commands._common import config_defaults, stage_of
from ovkit.options import flatten, specs

BEGIN = "<!-- options: begin (generated from the config's declarations by `make pages`; edit them there) -->"
END = "<!-- options: end -->"
CONFIG_ROW = (
    "| `--config` | none | YAML of option values (keys = option names or their other spellings: `learning_rate` for "
    "`--lr`); flags typed on the command line override it; each value is converted by the option's type (`lr: 1e-3` "
    "is a float) and one that does not convert exits 2 naming the key, the file and the type |"
)
HELP_ROW = "| `-h`, `--help` | | the options, their defaults and a worked example |"
PAGES = Path(__file__).resolve().parents[2] / "commands"


def shown(value: Any) -> str:
    """A default as the page writes it: off/on, none, 1.0, 1e-6 (not 1e-06), lists comma-separated."""
    if value is None or value == [] or value == {}:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))
    if isinstance(value, (list, tuple)):
        return ", ".join(shown(v) for v in value)
    return str(value)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(command: Any) -> str:
    """The markdown option table of a registered command."""
    info = stage_of(command)
    cls = info.config_class()
    defaults = config_defaults(cls)
    fields = {name: flat.field for name, flat in flatten(cls).items()}
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name, o in specs(cls).items():
        if o.argument:
            many = "list" in str(fields[name].type)
            names = f"`{o.cli_name(name)}{'...' if many else ''}`"
        else:
            flag = o.cli_name(name)
            names = ", ".join(f"`{f}`" for f in (flag, *o.flags))
            if o.negatable:
                names += f" / `--no-{flag[2:]}`"
        if name in info.required:
            default = "required"
        elif defaults.get(name) in (None, [], {}) and o.default_doc:
            default = o.default_doc
        else:
            default = shown(defaults.get(name))
        meaning = o.doc or o.help
        if o.accepts():  # the declared range, as `validate` checks it (choices are the meaning's to list)
            meaning = f"{meaning.rstrip('.')}; accepts `{o.accepts()}`"
        rows.append(f"| {names} | {cell(default)} | {cell(meaning)} |")
    rows.extend((CONFIG_ROW, HELP_ROW))
    return "\n".join(rows)


def render(text: str, generated: str, page: Path) -> str:
    """`text` with the part between the markers replaced by `generated`."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{page}: no option-table markers ({BEGIN} ... {END})")
    return text[: start + len(BEGIN)] + "\n" + generated + "\n" + text[end:]


def stale_pages(write: bool) -> list[str]:
    """The pages whose table differs from the declarations (rewritten when `write`)."""
    cli._register()
    group = typer.main.get_command(cli.app)
    stale = []
    for name, command in group.commands.items():
        page = PAGES / f"{name}.md"
        text = page.read_text(encoding="utf-8")
        new = render(text, table(command), page)
        if new != text:
            stale.append(str(page))
            if write:
                page.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    stale = stale_pages(write=not check)
    for page in stale:
        print(f"{page}: option table {'is stale (run make pages)' if check else 'rewritten'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
