"""The training-inference mismatch's metrics, as the RL frameworks compute them (verl's rollout-correction helper,
`verl/trainer/ppo/rollout_corr_helper.py`), on two sides' log-probabilities of the same response tokens.

With a = the rollout side (the policy the tokens were sampled from) and b = the trainer side, per token

    log_ratio = log pi_b(y_t) - log pi_a(y_t)          w = exp(log_ratio), clamped at exp(+-20) as verl clamps it

and over a set of tokens (one sequence, a position band, a whole run):

    k1 = mean(-log_ratio)   k2 = mean(log_ratio^2 / 2)   k3 = mean(w - 1 - log_ratio)     (Schulman's estimators of
                                                                                            KL(a || b), tokens from a)
    chi2 = mean((w - 1)^2)
    ppl_a = exp(-mean(log pi_a)), ppl_b likewise; log_ppl_diff = log ppl_b - log ppl_a
    |log_ratio|: mean, p50, p90, p99, max
    importance weights at three levels: token w, sequence exp(sum of log_ratio), geometric exp(mean of log_ratio):
    mean, min, max, std, effective sample size 1 / E[(w / E[w])^2] (as a fraction of the count), and the fractions
    outside [1/2, 2] and [1/5, 5]
    bitwise equal: tokens whose two fp32 log-probabilities are the same bits
    argmax agreement: tokens whose two rows' argmax are the same token (where both sides report it)

A token both sides give -inf (a processed distribution that removes it) agrees: log_ratio 0. Everything is computed
in float64 from the fp32 values. `paired_ci` gives a percentile bootstrap interval over items (resampling whole
sequences, seeded) for a per-sequence statistic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stagereplay.experiments.stats import paired_bootstrap_ci

CLAMP = 20.0
"""|log_ratio| above this is clamped for weights and KL (verl's exp(+-20))."""
THRESHOLDS = (2.0, 5.0)
"""The importance-weight bands whose outside fraction is reported: [1/2, 2] and [1/5, 5]."""
BANDS: tuple[tuple[int, int | None], ...] = ((0, 64), (64, 256), (256, 1024), (1024, None))
"""Response position bands [start, stop) (stop None: to the end)."""


@dataclass(frozen=True)
class Pair:
    """Two sides' log-probabilities [N] of one sequence's response tokens, and their argmaxes where known."""

    a: np.ndarray
    b: np.ndarray
    argmax_a: np.ndarray | None = None
    argmax_b: np.ndarray | None = None

    def log_ratio(self) -> np.ndarray:
        """log pi_b - log pi_a per token, float64; 0 where both are the same (both -inf included)."""
        a, b = self.a.astype(np.float64), self.b.astype(np.float64)
        same = a == b
        with np.errstate(invalid="ignore"):
            diff = np.where(same, 0.0, b - a)
        return np.nan_to_num(diff, nan=0.0, posinf=np.inf, neginf=-np.inf)

    def equal_bits(self) -> np.ndarray:
        return self.a.astype(np.float32).view(np.uint32) == self.b.astype(np.float32).view(np.uint32)

    def argmax_agree(self) -> np.ndarray | None:
        if self.argmax_a is None or self.argmax_b is None:
            return None
        return np.asarray(self.argmax_a) == np.asarray(self.argmax_b)

    def band(self, start: int, stop: int | None) -> Pair:
        s = slice(start, stop)
        return Pair(self.a[s], self.b[s], None if self.argmax_a is None else self.argmax_a[s],
                    None if self.argmax_b is None else self.argmax_b[s])


def _clamped(lr: np.ndarray) -> np.ndarray:
    return np.clip(lr, -CLAMP, CLAMP)


def weights_summary(log_w: np.ndarray) -> dict[str, float | int | None]:
    """Importance weights exp(log_w) (clamped): mean, min, max, std, ESS fraction, fractions outside the bands."""
    n = int(log_w.size)
    if n == 0:
        return {"n": 0, "mean": None, "min": None, "max": None, "std": None, "ess": None,
                **{f"outside_{int(t)}": None for t in THRESHOLDS}}
    w = np.exp(_clamped(log_w))
    mean = float(w.mean())
    ess = float(1.0 / np.mean((w / mean) ** 2)) if mean > 0 else 0.0  # a fraction of n: 1 when all are equal
    return {"n": n, "mean": mean, "min": float(w.min()), "max": float(w.max()), "std": float(w.std()),
            "ess": ess, **{f"outside_{int(t)}": float(np.mean((w > t) | (w < 1 / t))) for t in THRESHOLDS}}


def token_summary(pairs: Sequence[Pair]) -> dict[str, float | int | None]:
    """The token-level metrics over every token of `pairs` pooled (module docstring)."""
    if not pairs or sum(p.a.size for p in pairs) == 0:
        return {"tokens": 0}
    lr = np.concatenate([p.log_ratio() for p in pairs])
    a = np.concatenate([p.a.astype(np.float64) for p in pairs])
    b = np.concatenate([p.b.astype(np.float64) for p in pairs])
    clamped = _clamped(lr)
    w = np.exp(clamped)
    absolute = np.abs(lr)
    agree = [p.argmax_agree() for p in pairs]
    finite = np.isfinite(a) & np.isfinite(b)
    out: dict[str, float | int | None] = {
        "tokens": int(lr.size),
        "mean_log_ratio": float(clamped.mean()),
        "abs_mean": float(np.minimum(absolute, CLAMP).mean()),
        "abs_p50": float(np.quantile(absolute, 0.5)), "abs_p90": float(np.quantile(absolute, 0.9)),
        "abs_p99": float(np.quantile(absolute, 0.99)), "abs_max": float(absolute.max()),
        "k1": float(np.mean(-clamped)), "k2": float(np.mean(clamped**2 / 2)), "k3": float(np.mean(w - 1 - clamped)),
        "chi2": float(np.mean((w - 1) ** 2)),
        "ppl_a": float(np.exp(-a[finite].mean())) if finite.any() else None,
        "ppl_b": float(np.exp(-b[finite].mean())) if finite.any() else None,
        "log_ppl_diff": float(a[finite].mean() - b[finite].mean()) if finite.any() else None,
        "bitwise_equal": float(np.mean(np.concatenate([p.equal_bits() for p in pairs]))),
        "argmax_agree": None if any(x is None for x in agree) else float(np.mean(np.concatenate(agree))),  # type: ignore[arg-type]  # none is None here
        "not_finite": int((~finite).sum()),
    }
    token_w = weights_summary(lr)
    out.update({f"outside_{int(t)}": token_w[f"outside_{int(t)}"] for t in THRESHOLDS})
    return out


def sequence_summary(pairs: Sequence[Pair]) -> dict[str, dict[str, float | int | None]]:
    """Importance weights at the three levels: token (every token pooled), sequence (exp of each sequence's summed
    log-ratio) and geometric (exp of each sequence's mean log-ratio)."""
    ratios = [p.log_ratio() for p in pairs if p.a.size]
    return {"token": weights_summary(np.concatenate(ratios) if ratios else np.zeros(0)),
            "sequence": weights_summary(np.array([_clamped(r).sum() for r in ratios])),
            "geometric": weights_summary(np.array([_clamped(r).mean() for r in ratios]))}


def per_sequence(pairs: Sequence[Pair]) -> dict[str, np.ndarray]:
    """Per sequence: mean log-ratio, mean |log-ratio|, k3 and the bitwise-equal fraction (for paired intervals)."""
    rows = [(p, _clamped(p.log_ratio())) for p in pairs if p.a.size]
    return {"mean_log_ratio": np.array([lr.mean() for _, lr in rows]),
            "abs_mean": np.array([np.abs(lr).mean() for _, lr in rows]),
            "k3": np.array([np.mean(np.exp(lr) - 1 - lr) for _, lr in rows]),
            "bitwise_equal": np.array([p.equal_bits().mean() for p, _ in rows])}


def paired_ci(values: np.ndarray, seed: int = 0, n_resamples: int = 10_000) -> list[float] | None:
    """Percentile bootstrap 95% interval of the mean of a per-sequence statistic over items."""
    if values.size == 0:
        return None
    lo, hi = paired_bootstrap_ci(values, np.zeros_like(values), n_resamples=n_resamples, seed=seed)
    return [lo, hi]


def band_summary(pairs: Sequence[Pair]) -> list[dict[str, float | int | str | None]]:
    """The token metrics per response position band (`BANDS`), bands no token reaches left out."""
    out = []
    for start, stop in BANDS:
        inside = [p.band(start, stop) for p in pairs]
        summary = token_summary([p for p in inside if p.a.size])
        if summary["tokens"]:
            out.append({"band": f"{start}-{'' if stop is None else stop - 1}", **summary})
    return out


def summarize_pairs(pairs: Sequence[Pair], seed: int = 0, n_resamples: int = 10_000) -> dict[str, object]:
    """Everything the report says of one pair of sides over a run's sequences."""
    seq = per_sequence(pairs)
    return {"sequences": len(seq["k3"]), **token_summary(pairs), "weights": sequence_summary(pairs),
            "ci": {name: paired_ci(values, seed, n_resamples) for name, values in seq.items()},
            "bands": band_summary(pairs)}
