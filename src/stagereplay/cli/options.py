"""The options that several hand-written commands share (typer reads the annotations); the experiments' commands
make theirs from the library's option groups (`cli.groups`)."""

from __future__ import annotations

import inspect
from pathlib import Path
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


# Options of `plan`, which prices what `paper` would run.
Model = Annotated[str | None, typer.Option("--model", help=(
    "local model directory, or a .gguf file (default: the embedded toy)"))]
Data = Annotated[str | None, typer.Option("--data", help=(
    "items: a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk folder, or hf:NAME[:CONFIG][:SPLIT] "
    "(default: the toy task's held-out items)"))]
Device = Annotated[str, typer.Option("--device", help="cpu | cuda | cuda:<i>")]
Threads = Annotated[int, typer.Option("--threads", help="torch threads per process (fixed, recorded)")]
Cache = Annotated[str, typer.Option("--cache", help=(
    "dynamic (the default: grows per step, equals generate()) | static (preallocated, equals "
    "generate(cache_implementation='static'); CUDA-graph captured on a GPU)"))]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="suffix length limit")]
MaxStage1 = Annotated[int | None, typer.Option("--max-stage1-tokens", help=(
    "tokens allowed to reach the boundary (default: 8192 or what the context leaves)"))]
Batch = Annotated[int, typer.Option("--batch", help=(
    "items stepping together: up to C items' decode steps share one forward of C rows, each row batch-invariant "
    "(its attention per item; recorded, and later stages and the audit follow it); 1 = one item at a time"))]
Kernels = Annotated[str, typer.Option("--kernels", help=(
    "CPU kernels: native (this machine's own) | portable (ATen and oneDNN on AVX2, MKL on its branch for every "
    "vendor: the same bits on every x86-64 CPU with AVX2) | auto (portable for the embedded toy on a CPU, else native)"))]
LaterModel = Annotated[str | None, typer.Option("--later-model", help="second checkpoint")]
Items = Annotated[int, typer.Option("--n")]
Select = Annotated[str, typer.Option("--select", help="transplant selection at the primary checkpoint")]
BridgeRows = Annotated[int, typer.Option("--rows", help="bridge rows")]
Sweep = Annotated[bool, typer.Option("--sweep/--no-sweep", help="layer sweep at the primary checkpoint")]
Resample = Annotated[int, typer.Option("--resample", help="K sampled draws per state (0: no resample stage)")]
ResampleItems = Annotated[int, typer.Option("--resample-items", help="items the resample stage draws on")]
Processes = Annotated[int, typer.Option("--workers", help="processes; 0 = one per core on CPU (at most 2)")]

RunDir = Annotated[Path, typer.Argument(help="a run directory made by `stagereplay matched` or `paper`")]
