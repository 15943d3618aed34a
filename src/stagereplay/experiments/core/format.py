"""The report's number format and its renderer-neutral `Table` (one rule everywhere; see `report.tables`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from stagereplay.experiments.core.stats import wilson_interval
from stagereplay.records.summary import Count

NA = "-"
"""How a value that cannot be computed prints."""


@dataclass(frozen=True)
class Table:
    """A renderer-neutral table; `id` is the HTML element id (`table-matched`, `table-2x2`, ...)."""

    id: str
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""
    terminal: bool = True
    """False for long detail tables (the full layer sweep) that only the report files carry."""


# --- number formatting ---------------------------------------------------------------------------


def pct(x: float | None) -> str:
    """A proportion in percent, one decimal: 0.62 -> '62.0%'."""
    return NA if x is None else f"{100 * x:.1f}%"


def bound(x: float) -> str:
    """An interval bound in percent: two decimals below 10% (0.018845 -> '1.88%'), else one ('86.2%')."""
    v = 100 * x
    return f"{v:.2f}%" if v < 10 else f"{v:.1f}%"


def interval(ci: tuple[float, float] | None) -> str:
    """'[0.00%, 1.88%]'."""
    return NA if ci is None else f"[{bound(ci[0])}, {bound(ci[1])}]"


def k_of_n(k: int, n: int) -> str:
    """'166/200 (83.0%)'; a count over zero has no percentage."""
    return f"{k}/{n} ({pct(k / n)})" if n else f"{k}/{n}"


def points(x: float) -> str:
    """A difference of proportions in signed points: 0.01 -> '+1.0', -0.035 -> '-3.5'."""
    return f"{round(100 * x, 1) + 0.0:+.1f}"  # + 0.0 turns -0.0 into 0.0


def p_value(p: float | None) -> str:
    return NA if p is None else f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def count_of(d: Count | None) -> str:
    return NA if d is None else k_of_n(d.k, d.n)


def wilson_or_given(k: int, n: int, given: Any) -> tuple[float, float] | None:
    """The stored interval when present (the report shows what the run computed), else Wilson 95%."""
    if given is not None:
        return float(given[0]), float(given[1])
    return wilson_interval(k, n) if n else None


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def as_rows(rows: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(str(c) for c in row) for row in rows)


def slug(name: str) -> str:
    """A checkpoint name made safe for an HTML id: `table-transplant-<slug>`."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", name).strip("-") or "x"
