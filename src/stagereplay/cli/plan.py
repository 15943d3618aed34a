"""`plan`: what `paper` (or a run made) costs, counted from the model's config alone; runs nothing. Its options are
the groups `paper` is made of where they change the cost (the input, decoding, numerics, the protocol), the lengths
it assumes (`plan.stages.PlanConfig`) and the rates it prices at (`plan.rates.RateOptions`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from stagereplay.cli.app import app, guarded
from stagereplay.cli.groups import Group, command

HIDDEN = frozenset({"input.n", "input.columns", "input.shard", "input.scorer", "boundary", "decode.sample",
                    "decode.temperature", "decode.top_k", "decode.seed", "decode.top_p", "numerics.precision",
                    "numerics.attn_impl", "numerics.static_len"})
"""What of `paper`'s input changes no count (how items are read and scored, the boundary rule, sampling), what
`paper` fixes itself (its precision), and the items, which the plan's own `--n` counts (`PlanConfig.n`)."""


def _plan_command() -> Callable[..., None]:
    from stagereplay.plan.rates import RateOptions
    from stagereplay.plan.stages import PlanConfig
    from stagereplay.runs.inputs import Inputs

    def body(inputs: Any, assumed: Any, rates: Any, run_dir: Path | None, workers: int) -> None:
        def go() -> None:
            from dataclasses import replace

            from stagereplay.plan.paper import plan
            from stagereplay.runs.protocol import AUDIT_SAMPLE, auto_workers

            model, numerics, decode = inputs.input.model, inputs.numerics, inputs.decode
            cfg = replace(
                assumed, later=assumed.protocol.later_checkpoint(model) is not None,
                audit_sample=AUDIT_SAMPLE if assumed.audit_sample is None and run_dir is None else assumed.audit_sample,
                workers=workers or auto_workers(numerics.device), cache=numerics.cache, max_new_tokens=decode.max_new_tokens, batch=numerics.batch,
                device=numerics.device)
            calibrate_on = {"device": numerics.device, "threads": numerics.threads} if rates.calibrate else None
            typer.echo(plan(cfg, model, inputs.input.data, run_dir, decode.max_stage1_tokens,
                            rates.given(numerics.batch), calibrate_on, numerics.kernels))

        guarded(go)

    run_dir = inspect.Parameter("run_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Path | None,
                                default=typer.Argument(None, help="a run: plan it with its measured lengths"))
    workers = inspect.Parameter("workers", inspect.Parameter.KEYWORD_ONLY, annotation=int, default=typer.Option(
        0, "--workers", help="processes; 0 = one per core on CPU (at most 2)", rich_help_panel="Execution"))
    groups = [Group(Inputs, "inputs", hide=HIDDEN),
              Group(PlanConfig, "assumed", hide=frozenset({"protocol.audit_sample"}), helps={"audit_sample": (
                  "units per stage and part (a precision, an honest variant) the audit re-executes (0: every unit; default: "
                  "paper's, or what RUN's audit did)")}),
              Group(RateOptions, "rates")]
    return command(body, groups, [workers], doc="What `paper` (or the run RUN) costs: forwards, caches, weights and "
                                                "time per stage; runs nothing.", arguments=[run_dir])


app.command("plan")(_plan_command())
