"""The `stagereplay` command: a thin typer layer over the library (torch is imported only inside commands).

Its commands are grouped by what they act on: `experiments` (the protocol's stages, and `paper` running them
all), `plan` (a run's cost before it runs), `runs` (a run directory: audit, report, show, export, merge),
`compare` (two runs side by side) and `toy` (the embedded model). `app` holds the typer app, the one-line answer
to bad input and the exit code of a crash; `options` the options the commands share."""

from __future__ import annotations

from stagereplay.cli import compare, experiments, plan, runs, toy  # noqa: F401  (importing them registers their commands)
from stagereplay.cli.app import app


def main() -> None:
    """The `stagereplay` console script (and `python -m stagereplay.cli`): exits with `stagereplay.errors`' codes,
    a crash included (`app.OneLineErrors`)."""
    app(prog_name="stagereplay")
