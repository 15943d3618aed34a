"""Two attest runs of the same prompts side by side (`stagereplay compare A B`): per item whether the two served
responses are the same tokens, and the two decisions (two servers, two settings of one, or a run and its rerun)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from stagereplay.experiments.attest.payloads import AttestPayload
from stagereplay.experiments.attest.summary import AttestSummary
from stagereplay.experiments.core.compared import RunComparison, differences_answer, differences_table
from stagereplay.experiments.core.format import Table, as_rows, k_of_n
from stagereplay.records.differences import Differences
from stagereplay.records.ledger import Record

VERSION = 1


class AttestComparison(BaseModel):
    """compare.json of two attest runs."""

    model_config = ConfigDict(frozen=True)

    version: int = Field(VERSION, description="this document's schema")
    runs: tuple[str, str] = Field(description="run A and run B")
    checkpoint: str = Field(description="the claimed model")
    items: int = Field(description="items both runs served")
    same_tokens: int = Field(description="of those, items whose served responses are the same tokens")
    decisions: tuple[AttestSummary, AttestSummary] = Field(description="each run's section of results.json")

    def write(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def compared(records: tuple[list[Record], list[Record]], item_ids: Sequence[str], checkpoint: str,
             runs: tuple[str, str], sections: tuple[AttestSummary, AttestSummary],
             differences: Differences) -> RunComparison:
    """The comparison as `compare` writes it (module docstring)."""
    served = [{r.item_id: AttestPayload.model_validate(r.payload).tokens_fp for r in side if r.part == ""}
              for side in records]
    shared = [i for i in item_ids if i in served[0] and i in served[1]]
    same = sum(served[0][i] == served[1][i] for i in shared)
    c = AttestComparison(runs=runs, checkpoint=checkpoint, items=len(shared), same_tokens=same, decisions=sections)
    a, b = sections
    rows = [["served", a.served, b.served], ["decision", *(s.outcome for s in sections)],
            ["p-value", f"{a.p_value:.4g}", f"{b.p_value:.4g}"],
            [f"mean {a.score}", f"{a.statistic:.4g}", f"{b.statistic:.4g}"],
            ["tokens needed", str(a.tokens_needed or "-"), str(b.tokens_needed or "-")],
            ["Token-DiFR exact_match_rate", *(f"{s.difr.get('exact_match_rate', 0.0):.4f}" for s in sections)]]
    table = Table("table-compare-attest", "Two attest runs' decisions", ("", "A", "B"), as_rows(rows),
                  note=f"served responses with the same tokens: {k_of_n(same, len(shared))}")
    answer = ("Do the two runs serve the same tokens?", f"{k_of_n(same, len(shared))} of the items' served responses "
              "are the same tokens.")
    header = [("A", runs[0]), ("B", runs[1]), ("checkpoint", checkpoint), ("compare.json schema", str(VERSION))]
    return RunComparison(c, header, [answer, differences_answer(differences)], [differences_table(differences), table])
