"""An experiment's jobs: the settings every item job shares, the job, and the loop that runs the jobs not yet in
the ledger (with the environment that computed each) under a progress bar."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Generic, TypeVar

from stagereplay.engine.boundary import BoundaryRule, parse_boundary
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.execution.executors import run_jobs
from stagereplay.records.ledger import Run
from stagereplay.records.proofs import machine_store
from stagereplay.records.provenance import environment
from stagereplay.tasks.base import Item
from stagereplay.tasks.scoring import scorer_by_name


@dataclass(frozen=True)
class ReplaySettings:
    """What every item job needs besides the item: how to find the boundary, decode and score."""

    boundary: str = field(metadata={"help": "marker:TEXT | regex:PATTERN | after:N"})
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    scorer: str = field(default="last-number", metadata={"help": "last-number | exact | math | regex:PATTERN"})

    def __post_init__(self) -> None:
        scorer_by_name(self.scorer)  # an unknown scorer fails here, before any run directory exists

    def rule(self) -> BoundaryRule:
        return parse_boundary(self.boundary)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplaySettings:
        """The settings as a manifest stage records them (`as_dict`)."""
        return cls(d["boundary"], DecodeConfig(**d["decode"]), d["scorer"])


@dataclass(frozen=True)
class Params:
    """An experiment's parameters for one item's job, besides the item and the shared settings: each experiment
    has its own frozen subclass (typed, picklable for worker processes and Ray actors)."""

    @property
    def part(self) -> str:
        """The sub-unit of the item this job computes (a precision), '' for none: the record's `part`."""
        return ""


P = TypeVar("P", bound=Params)


@dataclass(frozen=True)
class Job(Generic[P]):
    """One item's work for one experiment; picklable so that worker processes and Ray actors can take it."""

    item: Item
    settings: ReplaySettings
    params: P

    @property
    def part(self) -> str:
        return self.params.part


def with_environment(work: Work, lm: LM, job: Job) -> dict[str, Any]:
    """`work(lm, job)` and the environment of the process that ran it (a worker, a Ray actor, this one)."""
    return {"payload": work(lm, job), "environment": environment(lm.config.device, lm.determinism)}


def execute(run: Run, experiment: str, checkpoint: str, model: ModelConfig, work: Work, jobs: Sequence[Job],
            ex: ExecConfig, lm: LM | None = None, quiet: bool = False, env_work: Work | None = None) -> None:
    """Run every job not yet in the ledger, appending records in job order with the environment that
    computed each, with a progress bar. `env_work` returns a job's payload and environment itself (a serving
    engine adds its own to the environment); by default `work`'s payload gets `with_environment`'s."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    pending = [j for j in jobs if not run.done(experiment, checkpoint, j.item.id, j.part)]
    label = f"{experiment} [{checkpoint}]" + (f" {model.precision}" if model.precision else "")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=quiet, transient=False) as bar:
        # The description is rich markup: escaped, "[primary]" is shown, not taken for a style.
        task = bar.add_task(escape(label), total=len(jobs), completed=len(jobs) - len(pending))
        done = run_jobs(model, env_work or partial(with_environment, work), pending, ex, lm, machine_store)
        for job, out in zip(pending, done, strict=False):
            run.append(experiment, checkpoint, job.item.id, out["payload"], job.part, out["environment"])
            bar.advance(task)
