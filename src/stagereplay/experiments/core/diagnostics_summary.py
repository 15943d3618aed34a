"""The diagnostics of one compared pair across a run's records, summarised for `results.json`.

Records carry, per item, the margins of every step and per pair the logits at the first divergent step and the
cache difference (`experiments.protocol.diagnose`); this folds them into what a reader compares across items: which items
diverged and how close their decisions were, the first-step logit difference per item, and per layer and per
position band the median cache difference. Records made before diagnostics existed summarise to nothing.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from pydantic import Field

from stagereplay.records.payloads import BandDiff, CacheDiff, Diagnostics, PairDiagnostics
from stagereplay.records.summary import SummaryModel

PERCENTILES = tuple(range(0, 101, 5))
"""Where the distribution of step margins is sampled: enough to draw its curve, small enough to store."""


class DivergenceAt(SummaryModel):
    """One item's pair at its first divergent step."""

    item_id: str = Field(description="the item")
    first_divergence: int = Field(description="the first suffix step where the two arms' tokens differ")
    margin: dict[str, float | None] = Field(description="per arm (the pair's two), top-1 minus top-2 logit there")
    logit_maxabs: float | None = Field(description="max |logit a - logit b| there (null: not recorded)")


class StepMargins(SummaryModel):
    """The reference arm's margins over all its steps."""

    n: int = Field(description="steps with a margin")
    median: float | None = Field(description="their median")
    percentiles: list[float] = Field(description="their `PERCENTILES` (0, 5, .., 100)")


class DivergenceMargins(SummaryModel):
    """The reference arm's margins at the first divergent steps."""

    n: int = Field(description="divergent items")
    median: float | None = Field(description="the median margin there (null: none diverged, or no margin)")


class Margins(SummaryModel):
    """Top-1 minus top-2 logit margins of the reference arm."""

    arm: str = Field(description="the reference arm (the pair's first)")
    steps: StepMargins | None = Field(description="over all steps (null: no step recorded a margin)")
    at_divergence: DivergenceMargins = Field(description="at the first divergent step of each divergent item")


class LayerMedians(SummaryModel):
    """One layer's cache difference, median over items."""

    layer: int = Field(description="layer index")
    k_rel_l2: float | None = Field(description="keys: relative L2 ||a-b||/||a||")
    k_maxabs: float | None = Field(description="keys: max |a-b|")
    v_rel_l2: float | None = Field(description="values: relative L2 ||a-b||/||a||")
    v_maxabs: float | None = Field(description="values: max |a-b|")


class BandMedians(SummaryModel):
    """One position band's cache difference, median over the items that have it."""

    band: str = Field(description="prompt, s1.q1 .. s1.q4 (stage 1 in quartiles) or last16")
    n: int = Field(description="items with this band")
    k_rel_l2: float | None = Field(description="keys: relative L2 ||a-b||/||a||")
    k_maxabs: float | None = Field(description="keys: max |a-b|")
    v_rel_l2: float | None = Field(description="values: relative L2 ||a-b||/||a||")
    v_maxabs: float | None = Field(description="values: max |a-b|")


class Diagnosed(SummaryModel):
    """The diagnostics of one compared pair across a stage's records: the fields a section that carries them holds
    (unset where no record has a pair to diagnose)."""

    divergences: list[DivergenceAt] | None = Field(default=None, description="each divergent item at its first "
                                                                             "divergent step")
    first_step_logit_maxabs: dict[str, float | None] | None = Field(
        default=None, description="per item, max |logit a - logit b| at the first suffix step")
    margins: Margins | None = Field(default=None, description="the reference arm's margins")
    cache_diff: list[LayerMedians] | None = Field(default=None, description="per layer, median cache differences")
    cache_bands: list[BandMedians] | None = Field(default=None, description="per position band (in first-seen "
                                                                            "order), median cache differences")

    def diagnostics(self) -> dict[str, Any]:
        """Its diagnostic fields, to set on a section that carries them."""
        return {f: getattr(self, f) for f in Diagnosed.model_fields if f in self.model_fields_set}


def pair_diagnostics(diagnostics: Diagnostics | None, a: str, b: str) -> PairDiagnostics | None:
    """A record's diagnostics for the pair (a, b), or None when it has none."""
    return None if diagnostics is None else diagnostics.pairs.get(f"{a} vs {b}")


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return float(median(xs)) if xs else None


def percentiles(values: list[float]) -> list[float]:
    """The `PERCENTILES` of `values` (linear interpolation, as numpy's default)."""
    import numpy as np

    return [float(x) for x in np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)]


def summarize_pair(records: list[tuple[str, Diagnostics | None]], a: str, b: str) -> Diagnosed:
    """Divergences with their margins, the first-step logit difference per item, median cache differences.

    `records`: per item, its id and its record's diagnostics block (None: its record has none). The margin
    distribution over all steps is the reference arm `a`'s (the live arm in a matched run), so the
    margin at divergence and the margins it is read against come from the same continuations.
    """
    divergences: list[DivergenceAt] = []
    first_step: dict[str, float | None] = {}
    caches: list[CacheDiff] = []
    steps: list[float] = []
    for item_id, diagnostics in records:
        diag = pair_diagnostics(diagnostics, a, b)
        if diagnostics is None or diag is None:
            continue
        first_step[item_id] = diag.first_step_logit_maxabs
        steps += [m for m in diagnostics.margins.get(a, []) if m is not None]
        if diag.cache:
            caches.append(diag.cache)
        d = diag.divergence
        if d is not None:
            divergences.append(DivergenceAt(item_id=item_id, first_divergence=d.step,
                                            margin={a: d.a.margin, b: d.b.margin}, logit_maxabs=d.logit_maxabs))
    at_divergence = [d.margin[a] for d in divergences]
    return Diagnosed(
        divergences=divergences,
        first_step_logit_maxabs=first_step,
        margins=Margins(
            arm=a,
            steps=StepMargins(n=len(steps), median=_median(list(steps)), percentiles=percentiles(steps))
            if steps else None,
            at_divergence=DivergenceMargins(n=len(at_divergence), median=_median(at_divergence)),
        ),
        cache_diff=_layer_medians(caches),
        cache_bands=_band_medians(caches),
    )


def _layer_medians(caches: list[CacheDiff]) -> list[LayerMedians]:
    """Per layer, medians over items of K and V relative L2 and max-abs differences."""
    n_layers = max((len(c.layers) for c in caches), default=0)
    out = []
    for i in range(n_layers):
        rows = [c.layers[i] for c in caches if i < len(c.layers)]
        k, v = [row.k for row in rows], [row.v for row in rows]
        out.append(LayerMedians(layer=i, k_rel_l2=_median([x.rel_l2 for x in k]), k_maxabs=_median([x.maxabs for x in k]),
                                v_rel_l2=_median([x.rel_l2 for x in v]), v_maxabs=_median([x.maxabs for x in v])))
    return out


def _band_medians(caches: list[CacheDiff]) -> list[BandMedians]:
    """Per position band (in first-seen order), medians over items of K and V relative L2 and max-abs."""
    rows: dict[str, list[BandDiff]] = {}
    for c in caches:
        for band in c.bands:
            rows.setdefault(band.band, []).append(band)
    out = []
    for name, bands in rows.items():
        k, v = [b.k for b in bands], [b.v for b in bands]
        out.append(BandMedians(band=name, n=len(bands), k_rel_l2=_median([x.rel_l2 for x in k]),
                               k_maxabs=_median([x.maxabs for x in k]), v_rel_l2=_median([x.rel_l2 for x in v]),
                               v_maxabs=_median([x.maxabs for x in v])))
    return out
