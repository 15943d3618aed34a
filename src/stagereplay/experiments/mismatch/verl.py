"""verl's training-inference mismatch metrics (verl 0.9.1, `verl/trainer/ppo/rollout_corr_helper.py` and
`verl/utils/debug/metrics.py`), computed as verl computes them, in float64 numpy, on padded arrays.

Inputs: `train` and `rollout` [B, T] log-probabilities (verl's `old_log_prob` and `rollout_log_prob`) and `mask`
[B, T] bool (verl's `response_mask`), every row with at least one token. With lr = train - rollout per token,
SAFETY_BOUND = 20 and a "masked mean" the mean over the mask (pooled over every token of the batch, or per sequence
with axis=1):

    offpolicy         kl = mean(-lr), k3_kl = mean(exp(lr) - lr - 1) (pooled, unclamped); training_ppl, rollout_ppl:
                      the batch mean of per-sequence exp(-mean log-prob); log_ppl_diff: the batch mean of per-sequence
                      mean(rollout) - mean(train) (and its |.| mean, max, min); ppl_ratio = mean(exp(log_ppl_diff_i));
                      chi2_token = mean(exp(2 clamp(lr))) - 1; chi2_seq = mean_i exp(2 clamp(sum_i lr)) - 1
    importance        `rollout_is` token (w = exp(clamp(lr))) or sequence (w = exp(clamp(sum_i lr)) on each token of
                      sequence i), truncated at the upper threshold (TIS) or zeroed outside [lower, upper] (IcePop);
                      mean, min, max, std and ESS of the truncated weights, the fractions above/below the thresholds
                      of the raw ones, per-sequence means of the truncated weights (rollout_is_seq_*)
    rejection         `rollout_rs` options (token_k1, seq_sum_k3, seq_mean_k1, seq_max_k2, ...) with their thresholds:
                      each option's statistic (mean, min, max, std, fractions, seq_*) and masked fractions
    probs_diff        |exp(train) - exp(rollout)| over the mask: max, mean, std (n - 1), and the Pearson correlation
                      of the two probabilities (`training/rollout_probs_diff_*`)

A masked mean divides by the count + 1e-8, and the ESS normalises by the mean + 1e-8, as verl does (so that a
standard deviation of weights all truncated at one bound reads what verl's reads: not 0, but the square root of that
epsilon's rounding). Every name below is verl's, without its `rollout_corr/` or `training/` prefix.
"""

from __future__ import annotations

import math

import numpy as np

