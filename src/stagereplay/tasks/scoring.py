"""Scorers by name, as the CLI and the ledger spell them: `last-number`, `exact`, `math`, `regex:PATTERN`, `toy`."""

from __future__ import annotations

import re
from collections.abc import Callable

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Scorer, exact_match, last_number, last_number_answer, regex_scorer
from stagereplay.tasks.math_scorer import check_available, math_answer, math_match, scorer_packages
from stagereplay.tasks.toy import toy_scorer

SCORERS: dict[str, Scorer] = {"last-number": last_number, "exact": exact_match, "math": math_match}


def scorer_by_name(name: str) -> Scorer:
    """`last-number`, `exact`, `math`, or `regex:PATTERN`."""
    if name == "toy":  # the embedded task's own scorer
        return toy_scorer
    if name == "math":
        check_available()  # a missing math-verify fails here, before any run directory exists
    if name.startswith("regex:"):
        pattern = name.removeprefix("regex:")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise StageReplayError(f"invalid --scorer {name!r}: {exc}", "fix the pattern") from None
        return regex_scorer(pattern)
    if name not in SCORERS:
        raise StageReplayError(f"unknown --scorer {name!r}", f"use one of {', '.join(SCORERS)}, toy or regex:PATTERN")
    return SCORERS[name]


def answer_extractor(name: str) -> Callable[[str], str | None]:
    """What the scorer `name` reads as the answer of an output (None: no answer found), so that the answers of
    many sampled continuations can be counted as a distribution."""
    scorer = scorer_by_name(name)
    extract: Callable[[str], str | None] | None = getattr(scorer, "extract", None)
    if extract is not None:
        return extract
    if name == "last-number":
        return last_number_answer
    if name == "math":
        return math_answer  # the parsed form: 0.5 and \frac{1}{2} are one answer
    return str.strip


def scorer_versions(name: str) -> dict[str, str | None]:
    """The package versions a scorer's labels depend on (for the manifest); empty for the built-in scorers."""
    return scorer_packages() if name == "math" else {}
