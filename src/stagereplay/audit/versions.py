"""What a record made by an older version of the ledger claims, in one place: the audit holds a re-executed
payload to those claims and no more, and `verify` derives a comparison's fingerprint as that version did.

    ledger schema 1   the manifest is not bound into the chain; a comparison's fingerprint covers the item, the
                      arms' names, suffix fingerprints and labels only (`comparison_fp_schema_1`)
    before token texts (schema 2)   an item record has no `token_texts`
    before `took_place` and `request` (schema 2)   a serving arm does not say whether its construction took
                      place, nor what live's request asked for (`LATE_ARM_FIELDS`)
    results.json of an earlier version   claims fewer fields (`claimed`)

A newer schema than this stagereplay reads is refused by `records.record.parse_record`, naming the version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagereplay.experiments.protocol.arms import compare, comparison_fp_schema_1
from stagereplay.records.payloads import Arm, Comparison

if TYPE_CHECKING:
    from stagereplay.experiments.core.experiment import Experiment

LATE_ARM_FIELDS = ("took_place", "request")
"""Arm fields of serving records that records made before them lack (none of their arms has one)."""


def claimed(rebuilt: Any, stored: Any) -> Any:
    """`rebuilt` restricted to the fields `stored` has: a results.json (or a schema 1 record) written by an
    earlier version claims fewer fields, and only what it claims is checked."""
    if isinstance(rebuilt, dict) and isinstance(stored, dict):
        return {k: claimed(v, stored[k]) for k, v in rebuilt.items() if k in stored}
    if isinstance(rebuilt, list) and isinstance(stored, list) and len(rebuilt) == len(stored):
        return [claimed(a, b) for a, b in zip(rebuilt, stored, strict=True)]
    return rebuilt


def derived_comparison(item_id: str, a: Arm, b: Arm, bound: bool) -> Comparison:
    """The comparison of arms `a` and `b` as a record of this schema fingerprints it (`bound`: schema 2)."""
    derived = compare(item_id, a, b)
    if not bound:
        derived = derived.model_copy(update={"fp": comparison_fp_schema_1(item_id, a, b)})
    return derived


def as_recorded(experiment: Experiment, item_id: str, again: dict[str, Any], recorded: dict[str, Any], bound: bool
                ) -> dict[str, Any]:
    """A re-executed payload as the recorded payload's version would have written it: schema 1's comparison
    fingerprints and fields, and without the fields a record made before them lacks (which fields the recorded
    JSON holds: `recorded` is read as it is, a record too malformed for its model included). `experiment` made it: its
    payload model reads the re-executed payload."""
    if not bound:  # schema 1: our engine's records, re-executed by our engine
        made = experiment.payload.validate_python(again)
        arms = {a.name: a for a in made.arms}
        comparisons = [{**c.as_payload(), "fp": comparison_fp_schema_1(item_id, arms[c.a], arms[c.b])}
                       for c in made.comparisons]
        again = claimed({**again, "comparisons": comparisons}, recorded)
    if "token_texts" not in recorded:
        again = {k: v for k, v in again.items() if k != "token_texts"}
    for field in LATE_ARM_FIELDS:
        if "arms" in again and not any(field in a for a in recorded.get("arms", [])):
            again = {**again, "arms": [{k: v for k, v in a.items() if k != field} for a in again.get("arms", [])]}
    return again
