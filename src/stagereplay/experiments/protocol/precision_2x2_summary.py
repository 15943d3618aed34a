"""precision_2x2's section of results.json (`GridSummary`), summarised from its records, and its tables and verdict
facts: accuracy per cell (construction x precision), and per precision the first pair's disagreements with Wilson
95% and that pair's diagnostics.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from stagereplay.experiments.core.diagnostics_summary import Diagnosed, summarize_pair
from stagereplay.experiments.core.format import NA, Table, as_rows, interval, k_of_n, pct, wilson_or_given
from stagereplay.experiments.core.stats import wilson_interval
from stagereplay.experiments.core.verdict import FIRST_STEP, Fact, faithful, logit, median_of
from stagereplay.experiments.protocol.payloads import GridPayload
from stagereplay.records.ledger import Record
from stagereplay.records.summary import SummaryModel


class Cell(SummaryModel):
    """One construction at one precision."""

    construction: str = Field(description="the construction")
    precision: str = Field(description="the precision")
    n: int = Field(description="records with this arm")
    accuracy: float | None = Field(description="the share labelled correct (null: no record)")


class PairCount(SummaryModel):
    """Disagreements of a compared pair past the first (a serving engine's run crosses three arms)."""

    a: str = Field(description="the pair's first arm")
    b: str = Field(description="its second arm")
    k: int = Field(description="items whose suffixes differ")
    n: int = Field(description="items compared")
    wilson: list[float] = Field(description="Wilson 95% interval of k/n")
    label_k: int = Field(description="items whose correctness labels differ")


class DisagreementHead(SummaryModel):
    """What every precision's row holds before its first pair's diagnostics."""

    pairs: list[PairCount] | None = Field(default=None, description="every compared pair past the first (absent: "
                                                                      "two arms)")
    precision: str = Field(description="the precision")
    k: int = Field(description="items whose first pair's suffixes differ")
    n: int = Field(description="items compared")
    wilson: list[float] | None = Field(description="Wilson 95% interval of k/n (null: no item)")
    label_k: int = Field(description="items whose first pair's correctness labels differ")
    first_divergence: list[int] = Field(description="per divergent item, the first suffix step that differs")


class Disagreement(Diagnosed, DisagreementHead):
    """One precision's disagreements of the first pair, with its diagnostics (unset: no item compared)."""


class GridSummary(SummaryModel):
    """The fixed-prefix 2x2 at one checkpoint: precision_2x2's section of results.json."""

    checkpoint: str = Field(description="the stage's checkpoint")
    constructions: list[str] = Field(description="the constructions crossed, the first pair's two first")
    precisions: list[str] = Field(description="the precisions crossed")
    n: int = Field(description="the most items compared at any precision")
    cells: list[Cell] = Field(description="per precision, per construction: its accuracy")
    disagreements: list[Disagreement] = Field(description="per precision: its first pair's disagreements")


def summarize_2x2(records: list[Record], constructions: list[str], precisions: list[str],
                  checkpoint: str) -> GridSummary:
    cells, disagreements = [], []
    for precision in precisions:
        mine = [(r.item_id, GridPayload.model_validate(r.payload)) for r in records if r.part == precision]
        for c in constructions:
            name = f"{c}@{precision}"
            correct = [a.correct for _, p in mine for a in p.arms if a.name == name]
            cells.append(Cell(construction=c, precision=precision, n=len(correct),
                              accuracy=sum(correct) / len(correct) if correct else None))
        first = [p.comparisons[0] for _, p in mine if p.comparisons]
        k = sum(not c.suffix_equal for c in first)
        n = len(first)
        more = _more_pairs([p for _, p in mine])
        row: dict[str, Any] = {"pairs": more} if more else {}
        diagnosed = [(i, p.diagnostics) for i, p in mine]
        disagreements.append(Disagreement(
            **row, precision=precision, k=k, n=n,
            wilson=list(wilson_interval(k, n)) if n else None,
            label_k=sum(not c.label_equal for c in first),
            first_divergence=[c.first_divergence for c in first if not c.suffix_equal],
            **(summarize_pair(diagnosed, first[0].a, first[0].b).diagnostics() if first else {}),
        ))
    return GridSummary(checkpoint=checkpoint, constructions=constructions, precisions=precisions,
                       n=max((d.n for d in disagreements), default=0), cells=cells, disagreements=disagreements)


def _more_pairs(payloads: list[GridPayload]) -> list[PairCount]:
    """With three or more arms (a serving engine's run), every compared pair past the first: its disagreements."""
    ok = [p for p in payloads if len(p.comparisons) > 1]
    if not ok:
        return []
    out = []
    for j, c in enumerate(ok[0].comparisons[1:], start=1):
        cs = [p.comparisons[j] for p in ok]
        k, n = sum(not x.suffix_equal for x in cs), len(cs)
        out.append(PairCount(a=c.a, b=c.b, k=k, n=n, wilson=list(wilson_interval(k, n)),
                             label_k=sum(not x.label_equal for x in cs)))
    return out


def first_pair(grid: GridSummary) -> tuple[str, str]:
    """The names of the first pair's constructions ('?' where the stage names fewer)."""
    a, b = [*grid.constructions, "?", "?"][:2]
    return a, b


def precision_2x2_tables(grid: GridSummary) -> list[Table]:
    """Accuracy per cell (construction x precision), then disagreements per precision with Wilson 95%."""
    precisions = list(grid.precisions)
    cells = {(c.construction, c.precision): c for c in grid.cells}
    accuracy = []
    for construction in grid.constructions:
        row = [construction]
        for p in precisions:
            cell = cells.get((construction, p))
            row.append(f"{pct(cell.accuracy)} (n={cell.n})" if cell else NA)
        accuracy.append(row)
    a, b = first_pair(grid)
    disagreements = []
    for d in grid.disagreements:
        disagreements.append([d.precision, k_of_n(d.k, d.n), interval(wilson_or_given(d.k, d.n, d.wilson)),
                              k_of_n(d.label_k, d.n)])
        for pair in d.pairs or []:  # a serving engine's run crosses three arms: every other pair too
            names = f"{pair.a.split('@')[0]} vs {pair.b.split('@')[0]}"
            disagreements.append([f"{d.precision}: {names}", k_of_n(pair.k, pair.n),
                                  interval(wilson_or_given(pair.k, pair.n, pair.wilson)),
                                  k_of_n(pair.label_k, pair.n)])
    ckpt = grid.checkpoint
    return [
        Table(
            "table-2x2",
            f"Fixed-prefix 2x2 ({ckpt}): accuracy",
            ("construction", *precisions),
            as_rows(accuracy),
            f"All {grid.n} prefixes held fixed; only construction and precision change.",
        ),
        Table(
            "table-2x2-disagreements",
            f"Fixed-prefix 2x2 ({ckpt}): {a} vs {b} disagreements",
            ("precision", "suffix disagreements", "Wilson 95%", "label disagreements"),
            as_rows(disagreements),
            "0/n is reported with its Wilson upper bound.",
        ),
    ]


def grid_facts(grid: GridSummary) -> list[Fact]:
    """Per precision: the first pair's suffix disagreements, and the first step's logit difference where recorded."""
    rows = grid.disagreements
    if not rows:
        return []
    a, b = first_pair(grid)
    facts = [Fact(faithful(d.precision), f"fixed-prefix {a} vs {b}", holds=d.k == 0, k=d.k, n=d.n) for d in rows]
    for d in rows:
        value = median_of(d.first_step_logit_maxabs)
        if value is not None:
            facts.append(Fact(FIRST_STEP, f"{logit(value)} fixed-prefix @ {d.precision}"))
    return facts
