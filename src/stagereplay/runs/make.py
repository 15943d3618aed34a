"""Making a run directory, and what every command that writes one shares: the manifest made from the prepared run,
the run, its results and report.

    make_run(out, experiment, options, inputs, engine, ex)   a run from a model and items (`matched`, ...)

Every check that can fail on bad input runs in `runs.prepare`, before the run directory is created, so a bad input
never leaves a half-written run behind.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.core.prepared import OURS, PreparedRun, RunEngine
from stagereplay.records.ledger import SCHEMA_VERSION, Run, open_run
from stagereplay.records.manifest import Manifest, RunConfig
from stagereplay.records.provenance import environment, model_hashes, now, package_versions
from stagereplay.runs.inputs import Inputs
from stagereplay.runs.prepare import prepare

if TYPE_CHECKING:
    from stagereplay.report.results import Results


def new_manifest(prepared: PreparedRun, options: Mapping[str, Any], models: Mapping[str, str] | None = None
                 ) -> Manifest:
    """The frozen record of what this run is, made from the prepared run: its `config` is the run's identity
    (resuming requires it unchanged), the command's `options` in it beside the model, items and settings."""
    from stagereplay.tasks.scoring import scorer_versions

    models = {"primary": prepared.model.path, **(models or {})}
    scorer_packages = scorer_versions(prepared.settings.scorer)  # math-verify's version decides `math` labels
    config = RunConfig.model_validate({
        **options,
        "model": prepared.model.as_dict(),
        "data": prepared.data.as_dict(),
        "settings": prepared.settings.as_dict(),
        "dataset_hash": prepared.data_hash,
        "item_ids": [i.id for i in prepared.items],
        "model_hashes": {name: model_hashes(path) for name, path in models.items()},
        **({"stage1": prepared.stage1.as_json()} if prepared.stage1 is not None else {}),
        **({"scorer_packages": scorer_packages} if scorer_packages else {}),
    })
    env = environment(prepared.model.device, dict(prepared.determinism))
    if prepared.engine_identity is not None:  # the engine's version and settings, frozen before the first item
        env["engine"] = dict(prepared.engine_identity)
    return Manifest(schema_version=SCHEMA_VERSION, tool="stagereplay", tool_version=package_versions()["stagereplay"],
                    created=now(), command=prepared.command, config=config, environment=env)


def finish(run: Run, quiet: bool = False) -> Results:
    """Rebuild results.json from the whole ledger, write the report, print the tables."""
    from stagereplay.execution.local import shutdown_workers
    from stagereplay.report.results import build_results

    shutdown_workers()
    results = build_results(run.path, run.manifest, run.records)
    run.write_results(results.as_json())
    write_and_print_report(run.path, results, quiet)
    return results


def write_and_print_report(run_dir: Path, results: Results, quiet: bool) -> None:
    from stagereplay.report.render import print_tables, write_report

    write_report(run_dir)
    if not quiet:
        from rich.console import Console

        print_tables(results, Console())


def make_run(out: str | Path, experiment: Experiment, options: Any = None, inputs: Inputs | None = None,
             engine: RunEngine = OURS, ex: ExecConfig | None = None, quiet: bool = False) -> Results:
    """Run (or resume) `experiment` with `options` (its `Options`) into a new run directory `out`, on `engine`;
    return results.json's content (`Results`). With `inputs.input.shard="I/N"` only every N-th item from the I-th runs;
    `stagereplay merge` joins the shards."""
    options = experiment.Options() if options is None else options
    inputs = inputs or Inputs()
    prepared = prepare(experiment.name, inputs, experiment, options, engine, ex, quiet)
    identity = engine.run_identity(experiment, options)
    if inputs.input.shard is not None:
        identity["shard"] = inputs.input.shard
    with open_run(Path(out), new_manifest(prepared, identity)) as run:
        experiment.run(run, prepared, options)
        results = finish(run, quiet)
    experiment.check_outcome(results.of(experiment), prepared)
    return results
