"""Attest's decision: each statistic of the served run judged against the honest null at its share of the level,
and the three answers it can give.

    consistent      no statistic exceeds its threshold
    flagged         a statistic exceeds its threshold, and the null can support the stated level
    inconclusive    a statistic exceeds its threshold, but the null cannot support the level: a "No" there could be
                    an honest server the null does not hold, so none is said (`Blocker` names why, and what would
                    make the run conclusive)

The statistics (`experiments.attest.stats` tests each, resampling whole responses):

    primary        per token, the reference's margin (greedy claim) or the replayed seeded sampler's mismatch
    log-prob gap   per token, |the decoder's log-probability of its token - the reference's|, where the server gave
                   one for every token: its null is the honest variants' own decode log-probabilities against the
                   reference (decode vs one-shot prefill, this project's subject)

With both, each is judged at alpha / 2 (Bonferroni), so the run's false-positive rate stays at most alpha.

What a null cannot support (`blockers`):

    point mass     every honest token scored the same (every honest response chose the reference's argmax): the
                   null says nothing of how far an honest server strays, so the responses are the unit (`_exact`:
                   how many served responses leave the honest value, where no honest one did), and too few of them
                   to reach the level is no "No"
    too few        fewer calibration prompts than `min_calibration(alpha)`: the null's tail at alpha rests on too
                   few prompts
    held-out       the honest variants' own held-out prompts were flagged above alpha (the Wilson lower bound of
                   the prompt-level rate exceeds it): the null does not hold its level here
    engine         the claim names an engine (llama.cpp for a GGUF) that no honest variant runs
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from stagereplay.experiments.attest.stats import (
    DRAWS,
    Decision,
    Items,
    decide,
    item_interval,
    null_statistics,
    run_statistic,
)

Outcome = Literal["consistent", "flagged", "inconclusive"]
BlockerKind = Literal["point mass", "too few", "held-out", "engine"]
PRIMARY = "primary"
LOGPROB = "log-prob gap"
MIN_PROMPTS = 5
"""The fewest calibration prompts any level is decided on."""


def min_calibration(alpha: float) -> int:
    """The fewest calibration prompts a decision at `alpha` rests on: `MIN_PROMPTS`, and 1 / (10 alpha) (10 at
    0.01), so that the null's tail at alpha is an average over prompts rather than one prompt's quirk."""
    return max(MIN_PROMPTS, math.ceil(0.1 / alpha - 1e-9))


def prompts_needed(alpha: float) -> int:
    """The prompts a run at `alpha` needs: `min_calibration(alpha)` calibrate (half the items, `calibration_split`),
    as many held out."""
    return 2 * min_calibration(alpha)


@dataclass(frozen=True)
class Test:
    """One statistic of the served run against each honest variant's own null, at its share of alpha. An honest
    server is one of the variants, not a mixture of them: the run exceeds the null only where it exceeds every
    variant's, so the level holds for a server that is any one of them. `decision` is against the nearest variant
    (the largest p-value)."""

    name: str
    nearest: str  # the variant whose null the run sits deepest in
    decision: Decision  # against `nearest`'s null
    exceeds: bool  # the statistic lies above every variant's threshold (resampled null, no floor)
    point_mass: bool  # every honest token of every variant scored the same
    center: float  # the median of `nearest`'s null runs at the served run's length
    spread: float  # their standard deviation

    @property
    def flagged(self) -> bool:
        """Exceeds every variant's null, and each can reach the level for a run of this size (`p_floor`)."""
        return self.exceeds and self.decision.flagged

    @property
    def distance(self) -> float | None:
        """How far the served statistic lies above the nearest null's median, in its standard deviations (None
        above a point mass, 0 on it)."""
        gap = self.decision.statistic - self.center
        if self.spread > 0:
            return gap / self.spread
        return 0.0 if gap <= 0 else None


def judged(name: str, run: Items, nulls: Mapping[str, Items], alpha: float, seed: int = 0,
           needed: bool = True) -> Test:
    """`run` against each of `nulls` (one per honest variant) at `alpha` (`attest_stats.decide`)."""
    point = all(np.ptp(null.values) == 0 for null in nulls.values())
    if point:
        return _exact(name, run, nulls, alpha)
    decisions = {v: decide(run, null, alpha, DRAWS, seed=seed, needed=needed) for v, null in nulls.items()}
    near = max(decisions, key=lambda v: (decisions[v].p_value, -abs(decisions[v].statistic - decisions[v].threshold)))
    d = decisions[near]
    exceeds = all(x.statistic > x.threshold for x in decisions.values())
    if exceeds and not all(x.flagged for x in decisions.values()):
        d = next(x for x in decisions.values() if not x.flagged)  # a null that cannot reach the level: its decision
    draws = null_statistics(nulls[near], run.tokens, DRAWS, seed)
    return Test(name, near, d, exceeds, False, float(np.median(draws)), float(np.std(draws)))


