"""What a check of a run finds, as frozen models every room can make and read: a `Break` of the ledger's chain (a
line that does not parse, a hash or link that does not hold, a manifest the chain was not made under) and a
`Finding` about the records (a claim that does not follow, a record missing, a unit not reproduced).

audit.json and results.json's `audit` hold them as JSON (`as_json`: a finding's `kind` only once the audit has
told integrity from other kernels, as before it did); `records.audit_summary` holds an audit's summary with them
in it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FindingKind = Literal["integrity", "not_reproduced_here"]
"""integrity: tampering or a broken run, whatever the machine; not_reproduced_here: a unit that differs when
re-executed under other kernels than it was recorded with, which those kernels alone can cause."""


class Break(BaseModel):
    """One break of a ledger's chain or of its binding to the manifest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq: int = Field(description="the ledger line (0-based) where the chain breaks (its length: a stage record "
                                 "missing at the end)")
    reason: str = Field("", description="what does not hold there ('' : an older audit.json named none)")

    def as_json(self) -> dict[str, Any]:
        return self.model_dump()


class Finding(BaseModel):
    """One thing a check found wrong with a run's records, naming the item and the stage and field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    item_id: str = Field("", description="the item it is about ('' : the whole run)")
    what: str = Field(description="the stage and field, and what does not hold")
    kind: FindingKind | None = Field(None, description="what the audit makes of it (absent: a model-free check, "
                                                       "which has no other kind than integrity)")

    def as_json(self) -> dict[str, Any]:
        """`{item_id, what[, kind]}`: `kind` written once it is set."""
        return self.model_dump(exclude_none=True)

    def of_kind(self, kind: FindingKind) -> Finding:
        return self.model_copy(update={"kind": kind})

    @property
    def integrity(self) -> bool:
        """Whether it says something of the run's integrity (every finding but one not reproduced here)."""
        return (self.kind or "integrity") == "integrity"

