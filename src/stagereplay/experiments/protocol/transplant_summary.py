"""transplant's section of results.json (`TransplantSummary`), summarised from its records, and its tables, verdict
facts and figures: per direction (donor->recipient) whose suffix the transplanted continuations follow, the zero-layer
control's, and where the layers were swept, per band.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, TypeAdapter

from stagereplay.experiments.core.figures import (
    BLUE,
    GREY,
    ORANGE,
    ReportFigure,
    png,
    share_bars,
    share_heatmap,
)
from stagereplay.experiments.core.format import NA, Table, as_rows, bound, k_of_n, slug, wilson_or_given
from stagereplay.experiments.core.stats import wilson_interval
from stagereplay.experiments.core.verdict import CARRIES, Fact
from stagereplay.experiments.protocol.payloads import Outcome, PrefixNotReproducedPayload, TransplantPayload
from stagereplay.records.ledger import Record
from stagereplay.records.payloads import Followed
from stagereplay.records.summary import SummaryModel

PAYLOAD: TypeAdapter[TransplantPayload | PrefixNotReproducedPayload] = TypeAdapter(
    Annotated[TransplantPayload | PrefixNotReproducedPayload, Field(discriminator="status")])
"""A transplant record's payload (`records.payloads`): live reached the matched prefix again, or not."""


class Direction(SummaryModel):
    """One direction's outcomes: whose own suffix each transplanted continuation equals."""

    direction: str = Field(description="`<donor>-><recipient>`")
    n: int = Field(description="items transplanted")
    follows_donor: int = Field(description="continuations equal to the donor's suffix")
    follows_recipient: int = Field(description="continuations equal to the recipient's suffix")
    neither: int = Field(description="continuations equal to neither")
    donor_wilson: list[float] | None = Field(description="Wilson 95% interval of follows_donor/n (null: no item)")
    divergence_from_donor: list[int | None] = Field(description="per item, the first step it differs from the "
                                                                "donor's suffix (null: nowhere)")

    def outcomes(self) -> dict[str, int]:
        """Its counts per outcome (`OUTCOMES`' keys)."""
        return {"follows_donor": self.follows_donor, "follows_recipient": self.follows_recipient,
                "neither": self.neither}


class Control(SummaryModel):
    """The negative control: the same transplant moving no layer."""

    layers: str = Field(description="the layers it moves: none")
    directions: list[Direction] = Field(description="per direction, its outcomes")


class SweepBand(SummaryModel):
    """One band of the layer sweep in one direction."""

    band: str = Field(description="its layers as `A` or `A-B`")
    kind: str = Field(description="single, bottom or top")
    layers: list[int] = Field(description="its layers")
    direction: str = Field(description="`<donor>-><recipient>`")
    follows_donor: int = Field(description="continuations equal to the donor's suffix")
    n: int = Field(description="items transplanted")


class Sweep(SummaryModel):
    """The layer sweep: single layers, bands from the bottom, bands from the top."""

    n_layers: int = Field(description="the model's layers")
    rows: list[SweepBand] = Field(description="per band, per direction")
    smallest_band: dict[str, list[int]] = Field(description="per direction, the smallest band every continuation "
                                                            "follows the donor through (absent: none)")


class TransplantSummary(SummaryModel):
    """The transplant at one checkpoint: transplant's section of results.json (a list of them)."""

    checkpoint: str = Field(description="the stage's checkpoint")
    selection: str = Field(description="the selection rule, frozen before any outcome")
    layers: str = Field(default="all", description="the layers transplanted")
    kv: str = Field(default="kv", description="k, v or kv")
    positions: str | None = Field(default=None, description="the positions transplanted (null: all)")
    n_items: int = Field(description="selected items whose pair was reproduced")
    n_selected: int = Field(description="items selected")
    n_not_reproduced: int = Field(description="selected items whose pair did not diverge again")
    directions: list[Direction] = Field(description="per direction, its outcomes")
    control: Control | None = Field(default=None, description="the zero-layer control")
    sweep: Sweep | None = Field(default=None, description="the layer sweep (null: not swept)")


