"""The diagnostics block of a record (`records.payloads.Diagnostics`): why the arms of an item diverged (margins,
logits, cache differences).

A record's `diagnostics` is top-level in its payload, so the audit's field-by-field comparison re-derives every
number in it: a margin or a cache difference that the model does not reproduce is a mismatch like a token.

No [S, V] tensor is made: margins come from each continuation's per-step record (engine.steps), and the logits
of a pair's first divergent step from the record of the arm that watched the other's suffix, else by replaying
the arm's recorded suffix from its boundary cache (`replay_logits`), which experiments keep for the first arm
of every pair.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from stagereplay.engine.diagnostics import DivergenceLogits, cache_difference, logit_comparison
from stagereplay.engine.lm import BoundaryState, Continuation
from stagereplay.engine.steps import StepRecord, replay_logits
from stagereplay.experiments.core.stats import first_divergence
from stagereplay.records.payloads import Diagnostics, Divergence, DivergenceSide, PairDiagnostics

if TYPE_CHECKING:
    import torch


def pair_key(a: str, b: str) -> str:
    """The name of a compared pair in `diagnostics.pairs` (arm names hold `#`, `@` and `:`, never ` vs `)."""
    return f"{a} vs {b}"


def _logits_at(arm: tuple[BoundaryState, Continuation], step: int) -> torch.Tensor | None:
    """The arm's logits [V] at `step`: kept, or replayed from its boundary cache; None past its last step, or where
    neither can be had (steps reduced by transformers' generate(), whose forwards cannot be replayed: `_from_top`)."""
    state, cont = arm
    assert cont.record is not None
    if step >= cont.record.n or (step not in cont.record.full and cont.record.stepper is None):
        return None
    return replay_logits(cont.record, state.cache, state.prefix, cont.suffix, step)


def _from_top(record: StepRecord, step: int) -> DivergenceSide:
    """One side of a divergence from the step's recorded top-k alone (fp32 logits, ties by id)."""
    ranked = sorted(zip(record.ids[step].tolist(), record.values[step].tolist(), strict=True),
                    key=lambda p: (-p[1], p[0]))
    return DivergenceSide(margin=ranked[0][1] - ranked[1][1] if len(ranked) > 1 else None,
                          top=[(int(t), float(v)) for t, v in ranked])


def diagnose(arms: dict[str, tuple[BoundaryState, Continuation]], pairs: Iterable[tuple[str, str]],
             cache_pairs: Iterable[tuple[str, str]] = ()) -> Diagnostics:
    """Margins of every arm's steps; per pair, the logit comparison, and the cache difference for `cache_pairs`.

    Cache differences are for a retained or incremental cache against a fresh one (not replicas, whose caches
    the fingerprints already compare); the first arm of a pair is the reference of the relative difference.
    An arm whose cache was dropped must have watched the other arm's suffix (`LM.continue_from(watch=...)`).
    """
    import torch

    with torch.inference_mode():
        kept = {name: arm for name, arm in arms.items() if arm[1].record is not None and arm[1].record.n}
        margins: dict[str, list[float | None]] = {name: list(cont.record.margins()) for name, (_, cont) in kept.items()
                                                  if cont.record is not None}
        out: dict[str, PairDiagnostics] = {}
        with_cache = set(cache_pairs)
        for a, b in pairs:
            if a not in kept or b not in kept:
                continue
            (sa, ca), (sb, cb) = kept[a], kept[b]
            assert ca.record is not None and cb.record is not None
            d = first_divergence(ca.suffix, cb.suffix)
            at_a = at_b = None
            if d is not None and d < ca.record.n and d < cb.record.n:
                at_a, at_b = _logits_at(kept[a], d), _logits_at(kept[b], d)
            logits = logit_comparison(ca.record.full.get(0), cb.record.full.get(0), d, at_a, at_b)
            divergence: Divergence | DivergenceLogits | None = logits["divergence"]
            if divergence is None and d is not None and d < ca.record.n and d < cb.record.n:
                # an arm whose logits cannot be had there: each side's recorded top-k, no logit difference
                divergence = Divergence(step=d, logit_maxabs=None, a=_from_top(ca.record, d), b=_from_top(cb.record, d))
            cache = None
            if (a, b) in with_cache and sa.prefix == sb.prefix and sa.cache is not None and sb.cache is not None:
                cache = cache_difference(sa.cache, sb.cache, sa.prompt_len, len(sa.prefix) - 1)
            out[pair_key(a, b)] = PairDiagnostics.model_validate(
                {**logits, "divergence": divergence, "cache": cache})
    return Diagnostics(margins=margins, pairs=out)
