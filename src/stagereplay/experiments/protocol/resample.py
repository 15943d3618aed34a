"""Resample: does a re-prefilled boundary state give the same distribution of sampled continuations as the
live one?

Stage-replay methods mostly sample (Thought Anchors-style importance draws ~100 continuations per prefix at
temperature 0.6, top-p 0.95). Per item this takes K seeded draws from each of three boundary states of the
matched run's prefix: the live state, a live replica, and a fresh construction (oneshot by default). Every
draw starts from a clone of its state's cache: K decodes per state, never K prefills.

Seed streams (each draw's seed is `derive_seed(seed, item_id, "resample", stream, j)`, j = 0..K-1):

    A  live, fresh and live replica: coupled, draw j shares its seed on all three sides, so a differing
       draw is the cache's doing (live vs live replica must show none: the negative control)
    B  fresh, independent of A: live(A) vs fresh(B) compares answer distributions as two samples
    C  live, independent of A: live(A) vs live(C) is the null for that comparison

At the matched run's own precision the live state is regenerated from the prompt and must reproduce the
recorded prefix; at another precision the prefix is held fixed and `incremental` (the same operations as
live generation, bit-exact with it as the bridge shows) stands in for live. Each draw is an arm of the
record, so the audit re-executes and checks every one, and the export gives one row per draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter

from stagereplay.engine.constructions import parse_construction
from stagereplay.engine.decode import DecodeConfig, derive_seed
from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards, live_forwards
from stagereplay.engine.lm import LM, BoundaryState, NoBoundary
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.experiment import Assumed, Batch, Experiment, Planned, Replay, SmallRun
from stagereplay.experiments.core.figures import ReportFigure
from stagereplay.experiments.core.format import Table
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.lengths import lengths_of
from stagereplay.experiments.core.shape import Shape
from stagereplay.experiments.protocol.matched_stage import EXPERIMENT as MATCHED
from stagereplay.experiments.protocol.matched_stage import fixed_prefixes, fixed_state
from stagereplay.experiments.protocol.payloads import ResamplePayload
from stagereplay.experiments.protocol.resample_summary import (
    ResampleSummary,
    resample_figures,
    resample_tables,
    summarize_resample,
)
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import Draw, PayloadModel
from stagereplay.tasks.scoring import answer_extractor, scorer_by_name

if TYPE_CHECKING:
    from stagereplay.experiments.core.prepared import PreparedRun

EXPERIMENT = "resample"
PAYLOAD: TypeAdapter[ResamplePayload] = TypeAdapter(ResamplePayload)
"""A resample record's payload (`records.payloads`)."""
STREAMS = {
    "A": "coupled: live, fresh and live replica draw j share this seed",
    "B": "independent: fresh draws, set against live(A)",
    "C": "null: live draws, set against live(A)",
}
SEED_RULE = "derive_seed(seed, item_id, 'resample', stream, str(j))"


