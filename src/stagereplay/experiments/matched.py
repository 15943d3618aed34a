"""Matched: per item, the retained live continuation and a fresh construction of the same token IDs, each
with an exact replica from scratch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import Field, TypeAdapter

from stagereplay.engine.constructions import parse_construction
from stagereplay.engine.forwards import (
    Lengths,
    construct_forwards,
    continuation_forwards,
    live_forwards,
    no_boundary_forwards,
)
from stagereplay.engine.generated import Generated
from stagereplay.engine.lm import LM, BoundaryState, Continuation, NoBoundary
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.experiments.arms import (
    arm_record,
    compare,
    no_boundary_payload,
    record_lengths,
    with_token_texts,
)
from stagereplay.experiments.diagnose import diagnose
from stagereplay.experiments.diagnostics_summary import summarize_pair
from stagereplay.experiments.experiment import Assumed, Batch, Experiment, Planned, Replay, Section
from stagereplay.experiments.figures import DIVERGENCE, SharedFigure, Strip
from stagereplay.experiments.format import NA, Table, as_rows, count_of, k_of_n, p_value, pct, points
from stagereplay.experiments.jobs import Job, Params
from stagereplay.experiments.stats import mcnemar_exact, paired_bootstrap_ci
from stagereplay.experiments.verdict import (
    CARRIES,
    FIRST_STEP,
    MARGINS,
    REPLICAS,
    Fact,
    Question,
    faithful,
    items,
    logit,
    median_of,
)
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import Arm, MatchedPayload, NoBoundaryPayload, Payload
from stagereplay.tasks.base import Item

if TYPE_CHECKING:
    from stagereplay.experiments.prepared import PreparedRun

EXPERIMENT = "matched"
STAGE1_TOP = 2
"""Tokens kept per stage-1 step of live (`stage1_top`): the margin and the runner-up, at a size a trace of thousands
of steps can carry in every record."""
PAYLOAD: TypeAdapter[MatchedPayload | NoBoundaryPayload] = TypeAdapter(
    Annotated[MatchedPayload | NoBoundaryPayload, Field(discriminator="status")])
"""A matched record's payload (`records.payloads`): the item reached its boundary, or not (a serving run's too)."""


@dataclass(frozen=True)
class MatchedOptions:
    """Matched's own options: the fresh constructions set against live, and how live is built."""

    construction: str = field(default="oneshot", metadata={"help": (
        "oneshot | incremental | chunked:<n> | retokenized | roundtrip:fp8-e4m3|fp8-e5m2|int8 (live's K/V through that "
        "format and back), or several, comma-separated: each is set against live")})
    speculate: str | None = field(default=None, metadata={"help": (
        "live built by transformers' assisted generation: prompt-lookup:N | draft:PATH | self (the model as its own "
        "draft); the tokens each step added are recorded")})
    quantized_cache: str | None = field(default=None, metadata={"help": (
        "live built with transformers' quantized K/V cache: quanto:2|4 | hqq:1|2|3|4|8 | fp8")})

    def __post_init__(self) -> None:
        constructions(self.construction)
        self.generated()  # a bad --speculate or --quantized-cache fails here, before anything loads

    def generated(self) -> Generated:
        return Generated(self.speculate or "", self.quantized_cache or "")


class MatchedStage(StageSection):
    """Matched's frozen section."""

    construction: str = Field(description="the first fresh construction set against live (the one later stages "
                                          "set against live); a serving engine's run: oneshot")
    arms: list[str] | None = Field(None, description="every arm set against live, where there are several")
    generate: dict[str, str] | None = Field(None, description="live built by transformers' generate() with an "
                                                              "option: which (engine.generated)")


