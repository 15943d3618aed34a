"""matched's section of results.json (`MatchedSummary`), summarised from its records, and its table and verdict facts.

One section per arm set against live: replica exactness per side, suffix and label disagreements, accuracies, the
paired CI of their difference, McNemar's exact p, the first divergence indices, the pair's diagnostics, and where a
serving engine ran it, its counts of what it built.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from stagereplay.experiments.core.diagnostics_summary import Diagnosed, summarize_pair
from stagereplay.experiments.core.difference import PairedDifference
from stagereplay.experiments.core.format import NA, Table, as_rows, count_of, k_of_n, p_value, pct, points
from stagereplay.experiments.core.stats import mcnemar_exact
from stagereplay.experiments.core.verdict import (
    FIRST_STEP,
    MARGINS,
    REPLICAS,
    Fact,
    faithful,
    items,
    logit,
    median_of,
)
from stagereplay.experiments.protocol.payloads import MatchedPayload, NoBoundaryPayload
from stagereplay.records.ledger import Record
from stagereplay.records.payloads import Arm, Comparison
from stagereplay.records.summary import Count, SummaryModel


class Discordant(SummaryModel):
    """Items whose correctness labels differ, by which side was correct."""

    live_only: int = Field(description="items live got right and the construction wrong")
    other_only: int = Field(description="items the construction got right and live wrong")


class Built(SummaryModel):
    """A serving engine's counts of whether each item's arm was built as its name says (`serving.evidence`)."""

    k: int = Field(description="items whose arm was built as named")
    n: int = Field(description="items that reached the boundary")
    not_built: int = Field(description="items whose arm was not built as named (left out of the statistics)")
    unknown: int = Field(description="items whose engine said nothing")
    not_built_cached: list[int | None] = Field(description="per item not built, the cached positions reported")


class PrefixCache(SummaryModel):
    """How much of the prefix a serving engine's cache supplied to the arm, and how much decoding wrote."""

    n: int = Field(description="requests that reported their cached positions")
    hits: int = Field(description="requests with any cached position")
    num_cached_tokens: int = Field(description="cached positions over all requests")
    cached_from_decode: int = Field(description="of them, positions live's decoding wrote")
    hits_with_decode_blocks: int = Field(description="requests that hit blocks live's decoding wrote")


class MatchedHead(SummaryModel):
    """What every matched section holds before its pair's diagnostics."""

    engine: str | None = Field(default=None, description="the serving engine that ran it (absent: ours)")
    checkpoint: str = Field(description="the stage's checkpoint")
    construction: str = Field(description="the arm set against live")
    precision: str = Field(description="the precision the arm ran at")
    n: int = Field(description="items recorded")
    n_boundary: int = Field(description="items that reached the stage boundary")
    n_no_boundary: int = Field(description="items recorded as no_boundary")
    replica_exact: dict[str, Count | None] = Field(
        description="per side (live, the construction), items whose replica matched bit for bit (null: the side "
                    "has no replicas)")
    suffix_disagreements: Count = Field(description="items whose suffixes differ")
    label_disagreements: Count = Field(description="items whose correctness labels differ")
    accuracy: dict[str, float | None] = Field(description="per side, its accuracy (null: no item reached the "
                                                          "boundary)")
    accuracy_diff: PairedDifference | None = Field(description="live minus the construction (null: no item)")
    discordant: Discordant = Field(description="items whose labels differ, by side")
    mcnemar_p: float | None = Field(description="McNemar's exact p of the discordant labels (null: no item)")
    first_divergence: list[int] = Field(description="per divergent item, the first suffix step that differs")


class MatchedSummary(Diagnosed, MatchedHead):
    """One arm set against live at one checkpoint: matched's section of results.json (a list of them)."""

    built: Built | None = Field(default=None, description="a serving engine's counts of what it built as named "
                                                          "(absent: ours)")
    prefix_cache: PrefixCache | None = Field(default=None, description="a serving engine's prefix-cache counts "
                                                                       "(absent: none reported)")
    load: dict[str, dict[str, int]] | None = Field(
        default=None, description="a server's replicas under load: per arm, items per finding (invariant, "
                                  "batch-variant, not self-consistent, unknown)")
    n_marker_inside_token: int | None = Field(default=None, description="items whose boundary marker ended inside a "
                                                                        "token (absent: matched on token IDs)")


