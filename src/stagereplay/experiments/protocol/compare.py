"""`compare`: two runs of the same items under two settings, item by item, from their matched records at one
checkpoint (the model, the tokenizer and the items must be the runs' own and equal: `compare_manifests`).

Per item, the live trajectory (stage 1 = `prefix_ids[len(prompt_ids):]`, then the live arm's suffix) of run A
against run B: equal or not; the first position where they differ, in stage 1 or in the suffix (or where the two
runs' boundaries differ); each side's token there, its margin (top-1 minus top-2: a logit or a logprob, the same
difference) and its top candidates, as far as the records reach. Where they come from:

    stage 1            the record's `stage1_top` (per stage-1 step, the top-2), on the payload or the live arm
    suffix, a server   the live arm's `top_logprobs` (per step, the top-5)
    suffix, our engine `diagnostics.margins["live"]` (per step); the top-5 only at a step where live diverged
                       from an arm of its own record (`diagnostics.pairs`)

Elsewhere (an older record) the margin is not recorded, and says so (null). When stage 1 differs, the two runs'
suffixes continue different prefixes: they are compared all the same, and counted apart.

Then per arm the two runs share by name (live, the fresh construction, a server's prefix-cache ...): suffix and
correctness-label disagreements, each side's accuracy, the paired 95% CI of the accuracy difference (A - B) and
McNemar's exact p, as the matched table computes them (`experiments.protocol.matched_summary.summarize_matched`). A difference
between the runs means something only where each run is self-consistent, so each run's replicas are counted too
(an arm and its `#replica` equal in tokens and cache, live's replica reaching live's stage 1).

`build_comparison` returns compare.json as its model (`experiments.protocol.compare_document.CompareDocument`), reading each
record through its payload model (`experiments.protocol.matched.PAYLOAD`); `report.compare_render` draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pydantic import ValidationError

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.compare_manifests import RunSide, check_comparable, manifest_differences
from stagereplay.experiments.core.difference import PairedDifference
from stagereplay.experiments.core.stats import first_divergence, mcnemar_exact
from stagereplay.experiments.protocol.compare_document import (
    BOUNDARY,
    COMPARE_VERSION,
    STAGE1,
    SUFFIX,
    ArmPair,
    ArmSummary,
    ComparedItem,
    CompareDocument,
    Count,
    Discordant,
    DivergenceAt,
    ItemComparison,
    NotCompared,
    ReplicaCounts,
    RunInfo,
    Side,
    SideAt,
    Sides,
    Trajectories,
    Uncompared,
    WhereCounts,
)
from stagereplay.experiments.protocol.matched_stage import EXPERIMENT as MATCHED
from stagereplay.experiments.protocol.matched_summary import PAYLOAD
from stagereplay.experiments.protocol.payloads import MatchedPayload, NoBoundaryPayload
from stagereplay.records.ledger import Record
from stagereplay.records.payloads import Arm, TopEntry, first_error

N_RESAMPLES, SEED = 10_000, 0
"""The paired bootstrap's resamples and seed: the matched table's (`experiments.protocol.matched.MatchedConfig`)."""
REPLICA = "#replica"
T = TypeVar("T")
Matched = MatchedPayload | NoBoundaryPayload
"""A matched record's payload (`experiments.protocol.matched.PAYLOAD`)."""


