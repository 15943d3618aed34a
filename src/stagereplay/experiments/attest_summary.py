"""Attest's section of results.json: the served run tested against the honest null (`experiments.attest_stats`).

The statistic per token is the reference's margin (max logit minus the served token's) for a greedy claim, and the
Gumbel-max mismatch (1 where vLLM's sampler, replayed with the request's seed, picks another token) for a seeded
sampled claim. The null: every honest variant's responses on the calibration prompts, pooled. The served run: every
item's served response. The honest variants' own false-positive rate: each variant's response to each held-out
prompt decided alone against the same null.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stagereplay.experiments.attest_item import REFERENCE
from stagereplay.experiments.attest_stats import (
    ALPHA,
    DRAWS,
    Items,
    curve,
    decide,
    item_interval,
    nearest,
    pooled_statistics,
    run_statistic,
    tokens_for_power,
)
from stagereplay.experiments.stats import wilson_interval
from stagereplay.records import arrays
from stagereplay.records.attested import AttestPayload, AttestSide
from stagereplay.records.ledger import Record

SERVED = "served"
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


class AttestSummary(_Frozen):
    """Attest's section of results.json at one checkpoint."""

    checkpoint: str = Field(description="the claimed model")
    source: str = Field(description="generated (a simulated server, decoded here) | file (served outputs)")
    served: str = Field(description="what served the outputs: the file, or the simulated setting")
    claim: str = Field(description="the claimed sampler: greedy, or seeded sampling at its temperature")
    score: str = Field(description="the per-token score: margin (greedy) or gumbel mismatch (seeded)")
    reference_precision: str = Field(description="the precision the claimed model's reference ran at")
    alpha: float = Field(description="the false-positive rate the decision is made at")
    flagged: bool = Field(description="whether the served run is flagged as not the claimed model")
    p_value: float = Field(description="empirical, +1-corrected, against null runs of the same token count")
    statistic: float = Field(description="the served run's mean score per token")
    interval: tuple[float, float] = Field(description="its 95% interval, resampling items")
    threshold: float = Field(description="flagged iff statistic > threshold")
    tokens: int = Field(description="served tokens the decision used")
    items: int = Field(description="served responses")
    tokens_needed: int | None = Field(description="the fewest leading responses' tokens from which every longer "
                                                  "prefix is flagged (null: not flagged)")
    null_items: int = Field(description="honest responses in the null (calibration prompts, variants pooled)")
    null_tokens: int = Field(description="their tokens")
    calibration: list[str] = Field(description="the item ids whose honest responses make the null")
    nearest: list[tuple[str, float]] = Field(description="honest variants by |statistic - served's|, nearest first")
    difr: dict[str, float] = Field(description="Token-DiFR's compute_metrics_summary of the served tokens")
    honest_fpr: tuple[int, int] = Field(description="honest held-out responses flagged alone, of those decided")
    honest_fpr_interval: tuple[float, float] = Field(description="its 95% Wilson interval")
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
    """The section from the reference records of one stage (module docstring)."""
    by_item = {r.item_id: AttestPayload.model_validate(r.payload) for r in records if r.part == REFERENCE}
    served_parts = [(r.item_id, AttestPayload.model_validate(r.payload)) for r in records if r.part == ""]
    roundtrips = [(i, p.prompt_roundtrip) for i, p in served_parts if p.prompt_roundtrip is not None]
    ids = list(by_item)
    calibration = [i for i in stage.calibration if i in by_item]
    held = [i for i in ids if i not in set(calibration)]
    sides: dict[str, dict[str, AttestSide]] = {i: {a.name: a for a in by_item[i].arms or []} for i in ids}
    honest = [n for n in (sides[ids[0]] if ids else {}) if n != SERVED]
    null = Items.of([per_token(sides[i][n]) for i in calibration for n in honest])
    served = [sides[i][SERVED] for i in ids]
    run = Items.of([per_token(s) for s in served])
    d = decide(run, null, stage.alpha, DRAWS, seed=0)
    rows = [_row(SERVED, served)]
    flags = total = 0
    for n in honest:
        alone = [decide(Items.of([per_token(sides[i][n])]), null, stage.alpha, DRAWS, seed=k, needed=False).flagged
                 for k, i in enumerate(held)]
        flags, total = flags + sum(alone), total + len(alone)
        rows.append(_row(n, [sides[i][n] for i in ids]).model_copy(update={"flagged": sum(alone),
                                                                            "heldout": len(alone)}))
    variants = {n: Items.of([per_token(sides[i][n]) for i in ids]) for n in honest}
    null_stats = pooled_statistics(null, run.tokens, DRAWS, seed=0)
    c = curve(run, null, power_lengths(run.tokens), stage.alpha, DRAWS, seed=1)
    return AttestSummary(
        checkpoint=checkpoint, source=stage.source, served=stage.served_label(), claim=stage.claim_label(),
        score="gumbel mismatch" if served and served[0].gumbel_match is not None else "margin",
        reference_precision=stage.model.precision, alpha=stage.alpha, flagged=d.flagged, p_value=d.p_value,
        statistic=d.statistic, interval=d.interval, threshold=d.threshold, tokens=d.tokens, items=d.items,
        tokens_needed=d.tokens_needed, null_items=d.null_items, null_tokens=d.null_tokens, calibration=calibration,
        nearest=[(n, float(x)) for n, x in nearest(run, variants)], difr=_difr(served), honest_fpr=(flags, total),
        honest_fpr_interval=wilson_interval(flags, total) if total else (0.0, 1.0), variants=rows,
        null_quantiles=[float(q) for q in np.quantile(null_stats, np.linspace(0, 1, QUANTILES))],
        power_by_tokens=[PowerPoint(tokens=int(t), auc=float(a), power=float(w))
                         for t, a, w in zip(c.tokens, c.auc, c.power, strict=True)],
        tokens_for_power=tokens_for_power(c, POWER),
        prompts_not_reencoded=[i for i, same in roundtrips if not same] if roundtrips else None)


def power_lengths(served: int) -> list[int]:
    """The run lengths the power curve looks at: powers of two from 8 to `LONGEST`, and the served run's own."""
    return sorted({*(2**k for k in range(3, LONGEST.bit_length())), served})


__all__ = ["ALPHA", "AttestSummary", "PowerPoint", "VariantRow", "per_token", "summarize_attest"]
