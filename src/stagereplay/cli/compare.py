"""`stagereplay compare RUN_A RUN_B [--out DIR]`: two runs of the same items under two settings, item by item."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stagereplay.cli.app import app, guarded
from stagereplay.cli.options import Quiet


@app.command()
def compare(
    run_a: Annotated[Path, typer.Argument(help="run A: a run directory with matched (or mismatch) records")],
    run_b: Annotated[Path, typer.Argument(help="run B: the same model and items under another setting")],
    out: Annotated[Path | None, typer.Option("--out", help="folder for compare.json, compare.md and compare.html "
                                                           "(default: <A>-vs-<B> beside run A)")] = None,
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="the model of the runs to compare")] = "primary",
    quiet: Quiet = False,
) -> None:
    """Two runs of one model and the same items under two settings (servers, engine options, engines,
    precisions): live trajectories equal, the first divergence and its margins, suffix and label disagreements
    per arm with the paired CI and McNemar's p, and what differs between the manifests. Two mismatch runs (two
    rollout engines or files, an engine option): the rollouts' tokens, B's log-probabilities against A's on the
    same tokens, and each attribution row side by side. Both ledgers are verified first; runs of different models,
    tokenizers or items are refused. Exit 0 when it compared: a difference is a finding."""

    def go() -> None:
        from stagereplay.report.compare_render import FILES, print_compare
        from stagereplay.runs.compare import compare as run
        from stagereplay.runs.compare import default_out

        comparison = run(run_a, run_b, out, checkpoint)
        folder = out if out is not None else default_out(run_a, run_b)
        if not quiet:
            print_compare(comparison)
        if not quiet or out is None:  # a folder chosen for the user is named even when --quiet
            typer.echo(f"wrote {', '.join(str(folder / name) for name in FILES)}"
                       + ("" if out is not None else " (no --out given: beside run A)"))

    guarded(go)
