"""docs/cli.md is generated from the CLI's argparse definitions (tools/gen_cli_docs.py) and must be current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from colibri import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_cli_docs", ROOT / "tools" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_docs_are_current(gen):
    assert (ROOT / "docs" / "cli.md").read_text() == gen.render(), \
        f"docs/cli.md is not current: run `{gen.COMMAND}` and commit the result"


def test_cli_docs_cover_every_command_and_option(gen):
    text = gen.render()
    for name, _, sub in gen.commands(gen.parser(), ""):
        assert f"## colibri {name}\n" in text
        for action in gen.options(sub):
            assert f"| `{gen.option_name(action)}` |" in text, (name, action.dest)
    assert {name.split()[0] for name, _, _ in gen.commands(gen.parser(), "")} == set(
        cli.build_parser()._subparsers._group_actions[0].choices)


def test_cli_docs_ignore_the_environment(gen, monkeypatch):
    """An option's environment variable changes its default in `--help`, never in the page."""
    clean = gen.render()
    for _, env in cli.OPTIONS.values():
        if env:
            monkeypatch.setenv(env, "7")
    assert gen.render() == clean
