"""`stagereplay toy ...`: train the embedded toy model, write its held-out items."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stagereplay.cli.app import guarded, toy_app
from stagereplay.errors import StageReplayError


@toy_app.command("train")
def toy_train(
    out: Annotated[Path, typer.Option("--out", help="folder for the primary and later checkpoints")],
    steps: Annotated[int | None, typer.Option("--steps", help="training steps (default: the shipped run's)")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    threads: Annotated[int | None, typer.Option("--threads")] = None,
) -> None:
    """Train the embedded toy model from scratch (deterministic for a seed and thread count)."""

    def go() -> None:
        from dataclasses import replace

        from stagereplay.toy.train import TrainConfig, train

        for name, value in (("--steps", steps), ("--threads", threads)):
            if value is not None and value < 1:
                raise StageReplayError(f"{name} must be at least 1, got {value}", f"pass a positive {name}")
        config = TrainConfig(out=out)
        train(replace(config, steps=config.steps if steps is None else steps,
                      seed=config.seed if seed is None else seed,
                      threads=config.threads if threads is None else threads))

    guarded(go)


@toy_app.command("items")
def toy_items_command(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write (refused if it exists)")],
    n: Annotated[int, typer.Option("--n", help="held-out items")] = 200,
) -> None:
    """Write the toy's held-out items as `messages` JSONL: `--data` of this file runs exactly the default items."""

    def go() -> None:
        from stagereplay.records.ledger import atomic_write
        from stagereplay.tasks.toy import HELDOUT_SEED, toy_jsonl

        if n < 1:
            raise StageReplayError(f"--n must be at least 1, got {n}", "pass a positive --n")
        if out.exists():
            raise StageReplayError(f"{out} already exists", "pass a new --out path")
        atomic_write(out, toy_jsonl(n, HELDOUT_SEED))
        typer.echo(f"wrote {n} toy items to {out}")

    guarded(go)

