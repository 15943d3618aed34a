"""What one item's record is made of: its arms (suffix, fingerprints, label), the comparisons between them, the
arms another stage may carry over, the token texts the report shows; an item that never reached its boundary.
Built from the engine's results as the models of `records.payloads`, below the experiments that walk an item.

Ours and a serving engine's arms are built here alike: `arm_record` from our engine's boundary state and
continuation, `engine_arm` from the token IDs and top-k log-probabilities an engine returns (a serving run's arms,
its `--cross` arms included), and `top_k_diagnostics` the diagnostics block those give (no logits, no cache)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from stagereplay.engine.lm import LM, BoundaryState, Continuation, ids_fingerprint
from stagereplay.experiments.core.stats import first_divergence
from stagereplay.experiments.protocol.payloads import GridPayload, MatchedPayload, NoBoundaryPayload
from stagereplay.records.ledger import sha256_json
from stagereplay.records.manifest import StageSection
from stagereplay.records.payloads import (
    Arm,
    Comparison,
    Diagnostics,
    Divergence,
    DivergenceSide,
    Draw,
    GeneratedBy,
    PairDiagnostics,
)
from stagereplay.tasks.base import Item
from stagereplay.tasks.scoring import scorer_by_name


def arm_record(lm: LM, name: str, state: BoundaryState, cont: Continuation, stage1: Sequence[int], item: Item,
               scorer: str, cache_fp: str | None = None) -> Arm:
    """One arm: its suffix, fingerprints and correctness label. Text is scored as stage 1 + suffix.
    `cache_fp`: the state's cache fingerprint when the caller has already hashed that cache."""
    text = lm.text([*stage1, *cont.suffix])
    if cache_fp is None and state.cache is not None:
        cache_fp = state.fingerprint()
    arm = Arm(name=name, construction=state.construction, precision=lm.config.precision,
              suffix_ids=list(cont.suffix), suffix_fp=cont.fingerprint, cache_fp=cache_fp, stop=cont.stop, text=text,
              correct=bool(scorer_by_name(scorer)(text, item.answer)))
    if state.generated is not None:  # live built by transformers' generate(): how, and what each step added
        arm = arm.model_copy(update={"generated": GeneratedBy.model_validate(state.generated)})
    # A field left unset is absent from the record: only a retokenized state has a round trip to report.
    return arm if state.roundtrip is None else arm.model_copy(update={"roundtrip": state.roundtrip})


TopK = Sequence[Sequence[tuple[int, float]]]
"""Per step, the engine's top-k candidates as (token id, log-probability), best first."""


def engine_arm(lm: LM, name: str, construction: str, engine: str, suffix: Sequence[int], top: TopK,
               stage1: Sequence[int], item: Item, scorer: str, cache_fp: str | None = None, **served: Any) -> Arm:
    """An arm as a serving run records it, of either engine: its suffix, fingerprints, label (of stage 1 + suffix),
    the engine that built it and each step's top-k log-probabilities. `cache_fp` None: the engine exposes no cache.
    `served`: the fields only a serving engine's arms have (`num_cached_tokens`, `request`, `load`, ...)."""
    text = lm.text([*stage1, *suffix])
    return Arm(name=name, construction=construction, engine=engine, precision=lm.config.precision,
               suffix_ids=list(suffix), suffix_fp=ids_fingerprint(suffix), cache_fp=cache_fp,
               stop="eos" if suffix and suffix[-1] in lm.eos else "length", text=text,
               correct=bool(scorer_by_name(scorer)(text, item.answer)),
               top_logprobs=[[(int(t), float(v)) for t, v in step] for step in top], **served)


def _margin(step: Sequence[tuple[int, float | None]]) -> float | None:
    """Top-1 minus top-2 log-probability of one step: its logit margin (a softmax shifts a step's logits alike)."""
    first, second = (step[0][1], step[1][1]) if len(step) > 1 else (None, None)
    return None if first is None or second is None else float(first - second)


def _top_k_divergence(a: Arm, b: Arm, step: int | None) -> Divergence | None:
    top_a, top_b = a.top_logprobs or [], b.top_logprobs or []
    if step is None or step >= len(top_a) or step >= len(top_b):
        return None
    return Divergence(step=step, logit_maxabs=None,
                      a=DivergenceSide(margin=_margin(top_a[step]), top=list(top_a[step])),
                      b=DivergenceSide(margin=_margin(top_b[step]), top=list(top_b[step])))


def top_k_diagnostics(arms: Mapping[str, Arm], pairs: Sequence[tuple[str, str]],
                      comparisons: Mapping[tuple[str, str], Comparison]) -> Diagnostics:
    """`experiments.protocol.diagnose`'s block from top-k log-probabilities (a serving run's arms): every arm's margin at
    each step and, per pair, both arms' margin and top-k at the first divergent step. A serving engine gives no
    full logits and no cache, so the first-step logit difference and the cache difference are null."""
    return Diagnostics(
        margins={name: [_margin(step) for step in arm.top_logprobs or []] for name, arm in arms.items()},
        pairs={f"{a} vs {b}": PairDiagnostics(
            first_step_logit_maxabs=None, cache=None,
            divergence=_top_k_divergence(arms[a], arms[b], comparisons[(a, b)].first_divergence))
            for a, b in pairs})


