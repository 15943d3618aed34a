"""What an experiment is, for everything that runs, checks, prices or reports it: one typed object per
experiment, found by name in the registry (`experiments.registry`).

An experiment declares

    work(lm, job)            its item function: one item's record payload, pure in (model, job)
    units(...)               the (item id, part) units a declared stage of it names: what `verify` expects
    claims(...)              what its records claim beyond the arms and comparisons every record has (`verify`)
    replay_job(replay)       the job that re-executes one recorded unit (`audit`)
    unit_forwards(...)       the forwards a recorded unit made (`plan`), and `peak_caches` the most K/V caches an
                             item holds at once
    summarize(...)           its section(s) of results.json, from its records
    tables(sections)         the report's tables of those sections

Its typed configuration and per-item job parameters (`Params`), and the function that runs it into a run
directory, live in its module beside it. Nothing outside an experiment's module names the experiment: a stage of
the manifest (`<experiment>/<checkpoint>`) finds its experiment in the registry, and a name the registry does not
know is refused in one line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from stagereplay.experiments.format import Table
from stagereplay.experiments.jobs import Job, ReplaySettings
from stagereplay.records.ledger import Record
from stagereplay.records.manifest import Stage
from stagereplay.records.payloads import Payload
from stagereplay.tasks.base import Item

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM

Section = dict[str, Any]
"""One section of results.json: what an experiment's summary says of one stage (or one arm or precision of it)."""


@dataclass(frozen=True)
class Replay:
    """What re-executing one recorded unit needs: the record, its stage, the item, and the matched record of the
    item at the same checkpoint (the prefix other experiments start from, the arms they carry over)."""

    record: Record
    stage: Stage
    item: Item
    matched_stage: Stage | None
    matched: Payload | None

    @property
    def settings(self) -> ReplaySettings:
        return ReplaySettings.from_dict(self.stage["settings"])

    @property
    def prefix(self) -> list[int] | None:
        return None if self.matched is None else self.matched.get("prefix_ids")


class Experiment(ABC):
    """One experiment of the protocol (module docstring)."""

    name: ClassVar[str]
    """The ledger's `experiment` field and the first half of a stage's name."""
    per_precision: ClassVar[bool] = False
    """Whether a unit's `part` is the precision it ran at (a stage crossing precisions)."""
    label: ClassVar[str] = ""
    """How the report names its compared pairs beside the checkpoint (`primary, 2x2`); '' for matched's."""
    many: ClassVar[bool] = True
    """Whether results.json holds a list of its sections (one per stage, arm or precision), else one section."""
    fixed_prefix: ClassVar[bool] = False
    """Whether its records hold the matched run's prefix of the item (`verify` checks that they do)."""
    replays_diagnostics: ClassVar[bool] = False
    """Whether its diagnostics decode an arm again to a pair's first divergent step (`plan.recorded`)."""

    @abstractmethod
    def work(self, lm: LM, job: Job) -> Payload:
        """One item's record payload."""

    @abstractmethod
    def units(self, checkpoint: str, stage: Stage, config: dict[str, Any], records: list[Record]
              ) -> list[tuple[str, str]]:
        """The (item id, part) units its stage at `checkpoint` names, from the manifest's `config` and the records
        it starts from."""

    def claims(self, record: Record, stage: Stage, matched: Record | None) -> list[str]:
        """What one of its records claims that follows from its other fields, checked: the problems found."""
        return []

    def stage_findings(self, name: str, stage: Stage, records: list[Record]) -> list[dict[str, str]]:
        """What its stage's frozen section claims that follows from the records (a selection from its rule)."""
        return []

    @abstractmethod
    def replay_job(self, replay: Replay) -> Job:
        """The job that re-executes one recorded unit."""

    @abstractmethod
    def unit_forwards(self, record: Record, stage: Stage) -> list[int] | None:
        """The token counts of the forwards one recorded unit made (None: its lengths are not recorded)."""

    @abstractmethod
    def peak_caches(self, stage: Stage) -> int:
        """The most K/V caches one item holds at once."""

    @abstractmethod
    def summarize(self, records: list[Record], stage: Stage, checkpoint: str) -> list[Section]:
        """Its sections of results.json from one stage's records (one, or one per arm or precision)."""

    @abstractmethod
    def tables(self, results: Any) -> list[Table]:
        """The report's tables of its results.json entry (a list of sections if `many`, else one)."""

    def diagnosed(self, results: Any) -> list[tuple[str, Section, dict[str, int]]]:
        """(label, summary, its disagreement counts {k, n}) of each compared pair in its results.json entry whose
        summary carries diagnostics (margins, logits, caches): the report's diagnostics table and figures."""
        return []

    def where(self, record: Record) -> str:
        """A unit's stage as findings name it, with the precision of a per-precision unit."""
        part = record.part if self.per_precision else ""
        return f"{record.experiment}/{record.checkpoint}{'@' + part if part else ''}"


def matched_ok(records: list[Record], checkpoint: str) -> list[str]:
    """The item ids whose matched record at `checkpoint` reached its boundary, in ledger order: the prefixes the
    experiments after matched start from."""
    return [r.item_id for r in records if r.experiment == "matched" and r.checkpoint == checkpoint
            and r.payload.get("status") == "ok"]