def constructions(given: str) -> tuple[str, ...]:
    """The fresh constructions of a comma list, each checked, none twice, live not among them."""
    cs = tuple(c.strip() for c in given.split(","))
    for c in cs:
        if not parse_construction(c).fixed_prefix:
            raise StageReplayError("live is what the constructions are set against", "drop live from --construction")
    if len(set(cs)) != len(cs):
        raise StageReplayError(f"--construction {given} names a construction twice", "name each once")
    return cs


@dataclass(frozen=True)
class MatchedParams(Params):
    """A matched job's parameters: the fresh construction(s) set against live (a comma list), and how live is
    built (our loop, or transformers' generate() with an option)."""

    construction: str = "oneshot"
    generated: Generated = field(default_factory=Generated)


def matched_item(lm: LM, job: Job[MatchedParams]) -> Payload:
    """Live + replica, construction + replica; the comparisons between them. Pure in (model, item, settings).

    Each replica's cache is dropped as soon as its record (with the cache fingerprint) is made: comparisons need
    only the fingerprints, and the diagnostics compare the caches of live and the fresh construction alone (a
    replica watches its pair's first arm, so its logits at their first divergent step are kept as it runs). So
    at most four K/V caches are alive at once: live's and the fresh construction's boundary states, and a
    replica's boundary state with the cache its continuation grows (README, "caches alive"); one more per further
    construction, whose boundary state the diagnostics compare with live's.
    """
    item, s = job.item, job.settings
    fresh_ones = constructions(job.params.construction)
    rule, via = s.rule(), job.params.generated

    def live_state(watch: Sequence[Sequence[int]] = ()) -> BoundaryState:
        return lm.live_generated(item, rule, s.decode, via) if via else lm.live(item, rule, s.decode, watch=watch)

    try:
        live = live_state()
    except NoBoundary as nb:
        return no_boundary_payload(item, nb.generated)
    stage1 = live.stage1
    assert live.live_suffix is not None
    arms: list[Arm] = []
    runs: dict[str, tuple[BoundaryState, Continuation]] = {}

    def record(name: str, state: BoundaryState, cont: Continuation, keep_cache: bool) -> None:
        arms.append(arm_record(lm, name, state, cont, stage1, item, s.scorer))
        runs[name] = (state if keep_cache else replace(state, cache=None), cont)

    record("live", live, live.live_suffix, keep_cache=True)
    try:
        # From scratch: the same construction run again, watching live's suffix for its first divergent step.
        replica = live_state([live.live_suffix.suffix])
    except NoBoundary:
        replica = None
    replica_prefix_equal = replica is not None and replica.prefix == live.prefix
    if replica is not None and replica.live_suffix is not None:
        record("live#replica", replica, replica.live_suffix, keep_cache=False)
    del replica
    for construction in fresh_ones:
        for name, keep, first in ((construction, True, "live"), (f"{construction}#replica", False, construction)):
            fresh = lm.construct(live, construction)
            record(name, fresh, lm.continue_from(fresh, s.decode, watch=[runs[first][1].suffix]), keep_cache=keep)
            del fresh
    by = {a.name: a for a in arms}
    pairs = [*(("live", c) for c in fresh_ones), ("live", "live#replica"),
             *((c, f"{c}#replica") for c in fresh_ones)]
    payload = MatchedPayload(
        status="ok",
        prompt_ids=list(item.prompt_ids),
        prefix_ids=list(live.prefix),
        boundary=len(live.prefix),
        **(live.match or {}),  # a marker matched on text: whether it ended inside the boundary token
        answer=item.answer,
        replica_prefix_equal=replica_prefix_equal,
        arms=arms,
        comparisons=[compare(item.id, by[a], by[b]) for a, b in pairs if a in by and b in by],
        diagnostics=diagnose(runs, pairs, cache_pairs=pairs[: len(fresh_ones)]),
        stage1_top=live.stage1_top(STAGE1_TOP),
    )
    return with_token_texts(lm, payload).as_payload()


