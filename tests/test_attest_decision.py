"""Attest's decision never accuses where its null cannot support the level: a point-mass null, too few calibration
prompts, a null that misses the claimed engine or fails its own held-out check read inconclusive (exit 3), each with
a control that flags (exit 1) once the blocker is gone; the level holds for an honest server that is one variant,
not a mixture of them; the p-value never claims a resolution its null lacks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stagereplay.experiments.attest.decision import blockers, judged, min_calibration, outcome
from stagereplay.experiments.attest.experiment import Attest
from stagereplay.experiments.attest.stats import Items, decide, p_floor
from stagereplay.experiments.attest.summary import fractional_wilson
from stagereplay.experiments.core.stats import wilson_interval

ALPHA = 0.01


def _items(rng: np.random.Generator, k: int, mean: float, sd: float, tokens: int = 12) -> Items:
    return Items.of([np.abs(rng.normal(mean, sd, tokens)) for _ in range(k)])


def _decide(run: Items, nulls: dict[str, Items], calibration: int, claim: str = "hf", engines: tuple[str, ...] = ("hf",),
            heldout_lower: float | None = None) -> tuple[str, list[str]]:
    t = judged("primary", run, nulls, ALPHA)
    found = blockers([t] if t.exceeds else [], calibration, ALPHA, heldout_lower, claim, engines) if t.exceeds else []
    return outcome([t], found), [b.kind for b in found]


def test_a_point_mass_null_reads_inconclusive_where_it_cannot_reach_the_level():
    """A planted point-mass null (every honest token the reference's argmax, as an honest server of our engine at the
    reference's own precision). Against 4 honest responses, 2 served ones cannot reach 1% even were both to leave it
    (C(6, 2) = 15 runs), so one that does reads inconclusive. The controls, against 20 honest responses: every one of
    20 served responses off it is flagged; 2 of 20 off it are what honest serving does (p = C(20, 2) / C(40, 2))."""
    off, on = np.r_[0.3, np.zeros(11)], np.zeros(12)
    assert _decide(Items.of([off, on]), {"bf16": Items.of([on] * 4)}, 20) == ("inconclusive", ["point mass"])
    point = {"bf16": Items.of([on] * 20)}
    assert _decide(Items.of([off] * 20), point, 20) == ("flagged", [])
    few = Items.of([off] * 2 + [on] * 18)
    t = judged("primary", few, point, ALPHA)
    assert t.point_mass and t.decision.p_value == pytest.approx(math.comb(20, 2) / math.comb(40, 2))
    assert _decide(few, point, 20) == ("consistent", [])
    rng = np.random.default_rng(0)
    assert _decide(_items(rng, 20, 0.05, 0.01), {"bf16": _items(rng, 20, 0.0, 0.002)}, 20) == ("flagged", [])


def test_too_few_calibration_prompts_read_inconclusive_with_the_prompts_that_would_decide():
    rng = np.random.default_rng(1)
    run, null = _items(rng, 20, 0.05, 0.01), {"fp32": _items(rng, 20, 0.0, 0.002)}
    need = min_calibration(ALPHA)
    assert need == 10
    t = judged("primary", run, null, ALPHA)
    found = blockers([t], need - 1, ALPHA, None, "hf", ("hf",))
    assert outcome([t], found) == "inconclusive" and "--n 20" in found[0].fix
    assert outcome([t], blockers([t], need, ALPHA, None, "hf", ("hf",))) == "flagged"


def test_a_claimed_engine_missing_from_the_null_reads_inconclusive():
    rng = np.random.default_rng(2)
    run, null = _items(rng, 20, 0.05, 0.01), {"bf16": _items(rng, 20, 0.0, 0.002)}
    assert _decide(run, null, 20, claim="llama.cpp") == ("inconclusive", ["engine"])
    assert _decide(run, null, 20, claim="llama.cpp", engines=("hf", "llama.cpp")) == ("flagged", [])


def test_a_null_that_fails_its_own_heldout_check_reads_inconclusive():
    rng = np.random.default_rng(3)
    run, null = _items(rng, 20, 0.05, 0.01), {"bf16": _items(rng, 20, 0.0, 0.002)}
    assert _decide(run, null, 20, heldout_lower=0.05) == ("inconclusive", ["held-out"])
    assert _decide(run, null, 20, heldout_lower=0.001) == ("flagged", [])


def test_an_honest_server_that_is_one_variant_holds_the_level_where_a_pooled_null_flags_it():
    """Two honest variants far apart, each null a fresh sample: runs of the far one exceed a null pooled over both
    (its long runs average the two) every time, and exceed the variants' own nulls, taken each alone and widened by
    their own sampling error, at about alpha (at most 3 of 200, where alpha's expected count is 2)."""
    flagged_pooled = flagged_each = 0
    trials = 200
    for seed in range(trials):
        rng = np.random.default_rng(seed)
        near, far = _items(rng, 20, 0.0, 0.001), _items(rng, 20, 0.01, 0.001)
        pooled = Items.of([near.values[near.offsets[k]:near.offsets[k + 1]] for k in range(20)]
                          + [far.values[far.offsets[k]:far.offsets[k + 1]] for k in range(20)])
        honest = _items(rng, 20, 0.01, 0.001)  # a server that is the far variant, on other prompts
        flagged_pooled += decide(honest, pooled, ALPHA, seed=seed, needed=False).flagged
        flagged_each += judged("primary", honest, {"near": near, "far": far}, ALPHA, seed=seed, needed=False).flagged
    assert flagged_pooled == trials and flagged_each <= 3, (flagged_pooled, flagged_each)


def test_a_run_of_one_response_cannot_reach_a_level_its_null_cannot_resolve():
    rng = np.random.default_rng(5)
    null = _items(rng, 10, 0.0, 0.002)
    beyond = Items.of([np.full(12, 1.0)])  # far past every honest response
    d = decide(beyond, null, ALPHA, needed=False)
    assert not d.flagged and not d.reachable and d.p_value == pytest.approx(1 / 11)
    assert decide(beyond, _items(rng, 120, 0.0, 0.002), ALPHA, needed=False).flagged  # the control: 120 can
    assert p_floor(10, 1) == pytest.approx(1 / 11) and p_floor(10, 2) == pytest.approx(1 / 56)
    assert p_floor(1000, 500) == 0.0 and p_floor(0, 3) == 1.0


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (10, 10), (1, 200)])
def test_the_prompt_level_interval_is_wilsons_on_whole_counts(k: int, n: int):
    lo, hi = fractional_wilson(k / n, n)
    wlo, whi = wilson_interval(k, n)
    assert math.isclose(lo, wlo, abs_tol=1e-9) and math.isclose(hi, whi, abs_tol=1e-9)


