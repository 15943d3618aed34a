"""results.json: every table of the report, rebuilt from the ledger (so a resumed run reports the same), as a model
(`Results`) whose JSON object is the file's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.core.registry import EXPERIMENTS, all_experiments, of_stage
from stagereplay.records.audit_summary import AuditSummary
from stagereplay.records.ledger import Record
from stagereplay.records.manifest import Manifest
from stagereplay.records.provenance import now
from stagereplay.records.summary import SummaryModel, section_json

RESULTS_VERSION = 1
AUDIT_FILE = "audit.json"
_OWN = ("schema_version", "run", "audit")
"""results.json's keys that are no experiment's."""


class RunInfo(SummaryModel):
    """What results.json says of the run it summarises."""

    model: str = Field(description="the primary checkpoint's location")
    later_model: str | None = Field(description="the later checkpoint's location (null: none)")
    precision: str = Field(description="the run's precision")
    n_items: int = Field(description="the run's items")
    created: str = Field(description="when results.json was written (ISO 8601, UTC)")
    tool_version: str = Field(description="the stagereplay that made the run")


class Results(BaseModel):
    """results.json: the run, each registered experiment's entry (its `Summary`s, in the registry's order) and the
    last audit. Its JSON object (`as_json`) puts each experiment's entry at its name, between `run` and `audit`."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = Field(description="results.json's format (`RESULTS_VERSION`)")
    run: RunInfo = Field(description="the run")
    sections: dict[str, Any] = Field(description="per experiment, its entry as its `results_of` reads it (a list of "
                                                 "its summaries, one, or None); an unregistered name's as JSON")
    audit: AuditSummary | None = Field(description="the last audit (audit.json; null: none yet)")

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data: Any) -> Any:
        """results.json's object: every key but its own three is an experiment's entry, read by its experiment."""
        if not isinstance(data, dict) or "sections" in data:
            return data
        entries = {name: EXPERIMENTS[name].results_of(entry) if name in EXPERIMENTS else entry
                   for name, entry in data.items() if name not in _OWN}
        return {"schema_version": data.get("schema_version"), "run": data.get("run"), "sections": entries,
                "audit": data.get("audit")}

    def of(self, experiment: Experiment) -> Any:
        """`experiment`'s entry, typed (`Experiment.results_of`): none where results.json has none."""
        if experiment.name in self.sections:
            return self.sections[experiment.name]
        return experiment.results_of(None)

    def as_json(self) -> dict[str, Any]:
        """results.json's object, key for key as the file holds it."""
        return {"schema_version": self.schema_version, "run": self.run.as_json(),
                **{name: [section_json(s) for s in entry] if isinstance(entry, list) else section_json(entry)
                   for name, entry in self.sections.items()},
                "audit": self.audit.as_json() if self.audit is not None else None}


def build_results(run_dir: Path, manifest: Manifest, records: list[Record]) -> Results:
    """Each declared stage's sections, as its experiment summarises its records (an experiment of a list of sections
    gets one per stage, arm or precision; one of a single section the last stage's), and the last audit."""
    config = manifest.config
    sections: dict[str, Any] = {e.name: [] if e.shape.many else None for e in all_experiments()}
    for name, stage in manifest.stages.items():
        experiment = of_stage(name)
        checkpoint = name.partition("/")[2]
        mine = [r for r in records if r.experiment == experiment.name and r.checkpoint == checkpoint]
        made = experiment.summarize(mine, stage, checkpoint)
        if experiment.shape.many:
            sections[experiment.name].extend(made)
        else:
            sections[experiment.name] = made[0] if made else None
    audit = run_dir / AUDIT_FILE
    return Results(
        schema_version=RESULTS_VERSION,
        run=RunInfo(model=config.model.path, later_model=config.later_model, precision=config.model.precision,
                    n_items=len(config.item_ids), created=now(), tool_version=manifest.tool_version),
        sections=sections,
        audit=AuditSummary.model_validate_json(audit.read_text()) if audit.exists() else None)


def comparable_results(results: dict[str, Any]) -> dict[str, Any]:
    """results.json's object less what the ledger does not decide: its time stamp, the last audit's findings and
    the models' locations (the chain binds their hashes, not where they lie)."""
    out = json.loads(json.dumps(results))
    for key in ("created", "model", "later_model"):
        out.get("run", {}).pop(key, None)
    out.pop("audit", None)
    return out
