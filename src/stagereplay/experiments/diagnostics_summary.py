"""The diagnostics of one compared pair across a run's records, summarised for `results.json`.

Records carry, per item, the margins of every step and per pair the logits at the first divergent step and the
cache difference (`experiments.diagnose`); this folds them into what a reader compares across items: which items
diverged and how close their decisions were, the first-step logit difference per item, and per layer and per
position band the median cache difference. Records made before diagnostics existed summarise to nothing.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from stagereplay.experiments.experiment import Section
from stagereplay.records.ledger import Record

PERCENTILES = tuple(range(0, 101, 5))
"""Where the distribution of step margins is sampled: enough to draw its curve, small enough to store."""


def pair_diagnostics(record: Record, a: str, b: str) -> dict[str, Any] | None:
    """The record's diagnostics for the pair (a, b), or None when it has none."""
    diag = record.payload.get("diagnostics")
    return None if not diag else diag.get("pairs", {}).get(f"{a} vs {b}")


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return float(median(xs)) if xs else None


def percentiles(values: list[float]) -> list[float]:
    """The `PERCENTILES` of `values` (linear interpolation, as numpy's default)."""
    import numpy as np

    return [float(x) for x in np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)]


def summarize_pair(records: list[Record], a: str, b: str) -> Section:
    """Divergences with their margins, the first-step logit difference per item, median cache differences.

    The margin distribution over all steps is the reference arm `a`'s (the live arm in a matched run), so the
    margin at divergence and the margins it is read against come from the same continuations.
    """
    divergences: list[dict[str, Any]] = []
    first_step: dict[str, float | None] = {}
    caches: list[dict[str, Any]] = []
    steps: list[float] = []
    for r in records:
        diag = pair_diagnostics(r, a, b)
        if diag is None:
            continue
        first_step[r.item_id] = diag["first_step_logit_maxabs"]
        steps += [m for m in r.payload["diagnostics"]["margins"].get(a, []) if m is not None]
        if diag.get("cache"):
            caches.append(diag["cache"])
        d = diag.get("divergence")
        if d is not None:
            divergences.append({"item_id": r.item_id, "first_divergence": d["step"],
                                "margin": {a: d["a"]["margin"], b: d["b"]["margin"]},
                                "logit_maxabs": d["logit_maxabs"]})
    at_divergence = [d["margin"][a] for d in divergences]
    return {
        "divergences": divergences,
        "first_step_logit_maxabs": first_step,
        "margins": {
            "arm": a,
            "steps": {"n": len(steps), "median": _median(list(steps)), "percentiles": percentiles(steps)}
            if steps else None,
            "at_divergence": {"n": len(at_divergence), "median": _median(at_divergence)},
        },
        "cache_diff": _layer_medians(caches),
        "cache_bands": _band_medians(caches),
    }


def _layer_medians(caches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per layer, medians over items of K and V relative L2 and max-abs differences."""
    n_layers = max((len(c["layers"]) for c in caches), default=0)
    out = []
    for i in range(n_layers):
        rows = [c["layers"][i] for c in caches if i < len(c["layers"])]
        out.append({"layer": i, **{f"{t}_{s}": _median([row[t][s] for row in rows])
                                   for t in ("k", "v") for s in ("rel_l2", "maxabs")}})
    return out


def _band_medians(caches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per position band (in first-seen order), medians over items of K and V relative L2 and max-abs."""
    names: list[str] = []
    rows: dict[str, list[dict[str, Any]]] = {}
    for c in caches:
        for band in c["bands"]:
            if band["band"] not in rows:
                names.append(band["band"])
            rows.setdefault(band["band"], []).append(band)
    return [{"band": name, "n": len(rows[name]),
             **{f"{t}_{s}": _median([row[t][s] for row in rows[name]]) for t in ("k", "v") for s in ("rel_l2",
                                                                                                    "maxabs")}}
            for name in names]