PAYLOAD: TypeAdapter[MatchedPayload | NoBoundaryPayload] = TypeAdapter(
    Annotated[MatchedPayload | NoBoundaryPayload, Field(discriminator="status")])
"""A matched record's payload (`records.payloads`): the item reached its boundary, or not (a serving run's too)."""


def reached(payload: dict[str, Any] | None) -> MatchedPayload | None:
    """A matched record's payload as its model where the item reached its boundary (None: none given, it did not
    reach it, or the payload is not a matched record's)."""
    try:
        read = None if payload is None else PAYLOAD.validate_python(payload)
    except ValidationError:
        return None
    return read if isinstance(read, MatchedPayload) else None


def _cmp(payload: MatchedPayload, a: str, b: str) -> Comparison | None:
    return next((c for c in payload.comparisons if c.a == a and c.b == b), None)


def summarize_matched(records: list[Record], construction: str, checkpoint: str, precision: str,
                      seed: int = 0, n_resamples: int = 10_000, engine: str | None = None) -> MatchedSummary:
    """The matched table: replica exactness, disagreements, accuracies, paired CI, McNemar, divergence indices.

    A serving engine's arm whose construction did not take place (`took_place` false: its engine reported a fresh
    prefill where a restore was asked for, say; `serving.evidence`) is not that construction: such items are
    counted apart (`not_built`) and left out of this column's statistics."""
    read = [(r.item_id, PAYLOAD.validate_python(r.payload)) for r in records]
    reached = [(i, p) for i, p in read if isinstance(p, MatchedPayload)]
    built = [_built(p, construction) for _, p in reached]
    ok = [r for r, b in zip(reached, built, strict=True) if b is not False]
    rep_live = rep_other = 0
    replicated = False  # whether the construction has replicas (a server's under-load arms are replicas themselves)
    suffix_k = label_k = live_only = other_only = 0
    live_acc, other_acc, divergence = [], [], []
    for _, p in ok:
        arms = {a.name: a for a in p.arms}
        lr, orr = _cmp(p, "live", "live#replica"), _cmp(p, construction, f"{construction}#replica")
        # cache_equal is None where an engine records no cache fingerprint: the tokens then decide alone.
        rep_live += bool(lr and lr.suffix_equal and lr.cache_equal is not False and p.replica_prefix_equal)
        rep_other += bool(orr and orr.suffix_equal and orr.cache_equal is not False)
        replicated = replicated or orr is not None
        main = _cmp(p, "live", construction)
        assert main is not None
        if not main.suffix_equal:
            suffix_k += 1
            divergence.append(main.first_divergence)
        a, b = arms["live"].correct, arms[construction].correct
        label_k += a != b
        live_only += a and not b
        other_only += b and not a
        live_acc.append(int(a))
        other_acc.append(int(b))
    n = len(ok)
    fields: dict[str, Any] = {"engine": engine} if engine is not None else {}
    fields |= {
        "checkpoint": checkpoint, "construction": construction, "precision": precision,
        "n": len(records), "n_boundary": len(reached), "n_no_boundary": len(records) - len(reached),
        "replica_exact": {"live": Count(k=rep_live, n=n),
                          construction: Count(k=rep_other, n=n) if replicated or not n else None},
        "suffix_disagreements": Count(k=suffix_k, n=n),
        "label_disagreements": Count(k=label_k, n=n),
        "accuracy": {"live": None, construction: None},
        "accuracy_diff": None,
        "discordant": Discordant(live_only=live_only, other_only=other_only),
        "mcnemar_p": None,
        "first_divergence": divergence,
        **summarize_pair([(i, p.diagnostics) for i, p in ok], "live", construction).diagnostics(),
    }
    if any(b is not None for b in built):  # a serving engine's counts say whether each arm was built as named
        fields["built"] = Built(k=built.count(True), n=len(reached), not_built=built.count(False),
                                unknown=built.count(None),
                                not_built_cached=[_cached(p, construction)
                                                  for (_, p), b in zip(reached, built, strict=True) if b is False])
    cached = [(a.num_cached_tokens, a.cached_from_decode or 0) for _, p in reached for a in p.arms
              if a.name == construction and a.num_cached_tokens is not None]
    if cached:  # a serving engine's arm: how much of the prefix its cache supplied, and how much decoding wrote
        fields["prefix_cache"] = PrefixCache(
            n=len(cached), hits=sum(c > 0 for c, _ in cached), num_cached_tokens=sum(c for c, _ in cached),
            cached_from_decode=sum(d for _, d in cached), hits_with_decode_blocks=sum(d > 0 for _, d in cached))
    findings = [p.load_finding for _, p in reached if "load_finding" in p.model_fields_set]
    if findings and construction == "live@load":  # a server's replicas under load (experiments.protocol.served_matched.load_finding)
        fields["load"] = {arm: {f: [(x or {}).get(arm) for x in findings].count(f)
                                for f in ("invariant", "batch-variant", "not self-consistent", "unknown")}
                          for arm in ("live", "oneshot")}
    if any("marker_inside_token" in p.model_fields_set for _, p in ok):  # a marker matched on text (engine.boundary)
        fields["n_marker_inside_token"] = sum(bool(p.marker_inside_token) for _, p in ok)
    if n:
        la, oa = sum(live_acc) / n, sum(other_acc) / n
        fields["accuracy"] = {"live": la, construction: oa}
        fields["accuracy_diff"] = PairedDifference.of(live_acc, other_acc, n_resamples=n_resamples, seed=seed)
        fields["mcnemar_p"] = mcnemar_exact(live_only, other_only)
    return MatchedSummary(**fields)


