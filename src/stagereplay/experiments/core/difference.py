"""The paired difference of two arms' per-item scores, with its bootstrap interval: one model for every table that
sets two arms side by side (matched's live against a construction, compare's run A against run B)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from stagereplay.experiments.core.stats import paired_bootstrap_ci
from stagereplay.records.summary import SummaryModel


class PairedDifference(SummaryModel):
    """mean(a) - mean(b) over the items both arms scored, with its paired percentile bootstrap CI over items."""

    estimate: float = Field(description="the first arm's mean score minus the second's (accuracy: fractions)")
    ci: list[float] = Field(description="[low, high] of the paired percentile bootstrap over items")
    confidence: float = Field(description="the CI's confidence")
    n_resamples: int = Field(description="bootstrap resamples")
    seed: int = Field(description="the bootstrap's seed")

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float], n_resamples: int = 10_000, seed: int = 0,
           confidence: float = 0.95) -> PairedDifference:
        """The difference of `a` and `b`, paired item by item (at least one item)."""
        lo, hi = paired_bootstrap_ci(a, b, n_resamples=n_resamples, confidence=confidence, seed=seed)
        return cls(estimate=sum(a) / len(a) - sum(b) / len(b), ci=[lo, hi], confidence=confidence,
                   n_resamples=n_resamples, seed=seed)
