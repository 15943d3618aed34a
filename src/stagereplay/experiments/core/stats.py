"""Statistics for the paper's tables: binomial intervals, the cluster bootstrap, McNemar, divergence index.

Every function is pure and takes its randomness as an explicit seed, so a report regenerated from the
same ledger prints the same numbers. Where scipy already has the piece we call it rather than re-derive
it: `scipy.stats.binomtest(...).proportion_ci` gives Wilson intervals
(z = Phi^-1(0.975) = 1.959964 at 95%), `binomtest(...).pvalue` the exact McNemar p, `scipy.stats.quantile` the
bootstrap's percentiles and `scipy.stats.false_discovery_control` the Benjamini-Hochberg adjustment. The
paper's numbers are pinned in tests/test_stats.py (0/200 -> 1.88%; 11 vs 9 of 200 -> [-3.5, +5.5]).

One bootstrap serves every experiment (`cluster_bootstrap`): a statistic that is a ratio of sums over clusters
(items, responses, sequences: the unit whose tokens are not independent) gets a percentile interval from resampling
whole clusters with replacement, every statistic on the same resamples, drawn in blocks of bounded memory. The
paired difference of two arms is its special case (`paired_bootstrap_ci`), and draws and percentiles are those of
`scipy.stats.bootstrap(paired=True, method="percentile")`, to the bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import binomtest, false_discovery_control, quantile

_BOOTSTRAP_BLOCK = 2_000
_BOOTSTRAP_CELLS = 2_000_000
"""Resamples are drawn `_BOOTSTRAP_BLOCK` at a time, fewer where that many of n clusters would pass this many cells
(16 MB of int64 indices): memory stays flat in the number of clusters. numpy's Generator draws the blocks from one
stream, so the block size never changes a draw."""


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


def resamples(k: int, n_resamples: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """`n_resamples` resamples of k clusters with replacement, as index blocks [b, k] of bounded memory whose rows,
    in order, are the same whatever the block size."""
    block = max(1, min(_BOOTSTRAP_BLOCK, _BOOTSTRAP_CELLS // k))
    for start in range(0, n_resamples, block):
        yield rng.integers(0, k, size=(min(block, n_resamples - start), k))  # [b, k]


def cluster_bootstrap(parts: Mapping[str, tuple[ArrayLike, ArrayLike]], n_resamples: int = 10_000,
                      confidence: float = 0.95, seed: int | np.random.Generator = 0
                      ) -> dict[str, tuple[float, float] | None]:
    """Per statistic of `parts` (its numerator and denominator per cluster, [k] each), the percentile bootstrap
    interval of sum(numerator) / sum(denominator), every statistic on the same resamples of the k clusters.

    A mean over clusters is the ratio with denominator 1 each; a token-weighted mean over responses the ratio with
    each response's token sum and count, so the tokens of one response move together. No cluster: no interval
    (None); one cluster: its own ratio, the only resample there is. Percentiles are scipy's linear ones."""
    _check_confidence(confidence)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be positive, got {n_resamples}")
    split = {name: (np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64))
             for name, (num, den) in parts.items()}
    sizes = {num.shape for num, _ in split.values()} | {den.shape for _, den in split.values()}
    if len(sizes) > 1 or any(len(shape) != 1 for shape in sizes):
        raise ValueError(f"every numerator and denominator must be 1-D over the same clusters, got shapes {sizes}")
    k = next(iter(sizes))[0] if sizes else 0
    if k == 0:
        return dict.fromkeys(split)
    if k == 1:
        return {name: (float(num[0] / den[0]),) * 2 for name, (num, den) in split.items()}
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    drawn: dict[str, list[np.ndarray]] = {name: [] for name in split}
    for idx in resamples(k, n_resamples, rng):
        for name, (num, den) in split.items():
            drawn[name].append(num[idx].sum(axis=1) / den[idx].sum(axis=1))  # [b]
    alpha = (1 - confidence) / 2
    out: dict[str, tuple[float, float] | None] = {}
    for name, d in drawn.items():
        lo, hi = quantile(np.concatenate(d), np.array([alpha, 1 - alpha]))
        out[name] = (float(lo), float(hi))
    return out


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
    The cluster bootstrap of the per-item difference (`cluster_bootstrap`), the same draws and percentiles as
    `scipy.stats.bootstrap(paired=True, method="percentile")` with a generator seeded with `seed`. With 0/1 inputs
    over n items every resampled mean is a multiple of 1/n, so at n = 200 the bounds land on multiples of half a point.
    """
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.ndim != 1 or xa.shape != xb.shape:
        raise ValueError(f"a and b must be 1-D and paired item by item, got shapes {xa.shape} and {xb.shape}")
    if xa.shape[0] == 0:
        raise ValueError("no items: a paired bootstrap needs at least one pair")
    ci = cluster_bootstrap({"d": (xa - xb, np.ones_like(xa))}, n_resamples, confidence, seed)["d"]
    assert ci is not None  # at least one item
    return ci


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
