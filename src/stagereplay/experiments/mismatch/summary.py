"""Mismatch's section of results.json (`MismatchSummary`): the attribution of the gap, the metrics of each pair of
sides, the position bands, the transplant's outcomes, and a sample of per-token ratios for the figure.

The attribution's rows, each a pair (a, b) of sides on the same tokens, log_ratio = log pi_b - log pi_a:

    total          rollout vs trainer@<run precision>        what an RL trainer sees
    construction   rollout vs prefill                        decode vs prefill inside the rollout engine
    engine         prefill vs trainer@<run precision>        two implementations' one-shot prefills (ours: the same)
    bridge         rollout vs incremental                    ours: the live loop's operations teacher-forced
    replicas       rollout vs rollout#replica, prefill vs prefill#replica, trainer@<p> vs its replica
    alternatives   trainer@<run precision> vs trainer@<p>    for each other trainer precision ("precision ..."), and
                   rollout vs trainer@<p> ("total @ <p>")     the total had the trainer run at <p>

Construction and engine are the parts of the total: per token their log-ratios add up to its log-ratio, so their kl
(a mean log-ratio) adds up to the total's. A precision row is an alternative to the total, not a part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from stagereplay.experiments.core.stats import wilson_interval
from stagereplay.experiments.mismatch.fields import MismatchMetrics
from stagereplay.experiments.mismatch.payloads import MismatchPayload
from stagereplay.experiments.mismatch.stats import Pair, summarize_pairs
from stagereplay.records import arrays
from stagereplay.records.ledger import Record

FIGURE_POINTS = 4000
"""Per-token ratios results.json keeps for the figure (evenly spaced over the run's tokens)."""
PARTS = ("construction", "engine")
"""The rows whose log-ratios add up, token by token, to the total's."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Intervals(_Frozen):
    """95% percentile bootstrap intervals, each of the statistic printed beside it (10,000 resamples, seed 0)."""

    abs_mean: tuple[float, float] | None = Field(None, description="mean |log-ratio|: a cluster bootstrap of the "
                                                                   "pooled ratio, resampling sequences")
    kl: tuple[float, float] | None = Field(None, description="kl (pooled): a cluster bootstrap over sequences")
    k3_kl: tuple[float, float] | None = Field(None, description="k3_kl (pooled): a cluster bootstrap over sequences")
    log_ppl_abs_diff: tuple[float, float] | None = Field(None, description="log_ppl_abs_diff (a mean over "
                                                                           "sequences): a bootstrap over sequences")


class Band(_Frozen):
    """The gap over the tokens at one band of response positions."""

    band: str = Field(description="the positions, `start-stop` (inclusive; `1024-`: to the end)")
    tokens: int = Field(description="tokens read")
    bitwise_equal: float | None = Field(description="fraction of the same bits")
    abs_mean: float | None = Field(description="mean |log-ratio|")
    abs_max: float | None = Field(description="max |log-ratio|")
    k3_kl: float | None = Field(description="k3, pooled over the band's tokens")
    token_outside_2: float | None = Field(description="fraction of token weights outside [1/2, 2]")


class PairSummary(_Frozen):
    """One row of the attribution: side b against side a on the same tokens."""

    row: str = Field(description="total, construction, engine, bridge, replica: <side>, precision <p> -> <q>, "
                                 "total @ <p>")
    a: str = Field(description="side a (the rollout side of the log-ratio)")
    b: str = Field(description="side b (the trainer side)")
    metrics: MismatchMetrics = Field(description="every metric (docs/reference/mismatch-metrics.md)")
    ci: Intervals = Field(description="intervals of the metrics they name")
    bands: list[Band] = Field(description="the metrics by response position")


class TransplantDirection(_Frozen):
    """The transplant's outcomes in one direction."""

    direction: str = Field(description="`<donor>-><recipient>`")
    n: int = Field(description="items transplanted")
    follows_donor: int = Field(description="continuations whose log-probabilities are the donor's own, bit for bit")
    follows_recipient: int = Field(description="continuations that are the recipient's own")
    neither: int = Field(description="continuations that are neither")
    donor_wilson: tuple[float, float] = Field(description="Wilson 95% interval of follows_donor / n")


class TransplantSummary(_Frozen):
    """The K/V transplant at mid-response."""

    n: int = Field(description="items transplanted")
    directions: list[TransplantDirection] = Field(description="every layer moved, per direction")
    control: list[TransplantDirection] = Field(description="no layer moved, per direction")


class KofN(_Frozen):
    k: int = Field(description="how many")
    n: int = Field(description="of how many")


class FigurePoints(_Frozen):
    """A sample of the total row's per-token log-ratios."""

    position: list[int] = Field(default_factory=list, description="each token's position in its response")
    log_ratio: list[float] = Field(default_factory=list, description="its log-ratio, clamped to [-20, 20]")


class MismatchSummary(_Frozen):
    """Mismatch's section of results.json at one checkpoint."""

    checkpoint: str = Field(description="the model")
    source: str = Field(description="generated (the run's rollouts) | file (a rollout file's)")
    mode: str = Field(description="raw | processed: the distribution every side's log-probabilities are from")
    engine: str = Field(description="the rollout engine: hf (ours), vllm, llama.cpp, http")
    precision: str = Field(description="the run's precision (the rollout's on our engine)")
    precisions: list[str] = Field(description="the trainer's precisions")
    n: int = Field(description="items scored")
    tokens: int = Field(description="response tokens over those items")
    replica_tokens_equal: KofN | None = Field(None, description="generated rollouts whose replica drew the same "
                                                                "tokens")
    pairs: list[PairSummary] = Field(description="the attribution's rows, in the report's order")
    transplant: TransplantSummary | None = Field(None, description="the transplant's outcomes (none: not run)")
    figure: FigurePoints = Field(default_factory=FigurePoints, description="the figure's sample of the total row")

    def row(self, label: str) -> PairSummary | None:
        return next((p for p in self.pairs if p.row == label), None)


def payloads(records: Sequence[Record]) -> list[tuple[Record, MismatchPayload]]:
    """Each scored record with its payload read through its model."""
    return [(r, MismatchPayload.model_validate(r.payload)) for r in records]


def sides(records: Sequence[Record]) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray | None]]]:
    """Per item, per arm name: its log-probabilities and argmaxes, decoded (every part of the item together)."""
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray | None]]] = {}
    for r, p in payloads(records):
        held = out.setdefault(r.item_id, {})
        for arm in p.arms:
            held[arm.name] = (arrays.decode(arm.logprobs), None if arm.argmax is None else arrays.decode(arm.argmax))
    return out


