"""Extending a run directory: another experiment's stage at one of its checkpoints (`extend`), the audit, and the
merge of shards.

An experiment that extends a run starts from the stage that made the run at that checkpoint (its model, where it is
now; its settings; its engine): `prepared_at` turns it into the prepared run the experiment makes its stage from, as
a command that makes a run does (`runs.prepare`). What the run's engine cannot run is refused in one line before
anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from stagereplay.audit.reexecute import AuditConfig
from stagereplay.audit.relocate import FLAGS, Relocation, relocate
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.kernels import follow_run
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.core.jobs import ReplaySettings
from stagereplay.experiments.core.prepared import PreparedRun, frozen
from stagereplay.experiments.core.registry import all_experiments
from stagereplay.experiments.core.serving_run import stage_engine
from stagereplay.records.audit_summary import AuditSummary
from stagereplay.records.ledger import open_run, read_ledger, read_manifest
from stagereplay.records.manifest import Manifest, StageSection
from stagereplay.records.shards import merge_runs
from stagereplay.report.results import Results
from stagereplay.runs.make import finish


@dataclass(frozen=True)
class Extension:
    """Where a later stage runs on a run directory: which of its models, in which processes, with the run's inputs
    where they are now (each checked against the run's hashes before anything runs)."""

    panel: ClassVar[str] = "Run"

    checkpoint: str = field(default="primary", metadata={"help": "which model of the run"})
    ex: ExecConfig = field(default_factory=ExecConfig, metadata={"help": "processes and backend"})
    where: Relocation = field(default_factory=Relocation, metadata={"help": "inputs that moved since the run"})


def existing_run(run_dir: str | Path, check_ledger: bool = True) -> tuple[Path, Manifest]:
    path = Path(run_dir)
    if not (path / "manifest.json").exists():
        starters = " or ".join(f"`stagereplay {e.command} --out`" for e in all_experiments() if e.shape.starts_run)
        raise StageReplayError(f"no run in {path} (manifest.json missing)", f"run {starters} first")
    if check_ledger:
        read_ledger(path, strict=False)  # a newer schema is named before its manifest is read
    manifest = read_manifest(path)
    follow_run(manifest.environment)  # the kernels the run was made with, where this process can still choose them
    if check_ledger:
        read_ledger(path)  # a newer schema or a broken chain stops here, before anything runs
    return path, manifest


def origin(manifest: Manifest, checkpoint: str) -> StageSection:
    """The stage that made the run at `checkpoint` (an experiment that starts runs): what a later stage starts from."""
    for e in all_experiments():
        stage = manifest.stage(f"{e.name}/{checkpoint}")
        if e.shape.starts_run and stage is not None:
            return stage
    starters = " or ".join(f"`stagereplay {e.command}`" for e in all_experiments() if e.shape.starts_run)
    raise StageReplayError(f"the run has no stage at checkpoint {checkpoint!r} to extend", f"run {starters} into it "
                                                                                             "first")


def prepared_at(manifest: Manifest, command: str, on: Extension, quiet: bool) -> PreparedRun:
    """The prepared run a stage at `on.checkpoint` is made from: the originating stage's model (where `on.where` says
    it is now, checked against the run's hashes), settings and engine, the run's items' hash and stage-1 facts."""
    here, _ = relocate(manifest, on.where, need_inputs=False)
    stage = origin(here, on.checkpoint)
    if not Path(stage.model.path).exists():  # a folder, or a GGUF file
        raise StageReplayError(f"the run's {on.checkpoint} model is not at {stage.model.path}",
                               f"pass {FLAGS.get(on.checkpoint, '--model')} PATH where it is now (checked against the "
                               "run's hashes)")
    engine = stage_engine(stage)
    from stagereplay.tasks import DataConfig

    config = here.config
    return PreparedRun(command=command, model=engine.model(stage.model.config()), data=DataConfig(**config.data.as_config()),
                       settings=ReplaySettings.of(stage.settings), stage1=config.stage1, items=(),
                       data_hash=config.dataset_hash, engine=engine, determinism=frozen({}), ex=on.ex,
                       checkpoint=on.checkpoint, quiet=quiet)


def extend(run_dir: str | Path, experiment: Experiment, options: Any = None, on: Extension | None = None,
           quiet: bool = False) -> Results:
    """Run `experiment` with `options` into the run at `run_dir` (its stage at `on.checkpoint`), then rebuild its
    results and report."""
    options = experiment.Options() if options is None else options
    on = on or Extension()
    path, manifest = existing_run(run_dir)
    prepared = prepared_at(manifest, experiment.name, on, quiet)
    prepared.engine.check_run(experiment, on.ex, prepared.settings.decode)
    prepared.engine.check(experiment, prepared.model, options)
    with open_run(path, manifest) as run:
        experiment.run(run, prepared, options)
        return finish(run, quiet)


def audit(run_dir: str | Path, config: AuditConfig | None = None, verify_only: bool = False,
          on: Extension | None = None, quiet: bool = False) -> AuditSummary:
    """Check what needs no model (chain, binding to the manifest, completeness, derivable claims), then
    (unless `verify_only`) re-execute the ledger, or a seeded sample of it (`config`), and compare every field;
    `reproduced` says if all held. `on.where` says where inputs that moved are now: each is checked against the
    run's hashes before anything runs."""
    from stagereplay.audit.reexecute import audit_run
    from stagereplay.audit.verify import verify_run
    from stagereplay.records.audit_summary import audit_json
    from stagereplay.records.ledger import atomic_write
    from stagereplay.report.results import AUDIT_FILE

    on = on or Extension()
    try:
        path, manifest = existing_run(run_dir, check_ledger=False)  # the audit reports damage instead of refusing
    except StageReplayError:
        from stagereplay.audit.verify import read_chain

        _, broken = read_chain(Path(run_dir))
        if not (Path(run_dir) / "manifest.json").exists() or not broken:
            raise
        # A manifest this version cannot read beside a ledger it cannot either (a newer schema): the ledger's
        # damage is the finding, named line by line.
        return AuditSummary(chain_ok=False, broken_records=broken, findings=[], notes=[], reproduced=False,
                            verify_only=True, integrity_ok=False)
    here, moved = relocate(manifest, on.where, need_inputs=not verify_only)
    checked = verify_run(path, here)
    if verify_only or checked.broken_records:
        return checked.model_copy(update={"integrity_ok": checked.reproduced, **({"relocated": moved} if moved else {})})
    with open_run(path, manifest, extend=False) as run:
        summary = audit_run(path, here, run.records, on.ex, quiet, config=config, relocated=moved,
                            server=on.where.server)
        atomic_write(path / AUDIT_FILE, audit_json(summary))
        if checked.reproduced:  # results and report are rebuilt only from a ledger that verifies and summarizes
            finish(run, quiet)
        return summary


def merge(shards: list[Path], out: Path, quiet: bool = True) -> Path:
    """Join the shards of one `--shard I/N` command into the run one process would have made, with its report.
    Shards computed in different environments merge (each record keeps its own); `shard_environments`
    of the merged manifest names them."""
    merge_runs(shards, out)
    with open_run(out, read_manifest(out)) as run:
        finish(run, quiet)
    return out
