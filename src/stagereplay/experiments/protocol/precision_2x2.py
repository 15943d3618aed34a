"""Fixed-prefix 2x2: the matched run's token IDs held fixed, construction crossed with precision."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, TypeAdapter

from stagereplay.engine.constructions import parse_construction
from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards
from stagereplay.engine.lm import LM, BoundaryState, Continuation
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
from stagereplay.experiments.core.stats import first_divergence
from stagereplay.experiments.core.verdict import FIRST_STEP, Fact, Question
from stagereplay.experiments.protocol.arms import (
    arm_record,
    carried_arm,
    compare,
    matched_arms,
    with_token_texts,
)
from stagereplay.experiments.protocol.diagnose import diagnose
from stagereplay.experiments.protocol.grid_stage import GridOptions, GridStage
from stagereplay.experiments.protocol.matched_stage import EXPERIMENT as MATCHED
from stagereplay.experiments.protocol.matched_stage import (
    MatchedStage,
    fixed_prefixes,
    fixed_state,
    matched_ok,
    matched_records,
    matched_stage,
)
from stagereplay.experiments.protocol.matched_summary import reached
from stagereplay.experiments.protocol.payloads import GridPayload, MatchedPayload
from stagereplay.experiments.protocol.precision_2x2_summary import (
    GridSummary,
    first_pair,
    grid_facts,
    precision_2x2_tables,
    summarize_2x2,
)
from stagereplay.experiments.protocol.served_grid import ServedGrid
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import Arm, Diagnostics, PayloadModel
from stagereplay.records.summary import Count

if TYPE_CHECKING:
    from stagereplay.experiments.core.prepared import PreparedRun

EXPERIMENT = "precision_2x2"
DEFAULT_CONSTRUCTIONS = ("incremental", "oneshot")
PAYLOAD: TypeAdapter[GridPayload] = TypeAdapter(GridPayload)
"""A 2x2 record's payload (`records.payloads`), a serving run's too."""


Carried = tuple[tuple[str, str, Arm, list[float | None]], ...]
"""(construction, `matched/<checkpoint>:<arm>`, that arm, its step margins) per carried-over arm (`reused_arms`)."""


@dataclass(frozen=True)
class GridParams(Params):
    """A 2x2 job's parameters: the fixed prefix, the constructions, the precision (the record's part) and the
    matched arms it may carry over."""

    prefix: tuple[int, ...]
    constructions: tuple[str, ...]
    precision: str
    reuse: Carried = ()

    @property
    def part(self) -> str:
        return self.precision


def grid_item(lm: LM, job: Job[GridParams]) -> GridPayload:
    """Every construction at this process's precision on one fixed prefix, and their pairwise comparison.

    With `reuse` (see `reused_arms`), a construction whose arm the matched run already computed on this model
    (its own construction, and `incremental`, which makes live generation's calls: the prompt, then one token
    per forward) is not continued again: its cache is built (for the cache differences) and must be the
    recorded arm's bit for bit (its fingerprint); it is then continued only as far as the diagnostics read its
    logits (the first step and the latest first divergent one, `diagnostic_steps`), and those steps must repeat
    the recorded tokens. Its arm is then the matched record's, marked `same_as`; otherwise it is decoded in
    full and recorded as its own.
    """
    item, s = job.item, job.settings
    state = fixed_state(item, list(job.params.prefix), s, lm)
    reuse = {c: (source, arm, margins) for c, source, arm, margins in job.params.reuse}
    built = {f"{c}@{lm.config.precision}": (c, lm.construct(state, c)) for c in job.params.constructions}
    conts: dict[str, Continuation] = {}
    for name, (c, b) in built.items():
        if c not in reuse:
            # Each arm watches the earlier ones' suffixes: its logits at their first divergent step are kept as
            # it runs; the earlier arm's are replayed from its cache, which every arm here keeps for
            # `cache_difference`.
            conts[name] = lm.continue_from(b, s.decode, watch=[cont.suffix for cont in conts.values()])
    suffixes = {name: conts[name].suffix if c not in reuse else tuple(reuse[c][1].suffix_ids)
                for name, (c, _) in built.items()}
    carried: dict[str, tuple[Arm, list[float | None]]] = {}  # arm name -> (its arm, its step margins)
    for name, (c, b) in built.items():
        if c not in reuse:
            continue
        source, recorded, margins = reuse[c]
        others = [suffix for other, suffix in suffixes.items() if other != name]  # it watches every other arm
        fp = b.fingerprint()
        if fp == recorded.cache_fp:
            steps = diagnostic_steps(recorded.suffix_ids, others)
            look = lm.continue_from(b, replace(s.decode, max_new_tokens=steps), watch=others)
            if list(look.suffix) == recorded.suffix_ids[: len(look.suffix)]:
                conts[name] = look
                carried[name] = (carried_arm(recorded, name, c, source), margins)
                continue
        # not the computation the matched run recorded: this arm is its own
        conts[name] = lm.continue_from(b, s.decode, watch=others)
    runs: dict[str, tuple[BoundaryState, Continuation]] = {name: (b, conts[name]) for name, (_, b) in built.items()}
    arms = [carried[name][0] if name in carried else arm_record(lm, name, b, cont, state.stage1, item, s.scorer)
            for name, (b, cont) in runs.items()]
    comparisons = [compare(item.id, a, b) for i, a in enumerate(arms) for b in arms[i + 1 :]]
    pairs = [(c.a, c.b) for c in comparisons]
    diagnosed = diagnose(runs, pairs, cache_pairs=pairs)
    # A carried arm's margins are every step's, as the matched run computed them.
    diagnostics = Diagnostics(margins={**diagnosed.margins, **{name: m for name, (_, m) in carried.items()}},
                              pairs=diagnosed.pairs)
    payload = GridPayload(status="ok", precision=lm.config.precision, prompt_ids=list(item.prompt_ids),
                          prefix_ids=list(state.prefix), boundary=len(state.prefix), answer=item.answer, arms=arms,
                          comparisons=comparisons, diagnostics=diagnostics)
    return with_token_texts(lm, payload)


def forwards(n: Lengths, constructions: tuple[str, ...], precision: str) -> list[int]:
    """The forwards `grid_item` makes at `precision` on a prefix of lengths `n`: each construction and its
    continuation; one carried over from matched (`n.looks`) continued only as many steps as its diagnostics read."""
    out: list[int] = []
    looks = dict(n.looks)
    for c in constructions:
        steps = looks[c] if c in looks else n.of(f"{c}@{precision}")
        out += construct_forwards(c, n.prompt, n.prefix) + continuation_forwards(steps)
    return out


def diagnostic_steps(recorded: list[int], others: list[tuple[int, ...]]) -> int:
    """How many steps of an arm whose suffix is `recorded` the diagnostics read against arms `others`: through
    the latest first divergence from any of them (the first step when none diverges), at most all of them."""
    last = max((first_divergence(recorded, list(o)) or 0 for o in others), default=0)
    return max(1, min(last + 1, len(recorded)))


CARRIED_FROM = {"incremental": "live"}
"""A fixed-prefix construction that makes the same forwards as a matched arm of another name: `incremental`
feeds the prompt in one forward, then one token per forward, as live generation did (the bridge's claim, which
the carried arm's cache fingerprint checks item by item)."""


def reused_arms(grid_stage: GridStage, matched_stage: StageSection | None, matched: MatchedPayload | None,
                checkpoint: str, precision: str) -> Carried:
    """(construction, `matched/<checkpoint>:<arm>`, that arm, its step margins) for each construction of the 2x2
    at `precision` that would repeat an arm of the matched record: the same model at the same precision, the
    same settings, from the same prefix (the 2x2's prefixes are the matched run's), and the same forwards (the
    matched run's own construction, and `incremental` for `live`: `CARRIED_FROM`). Empty when anything differs
    or the matched record has no diagnostics to carry over."""
    arms = matched_arms(grid_stage, matched_stage, matched, precision)
    if not arms:
        return ()
    assert matched_stage is not None
    own = matched_stage.as_stage(MatchedStage).construction
    sources = {own: own, **CARRIED_FROM}
    assert matched is not None
    margins = matched.diagnostics.margins if matched.diagnostics else {}
    return tuple((c, f"{MATCHED}/{checkpoint}:{sources[c]}", arms[sources[c]], margins[sources[c]])
                 for c in grid_stage.constructions if c in sources and sources[c] in arms
                 and sources[c] in margins)


def check_fixed_constructions(constructions: tuple[str, ...]) -> None:
    """Constructions that rebuild a state from fixed token IDs (all but live, which only generation makes)."""
    made = [parse_construction(c) for c in constructions]  # every name checked before live is refused
    if not all(m.fixed_prefix for m in made):
        raise StageReplayError("live is not a fixed-prefix construction", "use incremental, oneshot, chunked:<n> "
                                                                          "or retokenized")


def planned_grid(assumed: Assumed, constructions: tuple[str, ...], precision: str) -> list[tuple[Lengths, list[int]]]:
    """Every item at `precision`. At the run's precision the matched arms are carried over (`reused_arms`): each
    decoded only to the first divergence, at most all of it where the arms diverge, its first step where they do not;
    a pair is replayed by the diagnostics only where one of its arms is decoded in full (at another precision the
    arms are assumed not to diverge)."""
    at_run = precision == assumed.precision
    carried = [c for c in constructions if assumed.dedup and at_run and c in (assumed.construction, *CARRIED_FROM)]
    pairs = sum(1 for i, a in enumerate(constructions) for b in constructions[i + 1 :]
                if not (a in carried and b in carried))
    return [(u, forwards(replace(u, looks=tuple((c, u.suffix if i < assumed.divergent else 1) for c in carried)),
                         constructions, precision)
             + (assumed.replay(i) * pairs if at_run else []))
            for i, u in enumerate(assumed.items)]


def grid_lengths(record: Record) -> Lengths:
    """A 2x2 record's lengths, with the steps each arm it carried over from matched was decoded again for its
    diagnostics (`diagnostic_steps`: against every other arm's suffix, as `grid_item` runs it)."""
    n = lengths_of(record)
    arms = PAYLOAD.validate_python(record.payload).arms
    looks = tuple((a.construction, diagnostic_steps(a.suffix_ids, [tuple(o.suffix_ids) for o in arms if o is not a]))
                  for a in arms if a.same_as)
    return Lengths(n.prompt, n.stage1, 0, n.arms, looks=looks)


class PrecisionGrid(Experiment[GridOptions, GridStage, GridPayload, GridSummary]):
    """Hold the run's prefixes fixed; cross construction with precision."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    served: ClassVar[type[Served] | None] = ServedGrid
    name: ClassVar[str] = EXPERIMENT
    Stage: ClassVar[type[StageSection]] = GridStage
    Options: ClassVar[type] = GridOptions
    shape: ClassVar[Shape] = Shape(fixed_prefix=True, per_precision=True, many=False, replays_diagnostics=True, label="2x2")
    Summary: ClassVar[type[BaseModel]] = GridSummary
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--precisions", "bf16"), extends=MATCHED)

    def check(self, model: ModelConfig, options: GridOptions) -> None:
        check_fixed_constructions(options.constructions or DEFAULT_CONSTRUCTIONS)
        for p in options.precisions:
            model.with_precision(p)  # validates the name before anything runs

    def section(self, prepared: PreparedRun, options: GridOptions, run: Run) -> StageSection:
        return GridStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                         constructions=list(options.constructions or DEFAULT_CONSTRUCTIONS),
                         precisions=list(options.precisions))

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        own: GridStage = self.stage_of(stage)
        checkpoint, constructions = prepared.checkpoint, tuple(own.constructions)
        fixed = fixed_prefixes(run, checkpoint)
        first = matched_stage(run.manifest.stages, checkpoint)
        matched = matched_records(run, checkpoint)
        return [Batch(prepared.model.with_precision(precision),
                      [Job(item, prepared.settings, GridParams(tuple(prefix), constructions, precision,
                                                              reused_arms(own, first, matched[item.id], checkpoint,
                                                                          precision)))
                       for item, prefix in fixed])
                for precision in own.precisions]

    def work(self, lm: LM, job: Job) -> PayloadModel:
        return grid_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """Every prefix of its matched run, at each precision."""
        ok = matched_ok(records, checkpoint)
        return [(i, p) for p in self.stage_of(stage).precisions for i in ok]

    def replay_job(self, replay: Replay) -> Job:
        checkpoint, part = replay.record.checkpoint, replay.record.part
        own: GridStage = self.stage_of(replay.stage)
        reuse = () if replay.matched is None else reused_arms(own, replay.matched_stage, reached(replay.matched),
                                                              checkpoint, part)
        return Job(replay.item, replay.settings, GridParams(tuple(replay.prefix or ()),
                                                            tuple(own.constructions), part, reuse))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        return forwards(grid_lengths(record), tuple(self.stage_of(stage).constructions), record.part)

    def peak_caches(self, stage: StageSection) -> int:
        return len(self.stage_of(stage).constructions) + 1  # every construction's state, and one continuation's

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[GridSummary]:
        own: GridStage = self.stage_of(stage)
        return [summarize_2x2(records, own.constructions, own.precisions, checkpoint)]

    def tables(self, results: GridSummary | None) -> list[Table]:
        return precision_2x2_tables(results) if results else []

    def diagnosed(self, results: GridSummary | None) -> list[tuple[str, Diagnosed, Count]]:
        if not results:
            return []
        a, b = first_pair(results)
        return [(f"2x2 {results.checkpoint}: {a} vs {b} @ {d.precision}", d, Count(k=d.k, n=d.n))
                for d in results.disagreements if d.margins is not None]

    def planned_stage(self, options: GridOptions) -> StageSection:
        return self.unmade_stage({"constructions": list(options.constructions or DEFAULT_CONSTRUCTIONS),
                                  "precisions": list(options.precisions)})

    def planned_forwards(self, assumed: Assumed, options: GridOptions) -> Planned:
        cs = tuple(options.constructions or DEFAULT_CONSTRUCTIONS)
        return {p: planned_grid(assumed, cs, p) for p in options.precisions}

    def verdict_facts(self, results: GridSummary | None) -> list[Fact]:
        return grid_facts(results) if results else []

    def verdict_questions(self, results: GridSummary | None) -> list[Question]:
        """None of its precisions: its rows answer the faithfulness questions the run asks (matched's), a 2x2 at
        fp16 says nothing of a run at bf16; only its first-step logits raise their question."""
        return [FIRST_STEP] if any(f.question == FIRST_STEP for f in self.verdict_facts(results)) else []

    def series(self, results: GridSummary | None) -> dict[SharedFigure, list[Any]]:
        """Each precision's first pair on the first-divergence figure."""
        if not results:
            return {}
        a, b = [*results.constructions, "incremental", "oneshot"][:2]
        strips: list[Strip] = [(f"2x2 {results.checkpoint}: {a} vs {b} @ {d.precision}", list(d.first_divergence),
                                d.n)
                               for d in results.disagreements]
        return {DIVERGENCE: strips} if strips else {}
