"""The typer app every command registers on, and the one-line handling of bad input that every command shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import typer
from typer.core import TyperGroup

try:  # typer vendors click (0.2x on): its parser raises the vendored exceptions
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # an older typer on the real click
    from click.exceptions import NoArgsIsHelpError, UsageError  # type: ignore[assignment]  # same names, older home

from stagereplay.errors import StageReplayError


class OneLineErrors(TyperGroup):
    """Click's usage errors (a value of the wrong type, a missing or unknown option or command) as the one
    `error: <problem>; <fix>` line and exit code 2 of every other bad input, not a usage box."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else ctx.command_path
            problem = " ".join(exc.format_message().split())
            typer.echo(f"error: {problem.rstrip('.')}; see `{where} --help`", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Audit stage replay: live cache vs fresh prefill of identical token IDs.")
toy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The embedded toy reasoning model.")
app.add_typer(toy_app, name="toy")

T = TypeVar("T")


def guarded(fn: Callable[[], T]) -> T:
    """Bad input -> one line on stderr naming the problem and the fix, exit code 2."""
    import warnings

    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    try:
        return fn()
    except StageReplayError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