def forwards(n: Lengths, construction: str = "oneshot") -> list[int]:
    """The forwards `matched_item` makes for an item of lengths `n` (token counts, engine.forwards): live and its
    replica from scratch, then each fresh construction (a comma list) and its replica with their continuations."""
    if n.stage1 is None:
        return no_boundary_forwards(n.prompt, n.generated)
    out = live_forwards(n.prompt, n.stage1, n.of("live")) + live_forwards(n.prompt, n.stage1, n.of("live#replica"))
    for c in constructions(construction):
        for arm in (c, f"{c}#replica"):
            out += construct_forwards(c, n.prompt, n.prefix, from_cache=True) + continuation_forwards(n.of(arm))
    return out


def stage_constructions(stage: MatchedStage) -> str:
    """A matched stage's fresh constructions as the comma list its jobs take."""
    return ",".join(stage.arms or [stage.construction])


def fixed_prefixes(run: Run, checkpoint: str) -> list[tuple[Item, list[int]]]:
    """The items of the matched run at `checkpoint` that reached their boundary, with their prefixes: what the
    experiments after matched start from."""
    out = []
    for r in run.find(EXPERIMENT, checkpoint):
        p = r.payload
        if p["status"] == "ok":
            out.append((Item(r.item_id, tuple(p["prompt_ids"]), p["answer"]), p["prefix_ids"]))
    return out


def matched_ok(records: list[Record], checkpoint: str) -> list[str]:
    """The item ids whose matched record at `checkpoint` reached its boundary, in ledger order."""
    return [r.item_id for r in records if r.experiment == EXPERIMENT and r.checkpoint == checkpoint
            and r.payload.get("status") == "ok"]


def matched_stage(stages: Mapping[str, StageSection], checkpoint: str) -> StageSection | None:
    """The matched stage at `checkpoint`, where the run has one."""
    return stages.get(f"{EXPERIMENT}/{checkpoint}")


def matched_records(run: Run, checkpoint: str) -> dict[str, Payload]:
    """The matched payloads at `checkpoint`, by item id."""
    return {r.item_id: r.payload for r in run.find(EXPERIMENT, checkpoint)}


# -- results.json and the report ---------------------------------------------------------------------------------


def _cmp(record: Record, a: str, b: str) -> dict[str, Any] | None:
    for c in record.payload["comparisons"]:
        if c["a"] == a and c["b"] == b:
            return dict(c)
    return None


