"""Which divergent items a transplant takes: a rule (all divergent, the first K, K at random with a seed) applied to
the matched run's divergent items in ledger order. The rule and what it picks are frozen in the manifest before any
transplant outcome exists: that keeps a replication outcome-blind, and `verify` checks the pick against the rule.
"""

from __future__ import annotations

import random

from stagereplay.errors import StageReplayError
from stagereplay.experiments.protocol.matched_summary import PAYLOAD
from stagereplay.experiments.protocol.payloads import MatchedPayload
from stagereplay.records.ledger import Record
from stagereplay.tasks.base import Item


def parse_selection(rule: str) -> tuple[str, int, int]:
    parts = rule.split(":")
    if parts == ["all-divergent"]:
        return "all", 0, 0
    if parts[0] == "first" and len(parts) == 2 and parts[1].isdigit() and int(parts[1]) > 0:
        return "first", int(parts[1]), 0
    if (parts[0] == "random" and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) > 0
            and parts[2].lstrip("-").isdigit()):
        return "random", int(parts[1]), int(parts[2])
    raise StageReplayError(f"unknown --select {rule!r}", "use all-divergent, first:K or random:K:SEED with K >= 1")


def select(divergent: list[str], rule: str) -> list[str]:
    """Apply a selection rule to divergent item ids (in ledger order); seeded, so it can be frozen up front."""
    kind, k, seed = parse_selection(rule)
    if kind == "all":
        return list(divergent)
    if kind == "first":
        return divergent[:k]
    chosen = set(random.Random(seed).sample(divergent, min(k, len(divergent))))
    return [i for i in divergent if i in chosen]


def divergent_ids(matched: list[Record], construction: str) -> list[str]:
    """The matched records (in ledger order) whose live and fresh suffixes differ: what a selection picks from."""
    return [i for i, _ in _divergent(matched, construction)]


def divergent_items(matched: list[Record], construction: str) -> list[tuple[Item, list[int]]]:
    """The divergent items of the matched records (in ledger order), with their prefixes."""
    return [(Item(i, tuple(p.prompt_ids), p.answer), p.prefix_ids) for i, p in _divergent(matched, construction)]


def _divergent(matched: list[Record], construction: str) -> list[tuple[str, MatchedPayload]]:
    out = []
    for r in matched:
        p = PAYLOAD.validate_python(r.payload)
        if not isinstance(p, MatchedPayload):
            continue
        main = next((c for c in p.comparisons if c.a == "live" and c.b == construction), None)
        if main is not None and not main.suffix_equal:
            out.append((r.item_id, p))
    return out