def _arm(payload: MatchedPayload, name: str) -> Arm | None:
    return next((a for a in payload.arms if a.name == name), None)


def _cached(payload: MatchedPayload, construction: str) -> int | None:
    """The prompt positions the engine's prefix cache supplied to the arm of `construction` (None: it did not say)."""
    arm = _arm(payload, construction)
    return None if arm is None else arm.num_cached_tokens


def _built(payload: MatchedPayload, construction: str) -> bool | None:
    """Whether the record's arm of `construction` was built as named (None: nothing says; `serving.evidence`)."""
    arm = _arm(payload, construction)
    return None if arm is None or arm.took_place is None else arm.took_place


def matched_table(matched: list[MatchedSummary]) -> Table:
    """Rows are quantities, columns checkpoints, so two checkpoints read side by side."""
    fresh = {m.construction for m in matched}
    other = fresh.pop() if len(fresh) == 1 else "rebuilt"
    labels = [
        "items (boundary / no boundary)",
        "replica exact, live",
        f"replica exact, {other}",
        "suffix disagreements",
        "correctness-label disagreements",
        "accuracy, live",
        f"accuracy, {other}",
        f"accuracy difference, live - {other} (points) [95% CI]",
        f"discordant labels: live only / {other} only",
        "McNemar exact p",
    ]
    columns = []
    for m in matched:
        c, diff = m.construction, m.accuracy_diff
        ci = f"{points(diff.estimate)} [{points(diff.ci[0])}, {points(diff.ci[1])}]" if diff else NA
        columns.append(
            [
                f"{m.n} ({m.n_boundary} / {m.n_no_boundary})",
                count_of(m.replica_exact.get("live")),
                count_of(m.replica_exact.get(c)),
                count_of(m.suffix_disagreements),
                count_of(m.label_disagreements),
                pct(m.accuracy.get("live")),
                pct(m.accuracy.get(c)),
                ci,
                f"{m.discordant.live_only} / {m.discordant.other_only}",
                p_value(m.mcnemar_p),
            ]
        )
    if any("n_marker_inside_token" in m.model_fields_set for m in matched):  # a marker matched on text
        labels.insert(1, "boundary marker ended inside a token")
        for m, col in zip(matched, columns, strict=True):
            inside = m.n_marker_inside_token
            col.insert(1, NA if inside is None else k_of_n(inside, m.n_boundary))
    if any(m.built for m in matched):  # a serving engine's counts: was each arm built as its name says?
        labels.insert(1, "built as named, by the engine's counts (the rest left out below)")
        for m, col in zip(matched, columns, strict=True):
            b = m.built
            col.insert(1, NA if not b or b.k + b.not_built == 0 else k_of_n(b.k, b.k + b.not_built))
    rows = [[label, *(col[i] for col in columns)] for i, label in enumerate(labels)]
    headers = ("", *(f"{m.engine + ' ' if m.engine else ''}{m.checkpoint}: live vs {m.construction} "
                     f"@ {m.precision}" for m in matched))
    note = "Disagreements and accuracies are over items that reached the stage boundary."
    for m in matched:
        b = m.built
        if b and b.not_built:
            why = NOT_BUILT.get(m.construction.split("@")[0], "by the engine's counts")
            note += (f" {m.construction} @ {m.precision} was not built as named on {b.not_built} of "
                     f"{b.n} items ({why}; "
                     f"cached positions reported: {_spread(b.not_built_cached)}): those items are counted apart "
                     "and left out of its column.")
    for m in matched:
        pc = m.prefix_cache
        if pc and pc.hits:
            note += (f" {m.construction} @ {m.precision}: {pc.hits}/{pc.n} requests hit the prefix cache, "
                     f"{pc.hits_with_decode_blocks} of them on blocks live's decoding wrote "
                     f"({pc.cached_from_decode} of {pc.num_cached_tokens} cached positions).")
        if m.load:
            note += f" Under load (@ {m.precision}, the server's replicas with other requests in flight), per item:"
            for arm, n in m.load.items():
                note += (f" {arm}: {n['invariant']} invariant, {n['batch-variant']} batch-variant (exact alone, "
                         f"different under load), {n['not self-consistent']} not self-consistent (different even "
                         f"alone), {n['unknown']} unknown;")
    d = next((m.accuracy_diff for m in matched if m.accuracy_diff), None)
    if d:
        note += (
            f" CI: paired percentile bootstrap over items, {d.n_resamples} resamples, "
            f"seed {d.seed}, confidence {d.confidence}."
        )
    return Table("table-matched", "Matched: live cache vs fresh prefill", headers, as_rows(rows), note)