def summarize_matched(records: list[Record], construction: str, checkpoint: str, precision: str,
                      seed: int = 0, n_resamples: int = 10_000) -> dict[str, Any]:
    """The matched table: replica exactness, disagreements, accuracies, paired CI, McNemar, divergence indices.

    A serving engine's arm whose construction did not take place (`took_place` false: its engine reported a fresh
    prefill where a restore was asked for, say; `serving.evidence`) is not that construction: such items are
    counted apart (`not_built`) and left out of this column's statistics."""
    reached = [r for r in records if r.payload["status"] == "ok"]
    built = [_built(r, construction) for r in reached]
    ok = [r for r, b in zip(reached, built, strict=True) if b is not False]
    rep_live = rep_other = 0
    replicated = False  # whether the construction has replicas (a server's under-load arms are replicas themselves)
    suffix_k = label_k = live_only = other_only = 0
    live_acc, other_acc, divergence = [], [], []
    for r in ok:
        arms = {a["name"]: a for a in r.payload["arms"]}
        lr, orr = _cmp(r, "live", "live#replica"), _cmp(r, construction, f"{construction}#replica")
        # cache_equal is None where an engine records no cache fingerprint: the tokens then decide alone.
        rep_live += bool(lr and lr["suffix_equal"] and lr["cache_equal"] is not False
                         and r.payload["replica_prefix_equal"])
        rep_other += bool(orr and orr["suffix_equal"] and orr["cache_equal"] is not False)
        replicated = replicated or orr is not None
        main = _cmp(r, "live", construction)
        assert main is not None
        if not main["suffix_equal"]:
            suffix_k += 1
            divergence.append(main["first_divergence"])
        a, b = arms["live"]["correct"], arms[construction]["correct"]
        label_k += a != b
        live_only += a and not b
        other_only += b and not a
        live_acc.append(int(a))
        other_acc.append(int(b))
    n = len(ok)
    summary: dict[str, Any] = {
        "checkpoint": checkpoint, "construction": construction, "precision": precision,
        "n": len(records), "n_boundary": len(reached), "n_no_boundary": len(records) - len(reached),
        "replica_exact": {"live": {"k": rep_live, "n": n},
                          construction: {"k": rep_other, "n": n} if replicated or not n else None},
        "suffix_disagreements": {"k": suffix_k, "n": n},
        "label_disagreements": {"k": label_k, "n": n},
        "accuracy": {"live": None, construction: None},
        "accuracy_diff": None,
        "discordant": {"live_only": live_only, "other_only": other_only},
        "mcnemar_p": None,
        "first_divergence": divergence,
        **summarize_pair(ok, "live", construction),
    }
    if any(b is not None for b in built):  # a serving engine's counts say whether each arm was built as named
        summary["built"] = {"k": built.count(True), "n": len(reached), "not_built": built.count(False),
                            "unknown": built.count(None),
                            "not_built_cached": [_arm(r, construction).get("num_cached_tokens")
                                                 for r, b in zip(reached, built, strict=True) if b is False]}
    cached = [a for r in reached for a in r.payload["arms"] if a["name"] == construction
              and a.get("num_cached_tokens") is not None]
    if cached:  # a serving engine's arm: how much of the prefix its cache supplied, and how much decoding wrote
        summary["prefix_cache"] = {
            "n": len(cached), "hits": sum(a["num_cached_tokens"] > 0 for a in cached),
            "num_cached_tokens": sum(a["num_cached_tokens"] for a in cached),
            "cached_from_decode": sum(a.get("cached_from_decode", 0) for a in cached),
            "hits_with_decode_blocks": sum(a.get("cached_from_decode", 0) > 0 for a in cached)}
    findings = [r.payload["load_finding"] for r in records if "load_finding" in r.payload]
    if findings and construction == "live@load":  # a server's replicas under load (serving.matched.load_finding)
        summary["load"] = {arm: {f: [x.get(arm) for x in findings].count(f)
                                 for f in ("invariant", "batch-variant", "not self-consistent", "unknown")}
                           for arm in ("live", "oneshot")}
    if any("marker_inside_token" in r.payload for r in ok):  # a marker matched on text (engine.boundary)
        summary["n_marker_inside_token"] = sum(bool(r.payload.get("marker_inside_token")) for r in ok)
    if n:
        la, oa = sum(live_acc) / n, sum(other_acc) / n
        lo, hi = paired_bootstrap_ci(live_acc, other_acc, n_resamples=n_resamples, seed=seed)
        summary["accuracy"] = {"live": la, construction: oa}
        summary["accuracy_diff"] = {"estimate": la - oa, "ci": [lo, hi], "confidence": 0.95,
                                    "n_resamples": n_resamples, "seed": seed}
        summary["mcnemar_p"] = mcnemar_exact(live_only, other_only)
    return summary


def _arm(record: Record, name: str) -> dict[str, Any]:
    return next((a for a in record.payload["arms"] if a["name"] == name), {})


def _built(record: Record, construction: str) -> bool | None:
    """Whether the record's arm of `construction` was built as named (None: nothing says; `serving.evidence`)."""
    took = _arm(record, construction).get("took_place")
    return None if took is None else bool(took)



