"""Two runs of one experiment compared (`stagereplay compare A B`): `RunComparison`, what any experiment's
comparison shows (compare.json's model, the header, the answers, the tables, the figures), and the views of what
differs between the two runs' manifests that every comparison opens with."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from stagereplay.experiments.core.figures import ReportFigure
from stagereplay.experiments.core.format import NA, Table, as_rows
from stagereplay.records.differences import Differences

GROUPS = (("settings", "setting"), ("server", "server"), ("kernels", "kernels"), ("environment", "environment"),
          ("locations", "location"))
"""compare.json's groups of differences, in the order shown, and how a row names its group."""


class Document(Protocol):
    def write(self) -> str: ...


@dataclass(frozen=True)
class RunComparison:
    """A comparison as `compare` writes it: compare.json's model (`document.write()`), then compare.md and
    compare.html from the header, the (question, answer) pairs, the tables and the figures."""

    document: Document
    header: list[tuple[str, str]]
    verdict: list[tuple[str, str]]
    tables: list[Table]
    figures: list[ReportFigure] = field(default_factory=list)


def differences_table(d: Differences) -> Table:
    rows = [[name, x.field, show(x.a), show(x.b)] for key, name in GROUPS for x in d.group(key)]
    note = ("setting: the manifests' config and the compared stage; server: a serving engine's identity and settings "
            "(less what changes with each start); kernels: what chooses the kernels of the process that computed "
            "the records; location: where a file or a server lies, which is no setting.")
    return Table("table-compare-differences", "What differs between the runs", ("", "field", "A", "B"),
                 as_rows(rows or [["-", "nothing differs", NA, NA]]), note)


def differences_answer(d: Differences) -> tuple[str, str]:
    differs = [f"{name}: {', '.join(x.field for x in d.group(key))}" for key, name in GROUPS[:3] if d.group(key)]
    return ("What differs?", "; ".join(differs) + "." if differs else
            "nothing in the settings, the server or the kernels.")


def show(value: Any) -> str:
    """A manifest's value as a cell (any JSON)."""
    if value is None:
        return "(none)"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)
