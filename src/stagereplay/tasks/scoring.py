"""Scorers by name, as the CLI and the ledger spell them: `last-number`, `exact`, `regex:PATTERN`, `toy`."""

from __future__ import annotations

from stagereplay.tasks.base import Scorer, exact_match, last_number, regex_scorer
from stagereplay.tasks.toy import toy_scorer

SCORERS: dict[str, Scorer] = {"last-number": last_number, "exact": exact_match}


def scorer_by_name(name: str) -> Scorer:
    """`last-number`, `exact`, or `regex:PATTERN`."""
    if name == "toy":  # the embedded task's own scorer
        return toy_scorer
    if name.startswith("regex:"):
        return regex_scorer(name.removeprefix("regex:"))
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}: use one of {', '.join(SCORERS)}, toy or regex:PATTERN")
    return SCORERS[name]
