"""The experiments' commands, made from the registry when the command line is read: an experiment's command takes its
own options (`Experiment.Options`) and either the groups a run is made from (one that `starts_run`: the input, the
stage boundary, decoding, numerics, execution, the engine and each engine's own options, `--out`) or the run it
extends (`RUN_DIR` and where its stage runs: the checkpoint, the processes, inputs that moved). An experiment
registered at run time (an extension's, a test's) gets its command the same way, with no edit here. `paper` runs
them all.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from stagereplay.cli.app import COMMANDS, app, guarded
from stagereplay.cli.groups import Group, command, run_dir_argument
from stagereplay.cli.options import quiet_option

if TYPE_CHECKING:
    from stagereplay.report.results import Results


def _experiments() -> list[Any]:
    from stagereplay.experiments.core.registry import all_experiments

    return [e for e in all_experiments() if e.command]


def _engine_groups() -> list[Group]:
    """Each serving engine's options in its panel, not given unless on the command line; an option two engines take
    shows once."""
    from stagereplay.serving.engines import ENGINES

    groups: list[Group] = []
    seen: set[str] = set()
    for i, kind in enumerate(ENGINES.values()):
        from dataclasses import fields

        names = {f.name for f in fields(kind.options)}
        groups.append(Group(kind.options, f"engine_{i}", panel=f"{kind.title or kind.name} options",
                            hide=frozenset(names & seen), given_only=True))
        seen |= names
    return groups


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The serving engines' options given on the command line, merged (each engine refuses another's)."""
    out: dict[str, Any] = {}
    for key in sorted(values):
        out.update(values[key])
    return out


def _panel(experiment: Any) -> str:
    return getattr(experiment.Options, "panel", None) or f"{experiment.command} options"


def _exit(experiment: Any, results: Results) -> None:
    code = experiment.exit_code(results.of(experiment))
    if code:
        raise typer.Exit(code)


def starting_command(experiment: Any) -> Callable[..., None]:
    """The command of an experiment that makes a run from a model and items."""
    from stagereplay.execution.config import ExecConfig
    from stagereplay.plan.rates import RateOptions
    from stagereplay.runs.inputs import EngineChoice, Inputs

    engines = _engine_groups()

    def body(inputs: Any, ex: Any, choice: Any, options: Any, rates: Any, out: Path | None, plan: bool, quiet: bool,
             **engine_options: Any) -> None:
        def go() -> None:
            from stagereplay.errors import StageReplayError
            from stagereplay.runs import engine_of, make_run

            engine = engine_of(choice.engine, choice.cross, _given(engine_options))
            if plan:
                from stagereplay.plan.experiment import plan_experiment
                from stagereplay.runs.prepare import data_config

                experiment.check_inputs(inputs, options)
                numerics = inputs.numerics
                calibrate_on = {"device": numerics.device, "threads": numerics.threads} if rates.calibrate else None
                typer.echo(plan_experiment(experiment, options, inputs.input.model,
                                           data_config(inputs, experiment, options), inputs.decode,
                                           numerics.precision, engine.serves, rates.given(numerics.batch),
                                           calibrate_on))
                return
            if rates != RateOptions():
                raise StageReplayError("the rates price a plan, and this command runs",
                                       "add --plan, or drop the rate options")
            if out is None:
                raise StageReplayError("no run directory given", "pass --out DIR (or --plan to price the run)")
            _exit(experiment, make_run(out, experiment, options, inputs, engine, ex, quiet))

        guarded(go)

    out = inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=Path | None, default=typer.Option(
        None, "--out", help="run directory (created, or resumed); required unless --plan"))
    plan = inspect.Parameter("plan", inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=typer.Option(
        False, "--plan", help="price the run on our engine before it runs (forwards, caches, weights per stage): "
                              "runs nothing, writes nothing"))

    def own(of_choice: bool, names: Any) -> Any:  # its names in the engine choice's group (`choice.`), or the inputs'
        return {n.removeprefix("choice."): v for n, v in names if n.startswith("choice.") == of_choice}

    ignored = [(n, True) for n in experiment.ignores]
    groups = [Group(Inputs, "inputs", hide=frozenset(own(False, ignored)), helps=own(False, experiment.helps.items()),
                    defaults=own(False, experiment.defaults.items())),
              Group(experiment.Options, "options", panel=_panel(experiment)), Group(ExecConfig, "ex"),
              Group(EngineChoice, "choice", hide=frozenset(own(True, ignored)), helps=own(True, experiment.helps.items())),
              *engines, Group(RateOptions, "rates", helps={
                  "tokens_per_second": "with --plan: our engine's decode steps per second (any forward costs one)",
                  "calibrate": "with --plan: measure the rates on the real model first"})]
    return command(body, groups, [out, plan, quiet_option()], doc=experiment.__doc__)