def matched_arms(stage: StageSection, matched_stage: StageSection | None, matched: MatchedPayload | None,
                 precision: str | None = None) -> dict[str, Arm]:
    """By name, the arms of an item's matched record that `stage` may carry over instead of decoding them again:
    those of a record that reached its boundary, when `stage` runs the matched stage's model (at `precision`, by
    default the stage's own) with its settings. Empty otherwise. Which arms repeat which is the stage's to say;
    that the cache an arm continues from is the recorded one, its item function checks (`cache_fp`)."""
    if matched_stage is None or matched is None:
        return {}
    model = {**stage.model.as_json(), **({"precision": precision} if precision else {})}
    if matched_stage.model.as_json() != model or matched_stage.settings.as_json() != stage.settings.as_json():
        return {}
    return {a.name: a for a in matched.arms}


def carried_arm(recorded: Arm, name: str, construction: str, source: str) -> Arm:
    """Another stage's `recorded` arm as this stage's arm `name`, not decoded again: every field but its name and
    construction is the recorded arm's, and `same_as` names it (`verify._same_as_claims` checks both)."""
    return recorded.model_copy(update={"name": name, "construction": construction, "same_as": source})


Shown = TypeVar("Shown", MatchedPayload, GridPayload)


def with_token_texts(lm: LM, payload: Shown) -> Shown:
    """`payload` with `token_texts`: each token the record shows, decoded alone (special tokens kept), keyed by its
    id as text: the prompt, stage 1, every arm's suffix and the top-5 candidates at each first divergence. The
    report's explorer and `stagereplay show` render tokens from these, so they read the ledger, never the model's
    tokenizer."""
    ids = {*payload.prefix_ids, *payload.prompt_ids}
    for arm in payload.arms:
        ids.update(arm.suffix_ids)
    for pair in (payload.diagnostics.pairs if payload.diagnostics is not None else {}).values():
        if pair.divergence is not None:
            ids.update(t for side in (pair.divergence.a, pair.divergence.b) for t, _ in side.top)
    texts = {str(t): str(lm.tokenizer.decode([t], skip_special_tokens=False)) for t in sorted(ids)}
    return payload.model_copy(update={"token_texts": texts})


ARM_CLAIMS = ("name", "suffix_fp", "cache_fp", "correct")
"""The arm fields a comparison's fingerprint covers."""


def _fields(arm: Arm | Mapping[str, Any]) -> Mapping[str, Any]:
    return arm.as_payload() if isinstance(arm, Arm) else arm


def compare(item_id: str, arm_a: Arm | Mapping[str, Any], arm_b: Arm | Mapping[str, Any]) -> Comparison:
    """Two arms side by side. Its fingerprint covers every field a result depends on: the item, both arms'
    names, suffix and cache fingerprints and labels, and the comparison's own fields (so an audit that
    reproduces the fingerprint has reproduced them all)."""
    a, b = _fields(arm_a), _fields(arm_b)
    fields = {
        "a": a["name"],
        "b": b["name"],
        "suffix_equal": a["suffix_fp"] == b["suffix_fp"],
        # An engine that does not expose its cache records no fingerprint: equality is then unknown, not true; so
        # is it between two engines' fingerprints (llama.cpp's and ours hash different layouts).
        "cache_equal": None if a["cache_fp"] is None or b["cache_fp"] is None or a.get("engine") != b.get("engine")
        else a["cache_fp"] == b["cache_fp"],
        "label_equal": a["correct"] == b["correct"],
        "first_divergence": first_divergence(a["suffix_ids"], b["suffix_ids"]),
    }
    covered = [item_id, [a[k] for k in ARM_CLAIMS], [b[k] for k in ARM_CLAIMS], fields]
    return Comparison(**fields, fp=sha256_json(covered))


def comparison(item_id: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """`compare` of two arms held as dicts (a serving engine's item, the audit), as the record holds it."""
    return compare(item_id, a, b).as_payload()


def comparison_fp_schema_1(item_id: str, a: Arm | Draw, b: Arm | Draw) -> str:
    """The comparison fingerprint as ledger schema 1 wrote it (item, names, suffix fingerprints, labels only)."""
    return sha256_json([item_id, a.name, b.name, a.suffix_fp, b.suffix_fp, a.correct, b.correct])


def no_boundary(item: Item, generated: Sequence[int], nulls: bool = True) -> NoBoundaryPayload:
    """The record of an item whose output never reached its boundary: what it generated instead. `nulls`: with
    `prefix_ids` and `boundary` null (matched's record; the bridge's has neither field)."""
    return NoBoundaryPayload(status="no_boundary", prompt_ids=list(item.prompt_ids), generated_ids=list(generated),
                             answer=item.answer, arms=[], comparisons=[],
                             **({"prefix_ids": None, "boundary": None} if nulls else {}))