NOT_BUILT = {
    "live": "the engine took positions from a cache",
    "oneshot": "the engine took positions from a cache: not a fresh prefill",
    "prefix-cache": "no position written by live's decoding came from the cache",
    "slot-restore": "the server did not continue from the restored slot but prefilled afresh",
}
"""Per arm, what it means that the engine did not build it as named (`serving.evidence.took_place`)."""


def _spread(values: list[int | None]) -> str:
    """A list of counts as `a` or `a-b`."""
    known = sorted(int(v) for v in values if v is not None)
    if not known:
        return NA
    return str(known[0]) if known[0] == known[-1] else f"{known[0]}-{known[-1]}"


def matched_facts(matched: list[MatchedSummary]) -> list[Fact]:
    """Per section: its replicas, its suffix disagreements at its precision, and where it recorded diagnostics the
    margins at the first divergent token and the first step's logit difference."""
    facts = []
    for m in matched:
        arms, exact = [], True
        for arm, kn in m.replica_exact.items():
            if kn is None:  # an arm without replicas (a server's under-load arms)
                continue
            exact &= kn.k == kn.n
            arms.append(f"{arm} {kn.k}/{kn.n}")
        facts.append(Fact(REPLICAS, f"{m.checkpoint} " + ", ".join(arms), holds=exact,
                          caveat="caches where the engine exposes them" if m.engine else ""))
    for m in matched:
        d = m.suffix_disagreements
        facts.append(Fact(faithful(m.precision), f"live vs {m.construction} ({m.checkpoint})",
                          holds=d.k == 0, k=d.k, n=d.n))
    for m in matched:
        mg = m.margins
        if not mg or not mg.steps or not mg.at_divergence.n:
            continue
        at, steps = mg.at_divergence, mg.steps
        facts.append(Fact(MARGINS, (
            f"{m.checkpoint} @ {m.precision}: median top-1/top-2 logit margin {logit(at.median)} at the first "
            f"divergent token ({items(at.n)}, {mg.arm} arm) against {logit(steps.median)} over all "
            f"{steps.n} steps")))
    for m in matched:
        value = median_of(m.first_step_logit_maxabs)
        if value is not None:
            facts.append(Fact(FIRST_STEP, f"{logit(value)} live vs {m.construction} @ {m.precision} "
                                          f"({m.checkpoint})"))
    return facts
