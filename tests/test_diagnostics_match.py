"""The diagnostics made from per-step reductions equal, bit for bit, those the full [S, V] logits gave.

Until ledger schema 2's diagnostics were computed from every step's logits kept in full: stacked to fp32 [S, V],
margins from a top-2, the first divergent step read off the stack. `REFERENCE_*` below is that code, verbatim.
Here every continuation keeps its full logits as well (a `StepRecord` subclass, patched in), and each call of
`diagnose` in matched, the 2x2 and the bridge is checked against the reference on the same arms: the records
must be equal as JSON (floats compared exactly). Same machine, same process: no stored bf16 number is involved.
A forced divergence (sampled arms with different seeds, fp32) covers both ways of getting a divergent step's
logits, watched and replayed; the negative control replays the wrong step and must be caught.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import torch

from stagereplay.engine.steps import StepRecord
from stagereplay.experiments.core.stats import first_divergence

# --- the reference: the code that kept every step's logits (verbatim but for names) ----------------------


def reference_stack_logits(steps: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(steps)).float()


def reference_step_margins(logits: torch.Tensor) -> list[float]:
    if logits.shape[0] == 0 or logits.shape[1] < 2:
        return []
    top2 = torch.topk(logits, 2, dim=-1).values  # [S, 2]
    return [float(x) for x in (top2[:, 0] - top2[:, 1]).tolist()]


def _finite(x: float) -> float | None:
    import math

    return x if math.isfinite(x) else None


def reference_logit_comparison(a: torch.Tensor, b: torch.Tensor, divergence: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"first_step_logit_maxabs": None, "divergence": None}
    if a.shape[0] and b.shape[0] and a.shape[1] == b.shape[1]:
        out["first_step_logit_maxabs"] = _finite(float((a[0] - b[0]).abs().max()))
    d = divergence
    if d is None or d >= a.shape[0] or d >= b.shape[0] or a.shape[1] != b.shape[1]:
        return out
    pair = torch.stack([a[d], b[d]])  # [2, V]
    k = min(5, pair.shape[1])
    top = torch.sort(pair, dim=-1, descending=True, stable=True)
    maxabs = (pair[0] - pair[1]).abs().max()
    values, ids, gap = top.values[:, :k].tolist(), top.indices[:, :k].tolist(), float(maxabs)
    arms = []
    for v, i in zip(values, ids, strict=True):
        arms.append({"margin": _finite(v[0] - v[1]) if k > 1 else None,
                     "top": [[int(t), _finite(float(x))] for t, x in zip(i, v, strict=True)]})
    out["divergence"] = {"step": d, "logit_maxabs": _finite(gap), "a": arms[0], "b": arms[1]}
    return out


def reference_diagnose(arms: dict[str, Any], pairs: Iterable[tuple[str, str]],
                       cache_pairs: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
    from stagereplay.engine.diagnostics import cache_difference
    from stagereplay.experiments.protocol.diagnose import pair_key

    with torch.inference_mode():
        logits = {name: reference_stack_logits(cont.record.all) for name, (_, cont) in arms.items()
                  if cont.record is not None and cont.record.all}
        out: dict[str, Any] = {"margins": {name: reference_step_margins(x) for name, x in logits.items()},
                               "pairs": {}}
        with_cache = set(cache_pairs)
        for a, b in pairs:
            if a not in logits or b not in logits:
                continue
            (sa, ca), (sb, cb) = arms[a], arms[b]
            entry = reference_logit_comparison(logits[a], logits[b], first_divergence(ca.suffix, cb.suffix))
            entry["cache"] = None
            if (a, b) in with_cache and sa.prefix == sb.prefix:
                entry["cache"] = cache_difference(sa.cache, sb.cache, sa.prompt_len, len(sa.prefix) - 1)
            out["pairs"][pair_key(a, b)] = entry
    return out


class KeepAll(StepRecord):
    """A step record that also keeps every step's logits, for the reference."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.all: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, token: int) -> None:
        self.all.append(logits)
        super().add(logits, token)


def _json(x: Any) -> str:
    """A diagnostics block (`diagnose`'s model, or the reference's dict) as sorted JSON."""
    return json.dumps(x.as_payload() if hasattr(x, "as_payload") else x, sort_keys=True)


@pytest.fixture(scope="module")
def toy():
    from stagereplay.engine.lm import load
    from stagereplay.tasks import DataConfig, load_items
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), "bf16")
    items, _ = load_items(DataConfig(n=4), lm.tokenizer)  # items 2 and 3 diverge in bf16 on the CPUs seen so far
    return lm, items


