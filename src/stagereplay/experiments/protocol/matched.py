"""Matched: per item, the retained live continuation and a fresh construction of the same token IDs, each
with an exact replica from scratch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, TypeAdapter

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
from stagereplay.experiments.core.diagnostics_summary import Diagnosed
from stagereplay.experiments.core.experiment import Assumed, Batch, Experiment, Planned, Replay, SmallRun
from stagereplay.experiments.core.figures import DIVERGENCE, SharedFigure, Strip
from stagereplay.experiments.core.format import Table
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.lengths import lengths_of
from stagereplay.experiments.core.served import Served
from stagereplay.experiments.core.shape import Shape
from stagereplay.experiments.core.verdict import (
    CARRIES,
    FIRST_STEP,
    MARGINS,
    REPLICAS,
    Fact,
    Question,
    faithful,
)
from stagereplay.experiments.protocol.arms import arm_record, compare, no_boundary, with_token_texts
from stagereplay.experiments.protocol.diagnose import diagnose
from stagereplay.experiments.protocol.matched_stage import (
    EXPERIMENT,
    STAGE1_TOP,
    MatchedOptions,
    MatchedStage,
    constructions,
    stage_constructions,
)
from stagereplay.experiments.protocol.matched_summary import (
    PAYLOAD,
    MatchedSummary,
    matched_facts,
    matched_table,
    summarize_matched,
)
from stagereplay.experiments.protocol.payloads import MODELS, MatchedPayload, NoBoundaryPayload
from stagereplay.experiments.protocol.served_matched import ServedMatched
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import Arm, PayloadModel
from stagereplay.records.summary import Count

if TYPE_CHECKING:
    from stagereplay.experiments.core.compared import RunComparison
    from stagereplay.experiments.core.prepared import PreparedRun
    from stagereplay.experiments.core.run_side import RunSide


@dataclass(frozen=True)
class MatchedParams(Params):
    """A matched job's parameters: the fresh construction(s) set against live (a comma list), and how live is
    built (our loop, or transformers' generate() with an option)."""

    construction: str = "oneshot"
    generated: Generated = field(default_factory=Generated)


def matched_item(lm: LM, job: Job[MatchedParams]) -> MatchedPayload | NoBoundaryPayload:
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
        return no_boundary(item, nb.generated)
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
    return with_token_texts(lm, payload)


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


class Matched(Experiment[MatchedOptions, MatchedStage, MatchedPayload | NoBoundaryPayload, MatchedSummary]):
    """Live continuation vs a fresh construction of the same token IDs, each with an exact replica."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    payload_models: ClassVar[tuple[type[BaseModel], ...]] = MODELS
    served: ClassVar[type[Served] | None] = ServedMatched
    name: ClassVar[str] = EXPERIMENT
    Stage: ClassVar[type[StageSection]] = MatchedStage
    Options: ClassVar[type] = MatchedOptions
    shape: ClassVar[Shape] = Shape(starts_run=True, replays_diagnostics=True)
    Summary: ClassVar[type[BaseModel]] = MatchedSummary
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--n", "3", "--precision", "bf16", "--max-new-tokens", "8"))
    """3 items of 8 tokens: the toy's third item diverges within them in bf16, so a transplant of the run has a pair."""

    def check(self, model: ModelConfig, options: MatchedOptions) -> None:
        generated = options.generated()
        if generated:
            generated.check(model.cache, model.batch)

    def identity(self, options: MatchedOptions) -> dict[str, Any]:
        generated = options.generated()
        return {"construction": options.construction, **({"generate": generated.as_dict()} if generated else {})}

    def check_outcome(self, summaries: list[MatchedSummary], prepared: PreparedRun) -> None:
        """Every item missing its boundary means the rule is wrong: the records are kept, but the command fails."""
        summary, settings = summaries[0], prepared.settings
        if summary.n and not summary.n_boundary:
            raise StageReplayError(
                f"no item reached the boundary {settings.boundary} within {settings.decode.max_stage1_tokens} "
                f"stage-1 tokens ({summary.n} recorded as no_boundary)",
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

    def work(self, lm: LM, job: Job) -> PayloadModel:
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
        return forwards(lengths_of(record), stage_constructions(own))

    def compare_runs(self, a: RunSide, b: RunSide, checkpoint: str) -> RunComparison:
        """Two matched runs' live trajectories and arms, item by item (`experiments.protocol.compare`)."""
        from stagereplay.experiments.protocol.compare import build_comparison
        from stagereplay.experiments.protocol.compare_tables import matched_comparison

        return matched_comparison(build_comparison(a, b, checkpoint))

    def peak_caches(self, stage: StageSection) -> int:
        """live's and each fresh construction's boundary states, a replica's state and its continuation's."""
        own: MatchedStage = self.stage_of(stage)
        return 3 + len(own.arms or [own.construction])

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[MatchedSummary]:
        """One section per arm set against live: the construction, or a serving engine's arms (one column each)."""
        own: MatchedStage = self.stage_of(stage)
        out = []
        for construction in own.arms or [own.construction]:
            ours = not own.engine or (own.cross and construction.startswith(f"{own.cross}-"))
            at = own.model.precision if ours else (own.runs_at or own.model.precision)
            out.append(summarize_matched(records, construction, checkpoint, at,
                                         engine=own.engine.name if own.engine is not None else None))
        return out

    def tables(self, results: list[MatchedSummary]) -> list[Table]:
        return [matched_table(results)] if results else []

    def diagnosed(self, results: list[MatchedSummary]) -> list[tuple[str, Diagnosed, Count]]:
        return [(f"{m.checkpoint}: live vs {m.construction} @ {m.precision}", m, m.suffix_disagreements)
                for m in results if m.margins is not None]

    def planned_stage(self, options: MatchedOptions) -> StageSection:
        cs = constructions(options.construction)
        return self.unmade_stage({"construction": cs[0], "arms": list(cs) if len(cs) > 1 else None})

    def planned_forwards(self, assumed: Assumed, options: MatchedOptions) -> Planned:
        """Every item, its divergent pair's first-run arm replayed by the diagnostics."""
        return {"": [(u, forwards(u, options.construction) + assumed.replay(i)) for i, u in enumerate(assumed.items)]}

    def verdict_facts(self, results: list[MatchedSummary]) -> list[Fact]:
        return matched_facts(results)

    def verdict_questions(self, results: list[MatchedSummary]) -> list[Question]:
        """Its replicas and its faithfulness at its precision, and what its divergence asks next: is it faithful in
        fp32, and does the cache carry the divergence (the 2x2 and the transplant answer). A serving run's sections
        are at what the engine ran (its own types) or, a --cross arm, at our precision: each asks its own. Its facts
        at another precision answer no question of their own."""
        if not results:
            return []
        at = dict.fromkeys([results[0].precision, *(m.precision for m in results if m.engine is not None), "fp32"])
        raised = [REPLICAS, *(faithful(p) for p in at), CARRIES]
        return raised + [q for q in (MARGINS, FIRST_STEP) if any(f.question == q for f in self.verdict_facts(results))]

    def series(self, results: list[MatchedSummary]) -> dict[SharedFigure, list[Any]]:
        """Each section's pair on the first-divergence figure."""
        strips: list[Strip] = [(f"matched {m.checkpoint}: live vs {m.construction} @ {m.precision}",
                                list(m.first_divergence), m.suffix_disagreements.n)
                               for m in results]
        return {DIVERGENCE: strips} if strips else {}
