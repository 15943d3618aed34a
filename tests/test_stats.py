"""The statistics must reproduce the reference paper's numbers by arithmetic alone.

Numbers (paper/abstract): Wilson 95% upper bound for 0/200 = 1.88%; Wilson lower bounds for 24/24 and
43/43 = 86.2% and 91.8%; paired bootstrap CI for 11 vs 9 discordant pairs in 200 items = [-3.5, +5.5]
points. Each claim has a negative control that must not give the same number.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from stagereplay.experiments.core.stats import (
    first_divergence,
    mcnemar_exact,
    paired_bootstrap_ci,
    wilson_interval,
)

Z95 = 1.959963984540054  # Phi^-1(0.975)


def _wilson_by_hand(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


def _paper_pairs() -> tuple[np.ndarray, np.ndarray]:
    """200 paired 0/1 labels: 11 items only `a` right, 9 only `b` right, 113 both, 67 neither.

    Accuracies 0.62 and 0.61 (a one-point difference). Discordant items come first; see the
    seed note in `test_paired_bootstrap_reproduces_paper_interval` for why the order is fixed.
    """
    a = np.array([1] * 11 + [0] * 9 + [1] * 113 + [0] * 67)
    b = np.array([0] * 11 + [1] * 9 + [1] * 113 + [0] * 67)
    return a, b


# --- Wilson -------------------------------------------------------------------------------------


def test_wilson_upper_bound_zero_of_200_is_1_88_percent() -> None:
    lo, hi = wilson_interval(0, 200)
    assert lo == 0.0
    assert round(100 * hi, 2) == 1.88
    assert hi == pytest.approx(_wilson_by_hand(0, 200, Z95)[1], rel=1e-12)


@pytest.mark.parametrize(("k", "n", "lower_pct"), [(24, 24, 86.2), (43, 43, 91.8)])
def test_wilson_lower_bound_all_donor_following(k: int, n: int, lower_pct: float) -> None:
    lo, hi = wilson_interval(k, n)
    assert round(100 * lo, 1) == lower_pct
    assert hi == pytest.approx(1.0)
    assert lo == pytest.approx(_wilson_by_hand(k, n, Z95)[0], rel=1e-12)


def test_wilson_matches_hand_formula_mid_range() -> None:
    lo, hi = wilson_interval(166, 200)
    exp_lo, exp_hi = _wilson_by_hand(166, 200, Z95)
    assert (lo, hi) == pytest.approx((exp_lo, exp_hi), rel=1e-12)
    assert (round(100 * lo, 1), round(100 * hi, 1)) == (77.2, 87.6)  # 166/200 = 83%


def test_negative_control_wald_and_wrong_z_do_not_give_1_88() -> None:
    # Wald: p +- z sqrt(p(1-p)/n) collapses to [0, 0] at 0/n.
    p = 0 / 200
    wald_hi = p + Z95 * math.sqrt(p * (1 - p) / 200)
    assert round(100 * wald_hi, 2) != 1.88
    # Wilson with the rounded-up z = 2 gives 1.96%: the critical value matters at two decimals.
    assert round(100 * _wilson_by_hand(0, 200, 2.0)[1], 2) != 1.88


def test_wilson_confidence_changes_the_interval() -> None:
    assert wilson_interval(0, 200, confidence=0.99)[1] > wilson_interval(0, 200)[1]


def test_the_interval_rejects_n_zero_and_bad_counts() -> None:
    with pytest.raises(ValueError, match="n = 0"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)
    with pytest.raises(ValueError):
        wilson_interval(-1, 4)
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 4, confidence=1.0)


# --- paired bootstrap ----------------------------------------------------------------------------

# Measured with `paired_bootstrap_ci` (scipy.stats.bootstrap, paired percentile, 10,000 resamples) and
# the item order of `_paper_pairs` (discordant items first): seeds 0, 1, 2 and 42 all give exactly
# [-3.5, +5.5]. Over seeds 0..199, 192 do; the other 8 (`OFF_SEEDS`) give a lower bound of -3.0
# (57: -3.0125) and the same upper bound. That is Monte Carlo error, not a different answer: the exact
# (infinite-resample) bootstrap percentiles are -3.5 and +5.5 (`test_exact_bootstrap_distribution_...`),
# and the lower one sits near a step of the distribution (P(S <= -7) = 0.0280 vs the 0.025 target), so
# about 4% of seeds land one step up. Reordering the items changes which seeds do (with the order
# reversed, seed 0 gives -3.0), so the order is part of the fixture. `test_seed_census_on_paper_pairs`
# (slow) recomputes the census.
PAPER_SEEDS = [0, 1, 2, 42]
OFF_SEEDS = [52, 56, 57, 63, 127, 166, 169, 175]


@pytest.mark.parametrize("seed", PAPER_SEEDS)
def test_paired_bootstrap_reproduces_paper_interval(seed: int) -> None:
    a, b = _paper_pairs()
    assert a.mean() - b.mean() == pytest.approx(0.01)
    lo, hi = paired_bootstrap_ci(a, b, n_resamples=10_000, seed=seed)
    assert (round(100 * lo, 1), round(100 * hi, 1)) == (-3.5, 5.5)
    # Means of values in {-1, 0, 1}/200 are multiples of half a point; these bounds are exact steps.
    assert lo == pytest.approx(-0.035, abs=1e-12)
    assert hi == pytest.approx(0.055, abs=1e-12)


@pytest.mark.parametrize("seed", OFF_SEEDS)
def test_paired_bootstrap_off_seeds_land_one_step_up(seed: int) -> None:
    """The seeds the census comment names as off: Monte Carlo error moves only the lower bound."""
    a, b = _paper_pairs()
    lo, hi = paired_bootstrap_ci(a, b, n_resamples=10_000, seed=seed)
    assert round(100 * lo, 1) in (-3.0, -3.1)  # seed 57 interpolates to -3.0125
    assert hi == pytest.approx(0.055, abs=1e-12)


@pytest.mark.slow
def test_seed_census_on_paper_pairs() -> None:
    """Regenerates the census in the comment above (about 7 s): 192 of seeds 0..199 give [-3.5, +5.5]."""
    a, b = _paper_pairs()
    off = [s for s in range(200) if paired_bootstrap_ci(a, b, n_resamples=10_000, seed=s) != (-0.035, 0.055)]
    assert off == OFF_SEEDS


def _hand_bootstrap_ci(a: np.ndarray, b: np.ndarray, seed: int) -> tuple[float, float]:
    """An independent percentile bootstrap: (10,000, n) item indices from one generator, then percentiles."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(10_000, len(a)))  # (resample, item)
    lo, hi = np.percentile((a - b)[idx].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


@pytest.mark.parametrize("seed", [0, 57])
def test_paired_bootstrap_matches_an_independent_resampler(seed: int) -> None:
    """scipy draws its item indices from the generator as `rng.integers(0, n, (n_resamples, n))` does, so the
    interval agrees with a hand-written resampler on the same seed to rounding (seed 57 sits between steps)."""
    a, b = _paper_pairs()
    assert paired_bootstrap_ci(a, b, seed=seed) == pytest.approx(_hand_bootstrap_ci(a, b, seed), abs=1e-15)


def test_exact_bootstrap_distribution_gives_paper_interval() -> None:
    """Seed-free check: the bootstrap distribution of the summed difference S is a 200-fold convolution
    of the one-item distribution {-1: 9/200, 0: 180/200, +1: 11/200}; its 2.5% and 97.5% quantiles
    are what an infinite number of resamples would give."""
    step = np.array([9, 180, 11], dtype=np.float64) / 200  # P(d = -1, 0, +1)
    dist = np.array([1.0])
    for _ in range(200):
        dist = np.convolve(dist, step)
    support = np.arange(-200, 201)  # S values, aligned with dist
    cdf = np.cumsum(dist)
    s_lower = int(support[np.searchsorted(cdf, 0.025)])
    s_upper = int(support[np.searchsorted(cdf, 0.975)])
    # S / 200 in points is S / 2: -7 -> -3.5, +11 -> +5.5.
    assert (s_lower, s_upper) == (-7, 11)


def test_paired_bootstrap_ignores_how_concordant_items_split() -> None:
    a, b = _paper_pairs()
    both_right = (np.r_[a[:20], np.ones(180)], np.r_[b[:20], np.ones(180)])
    both_wrong = (np.r_[a[:20], np.zeros(180)], np.r_[b[:20], np.zeros(180)])
    ref = paired_bootstrap_ci(a, b, seed=0)
    assert paired_bootstrap_ci(*both_right, seed=0) == ref
    assert paired_bootstrap_ci(*both_wrong, seed=0) == ref


def _unpaired_bootstrap_ci(a: np.ndarray, b: np.ndarray, seed: int) -> tuple[float, float]:
    """The wrong analysis: resample each arm independently, losing the pairing."""
    rng = np.random.default_rng(seed)
    n = len(a)
    means = a[rng.integers(0, n, (10_000, n))].mean(1) - b[rng.integers(0, n, (10_000, n))].mean(1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def test_negative_control_unpaired_bootstrap_is_much_wider() -> None:
    a, b = _paper_pairs()
    lo, hi = _unpaired_bootstrap_ci(a, b, seed=0)
    assert (round(100 * lo, 1), round(100 * hi, 1)) != (-3.5, 5.5)
    assert hi - lo > 1.5 * (0.055 - -0.035)  # about [-8.5, +10.5] points


def test_paired_bootstrap_is_deterministic_per_seed_and_validates() -> None:
    a, b = _paper_pairs()
    assert paired_bootstrap_ci(a, b, n_resamples=500, seed=3) == paired_bootstrap_ci(
        a, b, n_resamples=500, seed=3
    )
    with pytest.raises(ValueError, match="no items"):
        paired_bootstrap_ci([], [])
    with pytest.raises(ValueError, match="paired"):
        paired_bootstrap_ci([1, 0], [1, 0, 1])
    with pytest.raises(ValueError, match="n_resamples"):
        paired_bootstrap_ci([1], [0], n_resamples=0)
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap_ci([1, 0], [0, 0], confidence=1.0)


def test_paired_bootstrap_single_pair_is_its_difference() -> None:
    # Every resample of one item is that item; scipy itself refuses samples of fewer than two.
    assert paired_bootstrap_ci([1], [0]) == (1.0, 1.0)
    assert paired_bootstrap_ci([0.25], [0.75]) == (-0.5, -0.5)


def test_paired_bootstrap_identical_arms_is_zero_width() -> None:
    a, _ = _paper_pairs()
    assert paired_bootstrap_ci(a, a, n_resamples=200) == (0.0, 0.0)


# --- McNemar -------------------------------------------------------------------------------------


def test_mcnemar_exact_paper_counts() -> None:
    # Two-sided binomial test of 9 out of 20 at 0.5: 2 * P(X <= 9) = 0.8238.
    p = mcnemar_exact(11, 9)
    assert p == pytest.approx(0.8238029479980469, rel=1e-12)
    assert mcnemar_exact(9, 11) == p


def test_mcnemar_edges() -> None:
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 * 0.5**10)
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 3)


