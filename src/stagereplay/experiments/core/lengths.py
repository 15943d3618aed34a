"""A recorded unit's measured lengths (prompt, stage 1, each arm's suffix), from a record of any experiment whose
records hold the protocol's arms: what plan prices a recorded run by and a unit's caches are sized by."""

from __future__ import annotations

from stagereplay.engine.forwards import Lengths
from stagereplay.records.ledger import Record
from stagereplay.records.payload_readers import ItemHead


def lengths_of(record: Record) -> Lengths:
    """`record_lengths` of a record of any experiment whose records hold the protocol's arms."""
    return record_lengths(ItemHead.model_validate(record.payload))


def record_lengths(payload: ItemHead) -> Lengths:
    """A record's measured lengths: prompt, stage 1, each arm's suffix (a no_boundary record: generated)."""
    prompt = len(payload.prompt_ids)
    if payload.status != "ok" or payload.boundary is None:
        return Lengths(prompt, None, 0, generated=len(payload.generated_ids or []))
    arms = tuple((a.name, len(a.suffix_ids)) for a in payload.arms)
    return Lengths(prompt, payload.boundary - prompt, 0, arms)