def matched_table(matched: list[dict[str, Any]]) -> Table:
    """Rows are quantities, columns checkpoints, so two checkpoints read side by side."""
    fresh = {m["construction"] for m in matched}
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
        c, diff = m["construction"], m.get("accuracy_diff")
        accuracy, discordant = m.get("accuracy") or {}, m["discordant"]
        ci = f"{points(diff['estimate'])} [{points(diff['ci'][0])}, {points(diff['ci'][1])}]" if diff else NA
        columns.append(
            [
                f"{m['n']} ({m['n_boundary']} / {m['n_no_boundary']})",
                count_of(m["replica_exact"].get("live")),
                count_of(m["replica_exact"].get(c)),
                count_of(m["suffix_disagreements"]),
                count_of(m["label_disagreements"]),
                pct(accuracy.get("live")),
                pct(accuracy.get(c)),
                ci,
                f"{discordant['live_only']} / {discordant['other_only']}",
                p_value(m.get("mcnemar_p")),
            ]
        )
    if any("n_marker_inside_token" in m for m in matched):  # a marker matched on text (engine.boundary)
        labels.insert(1, "boundary marker ended inside a token")
        for m, col in zip(matched, columns, strict=True):
            inside = m.get("n_marker_inside_token")
            col.insert(1, NA if inside is None else k_of_n(inside, m["n_boundary"]))
    if any(m.get("built") for m in matched):  # a serving engine's counts: was each arm built as its name says?
        labels.insert(1, "built as named, by the engine's counts (the rest left out below)")
        for m, col in zip(matched, columns, strict=True):
            b = m.get("built")
            col.insert(1, NA if not b or b["k"] + b["not_built"] == 0 else k_of_n(b["k"], b["k"] + b["not_built"]))
    rows = [[label, *(col[i] for col in columns)] for i, label in enumerate(labels)]
    headers = ("", *(f"{m['engine'] + ' ' if m.get('engine') else ''}{m['checkpoint']}: live vs {m['construction']} "
                     f"@ {m['precision']}" for m in matched))
    note = "Disagreements and accuracies are over items that reached the stage boundary."
    for m in matched:
        b = m.get("built")
        if b and b["not_built"]:
            why = NOT_BUILT.get(m["construction"].split("@")[0], "by the engine's counts")
            note += (f" {m['construction']} @ {m['precision']} was not built as named on {b['not_built']} of "
                     f"{b['n']} items ({why}; "
                     f"cached positions reported: {_spread(b['not_built_cached'])}): those items are counted apart "
                     "and left out of its column.")
    for m in matched:
        pc = m.get("prefix_cache")
        if pc and pc["hits"]:
            note += (f" {m['construction']} @ {m['precision']}: {pc['hits']}/{pc['n']} requests hit the prefix cache, "
                     f"{pc['hits_with_decode_blocks']} of them on blocks live's decoding wrote "
                     f"({pc['cached_from_decode']} of {pc['num_cached_tokens']} cached positions).")
        load = m.get("load")
        if load:
            note += f" Under load (@ {m['precision']}, the server's replicas with other requests in flight), per item:"
            for arm, n in load.items():
                note += (f" {arm}: {n['invariant']} invariant, {n['batch-variant']} batch-variant (exact alone, "
                         f"different under load), {n['not self-consistent']} not self-consistent (different even "
                         f"alone), {n['unknown']} unknown;")
    d = next((m["accuracy_diff"] for m in matched if m.get("accuracy_diff")), None)
    if d:
        note += (
            f" CI: paired percentile bootstrap over items, {d.get('n_resamples')} resamples, "
            f"seed {d.get('seed')}, confidence {d.get('confidence')}."
        )
    return Table("table-matched", "Matched: live cache vs fresh prefill", headers, as_rows(rows), note)


NOT_BUILT = {
    "live": "the engine took positions from a cache",
    "oneshot": "the engine took positions from a cache: not a fresh prefill",
    "prefix-cache": "no position written by live's decoding came from the cache",
    "slot-restore": "the server did not continue from the restored slot but prefilled afresh",
}
"""Per arm, what it means that the engine did not build it as named (`serving.evidence.took_place`)."""


