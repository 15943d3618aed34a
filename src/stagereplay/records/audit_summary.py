"""What an audit of a run says (`AuditSummary`): audit.json, results.json's `audit`, and what `stagereplay audit`
prints, made by the model-free check (`audit.verify.verify_run`, `verify_only`) or the re-execution
(`audit.reexecute.audit_run`).

audit.json names the findings `mismatches` (its key since its first version); the model calls them `findings`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict, Field, field_serializer

from stagereplay.records.findings import Break, Finding
from stagereplay.records.summary import Count, SummaryModel


class KernelDifference(SummaryModel):
    """One kernel-choosing field of the environment that differs from this machine's."""

    field: str = Field(description="the environment's field")
    recorded: Any = Field(description="its value where the records were computed")
    here: Any = Field(description="its value on this machine")
    records: int = Field(description="records computed under that value")


class EnvironmentSummary(SummaryModel):
    """The kernels the audit ran under against the run's."""

    records: int = Field(description="records of the run")
    records_other_kernels: int = Field(description="of them, records computed under other kernels than this "
                                                   "machine's")
    differences: list[KernelDifference] = Field(description="the fields that differ")
    line: str | None = Field(default=None, description="what the command says of them first (absent: none "
                                                       "differs)")


class Elsewhere(SummaryModel):
    """The units not reproduced under this machine's other kernels."""

    units: int = Field(description="units not reproduced")
    by_precision: dict[str, int] = Field(description="per precision, its units")
    reduced_precision_only: bool = Field(description="whether all are at bf16 or fp16")
    fp32_token_differences: list[str] = Field(description="fp32 units whose tokens or labels differ (suspicious: "
                                                          "other kernels rarely cause it)")


class Sample(SummaryModel):
    """A seeded sample of units re-executed per stage (every record still verified)."""

    per_stage: int = Field(description="units re-executed per stage")
    seed: int = Field(description="the sample's seed")
    units: dict[str, list[list[str]]] = Field(description="per stage, its [item id, part] units re-executed")
    re_executed: int = Field(description="records re-executed")
    of: int = Field(description="records of the run")


class AuditSummary(SummaryModel):
    """One audit of a run. The model-free check (`verify_only`) sets the chain, the findings and the verdict; the
    re-execution the counts, the environment and the split of the findings by kind as well. A field an older
    audit.json lacks is unset."""

    model_config = ConfigDict(populate_by_name=True)

    items: int | None = Field(default=None, description="items audited")
    records: int | None = Field(default=None, description="records audited")
    trajectories: Count | None = Field(default=None, description="trajectory fingerprints reproduced")
    comparisons: Count | None = Field(default=None, description="comparison fingerprints reproduced")
    chain_ok: bool = Field(description="whether the ledger's hash chain and its binding to the manifest hold")
    broken_records: list[Break | int] = Field(description="where the chain breaks (an older audit.json: the bare "
                                                          "line)")
    findings: list[Finding] = Field(alias="mismatches", description="what the checks found wrong (audit.json's "
                                                                    "`mismatches`)")
    notes: list[str] = Field(default_factory=list, description="what the audit could not check, and why")
    integrity_ok: bool | None = Field(default=None, description="whether no finding is of integrity (absent: an "
                                                                "older audit.json)")
    environment: EnvironmentSummary | None = Field(default=None, description="the kernels it ran under")
    not_reproduced_here: Elsewhere | None = Field(default=None, description="units not reproduced under other "
                                                                            "kernels")
    reproduced: bool = Field(description="whether every record was reproduced and no finding made")
    verify_only: bool | None = Field(default=None, description="the model-free check alone (absent: re-executed)")
    relocated: list[dict[str, str]] | None = Field(default=None, description="inputs found elsewhere than "
                                                                             "recorded")
    sample: Sample | None = Field(default=None, description="the units re-executed (absent: every unit)")

    @field_serializer("findings")
    def _findings(self, findings: list[Finding]) -> list[dict[str, Any]]:
        return [f.as_json() for f in findings]

    def as_json(self) -> dict[str, Any]:
        """audit.json's object: the fields that were set, findings as `mismatches`."""
        return self.model_dump(mode="json", exclude_unset=True, by_alias=True)


def audit_json(summary: AuditSummary) -> str:
    """audit.json's text: an audit's summary, its breaks and findings as JSON."""
    return json.dumps(summary.as_json(), indent=2) + "\n"
