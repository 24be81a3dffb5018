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
