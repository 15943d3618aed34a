"""The diagnostics block of a record: why the arms of an item diverged (margins, logits, cache differences).

A record's `diagnostics` is top-level in its payload, so the audit's field-by-field comparison re-derives every
number in it: a margin or a cache difference that the model does not reproduce is a mismatch like a token.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from stagereplay.engine.diagnostics import cache_difference, logit_comparison, stack_logits, step_margins
from stagereplay.engine.lm import BoundaryState, Continuation
from stagereplay.report.stats import first_divergence


def pair_key(a: str, b: str) -> str:
    """The name of a compared pair in `diagnostics.pairs` (arm names hold `#`, `@` and `:`, never ` vs `)."""
    return f"{a} vs {b}"


def diagnose(arms: dict[str, tuple[BoundaryState, Continuation]], pairs: Iterable[tuple[str, str]],
             cache_pairs: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
    """Margins of every arm's steps; per pair, the logit comparison, and the cache difference for `cache_pairs`.

    Cache differences are for a retained or incremental cache against a fresh one (not replicas, whose caches
    the fingerprints already compare); the first arm of a pair is the reference of the relative difference.
    """
    import torch

    with torch.inference_mode():
        logits = {name: stack_logits(cont.steps) for name, (_, cont) in arms.items() if cont.steps}
        out: dict[str, Any] = {"margins": {name: step_margins(x) for name, x in logits.items()}, "pairs": {}}
        with_cache = set(cache_pairs)
        for a, b in pairs:
            if a not in logits or b not in logits:
                continue
            (sa, ca), (sb, cb) = arms[a], arms[b]
            entry = logit_comparison(logits[a], logits[b], first_divergence(ca.suffix, cb.suffix))
            entry["cache"] = None
            if (a, b) in with_cache and sa.prefix == sb.prefix:
                entry["cache"] = cache_difference(sa.cache, sb.cache, sa.prompt_len, len(sa.prefix) - 1)
            out["pairs"][pair_key(a, b)] = entry
    return out