def _checked(monkeypatch: pytest.MonkeyPatch, module: Any, seen: list[tuple[str, str]]) -> None:
    """Patch `module.diagnose` to run the reference on the same arms and keep both results."""
    new = module.diagnose

    def both(arms: dict[str, Any], pairs: Any, cache_pairs: Any = ()) -> dict[str, Any]:
        pairs, cache_pairs = list(pairs), list(cache_pairs)
        old = reference_diagnose(arms, pairs, cache_pairs)  # before: the replay may add to a record's `full`
        out = new(arms, pairs, cache_pairs)
        seen.append((_json(old), _json(out)))
        return out

    monkeypatch.setattr(module, "diagnose", both)


@pytest.mark.slow  # every stage of four toy items in bf16: the slow tier (CI runs it)
def test_matched_2x2_and_bridge_diagnostics_equal_the_full_logits_ones(toy, monkeypatch):
    from stagereplay.engine import lm as lm_module
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.experiments.core.jobs import Job, ReplaySettings
    from stagereplay.experiments.protocol import bridge, matched, precision_2x2

    lm, items = toy
    monkeypatch.setattr(lm_module, "StepRecord", KeepAll)
    seen: list[tuple[str, str]] = []
    for module in (matched, precision_2x2, bridge):
        _checked(monkeypatch, module, seen)
    settings = ReplaySettings(boundary="marker:</think>", decode=DecodeConfig(max_new_tokens=80))
    divergent = 0
    for item in items:
        out = matched.matched_item(lm, Job(item, settings, matched.MatchedParams("oneshot"))).as_payload()
        prefix = tuple(out["prefix_ids"])
        divergent += sum(e["divergence"] is not None for e in out["diagnostics"]["pairs"].values())
        precision_2x2.grid_item(lm, Job(item, settings, precision_2x2.GridParams(
            prefix, ("incremental", "oneshot"), lm.config.precision)))
        bridge.bridge_item(lm, Job(item, settings, bridge.BridgeParams(prefix)))
    assert len(seen) == 3 * len(items)
    for old, new in seen:
        assert new == old
    print(f"{len(seen)} diagnostics blocks equal, {divergent} divergent matched pairs")


def _forced(lm: Any, item: Any) -> dict[str, Any]:
    """Three sampled arms from one boundary state, seeds 1, 2, 3 (fp32, temperature 3: they diverge early):
    b watches a's suffix; c watches nothing, so every divergent step of c's pairs is replayed."""
    from stagereplay.engine.boundary import Marker
    from stagereplay.engine.decode import DecodeConfig

    state = lm.live(item, Marker("</think>"), keep_going=False)
    dc = DecodeConfig(max_new_tokens=40, sample=True, temperature=3.0)
    a = lm.continue_from(state, dc, seed=1)
    b = lm.continue_from(state, dc, seed=2, watch=[a.suffix])
    c = lm.continue_from(state, dc, seed=3)
    return {"a": (state, a), "b": (state, b), "c": (state, c)}


PAIRS = [("a", "b"), ("a", "c"), ("b", "c")]


def test_a_forced_divergence_watched_and_replayed_equals_the_full_logits_one(monkeypatch):
    from stagereplay.engine import lm as lm_module
    from stagereplay.engine.lm import load
    from stagereplay.experiments.protocol.diagnose import diagnose
    from stagereplay.tasks import DataConfig, load_items
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), "fp32")
    item = load_items(DataConfig(n=1), lm.tokenizer)[0][0]
    monkeypatch.setattr(lm_module, "StepRecord", KeepAll)
    arms = _forced(lm, item)
    old = reference_diagnose(arms, PAIRS)
    new = diagnose(arms, PAIRS)
    assert all(old["pairs"][f"{x} vs {y}"]["divergence"] is not None for x, y in PAIRS)  # the path is exercised
    assert _json(new) == _json(old)
    assert sorted(arms["b"][1].record.full) == [0, first_divergence(arms["a"][1].suffix, arms["b"][1].suffix)]

    # Negative control: a replay that reads the step before the divergent one is caught.
    from stagereplay.experiments.protocol import diagnose as diagnose_module

    real = diagnose_module.replay_logits
    def wrong(record: StepRecord, cache: Any, prefix: Any, suffix: Any, step: int) -> torch.Tensor:
        return real(record, cache, prefix, suffix, step if step in record.full else step - 1)

    monkeypatch.setattr(diagnose_module, "replay_logits", wrong)
    arms = _forced(lm, item)
    assert _json(diagnose(arms, PAIRS)) != _json(reference_diagnose(arms, PAIRS))