def _directions(payloads: list[dict[str, Outcome]]) -> list[Direction]:
    """Per direction (in the first item's order), its outcomes over the items: `payloads` holds per item its
    outcome per direction."""
    names = list(payloads[0]) if payloads else []
    out = []
    for name in names:
        outcomes = [p[name].outcome for p in payloads]
        n, k = len(outcomes), outcomes.count("donor")
        out.append(Direction(direction=name, n=n, follows_donor=k, follows_recipient=outcomes.count("recipient"),
                             neither=outcomes.count("neither"),
                             donor_wilson=list(wilson_interval(k, n)) if n else None,
                             divergence_from_donor=[p[name].divergence_from_donor for p in payloads]))
    return out


def summarize_transplant(records: list[Record], checkpoint: str, *, selection: str, layers: str, kv: str,
                         positions: str | None, n_selected: int, sweep_layers: bool) -> TransplantSummary:
    """The stage's outcomes, under its settings (its frozen config, the number of items it selected); `sweep_layers`:
    whether it swept the layers."""
    read = [PAYLOAD.validate_python(r.payload) for r in records]
    ok = [p for p in read if isinstance(p, TransplantPayload)]
    directions = _directions([p.directions for p in ok])
    sweep = None
    if sweep_layers and ok:
        bands = ok[0].sweep or []
        n_layers = max(max(b.layers) for b in bands) + 1
        rows: list[SweepBand] = []
        smallest: dict[str, list[int]] = {}
        for j, band in enumerate(bands):
            for d in (x.direction for x in directions):
                k = sum(_followed(p, j, d) == "donor" for p in ok)
                moved = band.layers
                label = str(moved[0]) if len(moved) == 1 else f"{moved[0]}-{moved[-1]}"
                rows.append(SweepBand(band=label, kind=band.kind, layers=moved, direction=d, follows_donor=k,
                                      n=len(ok)))
                best = smallest.get(d)
                if k == len(ok) and (best is None or (len(moved), moved[0]) < (len(best), best[0])):
                    smallest[d] = moved
        sweep = Sweep(n_layers=n_layers, rows=rows, smallest_band=smallest)
    return TransplantSummary(
        checkpoint=checkpoint, selection=selection, layers=layers, kv=kv, positions=positions,
        n_items=len(ok), n_selected=n_selected, n_not_reproduced=len(records) - len(ok),
        directions=directions, control=Control(layers="none", directions=_directions([p.control for p in ok])),
        sweep=sweep)


def _followed(payload: TransplantPayload, band: int, direction: str) -> Followed | None:
    """Whose suffix the continuation of `direction` followed with the sweep's `band`-th band swapped."""
    row = (payload.sweep or [])[band]
    return (row.__pydantic_extra__ or {}).get(direction)


_TRANSPLANT_HEADERS = (
    "direction",
    "layers",
    "K/V",
    "follows donor",
    "Wilson 95% lower",
    "follows recipient",
    "neither",
)


def transplant_tables(t: TransplantSummary) -> list[Table]:
    ckpt = t.checkpoint
    rows = [_direction_row(d, t.layers, t.kv) for d in t.directions]
    if t.control:
        rows += [_direction_row(d, f"{t.control.layers} (control)", NA) for d in t.control.directions]
    note = (
        f"Selection {t.selection} ({t.n_items} items), frozen before outcomes were seen; positions "
        f"{t.positions or 'all'}. Direction is donor->recipient; 'Wilson 95% lower' bounds the "
        "donor-following rate."
    )
    tables = [
        Table(
            f"table-transplant-{slug(ckpt)}", f"Transplant ({ckpt})", _TRANSPLANT_HEADERS, as_rows(rows), note
        )
    ]
    if t.sweep and t.sweep.rows:
        tables.extend(_sweep_tables(t.sweep, ckpt))
    return tables


def _direction_row(d: Direction, layers: str, kv: str) -> list[str]:
    ci = wilson_or_given(d.follows_donor, d.n, d.donor_wilson)
    return [
        d.direction,
        layers,
        kv,
        k_of_n(d.follows_donor, d.n),
        bound(ci[0]) if ci else NA,
        k_of_n(d.follows_recipient, d.n),
        k_of_n(d.neither, d.n),
    ]