def attribution(run_precision: str, precisions: Sequence[str]) -> list[tuple[str, str, str]]:
    """(row, side a, side b) of the attribution, in the report's order."""
    trainer = f"trainer@{run_precision}" if run_precision in precisions else f"trainer@{precisions[0]}"
    rows = [("total", "rollout", trainer), ("construction", "rollout", "prefill"), ("engine", "prefill", trainer)]
    rows += [(f"precision {trainer.partition('@')[2]} -> {p}", trainer, f"trainer@{p}")
             for p in precisions if f"trainer@{p}" != trainer]
    rows += [("bridge", "rollout", "incremental"), ("replica: rollout", "rollout", "rollout#replica"),
             ("replica: prefill", "prefill", "prefill#replica")]
    rows += [(f"replica: trainer@{p}", f"trainer@{p}", f"trainer@{p}#replica") for p in precisions]
    rows += [(f"batch composition @ {p}", f"trainer@{p}", f"trainer@{p}#batch") for p in precisions]
    rows += [(f"total @ {p}", "rollout", f"trainer@{p}") for p in precisions if f"trainer@{p}" != trainer]
    return rows


def _pairs(held: dict[str, dict[str, tuple[np.ndarray, np.ndarray | None]]], a: str, b: str) -> list[Pair]:
    return [Pair(arms[a][0], arms[b][0], arms[a][1], arms[b][1]) for arms in held.values() if a in arms and b in arms]


def _figure_points(pairs: list[Pair]) -> FigurePoints:
    """Up to FIGURE_POINTS (position in the response, log_ratio) of the total row's kept tokens, evenly spaced."""
    if not pairs:
        return FigurePoints()
    positions = np.concatenate([np.arange(p.a.size)[p.kept()] for p in pairs])
    ratios = np.concatenate([(p.b.astype(np.float64) - p.a.astype(np.float64))[p.kept()] for p in pairs])
    keep = np.unique(np.linspace(0, ratios.size - 1, min(FIGURE_POINTS, ratios.size)).astype(int)) if ratios.size \
        else np.zeros(0, dtype=int)
    return FigurePoints(position=positions[keep].astype(int).tolist(),
                        log_ratio=[float(np.clip(x, -20, 20)) for x in ratios[keep]])


def _transplants(main: Sequence[MismatchPayload]) -> TransplantSummary | None:
    moved = [p.transplant for p in main if p.transplant is not None]
    if not moved:
        return None

    def of(key: str) -> list[TransplantDirection]:
        out = []
        for direction in sorted(getattr(moved[0], key)):
            outcomes = [getattr(m, key)[direction].outcome for m in moved]
            k, n = outcomes.count("donor"), len(outcomes)
            out.append(TransplantDirection(direction=direction, n=n, follows_donor=k,
                                           follows_recipient=outcomes.count("recipient"),
                                           neither=outcomes.count("neither"), donor_wilson=wilson_interval(k, n)))
        return out

    return TransplantSummary(n=len(moved), directions=of("directions"), control=of("control"))


def summarize_mismatch(records: Sequence[Record], stage: Any, checkpoint: str, seed: int = 0,
                       n_resamples: int = 10_000) -> MismatchSummary:
    """The section (module docstring)."""
    main = [p for r, p in payloads(records) if not r.part]
    held = sides(records)
    rows = []
    total: list[Pair] = []
    for label, a, b in attribution(stage.model.precision, stage.precisions):
        pairs = _pairs(held, a, b)
        if not pairs:
            continue
        if label == "total":
            total = pairs
        s = summarize_pairs(pairs, seed, n_resamples)
        rows.append(PairSummary(row=label, a=a, b=b, metrics=MismatchMetrics.of(s.metrics),
                                ci=Intervals.model_validate(s.ci), bands=[Band.model_validate(x) for x in s.bands]))
    replicas = [p.replica_tokens_equal for p in main if p.replica_tokens_equal is not None]
    return MismatchSummary(
        checkpoint=checkpoint, source=stage.source, mode=stage.mode,
        engine=stage.engine.name if stage.engine is not None else "hf", precision=stage.model.precision,
        precisions=list(stage.precisions), n=len(main), tokens=sum(len(p.response_ids or []) for p in main),
        replica_tokens_equal=KofN(k=sum(replicas), n=len(replicas)) if replicas else None, pairs=rows,
        transplant=_transplants(main), figure=_figure_points(total))