def test_exit_codes_say_the_outcome():
    from types import SimpleNamespace

    from stagereplay.errors import FLAGGED, INCONCLUSIVE, OK

    attest = Attest()
    said = [SimpleNamespace(outcome=o) for o in ("consistent", "inconclusive", "flagged")]
    assert attest.exit_code(said[:1]) == OK
    assert attest.exit_code(said[:2]) == INCONCLUSIVE
    assert attest.exit_code(said) == FLAGGED


def test_without_the_nulls_own_error_an_honest_run_is_flagged_past_the_level(monkeypatch: pytest.MonkeyPatch):
    """A null of as many responses as the run flags honest runs at about alpha (at most 10 of 400, where alpha's
    expected count is 4); its negative control: compared as if the null were honest serving's true distribution, it
    flags them well past alpha (more than 10 of 400)."""
    from stagereplay.experiments.attest import stats as attest_stats

    def unwidened(null: Items, tokens: int, n_draws: int = attest_stats.DRAWS, seed: int = 0,
                  alpha: float | None = None) -> np.ndarray:
        return attest_stats.pooled_statistics(null, tokens, n_draws, seed)

    def flags() -> int:
        out = 0
        for seed in range(400):
            rng = np.random.default_rng(seed)
            null, honest = _items(rng, 20, 0.01, 0.001), _items(rng, 20, 0.01, 0.001)
            out += decide(honest, null, ALPHA, seed=seed, needed=False).flagged
        return out

    widened = flags()
    monkeypatch.setattr(attest_stats, "null_statistics", unwidened)
    assert widened <= 10 < flags(), widened


def test_plan_says_how_many_prompts_the_level_needs():
    from typer.testing import CliRunner

    from stagereplay.cli import app

    few = CliRunner().invoke(app, ["attest", "--plan", "--n", "8"])
    assert few.exit_code == 0 and "20 prompts needed (10 calibrate); this run has 8 (4 calibrate)" in few.output
    assert "reads inconclusive" in few.output, few.output
    enough = CliRunner().invoke(app, ["attest", "--plan", "--n", "20", "--alpha", "0.05"])
    assert enough.exit_code == 0 and "10 prompts needed (5 calibrate)" in enough.output
    assert enough.output.rstrip().endswith("enough"), enough.output
