"""The attest decision on synthetic per-token scores: calibrated over items, with its controls."""

from __future__ import annotations

import numpy as np
import pytest

from stagereplay.experiments.attest.stats import (
    Items,
    auc,
    curve,
    decide,
    item_interval,
    nearest,
    p_value,
    pooled_statistics,
    run_statistic,
    threshold,
    tokens_for_power,
)


def clustered(rng: np.random.Generator, n_items: int, a: float, b: float = 15.0) -> Items:
    """Mismatch indicators [L] per item, L in 20..80, each item at its own rate u ~ Beta(a, b): tokens of one item
    share their rate, as tokens of one response share their prefix."""
    rates = rng.beta(a, b, size=n_items)
    return Items.of([rng.random(rng.integers(20, 81)) < u for u in rates])


def tokenwise(items: Items) -> Items:
    """The same scores with every token its own item: the independence a per-token count assumes."""
    return Items(items.values, np.arange(items.tokens + 1, dtype=np.int64))


def test_a_run_shorter_than_an_item_is_its_head_and_a_longer_one_pools_whole_items_then_cuts_the_last():
    one = Items.of([[1.0, 2.0, 3.0, 4.0]])
    assert np.array_equal(pooled_statistics(one, 2, n_draws=5), np.full(5, 1.5))
    assert np.array_equal(pooled_statistics(Items.of([[0.0, 0.0, 3.0]]), 5, n_draws=3), np.full(3, 0.6))
    assert run_statistic(Items.of([[1.0], [0.0, 0.0, 0.0]])) == 0.25  # per token, not per item


def test_the_flag_is_the_p_value_at_alpha_and_the_threshold_says_the_same():
    rng = np.random.default_rng(0)
    null = rng.normal(size=999)
    for alpha in (0.01, 0.05):
        thr = threshold(null, alpha)
        for s in np.concatenate([rng.normal(size=300) * 3, null]):
            assert (s > thr) == (p_value(float(s), null) <= alpha)
    with pytest.raises(ValueError, match="draws"):
        threshold(null[:50], 0.01)


def test_honest_runs_are_flagged_at_about_the_rate_and_a_per_token_null_overflags_them():
    """The negative control: the same calibration with every token its own item (a per-token count) flags honest
    runs far above the stated rate, since tokens of one item move together."""
    rng = np.random.default_rng(1)
    null = clustered(rng, 400, a=0.5)
    alpha, trials = 0.05, 200
    ours = per_token = 0
    for i in range(trials):
        run = clustered(rng, 20, a=0.5)
        ours += decide(run, null, alpha, n_draws=399, seed=i, needed=False).flagged
        per_token += decide(run, tokenwise(null), alpha, n_draws=399, seed=i, needed=False).flagged
    # Binomial(200, 0.05) exceeds 20 with probability below 0.2%.
    assert ours <= 20
    assert per_token > 3 * alpha * trials


def test_a_shifted_run_is_flagged_with_the_tokens_it_needed():
    rng = np.random.default_rng(2)
    null = clustered(rng, 400, a=0.5)
    run = clustered(rng, 30, a=2.0)
    d = decide(run, null, n_draws=999)
    assert d.flagged and d.p_value <= 0.01 and d.statistic > d.threshold
    assert d.tokens_needed is not None and d.tokens_needed <= d.tokens
    assert d.interval[0] <= d.statistic <= d.interval[1]
    honest = decide(clustered(rng, 30, a=0.5), null, n_draws=999)
    assert not honest.flagged and honest.tokens_needed is None  # control: the same test on an honest run


def test_the_interval_is_over_items():
    rng = np.random.default_rng(3)
    run = clustered(rng, 40, a=0.5)
    lo, hi = item_interval(run)
    tlo, thi = item_interval(tokenwise(run))
    assert hi - lo > 1.5 * (thi - tlo)  # control: a per-token interval is too narrow for clustered tokens


def test_auc_counts_ties_as_half():
    assert auc(np.array([1.0, 2.0]), np.array([1.0, 0.0])) == (0.5 + 1 + 1 + 1) / 4


def test_the_auc_and_power_of_a_substitution_grow_with_tokens_and_an_honest_one_stays_at_chance():
    rng = np.random.default_rng(4)
    null, sub, honest = clustered(rng, 300, 0.5), clustered(rng, 300, 1.5), clustered(rng, 300, 0.5)
    grid = [25, 100, 400, 1600, 6400]
    c = curve(sub, null, grid, n_draws=499)
    assert c.auc[-1] > c.auc[0] and c.auc[-1] > 0.99 and c.power[-1] >= 0.99
    needed = tokens_for_power(c)
    assert needed is not None and needed in grid
    h = curve(honest, null, grid, n_draws=499)
    assert np.all(np.abs(h.auc - 0.5) < 0.1) and tokens_for_power(h) is None


def test_nearest_orders_variants_by_statistic():
    run = Items.of([[0.0, 1.0]])
    names = [n for n, _ in nearest(run, {"far": Items.of([[5.0]]), "near": Items.of([[0.6]])})]
    assert names == ["near", "far"]


def test_bad_scores_are_refused():
    with pytest.raises(ValueError, match="finite"):
        Items.of([[0.0, np.inf]])
    with pytest.raises(ValueError, match="empty"):
        Items.of([[0.0], []])


@pytest.mark.parametrize(("module", "torch_expected"), [("stagereplay.experiments.attest.stats", False),
                                                        ("torch", True)])
def test_the_decision_imports_no_torch(module, torch_expected):
    """attest_stats is numpy only (a report or a planner may read decisions where torch is absent); the second case is
    the control that the probe sees an import of torch."""
    import subprocess
    import sys

    code = f"import sys; import {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == int(torch_expected)