def build_comparison(a: RunSide, b: RunSide, checkpoint: str = "primary") -> CompareDocument:
    """compare.json: the two runs, what differs between their manifests, each item, and the aggregates. Refuses
    (`StageReplayError`) runs of different models, tokenizers or items."""
    check_comparable(a, b, checkpoint, MATCHED, also="paper")
    ra = {r.item_id: _read(a, r) for r in a.matched(checkpoint, MATCHED)}
    rb = {r.item_id: _read(b, r) for r in b.matched(checkpoint, MATCHED)}
    ids = [i for i in a.manifest.config.item_ids if i in ra and i in rb]
    items = [compare_item(i, ra[i], rb[i]) for i in ids]
    names_a = list(dict.fromkeys(n for p in ra.values() for n in _arm_names(p)))
    names_b = list(dict.fromkeys(n for p in rb.values() for n in _arm_names(p)))
    shared = [n for n in names_a if n in names_b]
    return CompareDocument(
        schema_version=COMPARE_VERSION,
        checkpoint=checkpoint,
        runs=Sides(a=_run(a, checkpoint), b=_run(b, checkpoint)),
        differences=manifest_differences(a, b, checkpoint, MATCHED),
        trajectories=trajectory_summary(items),
        replicas=Sides(a=replica_counts(items, "a"), b=replica_counts(items, "b")),
        arms=[arm_summary(name, items) for name in shared],
        arms_only_in=Sides(a=[n for n in names_a if n not in names_b], b=[n for n in names_b if n not in names_a]),
        items=items,
    )


def _read(side: RunSide, record: Record) -> Matched:
    """A matched record's payload as its model; one that is not, refused in one line."""
    try:
        return PAYLOAD.validate_python(record.payload)
    except ValidationError as exc:
        raise StageReplayError(f"{side.path}'s matched record of {record.item_id} is not one ({first_error(exc)})",
                               f"`stagereplay audit {side.path} --verify-only` names what is wrong with it") from None


def _run(side: RunSide, checkpoint: str) -> RunInfo:
    """What names a run in the report: its folder, the command and when, and the matched stage's model settings."""
    m = side.manifest
    stage = m.stage(f"{MATCHED}/{checkpoint}")
    model = stage.model if stage is not None else m.config.model
    return RunInfo(path=str(side.path), command=m.command, created=m.created, tool_version=m.tool_version,
                   precision=model.precision,
                   engine=stage.engine.name if stage is not None and stage.engine is not None else "ours",
                   construction=stage.extras().get("construction") if stage is not None else None)


def _arm(payload: MatchedPayload, name: str) -> Arm | None:
    return next((x for x in payload.arms if x.name == name), None)


def _arm_names(payload: Matched) -> list[str]:
    """The arms compared across runs: every arm but the replicas (which say whether a run is self-consistent)."""
    return [x.name for x in payload.arms if REPLICA not in x.name]


# -- one item ------------------------------------------------------------------------------------------------------


def compare_item(item_id: str, pa: Matched, pb: Matched) -> ItemComparison:
    """One item of both runs: its live trajectories, their first divergence, the replicas, each shared arm."""
    if not isinstance(pa, MatchedPayload) or not isinstance(pb, MatchedPayload):  # no boundary: nothing to compare
        return NotCompared(item_id=item_id, compared=False, status=Sides(a=pa.status, b=pb.status))
    s1a, s1b = _stage1(pa), _stage1(pb)
    la, lb = _arm(pa, "live"), _arm(pb, "live")
    assert la is not None and lb is not None  # every matched record that reached its boundary has live
    ta, tb = [*s1a, *la.suffix_ids], [*s1b, *lb.suffix_ids]
    pos = first_divergence(ta, tb)
    divergence = None
    if pos is not None:
        sa, sb = _side(pa, ta, len(s1a), pos), _side(pb, tb, len(s1b), pos)
        divergence = DivergenceAt(position=pos, in_=sa.stage if sa.stage == sb.stage else BOUNDARY, a=sa, b=sb)
    names = [n for n in _arm_names(pa) if n in _arm_names(pb)]
    return ComparedItem(
        item_id=item_id,
        compared=True,
        trajectory_equal=pos is None,
        stage1_equal=s1a == s1b,
        stage1_len=Sides(a=len(s1a), b=len(s1b)),
        first_divergence=divergence,
        replicas=Sides(a=replicas_exact(pa), b=replicas_exact(pb)),
        arms={n: _arm_pair(_arm(pa, n), _arm(pb, n)) for n in names},
        token_texts=_texts(pa, pb, divergence),
    )


def _stage1(payload: MatchedPayload) -> list[int]:
    return list(payload.prefix_ids[len(payload.prompt_ids):])


