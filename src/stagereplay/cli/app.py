"""The typer app every command registers on, what every command's exit code means (`stagereplay.errors`: bad input
one line and `REFUSED`, a crash its traceback and `FAILED`, never a verdict), and where the library's log lines go in a
command."""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import typer
from typer.core import TyperGroup

try:  # typer vendors click (0.2x on): its parser raises the vendored exceptions
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # an older typer on the real click
    from click.exceptions import (  # type: ignore[assignment]  # same names, older home
        ClickException,
        NoArgsIsHelpError,
        UsageError,
    )

from stagereplay.errors import FAILED, REFUSED, StageReplayError

INTERRUPTED = 130
"""A command stopped by Ctrl-C (SIGINT) exits 128 + 2, as a shell reports it: neither a verdict nor a crash."""

COMMANDS: list[Callable[[], Mapping[str, tuple[Callable[..., Any], str | None]]]] = []
"""Sources of commands made when the command line is read (`cli.experiments`: one per registered experiment), each
giving {name: (the command's function, its help)}: a command registered after import has its command too."""


class OneLineErrors(TyperGroup):
    """Every command's exit: click's usage errors (a value of the wrong type, a missing or unknown option or command)
    as the one `error: <problem>; <fix>` line and exit code 2 of every other bad input, not a usage box; an exception
    a command did not answer as its traceback, one line saying it is a bug, and `FAILED`; Ctrl-C as `INTERRUPTED`.
    And the commands `COMMANDS` make, listed first."""

    def list_commands(self, ctx: Any) -> list[str]:
        made = [name for source in COMMANDS for name in source()]
        return [*made, *(n for n in super().list_commands(ctx) if n not in made)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        from typer.main import get_command_from_info
        from typer.models import CommandInfo

        for source in COMMANDS:
            made = source()
            if cmd_name in made:
                fn, help_text = made[cmd_name]
                return get_command_from_info(CommandInfo(name=cmd_name, callback=fn, help=help_text),
                                             pretty_exceptions_short=True, rich_markup_mode="rich")
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else ctx.command_path
            problem = " ".join(exc.format_message().split())
            typer.echo(f"error: {problem.rstrip('.')}; see `{where} --help`", err=True)
            raise typer.Exit(REFUSED) from None
        except typer.Exit:
            raise
        except Exception as exc:
            raise typer.Exit(exit_code_of(exc)) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(INTERRUPTED) from None

    def main(self, *args: Any, **kwargs: Any) -> Any:
        """Click's main, with what escapes it before a command runs (while the command line is read, `--help` listing
        the commands) answered as a command's failure is: the console script and `CliRunner` both come through
        here."""
        try:
            return super().main(*args, **kwargs)
        except (typer.Exit, typer.Abort, ClickException):
            raise  # outside standalone mode: the caller's to handle
        except Exception as exc:
            if not kwargs.get("standalone_mode", True):
                raise
            sys.exit(exit_code_of(exc))


def exit_code_of(exc: BaseException) -> int:
    """The exit code of a command that raised `exc`, its line said on stderr: bad input (`StageReplayError`, click's
    own errors) is one line; an abort, or any other exception with its traceback, is `FAILED`, never a verdict (an
    uncaught exception would otherwise exit 1, which is `FLAGGED`)."""
    if isinstance(exc, StageReplayError):
        typer.echo(f"error: {exc}", err=True)
        return exc.exit_code
    if isinstance(exc, ClickException):  # a click error that is not a usage error (a file it could not open)
        typer.echo(f"error: {' '.join(exc.format_message().split())}", err=True)
        return REFUSED
    if isinstance(exc, typer.Abort):
        typer.echo("error: aborted", err=True)
        return FAILED
    if isinstance(exc, BrokenPipeError):  # `stagereplay ... | head`: what it said was not all read
        typer.echo("error: the output was closed before the command finished (broken pipe)", err=True)
        return FAILED
    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    first = (str(exc).strip().splitlines() or [""])[0]
    typer.echo(f"error: internal failure ({type(exc).__name__}{': ' + first if first else ''}); a bug in stagereplay, "
               "not a verdict: please report it with the traceback above", err=True)
    return FAILED


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is when a line is said: a progress bar that redirects it, or a
    test's runner that swaps it, gets the line as it would a print."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


class _OneLine(logging.Formatter):
    """The message as the line; a warning or worse as `warning: <message>`."""

    def format(self, record: logging.LogRecord) -> str:
        line = record.getMessage()
        return line if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {line}"


class _Once(logging.Filter):
    """Passes a record whose `once` key it has passed before no more: a line that repeats nothing new (the batched
    check of a model setting, `LM.prove_batch`, made again by each stage and worker that loads the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "once", None)
        if key is None:
            return True
        if key in self.said:
            return False
        self.said.add(key)
        return True


def say_on_stderr(quiet: bool = False) -> None:
    """The library's log lines (`stagereplay.*`, its workers' included: execution.local) in this command: one line
    each on stderr, INFO and up, each `once` line once; under --quiet, errors only."""
    logger = logging.getLogger("stagereplay")
    _unsay(logger)
    level = logging.ERROR if quiet else logging.INFO
    handler = _Stderr()
    handler.setFormatter(_OneLine())
    handler.addFilter(_Once())
    handler.setLevel(level)
    logger.setLevel(level)
    logger.addHandler(handler)


def _unsay(logger: logging.Logger) -> None:
    for old in [h for h in logger.handlers if isinstance(h, _Stderr)]:
        logger.removeHandler(old)


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Audit stage replay: live cache vs fresh prefill of identical token IDs.")
toy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The embedded toy reasoning model.")
app.add_typer(toy_app, name="toy")


@app.callback()
def _every_command(ctx: typer.Context) -> None:
    """Each command says the library's lines (a --quiet among its options, cli.options.Quiet, turns them down as
    it is read), until it ends: a process that runs several commands (a test) starts each afresh."""
    logger = logging.getLogger("stagereplay")
    level = logger.level
    say_on_stderr()

    def done() -> None:
        _unsay(logger)
        logger.setLevel(level)

    ctx.call_on_close(done)


T = TypeVar("T")


def guarded(fn: Callable[[], T]) -> T:
    """Bad input -> one line on stderr naming the problem and the fix, exit code 2 (`REFUSED`); anything else a
    command raises is `OneLineErrors`'s to answer (`exit_code_of`)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    try:
        return fn()
    except StageReplayError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