def _sweep_tables(sweep: Sweep, ckpt: str) -> list[Table]:
    directions = list(dict.fromkeys(r.direction for r in sweep.rows))
    bands: dict[tuple[str, str], dict[str, str]] = {}
    for r in sweep.rows:
        bands.setdefault((r.kind, r.band), {})[r.direction] = f"{r.follows_donor}/{r.n}"
    summary = [[d, _layers(sweep.smallest_band.get(d), sweep.n_layers)] for d in directions]
    detail = [[kind, band, *(cells.get(d, NA) for d in directions)] for (kind, band), cells in bands.items()]
    return [
        Table(
            f"table-sweep-summary-{slug(ckpt)}",
            f"Layer sweep ({ckpt}): smallest band whose K/V makes every continuation follow the donor",
            ("direction", "smallest band"),
            as_rows(summary),
        ),
        Table(
            f"table-sweep-{slug(ckpt)}",
            f"Layer sweep ({ckpt}): follows donor per band",
            ("kind", "layers", *directions),
            as_rows(detail),
            terminal=False,
        ),
    ]


def _layers(layers: list[int] | None, n_layers: int) -> str:
    if not layers:
        return "none found"
    span = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
    return f"layers {span} ({len(layers)} of {n_layers})"


def transplant_facts(transplants: list[TransplantSummary]) -> list[Fact]:
    """Per checkpoint and direction with items: how many continuations followed the donor; then the zero-layer
    control's (how many followed the recipient), the negative control."""
    facts = [Fact(CARRIES, f"{t.checkpoint} {d.direction}", holds=d.follows_donor == d.n, k=d.follows_donor, n=d.n)
             for t in transplants for d in t.directions if d.n]
    return facts + [Fact(CARRIES, f"{t.checkpoint} {d.direction} control", k=d.follows_recipient, n=d.n,
                         control=True)
                    for t in transplants for d in (t.control.directions if t.control else []) if d.n]


OUTCOMES = {"follows_donor": (BLUE, "follows donor"), "follows_recipient": (ORANGE, "follows recipient"),
            "neither": (GREY, "neither")}
"""Each outcome's colour and legend, in the order the bars stack them."""


def transplant_figures(transplants: list[TransplantSummary]) -> list[ReportFigure]:
    """The outcome shares of every checkpoint and direction (controls included), then each checkpoint's sweep."""
    import numpy as np

    transplants = [t for t in transplants if t.directions]
    if not transplants:
        return []
    bars = [(f"{t.checkpoint}: {d.direction}{suffix} (n={d.n})", d.outcomes(), d.n) for t in transplants
            for suffix, rows in (("", t.directions), (" control", t.control.directions if t.control else []))
            for d in rows]
    figures = [ReportFigure(
        "fig-transplant", "Transplant outcomes",
        "Share of transplanted continuations that follow the cache donor, the recipient, or neither, per checkpoint "
        "and direction (donor->recipient); control rows move no layers.",
        png(share_bars(bars, OUTCOMES, "share of transplanted continuations")), after=("table-transplant-",))]
    for t in transplants:
        sweep = t.sweep
        if not sweep or not sweep.rows:
            continue
        ckpt = t.checkpoint
        bands = list(dict.fromkeys((r.kind, r.band) for r in sweep.rows))
        directions = list(dict.fromkeys(r.direction for r in sweep.rows))
        share = np.full((len(bands), len(directions)), np.nan)  # (bands, directions)
        counts: dict[tuple[int, int], str] = {}
        for r in sweep.rows:
            i, j = bands.index((r.kind, r.band)), directions.index(r.direction)
            share[i, j] = r.follows_donor / r.n if r.n else np.nan
            counts[i, j] = f"{r.follows_donor}/{r.n}"
        title = f"{ckpt}: K/V layers transplanted ({sweep.n_layers} layers)"
        figures.append(ReportFigure(
            f"fig-sweep-{slug(ckpt)}", f"Layer sweep ({ckpt})",
            "Fraction of continuations that follow the donor when only the listed layers' K/V are transplanted: "
            "single layers, bands growing from the bottom, bands growing from the top.",
            png(share_heatmap(share, counts, [f"{kind} {band}" for kind, band in bands], directions, title,
                              "share following donor")),
            after=(f"table-sweep-{slug(ckpt)}",)))
    return figures
