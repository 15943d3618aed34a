"""The mismatch metrics on known numbers, each property with its negative control:

- verl's definitions where they part from the obvious ones: chi2_token = E[w^2] - 1 (ours, centred, apart),
  perplexities and log-PPL differences per sequence then averaged (ours, pooled, apart), a sequence weight clamps
  the summed log-ratio, the mean |log-ratio| caps no token;
- a non-finite log-probability is counted and left out, never read as agreement (NaN, one side inf); both sides
  -inf are counted as agreeing and left out;
- a batch whose sequence weights all sit at the clamp is named so by the verdict, though verl's ESS reads 1;
- every interval is of the statistic printed beside it (a cluster bootstrap of the pooled ratio): the ragged
  example's contains its estimate, where a bootstrap of per-sequence means does not;
- the verdict grades: bits first, then the size against RL bounds; parts add up to the total, precisions are
  alternatives, no parts says none;
- `stagereplay.mismatch_metrics` reads tensors and arrays, padded or ragged, alike, and imports no torch;
- the reference page lists every metric with its verl name.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stagereplay import mismatch_metrics
from stagereplay.experiments.core.stats import paired_bootstrap_ci
from stagereplay.experiments.mismatch.fields import MismatchMetrics
from stagereplay.experiments.mismatch.stats import (
    INTERVALS,
    Padded,
    Pair,
    intervals,
    metrics,
    parts,
    summarize_pairs,
)
from stagereplay.experiments.mismatch.summary import Band, Intervals, MismatchSummary, PairSummary
from stagereplay.experiments.mismatch.verdict import mismatch_verdict

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference" / "mismatch-metrics.md"


def pair(log_ratio, rollout=-1.0) -> Pair:
    """A sequence whose rollout log-probabilities are `rollout` and whose trainer's differ by `log_ratio`."""
    lr = np.asarray(log_ratio, dtype=np.float64)
    a = np.full(lr.shape, rollout, dtype=np.float64)
    return Pair(a, a + lr)


def test_verls_chi_square_and_ours_are_two_names():
    m = metrics([pair([np.log(0.5), 0.0, np.log(1.2)])])
    w = np.array([0.5, 1.0, 1.2])
    assert m["chi2_token"] == pytest.approx(np.mean(w**2) - 1, rel=1e-6)
    assert m["chi2_centred"] == pytest.approx(np.mean((w - 1) ** 2), rel=1e-12)
    assert m["chi2_token"] != pytest.approx(m["chi2_centred"])  # control: the two definitions differ here


def test_perplexities_and_log_ppl_differences_are_per_sequence_then_averaged():
    """One sequence of 1,000 tokens at log-ratio 0.1, nine of one token at 0: verl averages sequences."""
    pairs = [pair(np.full(1000, 0.1), rollout=-2.0), *(pair([0.0], rollout=-1.0) for _ in range(9))]
    m = metrics(pairs)
    assert m["log_ppl_diff"] == pytest.approx(-0.1 / 10, rel=1e-6)  # per sequence: -0.1 once, 0 nine times
    assert m["kl"] == pytest.approx(-100 / 1009, rel=1e-6)  # pooled over tokens: another number
    assert m["rollout_ppl"] == pytest.approx((math.exp(2.0) + 9 * math.e) / 10, rel=1e-6)
    assert m["rollout_ppl_pooled"] == pytest.approx(math.exp((2000 + 9) / 1009), rel=1e-9)


def test_a_sequence_weight_clamps_the_sum_and_the_mean_abs_caps_no_token():
    m = metrics([pair([25.0, -10.0])])
    assert m["sequence_is_max"] == pytest.approx(math.exp(15.0), rel=1e-9)  # clamping each token: e^10
    m = metrics([pair([25.0, 0.0])])
    assert m["abs_mean"] == 12.5 and m["abs_max"] == 25.0  # capped at 20 per token: a mean of 10


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_logprob_is_counted_and_left_out_never_agreement(bad):
    clean = [pair([0.1, 0.2, -0.3]), pair([0.05])]
    a = np.array([-1.0, -1.0, -1.0, -1.0])
    b = a + np.array([0.1, 0.0, 0.2, -0.3])
    b[1] = bad
    m = metrics([Pair(a, b), clean[1]])
    assert m == {**metrics(clean), "excluded_nan": int(np.isnan(bad)), "excluded_infinite": int(np.isinf(bad))}
    # control: the same token as agreement (log-ratio 0, the old nan_to_num) moves the numbers
    b[1] = a[1]
    assert metrics([Pair(a, b), clean[1]])["kl"] != m["kl"]


