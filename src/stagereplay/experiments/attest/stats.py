"""Is a run of served tokens consistent with honest serving? A run-level statistic over tokens, tested against a null
made of the claimed model's honest variants, with its uncertainty over items.

The tokens of one response (an item) share a prefix and are not independent draws: a test that counts each token
as a data point calibrates its threshold too tight and flags honest runs. Here every resampling draws whole items:

    Items.of(per_item)                        per-token scores of K items, flattened: values [T], offsets [K + 1]
    run_statistic(items)                      the token-weighted mean score of a run (larger: further from the claim)
    item_interval(items, ...)                 its percentile interval from resampling the run's items
    pooled_statistics(items, tokens, ...)     statistics of runs of exactly `tokens` tokens made of whole items drawn
                                              with replacement, the last one truncated (one item truncated when it is
                                              longer than `tokens`) [n_draws]
    null_statistics(null, tokens, ...)        pooled statistics widened by the null's own sampling error: the null of
                                              `decide`
    decide(run, null, alpha, ...)             the decision at false-positive rate `alpha`: threshold, p-value, flag,
                                              and the tokens the run needed
    curve(substitute, null, tokens, ...)      AUC and power of a substitution against the null by run length
    tokens_for_power(curve, power)            the fewest tokens on the curve from which the power holds
    nearest(run, variants)                    the honest variants ordered by how close their statistic sits

The p-value is empirical with the +1 correction, p = (1 + #{null >= s}) / (1 + n_draws), never below `p_floor` (what
a null of so many responses can resolve for a run of so many), and the run is flagged iff p <= alpha, which is
s > the threshold `decide` reports where the floor lets the null reach alpha. Every function takes its randomness as a seed. Scores
must be finite (a token the claimed sampler removed is a mismatch, not an infinite margin).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from stagereplay.experiments.core.stats import cluster_bootstrap

ALPHA = 0.01
"""The default false-positive rate."""
DRAWS = 2_000
"""Default resamples of the null (and of a substitution) per run length."""
_CELLS = 2_000_000
"""Pooled draws are made in blocks of at most this many drawn items (16 MB of int64 indices)."""


@dataclass(frozen=True)
class Items:
    """Per-token scores of K items (responses), flattened: `values` [T] float64, item k's tokens at
    values[offsets[k] : offsets[k + 1]], `offsets` [K + 1] int64 from 0 to T."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, per_item: Sequence[ArrayLike]) -> Items:
        """From one array of per-token scores per item; every item non-empty, every score finite."""
        arrays = [np.asarray(a, dtype=np.float64).ravel() for a in per_item]
        if not arrays or any(a.size == 0 for a in arrays):
            raise ValueError("need at least one item, and no empty item: drop responses without tokens")
        values = np.concatenate(arrays)
        if not np.isfinite(values).all():
            raise ValueError("per-token scores must be finite: score a removed token as a mismatch, not an inf margin")
        offsets = np.concatenate([[0], np.cumsum([a.size for a in arrays])]).astype(np.int64)
        return cls(values, offsets)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per item [K]."""
        return np.diff(self.offsets)

    @property
    def sums(self) -> np.ndarray:
        """Score summed per item [K]."""
        return np.add.reduceat(self.values, self.offsets[:-1])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def head(self, k: int) -> Items:
        """The first k items."""
        return Items(self.values[: self.offsets[k]], self.offsets[: k + 1])


def run_statistic(items: Items) -> float:
    """The run's mean score per token: sum over all tokens / number of tokens."""
    return float(items.values.sum() / items.tokens)


def item_interval(items: Items, confidence: float = 0.95, n_resamples: int = DRAWS, seed: int = 0
                  ) -> tuple[float, float]:
    """Percentile interval of `run_statistic` from the cluster bootstrap over the run's items (whole responses:
    `experiments.core.stats.cluster_bootstrap` of their token sums over their token counts)."""
    ci = cluster_bootstrap({"run": (items.sums, items.lengths)}, n_resamples, confidence, seed)["run"]
    if ci is None:
        raise ValueError("a run of no items has no interval")
    return ci