def extending_command(experiment: Any) -> Callable[..., None]:
    """The command of an experiment that adds a stage to a run."""
    from stagereplay.runs.extend import Extension

    def body(on: Any, options: Any, run_dir: Path, quiet: bool) -> None:
        def go() -> None:
            from stagereplay.runs import extend

            _exit(experiment, extend(run_dir, experiment, options, on, quiet))

        guarded(go)

    groups = [Group(experiment.Options, "options", panel=_panel(experiment)),
              Group(Extension, "on", hide=frozenset({"where.data", "where.server"}))]
    return command(body, groups, [quiet_option()], doc=experiment.__doc__, arguments=[run_dir_argument()])


def experiment_commands() -> dict[str, tuple[Callable[..., None], str | None]]:
    """Every registered experiment's command, by name, with its help."""
    return {e.command: (starting_command(e) if e.shape.starts_run else extending_command(e), e.__doc__)
            for e in _experiments()}


COMMANDS.append(experiment_commands)


def _paper_command() -> Callable[..., None]:
    from stagereplay.runs.inputs import Inputs
    from stagereplay.runs.protocol import PaperConfig

    def body(inputs: Any, protocol: Any, out: Path, workers: int, executor: str, quiet: bool) -> None:
        def go() -> None:
            from stagereplay.audit.reexecute import exit_code
            from stagereplay.runs import paper as run

            res = run(out, inputs, protocol, workers, executor, quiet)
            typer.echo(f"report: {out / 'report.html'}")
            if res.audit is not None and exit_code(res.audit):
                raise typer.Exit(exit_code(res.audit))

        guarded(go)

    hidden = frozenset({"input.shard", "numerics.precision", "numerics.static_len", "decode.sample",
                        "decode.temperature", "decode.top_k", "decode.seed", "decode.top_p"})
    extra = [
        inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, annotation=Path, default=typer.Option(
            Path("stagereplay-paper"), "--out", help="run directory")),
        inspect.Parameter("workers", inspect.Parameter.KEYWORD_ONLY, annotation=int, default=typer.Option(
            0, "--workers", help="processes; 0 = one per core on CPU (at most 2)", rich_help_panel="Execution")),
        inspect.Parameter("executor", inspect.Parameter.KEYWORD_ONLY, annotation=str, default=typer.Option(
            "local", "--executor", help="local | ray", rich_help_panel="Execution")),
        quiet_option(),
    ]
    groups = [Group(Inputs, "inputs", hide=hidden, defaults={"input.n": 200, "numerics.batch": 0}, helps={
        "numerics.batch": ("items stepping together (as matched's --batch); 0 = auto: 16 for the embedded toy on a CPU, "
                           "1 for your model on a CPU, on a GPU what its memory holds beside the weights (at most 32)")}),
              Group(PaperConfig, "protocol")]
    return command(body, groups, extra, doc="The whole protocol in one command, then the report (defaults: the "
                                            "embedded toy model).")


app.command("paper")(_paper_command())