def _spread(values: list[Any]) -> str:
    """A list of counts as `a` or `a-b`."""
    known = sorted(int(v) for v in values if v is not None)
    if not known:
        return NA
    return str(known[0]) if known[0] == known[-1] else f"{known[0]}-{known[-1]}"


def matched_facts(matched: list[dict[str, Any]]) -> list[Fact]:
    """Per section: its replicas, its suffix disagreements at its precision, and where it recorded diagnostics the
    margins at the first divergent token and the first step's logit difference."""
    facts = []
    for m in matched:
        arms, exact = [], True
        for arm, kn in m["replica_exact"].items():
            if kn is None:  # an arm without replicas (a server's under-load arms)
                continue
            exact &= kn["k"] == kn["n"]
            arms.append(f"{arm} {kn['k']}/{kn['n']}")
        facts.append(Fact(REPLICAS, f"{m['checkpoint']} " + ", ".join(arms), holds=exact,
                          caveat="caches where the engine exposes them" if m.get("engine") else ""))
    for m in matched:
        d = m["suffix_disagreements"]
        facts.append(Fact(faithful(m["precision"]), f"live vs {m['construction']} ({m['checkpoint']})",
                          holds=d["k"] == 0, k=d["k"], n=d["n"]))
    for m in matched:
        mg = m.get("margins")
        if not mg or not mg.get("steps") or not mg["at_divergence"]["n"]:
            continue
        at, steps = mg["at_divergence"], mg["steps"]
        facts.append(Fact(MARGINS, (
            f"{m['checkpoint']} @ {m['precision']}: median top-1/top-2 logit margin {logit(at['median'])} at the first "
            f"divergent token ({items(at['n'])}, {mg['arm']} arm) against {logit(steps['median'])} over all "
            f"{steps['n']} steps")))
    for m in matched:
        value = median_of(m.get("first_step_logit_maxabs"))
        if value is not None:
            facts.append(Fact(FIRST_STEP, f"{logit(value)} live vs {m['construction']} @ {m['precision']} "
                                          f"({m['checkpoint']})"))
    return facts