def pooled_statistics(items: Items, tokens: int, n_draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """`run_statistic` of `n_draws` runs of exactly `tokens` tokens [n_draws]: each run concatenates items drawn
    with replacement until it reaches `tokens`, the last item cut there (a run shorter than its first item is that
    item's first `tokens` tokens)."""
    if tokens < 1:
        raise ValueError(f"a run needs at least one token, got {tokens}")
    rng = np.random.default_rng(seed)
    lengths, sums = items.lengths, items.sums
    within = np.concatenate([[0.0], np.cumsum(items.values)])  # [T + 1]: prefix sums over the flat values
    width = math.ceil(tokens / lengths.mean()) + 8  # items drawn per run at first; widened while a run falls short
    block = max(1, _CELLS // width)
    out = np.empty(n_draws)
    for start in range(0, n_draws, block):
        n = min(block, n_draws - start)
        idx = rng.integers(len(items), size=(n, width))  # [n, W]
        covered = np.cumsum(lengths[idx], axis=1)  # [n, W] tokens after each drawn item
        while covered[:, -1].min() < tokens:
            more = rng.integers(len(items), size=(n, width))
            idx = np.concatenate([idx, more], axis=1)
            covered = np.cumsum(lengths[idx], axis=1)
        last = np.argmax(covered >= tokens, axis=1)  # [n] the drawn item the run ends in
        rows = np.arange(n)
        before = np.where(last > 0, covered[rows, last - 1], 0)  # tokens of the whole items before it
        whole = np.cumsum(sums[idx], axis=1)
        whole_sum = np.where(last > 0, whole[rows, last - 1], 0.0)
        begin = items.offsets[idx[rows, last]]
        partial = within[begin + (tokens - before)] - within[begin]
        out[start : start + n] = (whole_sum + partial) / tokens
    return out


def small_sample_scale(null_items: int, alpha: float) -> float:
    """How much wider a null of `null_items` responses is drawn at `alpha` than resampling alone makes it: the
    bootstrap's variance is (K - 1) / K of the sample's, and its tail a normal one where the variance itself was
    estimated from K responses (Student's t with K - 1 degrees of freedom): sqrt(K / (K - 1)) t_{K-1}(1 - alpha) /
    z(1 - alpha). 1.09 at K = 20 and alpha 0.01, 1.01 at K = 200."""
    from scipy.stats import norm
    from scipy.stats import t as student

    k = max(null_items, 2)
    return math.sqrt(k / (k - 1)) * float(student.ppf(1 - alpha, k - 1) / norm.ppf(1 - alpha))


def null_statistics(null: Items, tokens: int, n_draws: int = DRAWS, seed: int = 0, alpha: float | None = None
                    ) -> np.ndarray:
    """What an honest run of `tokens` tokens may score, against a null that is itself a sample [n_draws]: a pooled run
    (`pooled_statistics`) less the resampled null's own error about its mean (a run of all the null's tokens resampled,
    centred on the null's statistic). A run is compared with the null's sample, not with honest serving's true mean,
    and the null's mean is uncertain as much as the run's: leaving that out makes the threshold too tight, and a null
    of as many responses as the run flags an honest one several times more often than alpha. With `alpha`, the
    deviations are widened by `small_sample_scale` for a null of few responses."""
    runs = pooled_statistics(null, tokens, n_draws, seed)
    own = pooled_statistics(null, null.tokens, n_draws, seed + 7919)  # an independent stream for the null's own error
    center = run_statistic(null)
    scale = 1.0 if alpha is None else small_sample_scale(len(null), alpha)
    return center + scale * ((runs - center) - (own - center))


def _order_index(n_draws: int, alpha: float) -> int:
    """m: a statistic s has p <= alpha iff at most m null draws are >= s; needs m >= 0."""
    m = math.floor(alpha * (n_draws + 1) + 1e-9) - 1
    if m < 0:
        raise ValueError(f"{n_draws} null draws cannot reach a p-value of {alpha}: use at least "
                         f"{math.ceil(1 / alpha) - 1} draws")
    return m


def threshold(null_stats: np.ndarray, alpha: float = ALPHA) -> float:
    """The statistic a run must exceed to be flagged at `alpha` against these null draws [n]: the (n - m)-th smallest
    draw (`_order_index`), so s > threshold iff the +1-corrected p-value is at most alpha."""
    ordered = np.sort(null_stats)
    return float(ordered[len(ordered) - 1 - _order_index(len(ordered), alpha)])


def p_value(statistic: float, null_stats: np.ndarray) -> float:
    """(1 + #{null draws >= statistic}) / (1 + n)."""
    return float((1 + np.count_nonzero(null_stats >= statistic)) / (1 + len(null_stats)))


def p_floor(null_items: int, run_items: int) -> float:
    """The smallest p-value a run of `run_items` responses can honestly have against a null of `null_items`: 1 over
    1 + the number of distinct runs the null can make (multisets of `run_items` of its responses). Resampling draws
    more runs than that, but not a tail the null never showed: a run of one response against 10 honest ones is beyond
    them all with probability 1/11 when it is honest, whatever the draws say."""
    if null_items < 1:
        return 1.0
    log_runs = math.lgamma(null_items + run_items) - math.lgamma(run_items + 1) - math.lgamma(null_items)
    return 0.0 if log_runs > 700 else 1.0 / (1 + round(math.exp(log_runs)))


@dataclass(frozen=True)
class Decision:
    """A run tested against the honest null at false-positive rate `alpha`."""

    statistic: float  # the run's mean score per token
    interval: tuple[float, float]  # its 95% interval over the run's items
    threshold: float  # flagged iff statistic > threshold (and the null can reach alpha: `reachable`)
    p_value: float  # empirical, +1-corrected, against null runs of the same number of tokens, at least `p_floor`
    flagged: bool
    alpha: float
    tokens: int  # tokens in the run
    items: int  # items in the run
    tokens_needed: int | None  # the fewest leading items' tokens from which every longer prefix is flagged
    null_items: int
    null_tokens: int
    reachable: bool = True  # p_floor(null items, run items) <= alpha: the null can flag a run of this size at all


def decide(run: Items, null: Items, alpha: float = ALPHA, n_draws: int = DRAWS, seed: int = 0,
           needed: bool = True) -> Decision:
    """Test `run` (a served run's per-token scores) against `null` (the honest variants' items on other prompts):
    the null runs are `null_statistics` of the null at the run's token count. `tokens_needed` (with `needed`) looks
    at the run's prefixes of whole items, in order, one null per prefix; the decision itself is made on the whole
    run only."""
    _order_index(n_draws, alpha)
    stat = run_statistic(run)
    null_stats = null_statistics(null, run.tokens, n_draws, seed, alpha)
    floor = p_floor(len(null), len(run))
    p = max(p_value(stat, null_stats), floor)
    flagged = p <= alpha
    tokens_needed = None
    if flagged and needed:
        tokens_needed = run.tokens
        for k in range(len(run) - 1, 0, -1):
            prefix = run.head(k)
            if max(p_value(run_statistic(prefix), null_statistics(null, prefix.tokens, n_draws, seed + k, alpha)),
                   p_floor(len(null), k)) > alpha:
                break
            tokens_needed = prefix.tokens
    return Decision(statistic=stat, interval=item_interval(run, seed=seed), threshold=threshold(null_stats, alpha),
                    p_value=p, flagged=flagged, alpha=alpha, tokens=run.tokens, items=len(run),
                    tokens_needed=tokens_needed, null_items=len(null), null_tokens=null.tokens, reachable=floor <= alpha)


def auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(positive > negative) + P(tie) / 2 over all pairs: the area under the ROC curve of `positive` [n] (larger is
    flagged) against `negative` [m] (the Mann-Whitney U / (n m))."""
    ordered = np.sort(negative)
    below = np.searchsorted(ordered, positive, side="left")
    at_or_below = np.searchsorted(ordered, positive, side="right")
    return float(((below + at_or_below) / 2).sum() / (len(positive) * len(negative)))


@dataclass(frozen=True)
class Curve:
    """A substitution against the honest null by run length, each array [G] over `tokens` [G]."""

    tokens: np.ndarray
    auc: np.ndarray
    power: np.ndarray  # fraction of the substitution's runs flagged at alpha
    threshold: np.ndarray
    alpha: float


def curve(substitute: Items, null: Items, tokens: Sequence[int], alpha: float = ALPHA, n_draws: int = DRAWS,
          seed: int = 0) -> Curve:
    """AUC and power at `alpha` of runs of t tokens of `substitute` against runs of t tokens of `null`, both from
    `pooled_statistics`, for each t in `tokens`."""
    grid = np.asarray(sorted(set(int(t) for t in tokens)), dtype=np.int64)
    aucs, powers, thresholds = [], [], []
    for i, t in enumerate(grid):
        null_stats = pooled_statistics(null, int(t), n_draws, seed + 2 * i)
        sub_stats = pooled_statistics(substitute, int(t), n_draws, seed + 2 * i + 1)
        thr = threshold(null_stats, alpha)
        aucs.append(auc(sub_stats, null_stats))
        powers.append(float(np.mean(sub_stats > thr)))
        thresholds.append(thr)
    return Curve(grid, np.array(aucs), np.array(powers), np.array(thresholds), alpha)


def tokens_for_power(c: Curve, power: float = 0.99) -> int | None:
    """The fewest tokens on the curve from which the power is at least `power` at every longer length; None if the
    longest length on the curve falls short."""
    needed = None
    for t, p in zip(c.tokens[::-1], c.power[::-1], strict=True):
        if p < power:
            break
        needed = int(t)
    return needed


def nearest(run: Items, variants: Mapping[str, Items]) -> list[tuple[str, float]]:
    """The honest variants by how far their `run_statistic` lies from the run's, nearest first: (name, distance)."""
    stat = run_statistic(run)
    return sorted(((name, abs(run_statistic(v) - stat)) for name, v in variants.items()), key=lambda x: x[1])