SAFETY_BOUND = 20.0
"""verl's clamp of a log-ratio (or a sequence's summed log-ratio) before it is exponentiated."""
IS_THRESHOLD = 2.0
"""verl's default `rollout_is_threshold`: token weights truncated at 2, lower bound 1/2 for the fractions."""
EPS = 1e-8
"""verl's guard in every masked mean's count and in the ESS's normalising mean."""
RS_OPTIONS = ("seq_sum_k1", "seq_mean_k1", "seq_mean_k3")
RS_THRESHOLDS = ("0.5_2.0", "0.999_1.001", "0.01")
"""The rejection options reported, with the thresholds of verl's presets for them (`decoupled_seq_is_rs`,
`decoupled_geo_rs`, `decoupled_k3_rs`)."""
RS_SUPPORTED = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _msum(x: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    return np.where(m, x, 0.0).sum(axis=axis)


def _mmean(x: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    return _msum(x, m, axis) / (m.sum(axis=axis) + EPS)


def _f(x: float | np.floating | np.ndarray) -> float | None:
    """A number (a float or a 0-d array), None where it is undefined (never NaN)."""
    v = float(x)
    return None if math.isnan(v) else v


def offpolicy(train: np.ndarray, rollout: np.ndarray, m: np.ndarray) -> dict[str, float | None]:
    """verl's `compute_offpolicy_metrics`."""
    lr = np.where(m, train - rollout, 0.0)
    mean_train, mean_rollout = _mmean(train, m, 1), _mmean(rollout, m, 1)
    d = mean_rollout - mean_train
    with np.errstate(over="ignore"):
        k3 = np.exp(lr) - lr - 1
    safe = np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
    sums = np.clip(_msum(lr, m, 1), -SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": _f(np.exp(-mean_train).mean()), "training_log_ppl": _f((-mean_train).mean()),
            "kl": _f(_mmean(rollout - train, m)), "k3_kl": _f(_mmean(k3, m)),
            "rollout_ppl": _f(np.exp(-mean_rollout).mean()), "rollout_log_ppl": _f((-mean_rollout).mean()),
            "log_ppl_diff": _f(d.mean()), "log_ppl_abs_diff": _f(np.abs(d).mean()),
            "log_ppl_diff_max": _f(d.max()), "log_ppl_diff_min": _f(d.min()), "ppl_ratio": _f(np.exp(d).mean()),
            "chi2_token": _f(_mmean(np.exp(safe) ** 2, m) - 1.0), "chi2_seq": _f(np.exp(2.0 * sums).mean() - 1.0)}


def importance(lr: np.ndarray, m: np.ndarray, level: str = "token", upper: float = IS_THRESHOLD,
               lower: float | None = None) -> dict[str, float | None]:
    """verl's `compute_rollout_correction_weights` metrics at `level` (token | sequence): TIS at `upper`, or IcePop
    on [lower, upper] where `lower` is given."""
    lr = np.where(m, lr, 0.0)
    low = 1.0 / upper if lower is None else lower
    sums = _msum(lr, m, 1)[:, None]  # [B, 1]
    if level == "token":
        raw = np.exp(np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)) * m
    else:
        raw = np.broadcast_to(np.exp(np.clip(sums, -SAFETY_BOUND, SAFETY_BOUND)), lr.shape) * m
    w = np.minimum(raw, upper) if lower is None else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    out: dict[str, float | None] = {}
    if level == "sequence":
        out["max"] = _f(np.exp(min(float(sums.max()), SAFETY_BOUND)))
        out["min"] = _f(np.exp(sums.min()))
        out["mean"] = _f(_mmean(w, m))
        out["ratio_fraction_high"] = _f(np.mean(sums > math.log(upper)))
        out["ratio_fraction_low"] = _f(np.mean(sums < math.log(low)))
    else:
        out["mean"] = _f(_mmean(w, m))
        out["ratio_fraction_high"] = _f(_mmean((raw > upper).astype(float), m))
        out["ratio_fraction_low"] = _f(_mmean((raw < low).astype(float), m))
        out["max"], out["min"] = _f(w[m].max()), _f(w[m].min())
    clamped = np.clip(w, 0.0, upper)
    mean_clamped = _mmean(clamped, m)
    out["std"] = _f(np.sqrt(max(float(_mmean(clamped**2, m) - mean_clamped**2), 0.0))) if m.sum() > 1 else 0.0
    out["eff_sample_size"] = _f(1.0 / _mmean((clamped / (mean_clamped + EPS)) ** 2, m))
    seq = _mmean(w, m, 1)
    out.update(seq_mean=_f(seq.mean()), seq_std=_f(seq.std(ddof=1)) if seq.size > 1 else 0.0, seq_max=_f(seq.max()),
               seq_min=_f(seq.min()), seq_max_deviation=_f(np.abs(seq - 1.0).max()))
    raw_seq = _mmean(raw, m, 1)
    out["seq_fraction_high"] = _f(np.mean(raw_seq > upper))
    out["seq_fraction_low"] = _f(np.mean(raw_seq < low))
    out["oob_ratio"] = None if lower is None else _f(_mmean(((raw < lower) | (raw > upper)).astype(float), m))
    return out


def _rs_bounds(option: str, spec: str) -> tuple[float | None, float]:
    """(lower, upper) of one option's threshold spec, as verl parses it: a k1 option's ratio bounds `lower_upper`
    (lower 1/upper when one number is given), another option's upper bound."""
    if option.endswith("k1"):
        lo, _, hi = spec.partition("_") if "_" in spec else (str(1.0 / float(spec)), "", spec)
        return float(lo), float(hi)
    return None, float(spec)


def rejection(lr: np.ndarray, m: np.ndarray, options: tuple[str, ...] = RS_OPTIONS,
              thresholds: tuple[str, ...] = RS_THRESHOLDS) -> dict[str, float | None]:
    """verl's `compute_rollout_rejection_mask` metrics for `options` (all must pass for a token to be kept)."""
    lr = np.where(m, lr, 0.0)
    safe = np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
    token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": np.exp(safe) - 1.0 - safe}
    keep_all = np.ones(m.shape, dtype=bool)
    out: dict[str, float | None] = {}
    for option, spec in zip(options, thresholds, strict=True):
        lower, upper = _rs_bounds(option, spec)
        k1 = option.endswith("k1")
        up = math.log(upper) if k1 else upper
        low = math.log(lower) if k1 and lower is not None else 0.0
        stat = token[option[-2:]]
        level = "token" if option.startswith("token") else "sequence"
        if level == "sequence":
            kind = option.split("_")[1]
            seq = (_msum(stat, m, 1) if kind == "sum" else _mmean(stat, m, 1) if kind == "mean"
                   else np.where(m, stat, -np.inf).max(axis=1))
            per_token = np.broadcast_to(seq[:, None], m.shape)
        else:
            seq, per_token = _mmean(stat, m, 1), stat
        keep = (per_token >= low) & (per_token <= up) if k1 else per_token <= up
        p = f"{option}_"
        out[p + "mean"] = _f(_mmean(per_token, m))
        values = seq if level == "sequence" else per_token[m]
        out[p + "max"], out[p + "min"] = _f(values.max()), _f(values.min())
        out[p + "fraction_high"] = _f(np.mean(values > up))
        out[p + "fraction_low"] = _f(np.mean(values < low)) if k1 else 0.0
        if m.sum() > 1:
            c = np.clip(per_token, low, up)
            out[p + "std"] = _f(np.sqrt(max(float(_mmean(c**2, m) - _mmean(c, m) ** 2), 0.0)))
        else:
            out[p + "std"] = 0.0
        out.update({p + "seq_mean": _f(seq.mean()), p + "seq_std": _f(seq.std(ddof=1)) if seq.size > 1 else 0.0,
                    p + "seq_max": _f(seq.max()), p + "seq_min": _f(seq.min()),
                    p + "seq_max_deviation": _f(np.abs(seq).max()), p + "seq_fraction_high": _f(np.mean(seq > up))})
        if k1:
            out[p + "seq_fraction_low"] = _f(np.mean(seq < low))
        out[p + "masked_fraction"] = _f(_mmean((~keep).astype(float), m))
        out[p + "seq_masked_fraction"] = _f(np.mean((~keep & m).any(axis=1)))
        keep_all &= keep
    out["masked_fraction"] = _f(_mmean((~keep_all).astype(float), m))
    out["seq_masked_fraction"] = _f(np.mean((~keep_all & m).any(axis=1)))
    return out


def probs_diff(train: np.ndarray, rollout: np.ndarray, m: np.ndarray) -> dict[str, float | None]:
    """verl's `calculate_debug_metrics`: the probabilities' absolute difference and their Pearson correlation."""
    p, q = np.exp(train[m]), np.exp(rollout[m])
    d = np.abs(p - q)
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = np.corrcoef(p, q)[0, 1] if p.size > 1 else math.nan
    return {"rollout_probs_diff_max": _f(d.max()), "rollout_probs_diff_mean": _f(d.mean()),
            "rollout_probs_diff_std": _f(d.std(ddof=1)) if d.size > 1 else None,
            "rollout_actor_probs_pearson_corr": _f(corr)}


def verl_metrics(train: np.ndarray, rollout: np.ndarray, m: np.ndarray, upper: float = IS_THRESHOLD,
                 lower: float | None = None, options: tuple[str, ...] = RS_OPTIONS,
                 thresholds: tuple[str, ...] = RS_THRESHOLDS) -> dict[str, float | None]:
    """Every verl metric by our name: verl's own (prefix dropped) for the token-level IS and everything else, and
    `sequence_is_*` for verl's `rollout_is_*` with `rollout_is="sequence"`."""
    lr = train - rollout
    return {**offpolicy(train, rollout, m),
            **{f"rollout_is_{k}": v for k, v in importance(lr, m, "token", upper, lower).items()},
            **{f"sequence_is_{k}": v for k, v in importance(lr, m, "sequence", upper, lower).items()},
            **{f"rollout_rs_{k}": v for k, v in rejection(lr, m, options, thresholds).items()},
            **probs_diff(train, rollout, m)}
