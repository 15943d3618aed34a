"""The documentation site's command reference is generated from the CLI: every command and option is on it,
and it follows the command tree it is given (not a copied text). The site itself is built with
`mkdocs build --strict` in CI (.ci/run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import typer
import typer.main

from stagereplay.cli import app

HOOK = Path(__file__).parents[1] / "docs" / "hooks" / "cli_reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("cli_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(group, path=("stagereplay",)):
    ctx = group.context_class(group, info_name=path[-1])
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if hasattr(command, "commands"):
            yield from _leaves(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


def test_every_command_and_option_is_on_the_reference_page():
    """Every command of this project is on the page, with every option; a command another distribution installs
    (the tests' plugin, `stagereplay echo`) is not."""
    page = _hook().cli_markdown()
    others = _hook()._others()
    assert "echo" in others and "## `stagereplay echo`" not in page
    leaves = [(path, command) for path, command in _leaves(typer.main.get_command(app))
              if path.split()[-1] not in others]
    assert len(leaves) >= 13
    for path, command in leaves:
        assert f"## `{path}`" in page, path
        section = page.split(f"## `{path}`", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            names = [*getattr(param, "opts", []), *getattr(param, "secondary_opts", [])]
            for name in names:
                if name.startswith("-") and name != "--help":
                    assert f"`{name}" in section or f" {name}" in section, (path, name)
    outside_code = page.split("```")[::2]  # help texts are HTML-escaped, so `</think>` is text, not a tag
    assert "&lt;/think&gt;" in page and not any("</think>" in part for part in outside_code)


def test_the_page_follows_the_command_tree_it_is_given():
    """Negative control: an app with another command and option renders them, and the real app's page has
    neither, so the page is rendered from the tree, not kept as text."""
    other = typer.Typer()

    @other.command()
    def frobnicate(level: int = typer.Option(3, "--zzz-level", help="how much | how often")) -> None:
        """Frobnicate a run."""

    @other.command()
    def second() -> None:
        """Another."""

    page = _hook().cli_markdown(other)
    assert "## `stagereplay frobnicate`" in page and "`--zzz-level <int>`" in page
    assert "how much &#124; how often" in page  # a pipe in a help text stays inside its table cell
    real = _hook().cli_markdown()
    assert "frobnicate" not in real and "--zzz-level" not in real