def test_both_sides_minus_infinity_agree_and_are_counted():
    a = np.array([-1.0, -np.inf, -2.0])
    m = metrics([Pair(a, a.copy())])
    assert m["both_neg_inf"] == 1 and m["tokens"] == 2 and m["bitwise_equal"] == 1.0
    assert m["excluded_nan"] == m["excluded_infinite"] == 0


def test_the_public_function_reads_a_nan_row_as_counted_not_zero():
    train = np.array([[-1.0, np.nan, -2.0], [-1.5, -0.5, 0.0]])
    rollout = np.array([[-1.0, -1.0, -2.1], [-1.5, -0.4, 0.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    m = mismatch_metrics(train, rollout, mask)
    assert m["excluded_nan"] == 1 and m["tokens"] == 4
    assert m["kl"] == pytest.approx(np.mean([0.0, -0.1, 0.0, 0.1]), abs=1e-12)


def _summary(rows: dict[str, list[Pair]]) -> MismatchSummary:
    sides = {"total": ("rollout", "trainer@bf16"), "construction": ("rollout", "prefill"),
             "engine": ("prefill", "trainer@bf16"), "total @ fp32": ("rollout", "trainer@fp32")}
    pairs = []
    for label, ps in rows.items():
        s = summarize_pairs(ps, n_resamples=200)
        pairs.append(PairSummary(row=label, a=sides[label][0], b=sides[label][1], metrics=MismatchMetrics.of(s.metrics),
                                 ci=Intervals.model_validate(s.ci), bands=[Band.model_validate(b) for b in s.bands]))
    return MismatchSummary(checkpoint="primary", source="file", mode="raw", engine="hf", precision="bf16",
                           precisions=["bf16"], n=len(next(iter(rows.values()))), tokens=0, pairs=pairs)


def _seen(summary: MismatchSummary) -> str:
    return next(f.phrase for f in mismatch_verdict(summary) if f.question.key == "trainer sees rollout")


def test_the_verdict_grades_a_small_gap_a_wrong_model_and_a_clamped_batch_apart():
    rng = np.random.default_rng(0)
    small = _seen(_summary({"total": [pair(rng.normal(0, 1e-3, 64)) for _ in range(8)]}))
    wrong = _seen(_summary({"total": [pair(rng.normal(-2.0, 3.0, 64)) for _ in range(8)]}))
    assert "size negligible" in small and "wrong model" not in small and "clamp" not in small
    assert "size wrong model" in wrong and "another tokenizer or model" in wrong
    assert "every one of the 8 sequence weights is at the clamp" in wrong
    clamped = metrics([pair(np.full(30, -1.0)) for _ in range(4)])
    assert clamped["sequence_clamped"] == 1.0  # verl's ESS of it reads a number (its 1e-8 guard's), not "hopeless"
    assert "at the clamp" in _seen(_summary({"total": [pair(np.full(30, -1.0)) for _ in range(4)]}))
    assert "by part" not in small  # no construction or engine row: no parts, and no empty list of them


def test_the_parts_add_up_and_a_precision_is_an_alternative():
    rng = np.random.default_rng(1)
    construction = [rng.normal(0, 1e-3, 32) for _ in range(6)]
    engine = [rng.normal(0, 1e-3, 32) for _ in range(6)]
    said = _seen(_summary({
        "total": [pair(c + e) for c, e in zip(construction, engine, strict=True)],
        "construction": [pair(c) for c in construction], "engine": [pair(e) for e in engine],
        "total @ fp32": [pair(rng.normal(0, 3e-3, 32)) for _ in range(6)]}))
    assert "kl by part: construction" in said and "= total" in said
    assert "alternatives (not parts): trainer at fp32" in said
    planted = _seen(_summary({  # control: parts over other tokens do not add up, and it says so
        "total": [pair(c + e) for c, e in zip(construction, engine, strict=True)],
        "construction": [pair(c) for c in construction], "engine": [pair(e + 1e-3) for e in engine]}))
    assert "= total" not in planted and "do not cover it" in planted


def test_the_ragged_example_prints_an_interval_containing_its_estimate():
    """One sequence of 1,000 tokens at log-ratio 0.1 and nine of one token at 0."""
    pairs = [pair(np.full(1000, 0.1)), *(pair([0.0]) for _ in range(9))]
    s = summarize_pairs(pairs)
    for name in ("abs_mean", "k3_kl"):
        lo, hi = s.ci[name]
        assert lo <= s.metrics[name] <= hi, (name, s.metrics[name], s.ci[name])
    # control: the bootstrap of per-sequence means printed beside the pooled number does not contain it
    per_sequence = np.array([0.1] + [0.0] * 9)
    assert paired_bootstrap_ci(per_sequence, np.zeros(10))[1] < s.metrics["abs_mean"]


@pytest.mark.parametrize("seed", range(5))
def test_every_interval_is_of_the_statistic_beside_it(seed):
    """Ragged lengths: each interval's statistic on the sample itself (every sequence once) is the printed one,
    and the interval holds it."""
    rng = np.random.default_rng(seed)
    pairs = [pair(rng.normal(0.0, rng.uniform(0.001, 0.5), int(n))) for n in rng.integers(1, 400, 30)]
    s = summarize_pairs(pairs, seed=seed)
    split = parts(Padded.of(pairs))
    for name in INTERVALS:
        num, den = split[name]
        assert num.sum() / den.sum() == pytest.approx(s.metrics[name], rel=1e-9), name
        lo, hi = s.ci[name]
        assert lo <= s.metrics[name] <= hi, name
    # control: a statistic of other parts (the per-sequence mean of |log-ratio|) is not the printed pooled one
    n = split["abs_mean"][1]
    assert (split["abs_mean"][0] / n).mean() != pytest.approx(s.metrics["abs_mean"], rel=1e-3)
    assert intervals(split, np.random.default_rng(0), 100).keys() == set(INTERVALS)


def test_tensors_and_arrays_padded_and_ragged_read_alike():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    lengths = [3, 1, 7]
    train = [rng.uniform(-5, 0, n) for n in lengths]
    rollout = [t + rng.normal(0, 0.01, t.size) for t in train]
    padded_t, padded_r, mask = (np.zeros((3, 7)) for _ in range(3))
    for i, n in enumerate(lengths):
        padded_t[i, :n], padded_r[i, :n], mask[i, :n] = train[i], rollout[i], 1
    ragged = mismatch_metrics(train, rollout)
    assert mismatch_metrics(torch.tensor(padded_t), torch.tensor(padded_r), torch.tensor(mask).bool()) == ragged
    assert mismatch_metrics(padded_t, padded_r) != ragged  # control: the padding read as tokens is another batch
    assert set(ragged) == set(MismatchMetrics.of(ragged).flat())


def test_the_module_imports_no_torch():
    def imports_torch(module: str) -> bool:
        code = f"import sys; import {module}; print('torch' in sys.modules)"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
            == "True"

    assert not imports_torch("stagereplay.experiments.mismatch.metrics")
    assert imports_torch("torch")  # control: the check sees torch where it is imported


def test_the_reference_page_lists_every_metric_with_its_verl_name():
    page = DOCS.read_text()
    for name, field in MismatchMetrics.model_fields.items():
        if name == "rejection":
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        verl = str(extra.get("verl", "ours only")).partition(" (")[0]
        row = next((line for line in page.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None and verl in row, name
