"""Attest's section of results.json: the served run judged against the honest null (`experiments.attest.stats`).

The statistic per token is the reference's margin (max logit minus the served token's) for a greedy claim, and the
Gumbel-max mismatch (1 where vLLM's sampler, replayed with the request's seed, picks another token) for a seeded
sampled claim; beside it, where the server gave a log-probability for every token, the log-prob gap (|the decoder's
log-probability - the reference's|, less `LOGPROB_TOLERANCE`). The null: every honest variant's responses on the
calibration prompts.
The served run: every item's served response. The decision and what can keep it from being made:
`experiments.attest.decision`. The honest false-positive rate is counted by prompt: each variant's response to each
held-out prompt decided alone by the same tests, a prompt's share of its responses flagged, averaged over prompts,
with a Wilson interval whose unit is the prompt (responses to one prompt are not independent trials).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stagereplay.experiments.attest.decision import (
    LOGPROB,
    PRIMARY,
    Outcome,
    Test,
    blockers,
    judged,
    outcome,
    share,
)
from stagereplay.experiments.attest.item import REFERENCE
from stagereplay.experiments.attest.payloads import AttestPayload, AttestSide
from stagereplay.experiments.attest.stats import (
    ALPHA,
    DRAWS,
    Items,
    curve,
    item_interval,
    nearest,
    null_statistics,
    p_floor,
    run_statistic,
    tokens_for_power,
)
from stagereplay.records import arrays
from stagereplay.records.ledger import Record

SERVED = "served"
LOGPROB_TOLERANCE = 1e-2
"""Log-probability differences below this many nats are how a stack computes and reports one, not the model: each
token's gap is |served - reference| less this, at least 0. llama-server's log-probabilities of the claimed f32 toy
differ from llama.cpp's own in process (another kernel combination) by up to a few 1e-3 nats on a few tokens: at a
tolerance of 1e-3 that flagged 4 of 30 honest runs (bench/attest_fpr.py), at 1e-2 none, while a Q4_0 server's gaps
(0.4 nats per token on SmolLM2) stay far above it."""
QUANTILES = 101
"""The null's statistic at the served run's length, kept as this many quantiles (the figure's)."""
POWER = 0.99
"""The power `tokens_for_power` asks for."""
LONGEST = 4096
"""The longest run the power curve looks at (its lengths: powers of two from 8, and the served run's own)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class VariantRow(_Frozen):
    """One scored side over the run's items: the served response, or an honest variant."""

    name: str = Field(description="served, or honest@<variant>")
    items: int = Field(description="items")
    tokens: int = Field(description="tokens over them")
    statistic: float = Field(description="mean score per token")
    interval: tuple[float, float] = Field(description="its 95% interval, resampling items")
    match_rate: float = Field(description="tokens that are the reference's argmax")
    flagged: int | None = Field(None, description="honest: held-out items flagged alone at alpha")
    heldout: int | None = Field(None, description="honest: held-out items decided")


class PowerPoint(_Frozen):
    """Runs of one length made of the served responses, against honest runs of that length."""

    tokens: int = Field(description="run length")
    auc: float = Field(description="P(a served run's statistic > an honest run's), ties counted half")
    power: float = Field(description="served runs flagged at alpha")


class TestRow(_Frozen):
    """One statistic of the served run against its null (`experiments.attest.decision`)."""

    name: str = Field(description="primary (margin or gumbel mismatch) | log-prob gap")
    score: str = Field(description="the per-token score it averages")
    alpha: float = Field(description="its share of the level (Bonferroni over the tests)")
    statistic: float = Field(description="the served run's mean score per token")
    interval: tuple[float, float] = Field(description="its 95% interval, resampling responses")
    threshold: float = Field(description="flagged iff statistic > threshold")
    p_value: float = Field(description="empirical, +1-corrected, against null runs of the same token count")
    flagged: bool = Field(description="exceeds, and every variant's null can reach its level for a run this size")
    point_mass: bool = Field(description="every honest token of the null scored the same: it cannot flag alone")
    null_center: float = Field(description="the median of the nearest variant's honest runs' statistic at the served "
                                           "run's length")
    null_spread: float = Field(description="their standard deviation")
    nearest: str = Field(description="the honest variant whose null the served run sits deepest in (the largest "
                                     "p-value); its null is the one these numbers are against")
    exceeds: bool = Field(description="the statistic lies above every honest variant's threshold")
    distance: float | None = Field(description="(statistic - null_center) / null_spread: how far above honest serving "
                                               "the served run lies, in the nearest null's standard deviations (null: "
                                               "above a point mass)")
    tokens_needed: int | None = Field(description="the fewest leading responses' tokens from which every longer "
                                                  "prefix is flagged (null: not flagged)")


class BlockerRow(_Frozen):
    """Why a flag was not said at the stated level (`experiments.attest.decision.Blocker`)."""

    kind: str = Field(description="point mass | too few | held-out | engine")
    reason: str = Field(description="what the null cannot support")
    fix: str = Field(description="what would make the run conclusive")


class Evidence(_Frozen):
    """One served token among those that weigh most on the primary statistic."""

    item: str = Field(description="the item id")
    position: int = Field(description="the token's index in the response (from 0)")
    served: int = Field(description="the served token ID")
    argmax: int | None = Field(description="the reference's own greedy pick there (null: not recorded)")
    score: float = Field(description="its per-token score (the margin, or the seeded sampler's mismatch)")
    served_logprob: float | None = Field(description="the log-probability the server gave it (null: none given)")
    reference_logprob: float = Field(description="the reference's log-probability of it")


class AttestSummary(_Frozen):
    """Attest's section of results.json at one checkpoint."""

    checkpoint: str = Field(description="the claimed model")
    source: str = Field(description="generated (a simulated server, decoded here) | file (served outputs) | server")
    served: str = Field(description="what served the outputs: the file, the server, or the simulated setting")
    claim: str = Field(description="the claimed sampler: greedy, or seeded sampling at its temperature")
    claim_engine: str = Field(description="the engine the claim says serves the model (hf, llama.cpp, vllm)")
    null_engines: list[str] = Field(description="the engines the honest variants of the null ran on")
    score: str = Field(description="the primary per-token score: margin (greedy) or gumbel mismatch (seeded)")
    reference_precision: str = Field(description="the precision the claimed model's reference ran at")
    alpha: float = Field(description="the false-positive rate the decision is made at")
    outcome: Outcome = Field(description="consistent | flagged (not the claimed model at the stated rate) | "
                                         "inconclusive (a test flagged where the null cannot support the level)")
    flagged: bool = Field(description="outcome is flagged")
    blockers: list[BlockerRow] = Field(description="inconclusive: why no flag is said, and what would decide")
    tests: list[TestRow] = Field(description="each statistic judged, the primary first")
    p_value: float = Field(description="the primary test's p-value")
    statistic: float = Field(description="the served run's mean primary score per token")
    interval: tuple[float, float] = Field(description="its 95% interval, resampling responses")
    threshold: float = Field(description="the primary test's threshold at its share of alpha")
    tokens: int = Field(description="served tokens the decision used")
    items: int = Field(description="served responses")
    tokens_needed: int | None = Field(description="the fewest leading responses' tokens from which every longer "
                                                  "prefix is flagged, by any test (null: not flagged)")
    null_items: int = Field(description="honest responses in the null (calibration prompts, variants pooled)")
    null_tokens: int = Field(description="their tokens")
    calibration: list[str] = Field(description="the item ids whose honest responses make the null")
    nearest: list[tuple[str, float]] = Field(description="honest variants by the distance of their primary statistic "
                                                         "from the served run's, nearest first")
    beyond_honest: bool = Field(description="the served run lies beyond every honest variant, more than 3 null "
                                            "standard deviations above the null's median: no variant is near it")
    difr: dict[str, float] = Field(description="Token-DiFR's compute_metrics_summary of the served tokens")
    honest_fpr: tuple[int, int] = Field(description="honest held-out responses flagged alone, of those decided")
    heldout_prompts: int = Field(description="held-out prompts whose honest responses were decided")
    heldout_rate: float = Field(description="the honest false-positive rate by prompt: the mean over held-out prompts "
                                            "of the fraction of their honest responses flagged")
    heldout_interval: tuple[float, float] = Field(description="its 95% Wilson interval with the prompt as the unit "
                                                              "(n = held-out prompts)")
    heldout_reachable: bool = Field(description="a single honest response can be flagged at all against nulls of "
                                                "this many calibration prompts (`attest_stats.p_floor`); false: the "
                                                "held-out check could not fire, and checked nothing")
    evidence: list[Evidence] = Field(default_factory=list, description="the served tokens that weigh most on the "
                                                                       "primary statistic, largest first")
    logprobs_used: bool = Field(description="the server gave a log-probability for every served token, and the "
                                            "log-prob gap was judged")
    variants: list[VariantRow] = Field(description="the served side and each honest variant, over every item")
    null_quantiles: list[float] = Field(description="the null's statistic at the served run's token count, as "
                                                    f"{QUANTILES} quantiles (the figure)")
    power_by_tokens: list[PowerPoint] = Field(default_factory=list, description=(
        "the served responses resampled whole into runs of each length, against honest runs of that length: how "
        "well a run of that many tokens tells this server from honest serving (the second figure)"))
    prompts_not_reencoded: list[str] | None = Field(None, description=(
        "a file's served prompts whose text the claimed tokenizer encodes to other IDs (item ids): prompts it would "
        "not make, from a server of another tokenizer or built otherwise (null: not a file)"))
    tokens_for_power: int | None = Field(None, description=(
        f"the fewest tokens from which runs like the served one are flagged with {POWER:.0%} power at alpha "
        f"(null: not within {LONGEST})"))


def per_token(side: AttestSide) -> np.ndarray:
    """A side's per-token score (module docstring), float64 [N]."""
    if side.gumbel_match is not None:
        return 1.0 - arrays.decode(side.gumbel_match).astype(np.float64)
    return arrays.decode(side.margin).astype(np.float64)


def _difr(sides: list[AttestSide]) -> dict[str, float]:
    from stagereplay.engine.reference import TokenScores, difr_summary

    scores = [TokenScores(match=arrays.decode(s.match).astype(bool), margin=arrays.decode(s.margin),
                          logit_rank=arrays.decode(s.logit_rank).astype(np.int64), logprob=arrays.decode(s.logprobs),
                          prob=arrays.decode(s.prob),
                          gumbel_match=None if s.gumbel_match is None else arrays.decode(s.gumbel_match).astype(bool),
                          gumbel_margin=None if s.gumbel_margin is None else arrays.decode(s.gumbel_margin),
                          gumbel_rank=None if s.gumbel_match is None else
                          (arrays.decode(s.gumbel_match) == 0).astype(np.float32))
              for s in sides]
    return {k: float(v) for k, v in difr_summary(scores).items()}


def _row(name: str, sides: list[AttestSide]) -> VariantRow:
    items = Items.of([per_token(s) for s in sides])
    matches = np.concatenate([arrays.decode(s.match) for s in sides])
    return VariantRow(name=name, items=len(items), tokens=items.tokens, statistic=run_statistic(items),
                      interval=item_interval(items), match_rate=float(matches.mean()))


def summarize_attest(records: list[Record], stage: Any, checkpoint: str) -> AttestSummary:
    """The section from one stage's records (module docstring)."""
    by_item = {r.item_id: AttestPayload.model_validate(r.payload) for r in records if r.part == REFERENCE}
    decoded = {(r.item_id, r.part): AttestPayload.model_validate(r.payload) for r in records if r.part != REFERENCE}
    roundtrips = [(i, p.prompt_roundtrip) for (i, part), p in decoded.items() if not part and p.prompt_roundtrip
                  is not None]
    ids = list(by_item)
    calibration = [i for i in stage.calibration if i in by_item]
    held = [i for i in ids if i not in set(calibration)]
    sides: dict[str, dict[str, AttestSide]] = {i: {a.name: a for a in by_item[i].arms or []} for i in ids}
    honest = [n for n in (sides[ids[0]] if ids else {}) if n != SERVED]
    part_of = {n: n.removeprefix("honest@") for n in honest}

    def gaps(i: str, name: str) -> np.ndarray | None:
        """|decoder log-probability - reference log-probability| per token of one side (None: no decoder's)."""
        own = decoded.get((i, "" if name == SERVED else part_of[name]))
        if own is None or own.logprobs is None:
            return None
        ref = arrays.decode(sides[i][name].logprobs).astype(np.float64)
        mine = arrays.decode(own.logprobs).astype(np.float64)
        return np.maximum(np.abs(mine - ref) - LOGPROB_TOLERANCE, 0.0) if mine.shape == ref.shape else None

    served = [sides[i][SERVED] for i in ids]
    run = Items.of([per_token(s) for s in served])
    null = Items.of([per_token(sides[i][n]) for i in calibration for n in honest])
    nulls = {n: Items.of([per_token(sides[i][n]) for i in calibration]) for n in honest}
    served_gaps = [gaps(i, SERVED) for i in ids]
    gap_nulls = {n: [gaps(i, n) for i in calibration] for n in honest}
    use_logprobs = bool(ids) and all(g is not None for g in served_gaps) and all(
        g is not None for v in gap_nulls.values() for g in v)
    level = share(stage.alpha, 2 if use_logprobs else 1)
    tests = [judged(PRIMARY, run, nulls, level, seed=0)]
    if use_logprobs:
        tests.append(judged(LOGPROB, Items.of(served_gaps), {n: Items.of(v) for n, v in gap_nulls.items()},  # type: ignore[arg-type]
                            level, seed=0))

    def alone(i: str, n: str, k: int) -> bool:
        """An honest held-out response decided alone, by the same tests against every variant's null."""
        if judged(PRIMARY, Items.of([per_token(sides[i][n])]), nulls, level, seed=k, needed=False).flagged:
            return True
        return use_logprobs and judged(LOGPROB, Items.of([gaps(i, n)]),  # type: ignore[list-item]
                                       {v: Items.of(g) for v, g in gap_nulls.items()},  # type: ignore[arg-type]
                                       level, seed=k, needed=False).flagged

    per_prompt = {i: [alone(i, n, k) for n in honest] for k, i in enumerate(held)}
    fractions = [float(np.mean(f)) for f in per_prompt.values() if f]
    rate = float(np.mean(fractions)) if fractions else 0.0
    lo, hi = fractional_wilson(rate, len(fractions)) if fractions else (0.0, 1.0)
    heldout_reachable = p_floor(len(calibration), 1) <= level
    rows = [_row(SERVED, served)]
    flags = total = 0
    for j, n in enumerate(honest):
        mine = [per_prompt[i][j] for i in held]
        flags, total = flags + sum(mine), total + len(mine)
        rows.append(_row(n, [sides[i][n] for i in ids]).model_copy(update={"flagged": sum(mine), "heldout": len(mine)}))
    claim_engine = getattr(stage, "claim_engine", "hf")
    null_engines = sorted({sides[ids[0]][n].engine for n in honest}) if ids else []
    flagged_tests = [t for t in tests if t.exceeds]
    found = blockers(flagged_tests, len(calibration), stage.alpha, lo if fractions and heldout_reachable else None,
                     claim_engine,
                     null_engines) if flagged_tests else []
    result = outcome(tests, found)
    variants = {n: Items.of([per_token(sides[i][n]) for i in ids]) for n in honest}
    near = nearest(run, variants)
    primary = tests[0]
    beyond = (primary.distance is None or primary.distance > 3) and primary.exceeds and all(run_statistic(v) < primary.decision.statistic for v in variants.values())
    null_stats = null_statistics(null, run.tokens, DRAWS, seed=0)
    c = curve(run, null, power_lengths(run.tokens), level, DRAWS, seed=1)
    needed = [t.decision.tokens_needed for t in tests if t.decision.tokens_needed is not None]
    d = primary.decision
    return AttestSummary(
        checkpoint=checkpoint, source=stage.source, served=stage.served_label(), claim=stage.claim_label(),
        claim_engine=claim_engine, null_engines=null_engines,
        score="gumbel mismatch" if served and served[0].gumbel_match is not None else "margin",
        reference_precision=stage.model.precision, alpha=stage.alpha, outcome=result, flagged=result == "flagged",
        blockers=[BlockerRow(kind=b.kind, reason=b.reason, fix=b.fix) for b in found] if result == "inconclusive"
        else [], tests=[_test_row(t, served) for t in tests], p_value=d.p_value, statistic=d.statistic,
        interval=d.interval, threshold=d.threshold, tokens=d.tokens, items=d.items,
        tokens_needed=min(needed) if needed and result == "flagged" else None, null_items=d.null_items,
        null_tokens=d.null_tokens, calibration=calibration, nearest=[(n, float(x)) for n, x in near],
        beyond_honest=bool(beyond), difr=_difr(served), honest_fpr=(flags, total), heldout_prompts=len(fractions),
        heldout_rate=rate, heldout_interval=(lo, hi), heldout_reachable=heldout_reachable,
        evidence=evidence(ids, served, {i: decoded.get((i, "")) for i in ids}), logprobs_used=use_logprobs,
        variants=rows, null_quantiles=[float(q) for q in np.quantile(null_stats, np.linspace(0, 1, QUANTILES))],
        power_by_tokens=[PowerPoint(tokens=int(t), auc=float(a), power=float(w))
                         for t, a, w in zip(c.tokens, c.auc, c.power, strict=True)],
        tokens_for_power=tokens_for_power(c, POWER),
        prompts_not_reencoded=[i for i, same in roundtrips if not same] if roundtrips else None)


def _test_row(t: Test, served: list[AttestSide]) -> TestRow:
    d = t.decision
    score = ("gumbel mismatch" if served and served[0].gumbel_match is not None else "margin") if t.name == PRIMARY \
        else f"|served - reference log-probability| - {LOGPROB_TOLERANCE:g}"
    return TestRow(name=t.name, score=score, alpha=d.alpha, statistic=d.statistic, interval=d.interval,
                   threshold=d.threshold, p_value=d.p_value, flagged=t.flagged, point_mass=t.point_mass,
                   nearest=t.nearest, exceeds=t.exceeds,
                   null_center=t.center, null_spread=t.spread, distance=t.distance, tokens_needed=d.tokens_needed)


def fractional_wilson(rate: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The 95% Wilson interval of a proportion `rate` estimated from `n` units (the prompts), its count rate * n
    allowed to be fractional (a prompt's share of its honest responses flagged)."""
    center = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


EVIDENCE = 10
"""Served tokens listed as the evidence behind a decision."""


def evidence(ids: list[str], served: list[AttestSide], payloads: dict[str, AttestPayload | None]) -> list[Evidence]:
    """The `EVIDENCE` served tokens with the largest primary score (ties: the earlier first), those scoring 0 left
    out."""
    rows = []
    for i, side in zip(ids, served, strict=True):
        score = per_token(side)
        ref = arrays.decode(side.logprobs)
        top = None if side.argmax is None else arrays.decode(side.argmax)
        own = payloads.get(i)
        mine = None if own is None or own.logprobs is None else arrays.decode(own.logprobs)
        for k in np.flatnonzero(score > 0):
            rows.append(Evidence(item=i, position=int(k), served=int(side.response_ids[k]),
                                 argmax=None if top is None else int(top[k]), score=float(score[k]),
                                 served_logprob=None if mine is None or len(mine) != len(score) else float(mine[k]),
                                 reference_logprob=float(ref[k])))
    return sorted(rows, key=lambda e: -e.score)[:EVIDENCE]


def power_lengths(served: int) -> list[int]:
    """The run lengths the power curve looks at: powers of two from 8 to `LONGEST`, and the served run's own."""
    return sorted({*(2**k for k in range(3, LONGEST.bit_length())), served})


__all__ = ["ALPHA", "AttestSummary", "BlockerRow", "Evidence", "PowerPoint", "TestRow", "VariantRow", "per_token",
           "summarize_attest"]
