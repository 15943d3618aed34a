"""verl's names mean verl's quantities: `stagereplay.mismatch_metrics` against verl 0.9.1's own functions
(`rollout_corr_helper.compute_rollout_correction_and_rejection_mask` at token and sequence level, TIS and IcePop, with
rejection options; `debug.metrics.calculate_debug_metrics`) on the same log-probabilities, equal and ragged lengths
(1 to 1,000 tokens, log-ratios up to +-25). Every metric verl returns has our metric of the same name, equal to a
relative 1e-6. The negative control: a planted
change of one definition (chi2_token as the centred E[(w - 1)^2]) is found, and only it.

verl installs in a venv of its own (`.ci/run`'s verl stage: torch, then `pip install --no-deps verl==0.9.1` and what
its helper imports); opt-in with -m verl."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.verl

torch = pytest.importorskip("torch")
helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
debug = pytest.importorskip("verl.utils.debug.metrics")

from verl.protocol import DataProto  # noqa: E402  (verl only after the skip)

from stagereplay import mismatch_metrics  # noqa: E402
from stagereplay.experiments.mismatch import verl as mismatch_verl  # noqa: E402

RS = ("token_k1", "seq_sum_k1", "seq_mean_k1", "seq_mean_k3", "seq_max_k2", "token_k3")
RS_THRESHOLDS = ("0.5_2.0", "0.5_2.0", "0.999_1.001", "0.01", "2.0", "0.5")


def batch(lengths: list[int], seed: int, wild: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[B, T] trainer and rollout log-probabilities (fp32 values, float64 arrays) and the mask: log-ratios of about
    0.01, a fraction `wild` of them anywhere in [-25, 25]."""
    rng = np.random.default_rng(seed)
    width = max(lengths)
    train, rollout = np.zeros((len(lengths), width)), np.zeros((len(lengths), width))
    mask = np.zeros((len(lengths), width))
    for i, n in enumerate(lengths):
        a = -rng.uniform(0.0, 30.0, n)
        lr = rng.normal(0.0, 0.01, n)
        far = rng.random(n) < wild
        lr[far] = rng.uniform(-25.0, 25.0, int(far.sum()))
        rollout[i, :n] = a.astype(np.float32)
        train[i, :n] = np.minimum(a + lr, 0.0).astype(np.float32)
        mask[i, :n] = 1.0
    return train, rollout, mask


LENGTHS = {"equal": [64] * 16, "ragged": [1, 1000, 3, 17, 250, 1, 64, 999, 8, 512, 2, 33]}


def verls(train: np.ndarray, rollout: np.ndarray, mask: np.ndarray, threshold: str | float) -> dict[str, float]:
    """Every metric verl logs for the batch, by our name."""
    t, r, m = (torch.tensor(x, dtype=torch.float64) for x in (train, rollout, mask))
    out: dict[str, float] = {}
    for level, prefix in (("token", "rollout_is_"), ("sequence", "sequence_is_")):
        _, _, got = helper.compute_rollout_correction_and_rejection_mask(
            t, r, m, rollout_is=level, rollout_is_threshold=threshold, rollout_rs=",".join(RS),
            rollout_rs_threshold=",".join(RS_THRESHOLDS))
        for key, value in got.items():
            name = key.removeprefix("rollout_corr/")
            out[prefix + name.removeprefix("rollout_is_") if name.startswith("rollout_is_") else name] = float(value)
    data = DataProto.from_dict(tensors={"rollout_log_probs": r, "old_log_probs": t, "response_mask": m,
                                        "responses": torch.zeros_like(m, dtype=torch.long)})
    for key, value in debug.calculate_debug_metrics(data).items():
        if key != "training/rollout_probs_diff_valid":
            out[key.removeprefix("training/")] = float(value)
    return out


def ours(train: np.ndarray, rollout: np.ndarray, mask: np.ndarray, threshold: str | float) -> dict:
    lower, _, upper = str(threshold).rpartition("_")
    return mismatch_metrics(train, rollout, mask, is_threshold=float(upper),
                            is_threshold_lower=float(lower) if lower else None, rs=RS, rs_thresholds=RS_THRESHOLDS)


def differing(theirs: dict[str, float], mine: dict) -> list[str]:
    """verl's names whose value we lack or differ in."""
    return [k for k, v in theirs.items()
            if mine.get(k) is None or not math.isclose(mine[k], v, rel_tol=1e-6)]


@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"], ids=["tis", "icepop"])
@pytest.mark.parametrize("shape", sorted(LENGTHS))
def test_every_verl_metric_is_ours_under_its_name(shape, threshold):
    train, rollout, mask = batch(LENGTHS[shape], seed=len(shape))
    theirs = verls(train, rollout, mask, threshold)
    assert len(theirs) > 90  # every family: off-policy, IS at two levels, six rejection options, probs diff
    assert differing(theirs, ours(train, rollout, mask, threshold)) == []


def test_ragged_lists_are_the_padded_batch():
    train, rollout, mask = batch(LENGTHS["ragged"], seed=3)
    n = mask.sum(axis=1).astype(int)
    ragged = mismatch_metrics([torch.tensor(t[:k]) for t, k in zip(train, n, strict=True)],
                              [r[:k] for r, k in zip(rollout, n, strict=True)])
    assert ragged == mismatch_metrics(train, rollout, mask)


def test_a_planted_definition_change_is_found(monkeypatch):
    """The control: chi2_token computed as the centred chi-square (our own `chi2_centred`) under verl's name, on
    log-ratios of about 0.01 (where a weight of e^25 would hide it: E[w^2] dwarfs the 2 E[w] between them)."""
    train, rollout, mask = batch(LENGTHS["ragged"], seed=5, wild=0.0)
    theirs = verls(train, rollout, mask, 2.0)
    original = mismatch_verl.offpolicy

    def planted(t, r, m):
        out = original(t, r, m)
        w = np.exp(np.clip(t - r, -20, 20))
        out["chi2_token"] = float(np.where(m, (w - 1) ** 2, 0).sum() / m.sum())
        return out

    monkeypatch.setattr(mismatch_verl, "offpolicy", planted)
    assert differing(theirs, ours(train, rollout, mask, 2.0)) == ["chi2_token"]
