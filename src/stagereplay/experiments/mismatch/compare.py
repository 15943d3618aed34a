"""Two mismatch runs of the same model and items under two settings (two rollout engines, an engine option, two
precisions), item by item: `stagereplay compare A B` on runs that `stagereplay mismatch` made.

    rollouts      per item, whether the two runs' rollouts are the same tokens, and where they first differ
    rollout A/B   on the items whose tokens agree, run B's rollout log-probabilities against run A's (the metrics
                  of `mismatch_stats`: what the setting moved in the engine's own numbers)
    trainer A/B   the same for each trainer precision both runs have (the trainer's numbers should not move)
    rows          each attribution row of both runs side by side: mean |log-ratio| and k3_kl in A and in B
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.compared import RunComparison, differences_answer, differences_table
from stagereplay.experiments.core.format import NA, Table, as_rows, k_of_n
from stagereplay.experiments.core.stats import first_divergence
from stagereplay.experiments.mismatch.fields import MismatchMetrics
from stagereplay.experiments.mismatch.stats import Pair, metrics
from stagereplay.experiments.mismatch.summary import MismatchSummary, payloads, sides
from stagereplay.experiments.mismatch.tables import num
from stagereplay.records.differences import Differences
from stagereplay.records.ledger import Record

VERSION = 2


class RowSideBySide(BaseModel):
    """One attribution row in both runs."""

    model_config = ConfigDict(frozen=True)

    row: str = Field(description="the row (total, construction, engine, precision ..., replica ...)")
    abs_mean: tuple[float | None, float | None] = Field(description="mean |log-ratio| in run A and in run B")
    k3_kl: tuple[float | None, float | None] = Field(description="k3_kl in run A and in run B")
    bitwise_equal: tuple[float | None, float | None] = Field(description="bitwise-equal fraction in A and in B")


class SideMoved(BaseModel):
    """One side's log-probabilities in run B against run A's, on the same tokens."""

    model_config = ConfigDict(frozen=True)

    side: str = Field(description="rollout, or trainer@<precision>")
    metrics: MismatchMetrics = Field(description="B's log-probabilities as side b, A's as side a")


class MismatchComparison(BaseModel):
    """compare.json of two mismatch runs."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = Field(VERSION, description="this document's format")
    kind: Literal["mismatch"] = Field("mismatch", description="the experiment compared")
    checkpoint: str = Field(description="the model of the runs compared")
    runs: tuple[str, str] = Field(description="run A's and run B's folders")
    differences: Differences = Field(description="what differs between their manifests")
    items: int = Field(description="items both runs scored")
    tokens_equal: int = Field(description="items whose two rollouts are the same tokens")
    first_divergence: list[int] = Field(description="per item whose rollouts differ, the first response token that does")
    pairs: list[SideMoved] = Field(description="B's side against A's on the items whose tokens agree: the rollout, "
                                               "each shared trainer precision")
    rows: list[RowSideBySide] = Field(description="each attribution row both runs have, side by side")

    def write(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def compared(records: tuple[list[Record], list[Record]], item_ids: Sequence[str], checkpoint: str,
             runs: tuple[str, str], sections: tuple[MismatchSummary, MismatchSummary],
             differences: Differences) -> RunComparison:
    """The comparison as `compare` writes it: the document, the answers (what differs last) and the tables (what
    differs first)."""
    c = compare_mismatch(records, item_ids, checkpoint, runs, sections, differences)
    header = [("A", runs[0]), ("B", runs[1]), ("checkpoint", checkpoint), ("compare.json schema", str(VERSION))]
    return RunComparison(c, header, [*comparison_verdict(c), differences_answer(differences)],
                         [differences_table(differences), *comparison_tables(c)])


def compare_mismatch(records: tuple[list[Record], list[Record]], item_ids: Sequence[str], checkpoint: str,
                     runs: tuple[str, str],
                     sections: tuple[MismatchSummary, MismatchSummary],
                     differences: Differences) -> MismatchComparison:
    """The comparison (module docstring) of two runs' records and results sections at `checkpoint`."""
    a, b = records
    s_a, s_b = sections
    main_a = {r.item_id: p for r, p in payloads(a) if not r.part}
    main_b = {r.item_id: p for r, p in payloads(b) if not r.part}
    shared = [i for i in item_ids if i in main_a and i in main_b]
    other = next((i for i in shared if main_a[i].prompt_ids != main_b[i].prompt_ids), None)
    if other is not None:
        raise StageReplayError(f"item {other} has another prompt in {runs[1]} than in {runs[0]}",
                               "compare rollouts of the same prompts (the same ids for the same prompt IDs)")
    equal = [i for i in shared if main_a[i].tokens_fp == main_b[i].tokens_fp]
    diverged = [first_divergence(main_a[i].response_ids or [], main_b[i].response_ids or [])
                for i in shared if i not in equal]
    held_a, held_b = sides(a), sides(b)
    names = ["rollout", *(f"trainer@{p}" for p in s_a.precisions if p in s_b.precisions)]
    pairs = []
    for name in names:
        found = [Pair(held_a[i][name][0], held_b[i][name][0], held_a[i][name][1], held_b[i][name][1])
                 for i in equal if name in held_a.get(i, {}) and name in held_b.get(i, {})]
        if found:
            pairs.append(SideMoved(side=name, metrics=MismatchMetrics.of(metrics(found))))
    rows_b = {p.row: p.metrics for p in s_b.pairs}
    rows = [RowSideBySide(row=p.row, abs_mean=(p.metrics.abs_mean, rows_b[p.row].abs_mean),
                          k3_kl=(p.metrics.k3_kl, rows_b[p.row].k3_kl),
                          bitwise_equal=(p.metrics.bitwise_equal, rows_b[p.row].bitwise_equal))
            for p in s_a.pairs if p.row in rows_b]
    return MismatchComparison(checkpoint=checkpoint, runs=runs, differences=differences, items=len(shared), tokens_equal=len(equal),
                              first_divergence=[d for d in diverged if d is not None], pairs=pairs, rows=rows)


def comparison_verdict(c: MismatchComparison) -> list[tuple[str, str]]:
    same = "yes" if c.tokens_equal == c.items else "no"
    out = [("Do the two runs roll out the same tokens?",
            f"{same}: {k_of_n(c.tokens_equal, c.items)} items' rollouts are the same tokens.")]
    rollout = next((p.metrics for p in c.pairs if p.side == "rollout"), None)
    if rollout is not None:
        moved = "no" if rollout.bitwise_equal == 1.0 else "yes"
        out.append(("Did the setting move the rollout engine's log-probabilities?",
                    f"{moved}: on the {rollout.sequences} items whose tokens agree, "
                    f"{100 * (rollout.bitwise_equal or 0.0):.1f}% of {rollout.tokens} are the same bits, mean "
                    f"|log-ratio| {num(rollout.abs_mean)}, max {num(rollout.abs_max)}."))
    return out


def comparison_tables(c: MismatchComparison) -> list[Table]:
    sides_table = Table("table-compare-mismatch-sides", "Run B's log-probabilities against run A's, on the same tokens",
                        ("side", "items", "tokens", "bitwise equal", "mean |log-ratio|", "max |log-ratio|", "k3_kl"),
                        as_rows([[p.side, str(p.metrics.sequences), str(p.metrics.tokens),
                                  num(p.metrics.bitwise_equal, 4), num(p.metrics.abs_mean), num(p.metrics.abs_max),
                                  num(p.metrics.k3_kl)] for p in c.pairs]))
    rows_table = Table("table-compare-mismatch-rows", "The attribution in run A and in run B",
                       ("row", "mean |log-ratio| A", "B", "k3_kl A", "B", "bitwise equal A", "B"),
                       as_rows([[r.row, num(r.abs_mean[0]), num(r.abs_mean[1]), num(r.k3_kl[0]), num(r.k3_kl[1]),
                                 num(r.bitwise_equal[0], 4), num(r.bitwise_equal[1], 4)] for r in c.rows]))
    tokens = Table("table-compare-mismatch-tokens", "Rollouts", ("items", "same tokens", "first divergence (median)"),
                   as_rows([[str(c.items), k_of_n(c.tokens_equal, c.items),
                             str(sorted(c.first_divergence)[len(c.first_divergence) // 2]) if c.first_divergence
                             else NA]]))
    return [tokens, sides_table, rows_table]
