"""`stagereplay.mismatch_metrics`: the mismatch metrics of one batch, for a training loop to log.

    from stagereplay import mismatch_metrics

    metrics = mismatch_metrics(old_log_prob, rollout_log_prob, response_mask)   # padded [B, T] and its mask
    metrics = mismatch_metrics([lp_train_0, lp_train_1], [lp_roll_0, lp_roll_1])  # ragged: one array per sequence
    logger.log({f"rollout_corr/{k}": v for k, v in metrics.items() if v is not None})

Tensors (any device; read as float64 on the CPU) or numpy arrays. It returns verl's metrics under verl's names and
ours beside them (docs/reference/mismatch-metrics.md has each name and formula). numpy only: torch is never
imported here, a tensor is read through its own `.detach().cpu().numpy()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stagereplay.errors import StageReplayError
from stagereplay.experiments.mismatch.stats import Number, Pair, metrics
from stagereplay.experiments.mismatch.verl import IS_THRESHOLD, RS_OPTIONS, RS_SUPPORTED, RS_THRESHOLDS


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor, read without importing torch
        x = x.detach().float().cpu().numpy() if str(getattr(x, "dtype", "")) == "torch.bfloat16" \
            else x.detach().cpu().numpy()
    return np.asarray(x)


def _rows(x: Any) -> list[np.ndarray]:
    if isinstance(x, (list, tuple)):
        return [_array(r).reshape(-1) for r in x]
    a = _array(x)
    if a.ndim == 1:
        return [a]
    if a.ndim != 2:
        raise StageReplayError(f"log-probabilities of shape {a.shape}", "pass [B, T] with a mask, or a list of [T_i]")
    return list(a)


def pairs_of(trainer_logprobs: Any, rollout_logprobs: Any, mask: Any = None) -> list[Pair]:
    """The per-sequence pairs of a padded batch (with `mask`, [B, T], nonzero where a token counts) or of two lists
    of per-sequence arrays."""
    train, roll = _rows(trainer_logprobs), _rows(rollout_logprobs)
    if len(train) != len(roll) or any(t.shape != r.shape for t, r in zip(train, roll, strict=False)):
        raise StageReplayError("the trainer's and the rollout's log-probabilities differ in shape",
                               "pass both sides for the same tokens, sequence by sequence")
    if mask is not None:
        rows = _rows(mask)
        if len(rows) != len(train) or any(m.shape != t.shape for m, t in zip(rows, train, strict=False)):
            raise StageReplayError("the mask's shape is not the log-probabilities'",
                                   "pass a mask [B, T] of the log-probabilities' shape (response_mask)")
        train, roll = [t[m != 0] for t, m in zip(train, rows, strict=True)], \
            [r[m != 0] for r, m in zip(roll, rows, strict=True)]
    return [Pair(r.astype(np.float64), t.astype(np.float64)) for t, r in zip(train, roll, strict=True)]


def mismatch_metrics(trainer_logprobs: Any, rollout_logprobs: Any, mask: Any = None, *,
                     is_threshold: float = IS_THRESHOLD, is_threshold_lower: float | None = None,
                     rs: Sequence[str] = RS_OPTIONS, rs_thresholds: Sequence[str] = RS_THRESHOLDS
                     ) -> dict[str, Number]:
    """verl's and our mismatch metrics of a batch: the trainer's log-probabilities of the sampled tokens (verl's
    `old_log_prob`) against the rollout engine's (`rollout_log_prob`), padded [B, T] with `mask` or ragged.

    `is_threshold` is verl's `rollout_is_threshold` (TIS at 2 by default; with `is_threshold_lower`, IcePop on
    [lower, upper]); `rs` and `rs_thresholds` are verl's `rollout_rs` options and `rollout_rs_threshold`s, one
    each (by default the thresholds of verl's presets for seq_sum_k1, seq_mean_k1 and seq_mean_k3). A token with a
    non-finite log-probability on either side is counted (`excluded_nan`, `excluded_infinite`, `both_neg_inf`) and
    left out; a metric with no token to read is None."""
    if len(rs) != len(rs_thresholds):
        raise StageReplayError(f"{len(rs)} rejection options and {len(rs_thresholds)} thresholds",
                               "give one threshold per option")
    unknown = [o for o in rs if o not in RS_SUPPORTED]
    if unknown:
        raise StageReplayError(f"unknown rejection option {unknown[0]!r}", f"use one of {', '.join(RS_SUPPORTED)}")
    pairs = pairs_of(trainer_logprobs, rollout_logprobs, mask)
    return metrics(pairs, is_threshold, is_threshold_lower, tuple(rs), tuple(str(t) for t in rs_thresholds))
