"""`plan`: what `paper` (or a run made) costs, counted from the model's config alone; runs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stagereplay.cli.app import app, guarded
from stagereplay.cli.options import (
    Batch,
    BridgeRows,
    Cache,
    Data,
    Device,
    Items,
    Kernels,
    LaterModel,
    MaxNew,
    MaxStage1,
    Model,
    Processes,
    Resample,
    ResampleItems,
    Select,
    Sweep,
    Threads,
)
from stagereplay.errors import StageReplayError


@app.command()
def plan(
    run_dir: Annotated[Path | None, typer.Argument(help="a run: plan it with its measured lengths")] = None,
    model: Model = None,
    later_model: LaterModel = None,
    data: Data = None,
    n: Items = 200,
    max_new_tokens: MaxNew = 128,
    max_stage1_tokens: MaxStage1 = None,
    select: Select = "first:24",
    rows: BridgeRows = 12,
    sweep: Sweep = False,
    device: Device = "cpu",
    threads: Threads = 1,
    workers: Processes = 0,
    stage1_tokens: Annotated[int | None, typer.Option("--stage1-tokens", help=(
        "assumed stage-1 length (default: the stage-1 budget)"))] = None,
    suffix_tokens: Annotated[int | None, typer.Option("--suffix-tokens", help=(
        "assumed suffix length (default: --max-new-tokens)"))] = None,
    prompt_tokens: Annotated[int | None, typer.Option("--prompt-tokens", help=(
        "assumed prompt length (default: the items' as tokenized)"))] = None,
    divergent: Annotated[int | None, typer.Option("--divergent", help=(
        "items whose live and fresh suffixes diverge (default: all)"))] = None,
    audit_sample: Annotated[int | None, typer.Option("--audit-sample", help=(
        "units per stage the audit re-executes (0: every unit; default: paper's, or what RUN's audit did)"))] = None,
    no_dedup: Annotated[bool, typer.Option("--no-dedup", help="count the 2x2 and the transplants decoding the matched arms again")] = False,
    resample: Resample = 0,
    resample_items: ResampleItems = 50,
    tokens_per_second: Annotated[float | None, typer.Option("--tokens-per-second", help=(
        "decode steps per second (any forward costs one)"))] = None,
    prefill_tokens_per_second: Annotated[float | None, typer.Option("--prefill-tokens-per-second", help=(
        "prefill tokens per second, on top of the forward's step"))] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help=(
        "measure the rates on the real model (on a CPU, in as many processes at once as --workers)"))] = False,
    row_ms: Annotated[float | None, typer.Option("--row-ms", help=(
        "with --batch: what each row beyond the first adds to a batched step, in ms (--calibrate measures it)"))] = None,
    cache: Cache = "dynamic",
    kernels: Kernels = "auto",
    batch: Batch = 1,
) -> None:
    """What `paper` (or the run RUN) costs: forwards, caches, weights and time per stage; runs nothing."""

    def go() -> None:
        import os

        from stagereplay.experiments.transplant import parse_selection
        from stagereplay.plan.paper import plan as make_plan
        from stagereplay.plan.rates import Rates
        from stagereplay.plan.stages import PlanConfig

        parse_selection(select)
        for name, rate in (("--tokens-per-second", tokens_per_second),
                           ("--prefill-tokens-per-second", prefill_tokens_per_second)):
            if rate is not None and not 0 < rate < float("inf"):
                raise StageReplayError(f"{name} must be positive, got {rate}", f"pass e.g. {name} 40")
        from stagereplay.runs.protocol import AUDIT_SAMPLE

        w = workers or (min(2, os.cpu_count() or 1) if device == "cpu" else 1)
        sample = AUDIT_SAMPLE if audit_sample is None and run_dir is None else audit_sample
        cfg = PlanConfig(n=n, suffix_tokens=suffix_tokens or max_new_tokens, stage1_tokens=stage1_tokens,
                         prompt_tokens=prompt_tokens, divergent=divergent, bridge_rows=rows, select=select,
                         sweep=sweep, later=later_model is not None or model is None, audit_sample=sample,
                         dedup=not no_dedup, workers=w, resample=resample, resample_items=resample_items,
                         cache=cache, max_new_tokens=max_new_tokens, batch=batch, device=device)
        if row_ms is not None and not 0 <= row_ms < float("inf"):
            raise StageReplayError(f"--row-ms must be 0 or more, got {row_ms}", "pass e.g. --row-ms 2")
        rates = None
        if tokens_per_second is not None:
            rates = Rates({"": tokens_per_second},
                          {"": prefill_tokens_per_second} if prefill_tokens_per_second else {},
                          f"{tokens_per_second:g} steps/s"
                          + (f", {prefill_tokens_per_second:g} prefill tokens/s" if prefill_tokens_per_second else "")
                          + (f", {row_ms:g} ms per extra row" if batch > 1 and row_ms is not None else ""),
                          {"": row_ms / 1e3} if row_ms is not None else {})
        elif batch > 1 and row_ms is not None and not calibrate:
            raise StageReplayError("--row-ms prices a batched step on top of --tokens-per-second",
                                   "pass --tokens-per-second too, or --calibrate")
        typer.echo(make_plan(cfg, model, data, run_dir, max_stage1_tokens, rates,
                             {"device": device, "threads": threads} if calibrate else None, kernels))

    guarded(go)