class Matched(Experiment):
    """Live continuation vs a fresh construction of the same token IDs, each with an exact replica."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    serving: ClassVar[str | None] = "arms"
    name: ClassVar[str] = EXPERIMENT
    Stage: ClassVar[type[StageSection]] = MatchedStage
    Options: ClassVar[type] = MatchedOptions
    command: ClassVar[str] = "matched"
    starts_run: ClassVar[bool] = True
    replays_diagnostics: ClassVar[bool] = True

    def check(self, model: ModelConfig, options: MatchedOptions) -> None:
        generated = options.generated()
        if generated:
            generated.check(model.cache, model.batch)

    def identity(self, options: MatchedOptions) -> dict[str, Any]:
        generated = options.generated()
        return {"construction": options.construction, **({"generate": generated.as_dict()} if generated else {})}

    def check_outcome(self, results: dict[str, Any], prepared: PreparedRun) -> None:
        """Every item missing its boundary means the rule is wrong: the records are kept, but the command fails."""
        summary, settings = results[EXPERIMENT][0], prepared.settings
        if summary["n"] and not summary["n_boundary"]:
            raise StageReplayError(
                f"no item reached the boundary {settings.boundary} within {settings.decode.max_stage1_tokens} "
                f"stage-1 tokens ({summary['n']} recorded as no_boundary)",
                "check the boundary rule against the model's output, or raise --max-stage1-tokens",
            )

    def section(self, prepared: PreparedRun, options: MatchedOptions, run: Run) -> StageSection:
        """`construction` is the first fresh construction (the one later stages set against live), `arms` every one
        where there are several."""
        cs, generated = constructions(options.construction), options.generated()
        return MatchedStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                            construction=cs[0], **({"arms": list(cs)} if len(cs) > 1 else {}),
                            **({"generate": generated.as_dict()} if generated else {}))

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        own: MatchedStage = self.stage_of(stage)
        params = MatchedParams(stage_constructions(own), Generated(**(own.generate or {})))
        return [Batch(prepared.model, [Job(item, prepared.settings, params) for item in prepared.items])]

    def work(self, lm: LM, job: Job) -> Payload:
        return matched_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """Every item id of the run."""
        return [(i, "") for i in config.item_ids]

    def replay_job(self, replay: Replay) -> Job:
        own: MatchedStage = self.stage_of(replay.stage)
        return Job(replay.item, replay.settings, MatchedParams(stage_constructions(own),
                                                               Generated(**(own.generate or {}))))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        own: MatchedStage = self.stage_of(stage)
        if own.generate:
            return None  # live's forwards were transformers' generate()'s, speculation's chunks included
        return forwards(record_lengths(record.payload), stage_constructions(own))

    def peak_caches(self, stage: StageSection) -> int:
        """live's and each fresh construction's boundary states, a replica's state and its continuation's."""
        own: MatchedStage = self.stage_of(stage)
        return 3 + len(own.arms or [own.construction])

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[Section]:
        """One section per arm set against live: the construction, or a serving engine's arms (one column each)."""
        own: MatchedStage = self.stage_of(stage)
        out = []
        for construction in own.arms or [own.construction]:
            ours = not own.engine or (own.cross and construction.startswith(f"{own.cross}-"))
            at = own.model.precision if ours else (own.runs_at or own.model.precision)
            summary = summarize_matched(records, construction, checkpoint, at)
            out.append({"engine": own.engine.name, **summary} if own.engine is not None else summary)
        return out

    def tables(self, results: Any) -> list[Table]:
        return [matched_table(results)] if results else []

    def diagnosed(self, results: Any) -> list[tuple[str, Section, dict[str, int]]]:
        return [(f"{m['checkpoint']}: live vs {m['construction']} @ {m['precision']}", m, m["suffix_disagreements"])
                for m in results or [] if m.get("margins") is not None]

    def planned_stage(self, options: MatchedOptions) -> StageSection:
        cs = constructions(options.construction)
        return self.unmade_stage({"construction": cs[0], "arms": list(cs) if len(cs) > 1 else None})

    def planned_forwards(self, assumed: Assumed, options: MatchedOptions) -> Planned:
        """Every item, its divergent pair's first-run arm replayed by the diagnostics."""
        return {"": [(u, forwards(u, options.construction) + assumed.replay(i)) for i, u in enumerate(assumed.items)]}

    def verdict_facts(self, results: Any) -> list[Fact]:
        return matched_facts(results or [])

    def verdict_questions(self, results: Any) -> list[Question]:
        """Its replicas and its faithfulness at its precision, and what its divergence asks next: is it faithful in
        fp32, and does the cache carry the divergence (the 2x2 and the transplant answer). A serving run's sections
        are at what the engine ran (its own types) or, a --cross arm, at our precision: each asks its own. Its facts
        at another precision answer no question of their own."""
        if not results:
            return []
        at = dict.fromkeys([results[0]["precision"], *(m["precision"] for m in results if "engine" in m), "fp32"])
        raised = [REPLICAS, *(faithful(p) for p in at), CARRIES]
        return raised + [q for q in (MARGINS, FIRST_STEP) if any(f.question == q for f in self.verdict_facts(results))]

    def series(self, results: Any) -> dict[SharedFigure, list[Any]]:
        """Each section's pair on the first-divergence figure."""
        strips: list[Strip] = [(f"matched {m['checkpoint']}: live vs {m['construction']} @ {m['precision']}",
                                list(m.get("first_divergence") or []), int(m["suffix_disagreements"]["n"]))
                               for m in results or []]
        return {DIVERGENCE: strips} if strips else {}
