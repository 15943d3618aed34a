"""The training-inference mismatch's metrics on two sides' log-probabilities of the same response tokens: verl's
(`mismatch_verl`, under verl's names) and our own beside them.

With a = the rollout side (the policy the tokens were sampled from) and b = the trainer side, per token
log_ratio = log pi_b(y_t) - log pi_a(y_t). Our own (verl has none of them under any name):

    abs_mean, abs_p50, abs_p90, abs_p99, abs_max    |log_ratio| pooled over every token, uncapped
    k2                                              mean(log_ratio^2 / 2), pooled
    chi2_centred                                    mean((w - 1)^2), w = exp(clamp(log_ratio, +-20)), pooled
    training_ppl_pooled, rollout_ppl_pooled         exp(-mean log-prob) over every token pooled
    token_outside_2, token_outside_5                fraction of token weights exp(clamp(log_ratio)) outside [1/2, 2],
                                                    [1/5, 5]
    sequence_outside_2, sequence_outside_5          the same of sequence weights exp(clamp(sum log_ratio))
    token_clamped, sequence_clamped                 fraction of token (sequence) log-ratios at or beyond the clamp 20
    geo_mean, geo_min, geo_max, geo_outside_2/5     geometric weights exp(mean log_ratio) per sequence
    bitwise_equal                                   fraction of tokens whose two fp32 log-probabilities are the same
                                                    bits
    argmax_agree                                    fraction of tokens whose two rows' argmax agree (where both say)

A log-probability that is not finite never reads as agreement: a token with NaN on either side (`excluded_nan`), or
+-inf on one side or +inf on both (`excluded_infinite`), is counted and left out of every metric. A token both sides
give -inf (a processed distribution that removed it on both sides: they agree) is counted in `both_neg_inf` and also
left out (its log-probability has no perplexity). A sequence left with no token is left out of the per-sequence
metrics. Everything is float64 from the fp32 values.

Intervals: a pooled statistic (sum over tokens / count of tokens) gets a cluster bootstrap of that same ratio,
resampling whole sequences; a per-sequence statistic a bootstrap of its mean over sequences (`interval`). Both are
percentile intervals from one seeded numpy Generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stagereplay.experiments.core.stats import cluster_bootstrap
from stagereplay.experiments.mismatch.verl import (
    IS_THRESHOLD,
    RS_OPTIONS,
    RS_THRESHOLDS,
    SAFETY_BOUND,
    verl_metrics,
)

BANDS: tuple[tuple[int, int | None], ...] = ((0, 64), (64, 256), (256, 1024), (1024, None))
"""Response position bands [start, stop) (stop None: to the end)."""
INTERVALS = ("abs_mean", "kl", "k3_kl", "log_ppl_abs_diff")
"""The metrics given a 95% interval: three pooled over tokens, one a mean over sequences."""
Number = float | int | None


@dataclass(frozen=True)
class Pair:
    """Two sides' log-probabilities [N] of one sequence's response tokens (a: rollout, b: trainer), and their
    argmaxes where known."""

    a: np.ndarray
    b: np.ndarray
    argmax_a: np.ndarray | None = None
    argmax_b: np.ndarray | None = None

    def kept(self) -> np.ndarray:
        """The tokens every metric reads: both log-probabilities finite."""
        return np.isfinite(self.a) & np.isfinite(self.b)

    def equal_bits(self) -> np.ndarray:
        """Per token, whether the two log-probabilities are the same bits (fp32 records as fp32; wider inputs in
        their common dtype)."""
        dtype = np.result_type(self.a.dtype, self.b.dtype, np.float32)
        unsigned = np.dtype(f"u{dtype.itemsize}")
        return self.a.astype(dtype).view(unsigned) == self.b.astype(dtype).view(unsigned)

    def argmax_agree(self) -> np.ndarray | None:
        if self.argmax_a is None or self.argmax_b is None:
            return None
        return np.asarray(self.argmax_a) == np.asarray(self.argmax_b)

    def band(self, start: int, stop: int | None) -> Pair:
        s = slice(start, stop)
        return Pair(self.a[s], self.b[s], None if self.argmax_a is None else self.argmax_a[s],
                    None if self.argmax_b is None else self.argmax_b[s])


@dataclass(frozen=True)
class Padded:
    """The kept tokens of a set of pairs as verl reads them: [B, T] trainer and rollout log-probabilities (0 where
    masked) and the mask, one row per sequence with a kept token."""

    train: np.ndarray
    rollout: np.ndarray
    mask: np.ndarray

    @classmethod
    def of(cls, pairs: Sequence[Pair]) -> Padded:
        rows = [(p.b[k].astype(np.float64), p.a[k].astype(np.float64)) for p in pairs if (k := p.kept()).any()]
        width = max((b.size for b, _ in rows), default=0)
        train, rollout = np.zeros((len(rows), width)), np.zeros((len(rows), width))
        mask = np.zeros((len(rows), width), dtype=bool)
        for i, (b, a) in enumerate(rows):
            train[i, :b.size], rollout[i, :a.size], mask[i, :b.size] = b, a, True
        return cls(train, rollout, mask)

    def log_ratios(self) -> list[np.ndarray]:
        return [(t - r)[m] for t, r, m in zip(self.train, self.rollout, self.mask, strict=True)]


def _outside(w: np.ndarray, t: float) -> float | None:
    return float(np.mean((w > t) | (w < 1 / t))) if w.size else None


def our_metrics(pairs: Sequence[Pair], padded: Padded) -> dict[str, Number]:
    """Our own metrics (module docstring) over every kept token of `pairs`."""
    nan = sum(int((np.isnan(p.a) | np.isnan(p.b)).sum()) for p in pairs)
    neg = sum(int(((p.a == -np.inf) & (p.b == -np.inf)).sum()) for p in pairs)
    dropped = sum(int((~p.kept()).sum()) for p in pairs)
    out: dict[str, Number] = {"tokens": int(padded.mask.sum()), "sequences": int(padded.mask.shape[0]),
                              "excluded_nan": nan, "excluded_infinite": dropped - nan - neg, "both_neg_inf": neg}
    ratios = padded.log_ratios()
    if not ratios:
        return out
    lr = np.concatenate(ratios)
    absolute, safe = np.abs(lr), np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
    w = np.exp(safe)
    sums = np.array([r.sum() for r in ratios])
    seq_w = np.exp(np.clip(sums, -SAFETY_BOUND, SAFETY_BOUND))
    geo = np.exp(np.array([r.mean() for r in ratios]))
    agree = [p.argmax_agree() for p in pairs]
    kept = [p.kept() for p in pairs]
    out.update({
        "abs_mean": float(absolute.mean()), "abs_p50": float(np.quantile(absolute, 0.5)),
        "abs_p90": float(np.quantile(absolute, 0.9)), "abs_p99": float(np.quantile(absolute, 0.99)),
        "abs_max": float(absolute.max()), "k2": float(np.mean(lr**2 / 2)), "chi2_centred": float(np.mean((w - 1) ** 2)),
        "training_ppl_pooled": float(np.exp(-padded.train[padded.mask].mean())),
        "rollout_ppl_pooled": float(np.exp(-padded.rollout[padded.mask].mean())),
        "token_outside_2": _outside(w, 2.0), "token_outside_5": _outside(w, 5.0),
        "sequence_outside_2": _outside(seq_w, 2.0), "sequence_outside_5": _outside(seq_w, 5.0),
        "token_clamped": float(np.mean(absolute >= SAFETY_BOUND)),
        "sequence_clamped": float(np.mean(np.abs(sums) >= SAFETY_BOUND)),
        "geo_mean": float(geo.mean()), "geo_min": float(geo.min()), "geo_max": float(geo.max()),
        "geo_outside_2": _outside(geo, 2.0), "geo_outside_5": _outside(geo, 5.0),
        "bitwise_equal": float(np.mean(np.concatenate([p.equal_bits()[k] for p, k in zip(pairs, kept, strict=True)]))),
        "argmax_agree": None if any(x is None for x in agree) else float(np.mean(np.concatenate(
            [x[k] for x, k in zip(agree, kept, strict=True) if x is not None]))),
    })
    return out


def parts(padded: Padded) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per interval metric, per sequence (numerator, denominator): the statistic is sum(numerator) /
    sum(denominator), over every sequence or over any resample of them (the cluster bootstrap's unit)."""
    ratios = padded.log_ratios()
    n = np.array([r.size for r in ratios], dtype=np.float64)
    d = np.array([r_.mean() - t_.mean() for t_, r_ in
                  ((t[m], r[m]) for t, r, m in zip(padded.train, padded.rollout, padded.mask, strict=True))])
    with np.errstate(over="ignore"):
        k3 = np.array([np.sum(np.exp(r) - r - 1) for r in ratios])
    return {"abs_mean": (np.array([np.abs(r).sum() for r in ratios]), n),
            "kl": (np.array([-r.sum() for r in ratios]), n), "k3_kl": (k3, n),
            "log_ppl_abs_diff": (np.abs(d), np.ones_like(d))}


