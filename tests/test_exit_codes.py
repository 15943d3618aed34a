"""Every command's exit code means one thing (`stagereplay.errors`): a crash anywhere in any command is FAILED (4) with
its traceback and one closing line, never 1, which is FLAGGED (a verdict that accuses); bad input is one line and
REFUSED (2); Ctrl-C is 130; a command's own exit code passes through. Every registered command is held to it, its
list taken from the app (the registry's experiments included), and so is the console script `pyproject.toml` names,
run as pip's wrapper runs it, in a process of its own.

The crash is injected where each command's body calls into the library (`CRASH_AT`), after its options were read: a
command with no entry here fails the check by name."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.cli.app import COMMANDS
from stagereplay.errors import FAILED, FLAGGED, INCONCLUSIVE, REFUSED, StageReplayError

runner = CliRunner()
ROOT = Path(__file__).parents[1]
CRASH_AT: dict[str, tuple[str, str, list[str]]] = {
    "paper": ("stagereplay.runs", "paper", ["--out", "{tmp}/paper"]),
    "plan": ("stagereplay.plan.paper", "plan", []),
    "audit": ("stagereplay.runs", "audit", ["{run}"]),
    "report": ("stagereplay.report.render", "write_report", ["{run}"]),
    "show": ("stagereplay.report.explorer", "show_item", ["{run}", "an-item"]),
    "export": ("stagereplay.report.export", "export_ledger", ["{run}", "--output", "{tmp}/rows.parquet"]),
    "merge": ("stagereplay.runs", "merge", ["{run}", "--out", "{tmp}/merged"]),
    "compare": ("stagereplay.runs.compare", "compare", ["{run}", "{run}"]),
    "toy train": ("stagereplay.toy.train", "train", ["--out", "{tmp}/toy"]),
    "toy items": ("stagereplay.tasks.toy", "toy_jsonl", ["--out", "{tmp}/items.jsonl"]),
}
"""Per command (its path under `stagereplay`): the library function its body calls (module, name) and the arguments
that reach it. An experiment's command is the registry's (`_crash_at`)."""


def _leaves(group: Any, path: tuple[str, ...] = ()) -> Iterator[str]:
    ctx = group.context_class(group, info_name="stagereplay")
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if hasattr(command, "commands"):
            yield from _leaves(command, (*path, name))
        else:
            yield " ".join((*path, name))


COMMAND_PATHS = sorted(_leaves(typer.main.get_command(app)))


def _crash_at(path: str) -> tuple[str, str, list[str]] | None:
    from stagereplay.experiments.core.registry import all_experiments

    for e in all_experiments():
        if e.command == path:
            return ("stagereplay.runs", "make_run", ["--out", "{tmp}/run"]) if e.shape.starts_run else (
                "stagereplay.runs", "extend", ["{run}"])
    return CRASH_AT.get(path)


def _run_dir(tmp: Path) -> Path:
    """What the commands look for before they call into the library: a folder with a ledger and results."""
    run = tmp / "a-run"
    run.mkdir(exist_ok=True)
    (run / "ledger.jsonl").write_text("")
    (run / "results.json").write_text("{}")
    return run


def _args(path: str, args: list[str], tmp: Path) -> list[str]:
    run = _run_dir(tmp)
    return [*path.split(), *(a.format(tmp=tmp, run=run) for a in args)]


def _raising(exc: BaseException) -> Any:
    def raises(*_: Any, **__: Any) -> Any:
        raise exc

    return raises


def _invoke(args: list[str]) -> Result:
    return runner.invoke(app, args, env={"COLUMNS": "120"})


def _crashed(result: Result, message: str) -> None:
    assert result.exit_code == FAILED != FLAGGED, result.output
    lines = result.output.strip().splitlines()
    assert "Traceback (most recent call last)" in result.output, result.output
    assert lines[-1] == (f"error: internal failure ({message}); a bug in stagereplay, not a verdict: please report "
                         "it with the traceback above"), result.output


def test_the_app_lists_the_commands_the_check_covers():
    """The parametrized list below is the app's, experiments and `toy` included: not a copied list."""
    assert {"matched", "attest", "audit", "plan", "paper", "toy train"} <= set(COMMAND_PATHS)


