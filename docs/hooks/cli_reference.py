"""MkDocs hook: the command reference page (`reference/cli.md`), rendered at build time from the typer app's
click command tree, so that it lists exactly the commands, arguments and options `stagereplay --help` has,
with their help texts and defaults. Nothing in it is written by hand."""

from __future__ import annotations

from html import escape
from typing import Any

PAGE = "reference/cli.md"
INTRO = """# Commands

Every command and option of `stagereplay`, generated from the command-line interface itself when this site is
built (`docs/hooks/cli_reference.py`). Each command also prints its own `--help`. A bad value of any option is
one line, `error: <problem>; <fix>`, and exit code 2 ([exit codes and bad input](errors.md)).
"""


def _cell(text: str) -> str:
    """Help text as a Markdown table cell: HTML-escaped (`</think>` is text, not a tag), pipes kept in the cell."""
    text = text.replace("\\[", "[")  # an option's help, escaped for rich (`cli.groups`), read as the text it is
    return escape(" ".join(text.split()), quote=False).replace("|", "&#124;")


def _commands(group: Any, ctx: Any) -> list[tuple[Any, Any]]:
    """(command, its context) for every leaf command, depth first, in the order `--help` lists them."""
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        sub = command.context_class(command, info_name=name, parent=ctx)
        if hasattr(command, "commands"):
            out += _commands(command, sub)
        else:
            out.append((command, sub))
    return out


def _others() -> set[str]:
    """The commands of experiments another distribution installed (a plugin, the tests' own): not this project's
    reference."""
    from stagereplay.experiments.core import registry

    return {e.command for e in registry.all_experiments()
            if registry.distribution(e.name) not in (None, "stagereplay")}


def cli_markdown(app: Any = None) -> str:
    """The reference page for `app` (default: `stagereplay.cli.app`)."""
    import typer.main

    if app is None:
        from stagereplay.cli import app
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="stagereplay")
    lines = [INTRO]
    leaves = [(c, sub) for c, sub in _commands(root, ctx) if sub.info_name not in _others()]
    lines += ["| command | what it does |", "| --- | --- |"]
    for command, sub in leaves:
        anchor = sub.command_path.replace(" ", "-")
        lines.append(f"| [`{sub.command_path}`](#{anchor}) | {_cell((command.help or '').split(chr(10))[0])} |")
    for command, sub in leaves:
        anchor = sub.command_path.replace(" ", "-")
        usage = " ".join([sub.command_path, *command.collect_usage_pieces(sub)])
        lines += ["", f"## `{sub.command_path}` {{#{anchor}}}", "", _cell(command.help or ""), "",
                  "```", usage, "```", "", "| argument or option | meaning |", "| --- | --- |"]
        for param in command.get_params(sub):
            record = param.get_help_record(sub)
            if record is None or "--help" in getattr(param, "opts", ()):
                continue
            names, help_text = record
            lines.append(f"| `{names}` | {_cell(help_text)} |")
    return "\n".join(lines) + "\n"


def on_files(files: Any, config: Any) -> Any:
    """Add the generated page to the site's files (MkDocs 1.6: `File.generated`)."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=cli_markdown()))
    return files