@dataclass(frozen=True)
class ResampleConfig:
    """K sampled continuations per boundary state, drawn the way users sample."""

    k: int = field(default=32, metadata={"help": "draws per state and seed stream"})
    temperature: float = field(default=0.6, metadata={"help": "sampling temperature"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k cut (0 = off)"})
    construction: str = field(default="oneshot", metadata={"help": "the fresh construction set against live"})
    n: int | None = field(default=None, metadata={"help": "first n items that reached the boundary (all: None)"})
    precisions: tuple[str, ...] = field(default=(), metadata={"help": "precisions to draw at (the run's: empty)"})
    seed: int = field(default=0, metadata={"help": "base seed of the three seed streams"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", tuple(self.precisions))
        if self.k < 1:
            raise StageReplayError(f"--k must be at least 1, got {self.k}", "pass e.g. --k 32")
        if self.n is not None and self.n < 1:
            raise StageReplayError(f"--n must be at least 1, got {self.n}", "pass a positive --n")
        if not parse_construction(self.construction).fixed_prefix:
            raise StageReplayError("the fresh side of resample cannot be live", "use e.g. --construction oneshot")
        self.sampling(1)  # temperature, top-p and top-k are checked where every sampler checks them

    def sampling(self, max_new_tokens: int) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=max_new_tokens, sample=True, temperature=self.temperature,
                            top_k=self.top_k, top_p=self.top_p)


@dataclass(frozen=True)
class ResampleParams(Params):
    """A resample job's parameters: the matched prefix, the draws, the precision (the record's part) and what
    stands in for live there (`live`: live generation again; `incremental` at another precision)."""

    prefix: tuple[int, ...]
    config: ResampleConfig
    precision: str
    live_source: str

    @property
    def part(self) -> str:
        return self.precision


def draw_names(construction: str, k: int) -> list[str]:
    """The arms `resample_item` draws, in order: K per (state, stream)."""
    return [f"{name}:{stream}{j}" for name, stream in (("live", "A"), (construction, "A"), ("live#replica", "A"),
                                                        (construction, "B"), ("live", "C")) for j in range(k)]


def forwards(n: Lengths, k: int, construction: str, live_source: str) -> list[int]:
    """The forwards `resample_item` makes on a prefix of lengths `n`: the live state and its replica (live
    generation to the boundary, or `incremental` at another precision), the fresh construction, then 5K draws."""
    if live_source == "incremental":
        states = construct_forwards("incremental", n.prompt, n.prefix) * 2
    else:
        states = live_forwards(n.prompt, n.stage1 or 0, None) * 2
    out = states + construct_forwards(construction, n.prompt, n.prefix, from_cache=True)
    for name in draw_names(construction, k):
        out += continuation_forwards(n.of(name))
    return out


def draw_seed(seed: int, item_id: str, stream: str, j: int) -> int:
    return derive_seed(seed, item_id, EXPERIMENT, stream, str(j))


def _states(lm: LM, job: Job[ResampleParams]) -> tuple[BoundaryState, BoundaryState] | None:
    """(live, live replica) for the job's prefix, or None when live generation no longer reaches it."""
    item, s, prefix = job.item, job.settings, job.params.prefix
    if job.params.live_source == "incremental":
        fixed = fixed_state(item, list(prefix), s, lm)
        return lm.construct(fixed, "incremental"), lm.construct(fixed, "incremental")
    try:
        live = lm.live(item, s.rule(), s.decode, keep_going=False)
        replica = lm.live(item, s.rule(), s.decode, keep_going=False)
    except NoBoundary:
        return None
    return (live, replica) if live.prefix == prefix == replica.prefix else None


def resample_item(lm: LM, job: Job[ResampleParams]) -> ResamplePayload:
    """5K draws for one item: live(A), fresh(A), live replica(A), fresh(B), live(C). Pure in (model, job)."""
    item, s = job.item, job.settings
    cfg = job.params.config
    states = _states(lm, job)

    def payload(status: Literal["ok", "not_reproduced"], boundary: int | None, draws: list[Draw]) -> ResamplePayload:
        return ResamplePayload(status=status, prompt_ids=list(item.prompt_ids), prefix_ids=list(job.params.prefix),
                               boundary=boundary, answer=item.answer, live_source=job.params.live_source,
                               arms=draws, comparisons=[])

    if states is None:
        return payload("not_reproduced", None, [])
    live, replica = states
    fresh = lm.construct(live, cfg.construction)
    dc = cfg.sampling(s.decode.max_new_tokens)
    answer_of, score = answer_extractor(s.scorer), scorer_by_name(s.scorer)
    draws = []
    for name, state, stream in (("live", live, "A"), (cfg.construction, fresh, "A"), ("live#replica", replica, "A"),
                                (cfg.construction, fresh, "B"), ("live", live, "C")):  # the order of draw_names
        cache_fp = state.fingerprint()
        for j in range(cfg.k):
            seed = draw_seed(cfg.seed, item.id, stream, j)
            cont = lm.continue_from(state, dc, seed, keep_steps=False)
            text = lm.text([*live.stage1, *cont.suffix])
            draws.append(Draw(
                name=f"{name}:{stream}{j}", state=name, stream=stream, draw=j, seed=seed,
                construction=state.construction, precision=lm.config.precision,
                suffix_ids=list(cont.suffix), suffix_fp=cont.fingerprint, cache_fp=cache_fp,
                stop=cont.stop, answer=answer_of(text), correct=bool(score(text, item.answer)),
            ))
    return payload("ok", len(live.prefix), draws)


class ResampleStage(StageSection):
    """Resample's frozen section: the sampling settings, the seed rule and the items, frozen before the first draw."""

    config: ResampleConfig = Field(description="the draws: K, sampling, the fresh construction, the seed")
    precisions: list[str] = Field(description="the precisions drawn at, each a part of every item's unit")
    items: list[str] = Field(description="the items drawn on (the first that reached the boundary)")
    seeds: dict[str, Any] = Field(description="the seed rule: base, rule and streams")


def resample_params(stage: ResampleStage, precision: str, prefix: list[int] | None) -> ResampleParams:
    """A resample job's parameters, from its frozen stage: shared by the run and its audit."""
    live_source = "live" if precision == stage.model.precision else "incremental"
    return ResampleParams(tuple(prefix or ()), stage.config, precision, live_source)


class Resample(Experiment[ResampleConfig, ResampleStage, ResamplePayload, ResampleSummary]):
    """K seeded draws from live and fresh boundary states: coupled (shared seeds) and independent designs."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    name: ClassVar[str] = EXPERIMENT
    Summary: ClassVar[type[BaseModel]] = ResampleSummary
    Stage: ClassVar[type[StageSection]] = ResampleStage
    Options: ClassVar[type] = ResampleConfig
    shape: ClassVar[Shape] = Shape(fixed_prefix=True, per_precision=True, label="resample")
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--k", "1", "--n", "1"), extends=MATCHED)

    def check(self, model: ModelConfig, options: ResampleConfig) -> None:
        for p in options.precisions:
            model.with_precision(p)  # validates the name before anything runs

    def section(self, prepared: PreparedRun, options: ResampleConfig, run: Run) -> StageSection:
        """Frozen before the first draw: the sampling settings, the seed rule and the items."""
        fixed = fixed_prefixes(run, prepared.checkpoint)[: options.n]
        return ResampleStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                             config=options, precisions=list(options.precisions or (prepared.model.precision,)),
                             items=[item.id for item, _ in fixed],
                             seeds={"base": options.seed, "rule": SEED_RULE, "streams": STREAMS})

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        own: ResampleStage = self.stage_of(stage)
        fixed = [(item, prefix) for item, prefix in fixed_prefixes(run, prepared.checkpoint) if item.id in own.items]
        return [Batch(prepared.model.with_precision(p),
                      [Job(item, prepared.settings, resample_params(own, p, prefix)) for item, prefix in fixed])
                for p in own.precisions]

    def work(self, lm: LM, job: Job) -> PayloadModel:
        return resample_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """Its frozen items, at each precision."""
        own: ResampleStage = self.stage_of(stage)
        return [(i, p) for p in own.precisions for i in own.items]

    def replay_job(self, replay: Replay) -> Job:
        return Job(replay.item, replay.settings, resample_params(self.stage_of(replay.stage), replay.record.part,
                                                                 replay.prefix))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        if PAYLOAD.validate_python(record.payload).status != "ok":
            return None  # live generation no longer reached the prefix: how far it went is not recorded
        own: ResampleStage = self.stage_of(stage)
        source = resample_params(own, record.part, None).live_source
        return forwards(lengths_of(record), own.config.k, own.config.construction, source)

    def peak_caches(self, stage: StageSection) -> int:
        return 4  # live's, its replica's and the fresh state, and a draw's continuation

    def planned_forwards(self, assumed: Assumed, options: ResampleConfig) -> Planned:
        """Its first `n` items at each precision, live generation standing in for live at the run's precision and
        `incremental` at another (`resample_params`)."""
        return {p: [(u, forwards(u, options.k, options.construction,
                                 "live" if p == assumed.precision else "incremental"))
                    for u in assumed.items[: options.n]]
                for p in options.precisions or (assumed.precision,)}

    def figures(self, results: list[ResampleSummary]) -> list[ReportFigure]:
        return resample_figures(results)

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[ResampleSummary]:
        own: ResampleStage = self.stage_of(stage)
        return summarize_resample(records, own.precisions, own.config, checkpoint)

    def tables(self, results: list[ResampleSummary]) -> list[Table]:
        return resample_tables(results) if results else []
