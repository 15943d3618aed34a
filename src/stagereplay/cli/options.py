"""`--quiet`, which every command that runs something takes: as an annotation for a hand-written command (`Quiet`),
as a parameter for one made from the library's option groups (`quiet_option`, `cli.groups`)."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer

from stagereplay.cli.app import say_on_stderr


def _quiet(value: bool) -> bool:
    if value:
        say_on_stderr(quiet=True)
    return value


QUIET_HELP = "no progress bar or tables; on stderr, errors only"
Quiet = Annotated[bool, typer.Option("--quiet", callback=_quiet, help=QUIET_HELP)]


def quiet_option() -> inspect.Parameter:
    """`--quiet` as a parameter of a command made from option groups."""
    return inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                             default=typer.Option(False, "--quiet", callback=_quiet, help=QUIET_HELP))