# --- first divergence ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
        ([1, 2], [1, 2, 3], 2),  # one arm stopped early: diverges at the shorter length
        ([1, 2, 3], [1, 2], 2),
        ([], [4], 0),
    ],
)
def test_first_divergence(a: list[int], b: list[int], expected: int | None) -> None:
    assert first_divergence(a, b) == expected


def test_one_cluster_bootstrap_is_scipys_paired_percentile_bootstrap_to_the_bit():
    """The one bootstrap every experiment uses (`cluster_bootstrap`) gives, for the paired difference, the bits of
    `scipy.stats.bootstrap(paired=True, method="percentile")` with the same seed, on 0/1 scores and on real ones, in
    blocks of any size; attest's run interval and mismatch's pooled intervals are it. The control: numpy's own
    quantile of the same resamples differs from scipy's in the last bits on some of these inputs, so the equality
    is a property of the percentiles chosen, not of any two ways of taking them."""
    from scipy.stats import bootstrap

    from stagereplay.experiments.attest.stats import Items, item_interval
    from stagereplay.experiments.core import stats
    from stagereplay.experiments.core.stats import cluster_bootstrap, resamples
    from stagereplay.experiments.mismatch.stats import intervals

    g = np.random.default_rng(1)
    numpy_differs = 0
    for trial in range(24):
        n = int(g.integers(2, 300))
        a, b = (g.integers(0, 2, n), g.integers(0, 2, n)) if trial % 2 else (g.normal(size=n), g.normal(size=n))
        theirs = bootstrap((a.astype(float), b.astype(float)), lambda x, y, axis: np.mean(x - y, axis=axis),
                           paired=True, vectorized=True, method="percentile", n_resamples=2_000,
                           rng=np.random.default_rng(trial)).confidence_interval
        ours = cluster_bootstrap({"d": (a - b, np.ones(n))}, 2_000, seed=trial)["d"]
        assert ours == (float(theirs.low), float(theirs.high)), trial
        draws = np.concatenate([(a - b)[i].sum(axis=1) / n for i in resamples(n, 2_000, np.random.default_rng(trial))])
        numpy_differs += tuple(np.quantile(draws, [0.025000000000000022, 0.975])) != ours
    assert numpy_differs > 0
    monkey_block = stats._BOOTSTRAP_BLOCK
    try:
        stats._BOOTSTRAP_BLOCK = 7  # blocks of 7 resamples: the same draws, the same interval
        assert cluster_bootstrap({"d": (a - b, np.ones(n))}, 2_000, seed=23)["d"] == ours
    finally:
        stats._BOOTSTRAP_BLOCK = monkey_block
    per_item = [g.normal(size=int(k)) for k in g.integers(1, 9, 30)]
    items = Items.of(per_item)
    assert item_interval(items, n_resamples=500, seed=4) == cluster_bootstrap(
        {"run": (items.sums, items.lengths)}, 500, seed=4)["run"]
    split = {"x": (items.sums, items.lengths)}
    assert intervals(split, np.random.default_rng(4), 500)["x"] == list(item_interval(items, n_resamples=500, seed=4))
