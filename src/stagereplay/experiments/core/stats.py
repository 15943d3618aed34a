"""Statistics for the paper's tables: binomial intervals, a paired bootstrap, McNemar, divergence index.

Every function is pure and takes its randomness as an explicit seed, so a report regenerated from the
same ledger prints the same numbers. Where scipy already has the piece we call it rather than re-derive
it: `scipy.stats.binomtest(...).proportion_ci` gives Wilson intervals
(z = Phi^-1(0.975) = 1.959964 at 95%), `binomtest(...).pvalue` the exact McNemar p, `scipy.stats.bootstrap` the paired
percentile bootstrap and `scipy.stats.false_discovery_control` the Benjamini-Hochberg adjustment. The
paper's numbers are pinned in tests/test_stats.py (0/200 -> 1.88%; 11 vs 9 of 200 -> [-3.5, +5.5]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import binomtest, bootstrap, false_discovery_control

# Resamples are evaluated in blocks so memory stays bounded (block x n int64 indices) for large item counts;
# scipy draws the blocks from one stream, so the block size does not change the interval.
_BOOTSTRAP_BLOCK = 2_000
_BOOTSTRAP_CELLS = 2_000_000
"""Resamples are drawn `_BOOTSTRAP_BLOCK` at a time, fewer where that many of n items would pass this many cells (16 MB
of float64 per array): memory stays flat in the number of items; up to 1,000 items the blocks, and so the draws, are
the same as ever."""


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")


def _check_counts(k: int, n: int) -> None:
    if n == 0:
        raise ValueError("n = 0: a proportion over no trials has no interval (nothing was tested)")
    if n < 0 or k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson score interval for k successes in n trials.

    Wilson rather than Wald because the tables are full of 0/n and n/n, where Wald collapses to a
    zero-width interval: 0/200 has a Wilson upper bound of 1.88%, 24/24 a lower bound of 86.2%.
    """
    _check_counts(k, n)
    _check_confidence(confidence)
    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def paired_bootstrap_ci(
    a: ArrayLike,
    b: ArrayLike,
    n_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(a - b), resampling items (pairs) with replacement.

    `a[i]` and `b[i]` are the two arms' scores (e.g. 0/1 correctness) on the same item i; resampling
    the pair keeps the within-item correlation, which is what makes a one-point accuracy difference
    between two near-identical arms tight. Units follow the inputs: fractions in, fractions out.
    `scipy.stats.bootstrap(paired=True, method="percentile")` does the resampling with a generator
    seeded with `seed`; its percentiles use numpy's linear interpolation. With 0/1 inputs over n items
    every resampled mean is a multiple of 1/n, so at n = 200 the bounds land on multiples of half a point.
    """
    _check_confidence(confidence)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be positive, got {n_resamples}")
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.ndim != 1 or xa.shape != xb.shape:
        raise ValueError(f"a and b must be 1-D and paired item by item, got shapes {xa.shape} and {xb.shape}")
    n = xa.shape[0]
    if n == 0:
        raise ValueError("no items: a paired bootstrap needs at least one pair")
    if n == 1:  # every resample is the one pair (scipy refuses samples of fewer than two)
        d = float(xa[0] - xb[0])
        return d, d
    result = bootstrap(
        (xa, xb),
        statistic=lambda x, y, axis: np.mean(x - y, axis=axis),  # x, y: (..., n) resampled pairs
        paired=True,
        vectorized=True,
        method="percentile",
        n_resamples=n_resamples,
        batch=max(1, min(_BOOTSTRAP_BLOCK, _BOOTSTRAP_CELLS // n)),
        confidence_level=confidence,
        rng=np.random.default_rng(seed),
    )
    ci = result.confidence_interval
    return float(ci.low), float(ci.high)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p from the discordant counts (b: only arm A right, c: only arm B right).

    Under the null each discordant pair is a fair coin, so p is the two-sided binomial test of b out of
    b + c at 0.5. With no discordant pairs there is no evidence of a difference and p = 1.0.
    """
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be non-negative, got b={b}, c={c}")
    if b + c == 0:
        return 1.0
    return float(binomtest(int(b), int(b + c), p=0.5, alternative="two-sided").pvalue)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index at which two token sequences differ, or None when they are equal.

    A strict prefix counts as diverging at the shorter length: one arm stopped (EOS) where the other
    went on, which is a behavioural difference at that position.
    """
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # unequal lengths handled below
        if x != y:
            return i
    if len(a) != len(b):
        return min(len(a), len(b))
    return None


def total_variation(a: Sequence[str | None], b: Sequence[str | None]) -> float:
    """Total-variation distance between the empirical distributions of two samples of answers (None counts
    as an answer of its own: "no answer found"): half the L1 distance of the two frequency vectors."""
    if not a or not b:
        raise ValueError("total variation needs two non-empty samples")
    fa, fb = Counter(a), Counter(b)
    return 0.5 * sum(abs(fa[x] / len(a) - fb[x] / len(b)) for x in fa.keys() | fb.keys())


TWO_SAMPLE_TEST = "Fisher-Freeman-Halton"
MONTE_CARLO_TABLES = 9_999


def two_sample_answer_test(a: Sequence[str | None], b: Sequence[str | None], seed: int = 0) -> float:
    """p of the Fisher-Freeman-Halton test that two samples of answers come from one distribution.

    The 2 x m table (sample x answer) is tested with its margins fixed. With two answers it is Fisher's exact
    test; with more, scipy draws `MONTE_CARLO_TABLES` tables with those margins from a generator seeded with
    `seed` (so the p is reproducible, and never below 1 / (MONTE_CARLO_TABLES + 1)). One answer in all: p = 1.
    """
    from scipy.stats import MonteCarloMethod, fisher_exact

    answers = sorted({*a, *b}, key=lambda x: (x is None, str(x)))
    if len(answers) < 2:
        return 1.0
    fa, fb = Counter(a), Counter(b)
    table = np.array([[fa[x] for x in answers], [fb[x] for x in answers]])  # (2, m)
    if len(answers) == 2:
        return float(fisher_exact(table).pvalue)
    method = MonteCarloMethod(n_resamples=MONTE_CARLO_TABLES, rng=np.random.default_rng(seed))
    # scipy returns some tables' p as a (1,) array rather than a scalar (a 2 x 5 table of 4 + 4 draws, say)
    return float(np.ravel(fisher_exact(table, method=method).pvalue)[0])


def benjamini_hochberg(p_values: Sequence[float], alpha: float = 0.05) -> list[bool]:
    """Which hypotheses the Benjamini-Hochberg step-up procedure rejects at false-discovery rate `alpha`.

    A hypothesis is rejected when its BH-adjusted p (`scipy.stats.false_discovery_control`, method "bh")
    is at most `alpha`; that is the step-up rule: reject the k smallest p, k the largest rank with
    p_(k) <= alpha * k / m.
    """
    if not p_values:
        return []
    adjusted = false_discovery_control(np.asarray(p_values, dtype=np.float64), method="bh")  # (m,)
    return [bool(q <= alpha) for q in adjusted]