def _exact(name: str, run: Items, nulls: Mapping[str, Items], alpha: float) -> Test:
    """Against a point-mass null (every honest token scored one value `c`): responses are the unit. Of the m served
    responses, x have a token off `c`; of the M honest ones, none. Were served and honest responses exchangeable, the
    chance that all x deviating responses fall on the served side is C(m, x) / C(m + M, x), the p-value: a few
    deviating responses are consistent with honest serving, many are not. A run too small for even all its responses
    deviating to reach the level (C(m + M, m) < 1 / alpha) is inconclusive where any deviates."""
    values = next(iter(nulls.values())).values
    c = float(values[0])
    honest = sum(len(null) for null in nulls.values())
    deviates = np.maximum.reduceat(np.abs(run.values - c), run.offsets[:-1]) > 0  # [m]
    m, x = len(run), int(deviates.sum())

    def p_of(k: int) -> float:
        return 1.0 if k == 0 else math.exp(math.lgamma(m + 1) - math.lgamma(m - k + 1) - math.lgamma(m + honest + 1)
                                           + math.lgamma(m + honest - k + 1))

    p, reachable = p_of(x), p_of(m) <= alpha
    stat = run_statistic(run)
    near = next(iter(nulls))
    d = Decision(statistic=stat, interval=item_interval(run), threshold=c, p_value=p, flagged=p <= alpha,
                 alpha=alpha, tokens=run.tokens, items=m, tokens_needed=run.tokens if p <= alpha else None,
                 null_items=honest, null_tokens=sum(null.tokens for null in nulls.values()), reachable=reachable)
    exceeds = p <= alpha or (x > 0 and not reachable)  # beyond the null, or unable to say: never consistent then
    return Test(name, near, d, exceeds, True, c, 0.0)


@dataclass(frozen=True)
class Blocker:
    """Why a flag cannot be said at the stated level, and what would make the run conclusive."""

    kind: BlockerKind
    reason: str
    fix: str


def blockers(flagged: Sequence[Test], calibration: int, alpha: float, heldout_lower: float | None,
             claim_engine: str, null_engines: Sequence[str]) -> list[Blocker]:
    """What keeps the flags of `flagged` (tests that exceeded their thresholds) from being a "No" (module
    docstring); `heldout_lower` is the Wilson lower bound of the honest held-out prompts' flag rate (None: none
    held out)."""
    out = []
    unsure = [t for t in flagged if t.point_mass and not t.flagged]
    if unsure and not any(t.flagged for t in flagged):
        t = unsure[0]
        out.append(Blocker(
            "point mass", f"every honest response scored {t.center:g} per token on {t.name} (a point mass), and "
            f"{t.decision.items} served responses against {t.decision.null_items} honest ones cannot reach the level "
            f"even were every one to leave it",
            "pass more prompts, or honest variants of the serving engine's own (--claim-engine), or compute the "
            "reference at another precision (--precision)"))
    need = min_calibration(alpha)
    if any(not t.decision.reachable and not t.point_mass for t in flagged):
        floor = min(t.decision.null_items for t in flagged)
        out.append(Blocker("too few", f"a run of {flagged[0].decision.items} responses against {floor} honest ones per "
                           f"variant cannot reach a p-value of {alpha:g}",
                           f"pass more prompts (--n {prompts_needed(alpha)} or more)"))
    elif calibration < need:
        out.append(Blocker("too few", f"the null rests on {calibration} calibration prompts, and a decision at {alpha:g} needs "
                           f"{need}", f"pass --n {prompts_needed(alpha)} or more (half the prompts calibrate)"))
    if heldout_lower is not None and heldout_lower > alpha:
        out.append(Blocker("held-out", f"the honest variants' own held-out prompts were flagged above {alpha:g} (lower bound "
                           f"{heldout_lower:.3f}): the null does not hold its level on these prompts",
                           "add honest variants that serve as the server does, or more prompts"))
    if claim_engine not in null_engines:
        out.append(Blocker("engine", f"the claim names {claim_engine} as the serving engine, and no honest variant runs on it "
                           f"(the null holds {', '.join(sorted(set(null_engines)))})",
                           f"add {claim_engine}'s own variants to --honest"))
    return out


def outcome(tests: Sequence[Test], found: Sequence[Blocker]) -> Outcome:
    """consistent where no statistic exceeds its nulls; flagged where one does, can reach the level, and nothing
    blocks it; else inconclusive. A point mass blocks only its own statistic: another with honest spread may still
    flag."""
    over = [t for t in tests if t.exceeds]
    if not over:
        return "consistent"
    if any(b.kind != "point mass" for b in found):
        return "inconclusive"
    return "flagged" if any(t.flagged for t in over) else "inconclusive"


def share(alpha: float, tests: int) -> float:
    """Each test's level: alpha split evenly (Bonferroni)."""
    return alpha / max(1, tests)


__all__ = [
    "LOGPROB",
    "PRIMARY",
    "Blocker",
    "BlockerKind",
    "Outcome",
    "Test",
    "blockers",
    "judged",
    "min_calibration",
    "outcome",
    "prompts_needed",
    "share",
]
