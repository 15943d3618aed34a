"""One ledger line: its versioned format, its canonical bytes and hash, and the checks of a chain of them.

Schema 2 (this version) has three kinds of record, all in one chain:

    stage        an experiment's frozen section, before its first item      (experiment, checkpoint, payload)
    environment  the environment of a process that computed items, in full  (env = sha256 of the payload)
    item         one experiment's outcome on one item (and part)            (env names its environment)

Schema 1 had only items, no `kind` and no `env`; its records still read, and hash as they did.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stagereplay.errors import StageReplayError
from stagereplay.records.findings import Break

SCHEMA_VERSION = 2
GENESIS = "0" * 64
SCHEMA_2_FIELDS = frozenset({"kind", "env"})


class Record(BaseModel):
    """One ledger line, chained to the one before it by `prev_hash`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(SCHEMA_VERSION, description="ledger record format version")
    seq: int = Field(description="0-based position in the ledger")
    kind: Literal["item", "stage", "environment"] = Field(
        "item", description="item (an outcome), stage (a frozen section) or environment (a writer's provenance)")
    experiment: str = Field(description="matched | precision_2x2 | bridge | transplant ('' for an environment)")
    checkpoint: str = Field(description="which model of the run: primary, later, ... ('' for an environment)")
    item_id: str = Field(description="the item this record is about ('' unless an item)")
    part: str = Field("", description="sub-unit of the item for experiments that split it (e.g. a precision)")
    payload: dict[str, Any] = Field(description="item: token IDs, fingerprints, labels; stage: its section; "
                                                "environment: the environment in full")
    env: str = Field("", description="sha256 of the environment that computed this item (or that this record "
                                     "holds); '' for a stage")
    prev_hash: str = Field(description="hash of the previous record (the run's identity hash for the first)")
    hash: str = Field("", description="sha256 of this record's canonical JSON without this field")

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.experiment, self.checkpoint, self.item_id, self.part)

    def computed_hash(self) -> str:
        exclude = {"hash"} | (set(SCHEMA_2_FIELDS) if self.schema_version < 2 else set())
        return sha256_json(self.model_dump(exclude=exclude))

    def line(self) -> bytes:
        """The record's ledger line, as its schema version writes it."""
        exclude = set(SCHEMA_2_FIELDS) if self.schema_version < 2 else set()
        return canonical_json(self.model_dump(exclude=exclude)) + b"\n"


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def parse_record(line: str, lineno: int, path: Path) -> Record:
    """Parse one ledger line, refusing newer schema versions by name."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError:
        raise StageReplayError(f"{path} line {lineno} is not valid JSON",
                               "run `stagereplay audit --verify-only` on the run to see the damage") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise StageReplayError(
            f"{path} line {lineno} has ledger schema_version {version}, newer than this stagereplay's {SCHEMA_VERSION}",
            "upgrade stagereplay to read it",
        )
    if isinstance(version, int) and version < 2 and SCHEMA_2_FIELDS & set(raw):
        raise StageReplayError(f"{path} line {lineno} is a schema 1 record with schema 2 fields",
                               "restore the ledger from a copy or start a new run")
    try:
        return Record.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise StageReplayError(f"{path} line {lineno} is not a valid ledger record ({where}: {first['msg']})",
                               "restore the ledger from a copy or start a new run") from None


def chain_problems(records: list[Record], start: str = GENESIS) -> list[Break]:
    """Every break in the hash chain or sequence: empty means intact. `start` is what the first record links to
    (the run's identity hash; GENESIS for schema 1)."""
    problems: list[Break] = []
    prev = start
    for i, r in enumerate(records):
        if r.seq != i:
            problems.append(Break(seq=i, reason=f"seq is {r.seq}, expected {i}"))
        if r.prev_hash != prev:
            what = "the run's identity in the manifest" if i == 0 else f"record {i - 1}"
            problems.append(Break(seq=i, reason=f"prev_hash does not match {what}"))
        if r.computed_hash() != r.hash:
            problems.append(Break(seq=i, reason="content does not match its hash"))
        prev = r.hash
    return problems


def diff_fields(old: Any, new: Any, prefix: str = "", lists: bool = False) -> list[str]:
    """Dotted names of the fields whose values differ between two JSON-like objects; with `lists`, also
    inside lists of equal length (`matched.0.accuracy`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new)):
            out += diff_fields(old.get(k), new.get(k), f"{prefix}{k}.", lists)
        return out
    if lists and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [f for i, (a, b) in enumerate(zip(old, new, strict=True)) for f in diff_fields(a, b, f"{prefix}{i}.", lists)]
    return [] if old == new else [prefix.rstrip(".")]