def _side(payload: MatchedPayload, trajectory: list[int], stage1_len: int, pos: int) -> SideAt:
    """One run at the trajectory's position `pos`: its token there (None: its trajectory ended before), whether
    that step is in its stage 1 or its suffix, and the margin and top candidates its record holds for that step."""
    token = trajectory[pos] if pos < len(trajectory) else None
    margin: float | None
    if pos < stage1_len:
        stage, step = STAGE1, pos
        top, source = _nth(payload.stage1_top, step), "stage1_top"
        margin = _margin(top)
    else:
        stage, step = SUFFIX, pos - stage1_len
        live = _arm(payload, "live")
        top, source = _nth(live.top_logprobs if live is not None else None, step), "top_logprobs"
        margin = _margin(top)
        if top is None:  # our engine: the margin at every step, the candidates where live diverged in its record
            margins = payload.diagnostics.margins.get("live") if payload.diagnostics is not None else None
            margin, source = _nth(margins, step), "margins"
            top = _divergence_top(payload, step)
    recorded = top is not None or margin is not None
    return SideAt(stage=stage, step=step, token=token, margin=margin, top=top,
                  recorded=source if recorded else None)


def _nth(values: Sequence[T] | None, i: int) -> T | None:
    return values[i] if values is not None and i < len(values) else None


def _margin(top: list[TopEntry] | None) -> float | None:
    """Top-1 minus top-2 of a step's candidates, best first (None: fewer than two, or a value not recorded)."""
    if top is None or len(top) < 2 or top[0][1] is None or top[1][1] is None:
        return None
    return float(top[0][1]) - float(top[1][1])


def _divergence_top(payload: MatchedPayload, step: int) -> list[TopEntry] | None:
    """live's top candidates at suffix `step`, where a pair of its record with live in it first diverged there."""
    for key, pair in (payload.diagnostics.pairs if payload.diagnostics is not None else {}).items():
        d = pair.divergence
        first, _, second = key.partition(" vs ")
        if d is not None and d.step == step and "live" in (first, second):
            return list((d.a if first == "live" else d.b).top)
    return None


def replicas_exact(payload: MatchedPayload) -> dict[str, bool]:
    """Per arm with a replica in the record: whether the two are exact (the matched table's `replica exact`:
    suffixes equal, caches not different, and for live, its replica reaching live's stage 1)."""
    out = {}
    for c in payload.comparisons:
        if c.b == f"{c.a}{REPLICA}":
            exact = c.suffix_equal and c.cache_equal is not False
            if c.a == "live":
                exact = exact and payload.replica_prefix_equal
            out[c.a] = exact
    return out


def _arm_pair(a: Arm | None, b: Arm | None) -> ArmPair:
    """One arm of one item in both runs: suffixes, labels, and whether each was built as named (a server's)."""
    assert a is not None and b is not None
    equal, first, label = a.suffix_ids == b.suffix_ids, first_divergence(a.suffix_ids, b.suffix_ids), a.correct == b.correct
    correct: Sides[bool] = Sides(a=a.correct, b=b.correct)
    if a.took_place is None and b.took_place is None:  # `built` left unset: absent
        return ArmPair(suffix_equal=equal, first_divergence=first, label_equal=label, correct=correct)
    return ArmPair(suffix_equal=equal, first_divergence=first, label_equal=label, correct=correct,
                   built=Sides(a=a.took_place, b=b.took_place))


def _texts(pa: MatchedPayload, pb: MatchedPayload, divergence: DivergenceAt | None) -> dict[str, str]:
    """The decoded text of each token shown at the divergence, from the records' `token_texts`."""
    if divergence is None:
        return {}
    known = {**(pb.token_texts or {}), **(pa.token_texts or {})}
    sides = (divergence.a, divergence.b)
    shown = {s.token for s in sides} | {t[0] for s in sides for t in s.top or []}
    return {str(t): known[str(t)] for t in sorted(x for x in shown if x is not None) if str(t) in known}


# -- the aggregates ------------------------------------------------------------------------------------------------