def intervals(split: dict[str, tuple[np.ndarray, np.ndarray]], rng: np.random.Generator, n_resamples: int = 10_000,
              confidence: float = 0.95) -> dict[str, list[float] | None]:
    """Per statistic of `split` (numerator, denominator per sequence: `parts`), the percentile interval of
    sum(numerator) / sum(denominator) from the cluster bootstrap over sequences (`experiments.core.stats`), every
    statistic on the same resamples drawn from `rng`."""
    return {name: None if ci is None else list(ci)
            for name, ci in cluster_bootstrap(split, n_resamples, confidence, rng).items()}


def metrics(pairs: Sequence[Pair], upper: float = IS_THRESHOLD, lower: float | None = None,
            options: tuple[str, ...] = RS_OPTIONS, thresholds: tuple[str, ...] = RS_THRESHOLDS) -> dict[str, Number]:
    """verl's metrics and ours over `pairs` (verl's None where no token is kept)."""
    padded = Padded.of(pairs)
    ours = our_metrics(pairs, padded)
    if not padded.mask.any():
        return ours
    return {**verl_metrics(padded.train, padded.rollout, padded.mask, upper, lower, options, thresholds), **ours}


def band_summary(pairs: Sequence[Pair]) -> list[dict[str, Number | str]]:
    """Per response position band (`BANDS`) its metrics; bands no token reaches are left out."""
    out: list[dict[str, Number | str]] = []
    for start, stop in BANDS:
        inside = [b for p in pairs if (b := p.band(start, stop)).a.size]
        padded = Padded.of(inside)
        if padded.mask.any():
            ours = our_metrics(inside, padded)
            lr = np.where(padded.mask, padded.train - padded.rollout, 0.0)
            with np.errstate(over="ignore"):
                k3 = float(np.where(padded.mask, np.exp(lr) - lr - 1, 0.0).sum() / padded.mask.sum())
            out.append({"band": f"{start}-{'' if stop is None else stop - 1}", "k3_kl": k3,
                        **{k: ours[k] for k in ("tokens", "bitwise_equal", "abs_mean", "abs_max", "token_outside_2")}})
    return out


@dataclass(frozen=True)
class PairStats:
    """Everything the report says of one pair of sides."""

    metrics: dict[str, Number]
    ci: dict[str, list[float] | None]
    bands: list[dict[str, Number | str]]


def summarize_pairs(pairs: Sequence[Pair], seed: int = 0, n_resamples: int = 10_000) -> PairStats:
    """The metrics of one pair of sides over a run's sequences, the intervals (`intervals`, one Generator seeded
    with `seed`) and the position bands."""
    padded = Padded.of(pairs)
    cis = intervals(parts(padded), np.random.default_rng(seed), n_resamples) if padded.mask.any() \
        else dict.fromkeys(INTERVALS)
    return PairStats(metrics(pairs), cis, band_summary(pairs))