@pytest.mark.parametrize("path", COMMAND_PATHS)
def test_a_crash_in_any_command_exits_failed_never_flagged(path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    at = _crash_at(path)
    assert at is not None, f"`stagereplay {path}` has no crash point in CRASH_AT: add the function its body calls"
    module, name, args = at
    # The module itself (`stagereplay.runs.compare` is also the name of a function `stagereplay.runs` exports).
    monkeypatch.setattr(importlib.import_module(module), name, _raising(RuntimeError("injected\nsecond line")))
    _crashed(_invoke(_args(path, args, tmp_path)), "RuntimeError: injected")


@pytest.mark.parametrize(("raised", "code", "says"), [
    (StageReplayError("the run is bad", "pass a good one"), REFUSED, "error: the run is bad; pass a good one"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (typer.Exit(INCONCLUSIVE), INCONCLUSIVE, None),
    (SystemExit(5), 5, None),
    (BrokenPipeError(), FAILED, "error: the output was closed before the command finished (broken pipe)"),
])
def test_what_is_not_a_crash_keeps_its_exit(raised: BaseException, code: int, says: str | None, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch):
    """Bad input raised deep in a command is one line and REFUSED; Ctrl-C is 130; an exit code (a verdict) passes
    through; a closed pipe is a failure, not a bug."""
    monkeypatch.setattr("stagereplay.runs.audit", _raising(raised))
    result = _invoke(["audit", str(_run_dir(tmp_path))])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output, result.output
    assert result.output.strip() == (says or ""), result.output


def test_every_command_shows_its_help():
    """`--help` of every command exits 0 with each of its options listed: a help text that rich reads as markup
    (`ENGINE[/SETTING]` is a closing tag to it) would crash it. The control is such a text shown unescaped."""
    from rich.console import Console
    from rich.errors import MarkupError

    command = typer.main.get_command(app)
    assert isinstance(command, typer.core.TyperGroup)
    for name in command.list_commands(typer.Context(command)):
        result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "Traceback" not in result.output, (name, result.output)
        sub = command.get_command(typer.Context(command), name)
        assert sub is not None
        for param in sub.params:
            shown = [o for o in getattr(param, "opts", []) if o.startswith("--")]
            assert not shown or shown[0] in result.output, (name, shown)
    with pytest.raises(MarkupError):
        Console().print("ENGINE[/SETTING...]")


def test_a_crash_before_any_command_runs_exits_failed(monkeypatch: pytest.MonkeyPatch):
    """What fails while the command line is read (`--help` lists the commands) is answered as a command's crash."""
    def broken() -> dict[str, Any]:
        raise ValueError("a command source that cannot list its commands")

    COMMANDS.append(broken)
    try:
        result = _invoke(["--help"])
    finally:
        COMMANDS.remove(broken)
    _crashed(result, "ValueError: a command source that cannot list its commands")


def test_the_console_script_maps_a_crash_to_failed(tmp_path: Path):
    """The entry point `pyproject.toml` names, called as pip's console-script wrapper calls it
    (`sys.exit(<entry>())`), in a fresh process: a crash deep in `report` exits 4 with its traceback on stderr."""
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]")[1].split("\n[")[0]
    found = re.search(r'^stagereplay\s*=\s*"([\w.]+):(\w+)"', scripts, re.MULTILINE)
    assert found, scripts
    module, attr = found.groups()

    def run(raised: str) -> subprocess.CompletedProcess[str]:
        code = (
            "import importlib, sys\n"
            "import stagereplay.report.render as render\n"
            "from stagereplay.errors import StageReplayError\n"
            "def fails(*a, **k):\n"
            f"    raise {raised}\n"
            "render.write_report = fails\n"
            f"sys.argv = ['stagereplay', 'report', {str(_run_dir(tmp_path))!r}]\n"
            f"sys.exit(getattr(importlib.import_module({module!r}), {attr!r})())\n"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)

    done = run("ZeroDivisionError('deep in the report')")
    assert done.returncode == FAILED, (done.returncode, done.stderr)
    assert "Traceback (most recent call last)" in done.stderr and "ZeroDivisionError" in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: internal failure (ZeroDivisionError: deep in the report); a bug in stagereplay"), done.stderr
    # The control: bad input raised at the same place is one line and REFUSED.
    refused = run("StageReplayError('the results are bad', 'rebuild them')")
    assert refused.returncode == REFUSED and refused.stderr == "error: the results are bad; rebuild them\n", \
        refused.stderr
