"""Commands on a run directory: re-execute it, render its report, tell one item's story, export and merge."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from stagereplay.cli.app import app, guarded
from stagereplay.cli.groups import Group, command, run_dir_argument
from stagereplay.cli.options import quiet_option
from stagereplay.errors import StageReplayError


def _audit(on: Any, config: Any, run_dir: Path, verify_only: bool, quiet: bool) -> None:
    """Re-execute a run from its manifest and ledger. Exit 0: every record re-executed reproduced (and every record
    verified); 1: an integrity finding (tampering or a broken run, whatever the machine); 3: integrity holds, but
    units were not reproduced under this machine's other kernels (the first line names the fields that differ), or
    nothing was re-executed or verified, which is no pass."""

    def go() -> None:
        from stagereplay.audit.reexecute import exit_code
        from stagereplay.records.findings import Break
        from stagereplay.report.audit_lines import count_line, finding_lines, verdict_line, verify_line
        from stagereplay.runs import audit as run

        res = run(run_dir, config, verify_only, on, quiet)
        line = res.environment.line if res.environment else None
        if line:  # why units may not reproduce here: the kernels that made them are not this machine's
            typer.echo(line, err=True)
        for moved in res.relocated or []:
            typer.echo(f"note: {moved['input']} found at {moved['here']} ({moved['how']}), recorded at "
                       f"{moved['recorded']}", err=True)
        for note in res.notes:
            typer.echo(f"note: {note}", err=True)
        for b in res.broken_records:
            typer.echo(f"  ledger record {b.seq}: {b.reason}" if isinstance(b, Break) else f"  ledger record {b}",
                       err=True)
        for line in finding_lines(res):
            typer.echo(line, err=True)
        if res.verify_only:
            typer.echo(verify_line(res))
        else:
            typer.echo(count_line(res))
            typer.echo(verdict_line(res))
        code = exit_code(res)
        if code:
            raise typer.Exit(code)

    guarded(go)


def _audit_command() -> Any:
    from stagereplay.audit.reexecute import AuditConfig
    from stagereplay.runs.extend import Extension

    verify_only = inspect.Parameter("verify_only", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                    default=typer.Option(False, "--verify-only", help="check the ledger's integrity "
                                                                                      "only", rich_help_panel="Audit"))
    return command(_audit, [Group(AuditConfig, "config", panel="Audit"),
                            Group(Extension, "on", hide=frozenset({"checkpoint"}))], [verify_only, quiet_option()],
                   arguments=[run_dir_argument()])


app.command("audit")(_audit_command())


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Rewrite report.md and report.html from results.json."""

    def go() -> None:
        from stagereplay.report.render import write_report

        if not (run_dir / "results.json").exists():
            raise StageReplayError(f"no results.json in {run_dir}", "run an experiment into it first")
        md, html = write_report(run_dir)
        typer.echo(f"wrote {md} and {html}")

    guarded(go)


@app.command()
def show(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    item_id: Annotated[str, typer.Argument(help="the item's id, as in the report's explorer")],
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help="only this model of the run")] = None,
) -> None:
    """One item's story: prompt, stage 1, both suffixes with the divergence marked, margins, cache per layer."""

    def go() -> None:
        from stagereplay.report.explorer import show_item

        show_item(run_dir, item_id, checkpoint)

    guarded(go)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    format: Annotated[str, typer.Option("--format", help="parquet | csv")] = "parquet",
    output: Annotated[Path | None, typer.Option("--output", help="file to write")] = None,
) -> None:
    """One row per item and arm, token IDs included."""

    def go() -> None:
        from stagereplay.report.export import export_ledger

        if format not in ("parquet", "csv"):
            raise StageReplayError(f"unknown export format {format!r}", "use --format parquet or csv")
        if not (run_dir / "ledger.jsonl").exists():
            raise StageReplayError(f"no ledger.jsonl in {run_dir}", "point at a run directory")
        if output is not None and output.is_dir():
            raise StageReplayError(f"--output {output} is a directory", "pass the path of the file to write")
        typer.echo(f"wrote {export_ledger(run_dir, format, output)}")  # type: ignore[arg-type]  # checked above

    guarded(go)


@app.command()
def merge(
    shards: Annotated[list[Path], typer.Argument(help="the shard run directories")],
    out: Annotated[Path, typer.Option("--out", help="the merged run directory (new)")],
) -> None:
    """Join runs made with --shard I/N into the run one process would have made; refuses mismatched shards."""

    def go() -> None:
        from stagereplay.records.ledger import read_manifest
        from stagereplay.records.shards import environment_notes
        from stagereplay.runs import merge

        typer.echo(f"merged {len(shards)} shards into {merge(shards, out)}")
        for note in environment_notes(read_manifest(out)):
            typer.echo(f"note: {note}", err=True)

    guarded(go)