def trajectory_summary(items: list[ItemComparison]) -> Trajectories:
    """Live trajectories over the items both runs took to their boundary: equal, and where the others first
    diverge; the same over the items where both runs' live replicas are exact."""
    compared = _compared(items)
    consistent = [i for i in compared if i.replicas.a.get("live") and i.replicas.b.get("live")]
    where = [i.first_divergence.in_ for i in compared if i.first_divergence]
    return Trajectories(
        n=len(items),
        not_compared=[Uncompared(item_id=i.item_id, status=i.status) for i in items if isinstance(i, NotCompared)],
        equal=Count(k=sum(i.trajectory_equal for i in compared), n=len(compared)),
        first_divergence_in=WhereCounts(stage1=where.count(STAGE1), suffix=where.count(SUFFIX),
                                        boundary=where.count(BOUNDARY)),
        self_consistent=Count(k=sum(i.trajectory_equal for i in consistent), n=len(consistent)),
    )


def _compared(items: list[ItemComparison]) -> list[ComparedItem]:
    return [i for i in items if isinstance(i, ComparedItem)]


def replica_counts(items: list[ItemComparison], side: Side) -> ReplicaCounts:
    """One run's replicas per arm (exact k of n items), and the items whose live replica was not exact."""
    compared = _compared(items)
    arms = dict.fromkeys(a for i in compared for a in i.replicas.of(side))
    return ReplicaCounts(
        exact={a: Count(k=sum(bool(i.replicas.of(side).get(a)) for i in compared),
                        n=sum(a in i.replicas.of(side) for i in compared)) for a in arms},
        live_inexact=[i.item_id for i in compared if i.replicas.of(side).get("live") is False])


def arm_summary(name: str, items: list[ItemComparison], n_resamples: int = N_RESAMPLES, seed: int = SEED
                ) -> ArmSummary:
    """One arm, A against B, over the items where both runs have it built as named: the matched table's numbers
    with A and B in place of live and the construction."""
    both = [i for i in _compared(items) if name in i.arms]
    built = [i for i in both if not _not_built(i.arms[name])]
    pairs = [(i, i.arms[name]) for i in built]
    same = [(i, p) for i, p in pairs if i.stage1_equal]
    acc_a = [int(p.correct.a) for _, p in pairs]
    acc_b = [int(p.correct.b) for _, p in pairs]
    a_only = sum(x and not y for x, y in zip(acc_a, acc_b, strict=True))
    b_only = sum(y and not x for x, y in zip(acc_a, acc_b, strict=True))
    n = len(pairs)
    accuracy: Sides[float | None] = Sides(a=None, b=None)
    accuracy_diff, mcnemar_p = None, None
    if n:
        accuracy = Sides(a=sum(acc_a) / n, b=sum(acc_b) / n)
        accuracy_diff = PairedDifference.of(acc_a, acc_b, n_resamples=n_resamples, seed=seed)
        mcnemar_p = mcnemar_exact(a_only, b_only)
    return ArmSummary(
        arm=name, n=n, not_built=len(both) - len(built),
        suffix_disagreements=Count(k=sum(not p.suffix_equal for _, p in pairs), n=n),
        suffix_disagreements_same_stage1=Count(k=sum(not p.suffix_equal for _, p in same), n=len(same)),
        label_disagreements=Count(k=sum(not p.label_equal for _, p in pairs), n=n),
        accuracy=accuracy, accuracy_diff=accuracy_diff,
        discordant=Discordant(a_only=a_only, b_only=b_only), mcnemar_p=mcnemar_p,
        first_divergence=[p.first_divergence for _, p in same if not p.suffix_equal and p.first_divergence is not None],
        replica_exact=Sides(a=_replica_of(name, [i for i, _ in pairs], "a"),
                            b=_replica_of(name, [i for i, _ in pairs], "b")),
    )


def _not_built(pair: ArmPair) -> bool:
    """Whether a run's engine says it did not build the arm as named."""
    return pair.built is not None and False in (pair.built.a, pair.built.b)


def _replica_of(name: str, items: list[ComparedItem], side: Side) -> Count | None:
    has = [i.replicas.of(side)[name] for i in items if name in i.replicas.of(side)]
    return Count(k=sum(has), n=len(has)) if has else None
