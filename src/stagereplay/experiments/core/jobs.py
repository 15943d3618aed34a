"""An experiment's jobs: the settings every item job shares, the job and its parameters, a batch of jobs under one model
setting, what re-executing a recorded unit needs (`Replay`), and the environment a job's record carries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from stagereplay.engine.boundary import BoundaryRule, parse_boundary
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import Work
from stagereplay.records.provenance import environment
from stagereplay.tasks.base import Item
from stagereplay.tasks.scoring import scorer_by_name

if TYPE_CHECKING:
    from stagereplay.records.ledger import Record
    from stagereplay.records.manifest import SettingsSection, StageSection
    from stagereplay.records.payloads import PayloadModel


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

    def section(self) -> SettingsSection:
        """The settings as the manifest records them."""
        from stagereplay.records.manifest import SettingsSection

        return SettingsSection.model_validate(self.as_dict())

    @classmethod
    def of(cls, section: SettingsSection) -> ReplaySettings:
        """The settings as a manifest records them, with the defaults a run made before a field existed lacks."""
        return cls(section.boundary, DecodeConfig(**section.decode.declared()), section.scorer)


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


@dataclass(frozen=True)
class Batch:
    """Jobs that run under one model setting (a stage crossing precisions has one batch per precision)."""

    model: ModelConfig
    jobs: Sequence[Job]
    at: str | None = None
    """What its numbers are made at, where that is not the model's precision (a serving engine's own types)."""


@dataclass(frozen=True)
class Replay:
    """What re-executing one recorded unit needs: the record, its stage, the item, and the first stage's record of
    the item at the same checkpoint (the prefix other experiments start from, the arms they carry over)."""

    record: Record
    stage: StageSection
    item: Item
    matched_stage: StageSection | None
    matched: dict[str, Any] | None

    @property
    def settings(self) -> ReplaySettings:
        return ReplaySettings.of(self.stage.settings)

    @property
    def prefix(self) -> list[int] | None:
        return None if self.matched is None else self.matched.get("prefix_ids")


@dataclass(frozen=True)
class JobResult:
    """What a job gives back to the run that appends its record."""

    payload: PayloadModel
    """The record's payload as its model (the ledger holds its `as_payload`)."""
    environment: dict[str, Any]
    """The environment of the process that computed it (`records.provenance.environment`: JSON, an engine's own
    settings included)."""


def with_environment(work: Work[PayloadModel], lm: LM, job: Job) -> JobResult:
    """`work(lm, job)` and the environment of the process that ran it (a worker, a Ray actor, this one)."""
    return JobResult(work(lm, job), environment(lm.config.device, lm.determinism))
