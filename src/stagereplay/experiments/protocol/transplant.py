"""Transplant: swap K/V between the live and the fresh boundary states of a divergent item, both directions.

Direction names read `<donor>-><recipient>`. An outcome is `donor` when the transplanted continuation equals the
donor's own suffix, `recipient` when it equals the recipient's, `neither` otherwise. The selection rule and the
selected items are frozen in the manifest before the first transplant runs: that keeps a replication outcome-blind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards, live_forwards
from stagereplay.engine.lm import LM, BoundaryState, Continuation, NoBoundary
from stagereplay.engine.model import ModelConfig
from stagereplay.engine.transplant import TransplantSpec, parse_layers, parse_positions, transplant
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.experiment import Assumed, Batch, Experiment, Planned, Replay, SmallRun
from stagereplay.experiments.core.figures import ReportFigure
from stagereplay.experiments.core.format import Table
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.lengths import lengths_of
from stagereplay.experiments.core.shape import Shape
from stagereplay.experiments.core.stats import first_divergence
from stagereplay.experiments.core.verdict import Fact
from stagereplay.experiments.protocol.arms import arm_record, carried_arm, matched_arms
from stagereplay.experiments.protocol.matched_stage import EXPERIMENT as MATCHED
from stagereplay.experiments.protocol.matched_stage import MatchedStage, matched_records, matched_stage
from stagereplay.experiments.protocol.matched_summary import reached
from stagereplay.experiments.protocol.payloads import (
    BandKind,
    MatchedPayload,
    Outcome,
    PrefixNotReproducedPayload,
    SweepRow,
    TransplantPayload,
)
from stagereplay.experiments.protocol.selection import divergent_ids, divergent_items, parse_selection, select
from stagereplay.experiments.protocol.transplant_summary import (
    PAYLOAD,
    TransplantSummary,
    summarize_transplant,
    transplant_facts,
    transplant_figures,
    transplant_tables,
)
from stagereplay.records.findings import Finding
from stagereplay.records.ledger import Record, Run, diff_fields
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import Arm, Followed, PayloadModel, first_error

if TYPE_CHECKING:
    from stagereplay.experiments.core.prepared import PreparedRun

EXPERIMENT = "transplant"


@dataclass(frozen=True)
class TransplantConfig:
    """What to swap and for which items."""

    construction: str | None = field(default=None, metadata={
        "help": "the fresh arm (None: the matched run's construction)", "cli": False})
    layers: str = field(default="all", metadata={"help": "all | none | A-B,C,..."})
    kv: str = field(default="kv", metadata={"help": "k | v | kv"})
    positions: str | None = field(default=None, metadata={"help": "A:B sequence positions (half-open)"})
    select: str = field(default="all-divergent", metadata={"help": "all-divergent | first:K | random:K:SEED"})
    sweep: bool = field(default=False, metadata={"help": "also every single layer, and every band from the bottom "
                                                           "and from the top"})

    def __post_init__(self) -> None:
        if self.kv not in ("k", "v", "kv"):
            raise StageReplayError(f"unknown --kv {self.kv!r}", "use k, v or kv")
        parse_selection(self.select)
        try:  # the syntax here (any layer count will do); the range against the model in `check_layers`
            parse_layers(self.layers if self.layers not in ("all", "none") else "0", 1 << 30)
        except StageReplayError:
            raise StageReplayError(f"bad --layers {self.layers!r}", "use all, none, or low-high bands, e.g. 0-3,10") from None
        if self.positions is not None:
            start, stop = parse_positions(self.positions, 1 << 30)  # a slice's bounds, nothing allocated
            if start >= stop:
                raise StageReplayError(f"--positions {self.positions!r} selects no position",
                                       "use A:B with A < B, e.g. 0:64")

    @property
    def fresh(self) -> str:
        """The fresh arm (resolved to the matched run's construction when the stage is frozen)."""
        return self.construction or "oneshot"

    def check_layers(self, n_layers: int) -> None:
        """The layers exist in a model of `n_layers` layers (checked before any run directory changes)."""
        parse_layers(self.layers, n_layers)


def sweep_bands(n_layers: int) -> list[tuple[BandKind, tuple[int, ...]]]:
    """Every single layer, every band from the bottom (0..k) and every band from the top (k..L-1)."""
    bands: list[tuple[BandKind, tuple[int, ...]]] = [("single", (i,)) for i in range(n_layers)]
    bands += [("bottom", tuple(range(k + 1))) for k in range(n_layers)]
    bands += [("top", tuple(range(k, n_layers))) for k in range(n_layers)]
    return bands


def followed(suffix: tuple[int, ...], donor: tuple[int, ...], recipient: tuple[int, ...]) -> Outcome:
    """Whose own suffix a transplanted continuation `suffix` equals, and where it leaves each."""
    which: Followed = "donor" if suffix == donor else "recipient" if suffix == recipient else "neither"
    return Outcome(outcome=which, divergence_from_donor=first_divergence(suffix, donor),
                   divergence_from_recipient=first_divergence(suffix, recipient))


@dataclass(frozen=True)
class TransplantParams(Params):
    """A transplant job's parameters: the matched prefix, what to swap, and the matched arms it may carry over."""

    prefix: tuple[int, ...]
    config: TransplantConfig
    reuse: tuple[tuple[str, str, Arm], ...] = ()


def _swap(lm: LM, recipient: BoundaryState, donor: BoundaryState, spec: TransplantSpec, job: Job
          ) -> tuple[BoundaryState, Continuation]:
    cache = transplant(recipient.cache, donor.cache, spec)
    state = BoundaryState(recipient.prefix, recipient.prompt_len, "transplant", cache, recipient.seed)
    return state, lm.continue_from(state, job.settings.decode, keep_steps=False)  # no diagnostics read steps


def transplant_item(lm: LM, job: Job[TransplantParams]) -> TransplantPayload | PrefixNotReproducedPayload:
    """Live and the fresh construction with their own suffixes, then the transplants both ways (and the
    zero-layer control). With `reuse` (`reused_arms`), an own suffix the matched run already decoded from the same
    cache is not decoded again: the boundary cache built here must be the recorded arm's bit for bit (its
    fingerprint), and the arm is then the matched record's, marked `same_as`."""
    item, s = job.item, job.settings
    cfg = job.params.config
    reuse = {name: (source, arm) for name, source, arm in job.params.reuse}
    try:
        live = lm.live(item, s.rule(), s.decode, keep_going="live" not in reuse, keep_steps=False)
    except NoBoundary:
        live = None
    if live is None or list(live.prefix) != list(job.params.prefix):
        # The live run no longer reaches the recorded prefix: transplant between the recorded token states instead.
        live = None
    if live is None:
        return PrefixNotReproducedPayload(status="prefix_not_reproduced", prompt_ids=list(item.prompt_ids),
                                          answer=item.answer, arms=[], comparisons=[])
    fresh = lm.construct(live, cfg.fresh)
    states = {"live": live, cfg.fresh: fresh}
    own: dict[str, Continuation] = {}
    arms: list[Arm] = []
    for name, state in states.items():
        fp = state.fingerprint()
        if name in reuse and reuse[name][1].cache_fp == fp:
            source, recorded = reuse[name]
            own[name] = Continuation(tuple(recorded.suffix_ids), recorded.stop)
            arms.append(carried_arm(recorded, name, state.construction, source))
            continue
        if name == "live":  # the uninterrupted loop's own suffix (its cache was the snapshot's, bit for bit)
            suffix = live.live_suffix if live.live_suffix is not None else lm.continue_from(live, s.decode,
                                                                                              keep_steps=False)
        else:
            suffix = lm.continue_from(state, s.decode, keep_steps=False)
        own[name] = suffix
        arms.append(arm_record(lm, name, state, suffix, live.stage1, item, s.scorer, cache_fp=fp))
    positions = parse_positions(cfg.positions, len(live.prefix) - 1) if cfg.positions else None
    pairs = [("live", cfg.fresh), (cfg.fresh, "live")]  # (donor, recipient)

    def run_spec(layers: tuple[int, ...], arm_prefix: str | None) -> dict[str, Outcome]:
        """Outcome per direction; the continuations become arms when `arm_prefix` is given (not for sweeps)."""
        out = {}
        for d, r in pairs:
            state, cont = _swap(lm, states[r], states[d], TransplantSpec(layers, cfg.kv, positions), job)
            out[f"{d}->{r}"] = followed(cont.suffix, own[d].suffix, own[r].suffix)
            if arm_prefix is not None:
                arms.append(arm_record(lm, f"{arm_prefix}{d}->{r}", state, cont, live.stage1, item, s.scorer))
            del state  # before the next direction's transplant: at most four caches alive (README)
        return out

    directions, control = run_spec(parse_layers(cfg.layers, lm.n_layers), ""), run_spec((), "control:")
    sweep = [SweepRow(kind=kind, layers=list(layers), **{k: v.outcome for k, v in run_spec(layers, None).items()})
             for kind, layers in sweep_bands(lm.n_layers)] if cfg.sweep else None
    return TransplantPayload(
        status="ok", prompt_ids=list(item.prompt_ids), prefix_ids=list(live.prefix), boundary=len(live.prefix),
        answer=item.answer, baseline_diverges=own["live"].suffix != own[cfg.fresh].suffix,
        directions=directions, control=control, arms=arms, comparisons=[],
        **({"sweep": sweep} if sweep is not None else {}),  # absent without --sweep
    )


def forwards(n: Lengths, cfg: TransplantConfig, n_layers: int) -> list[int]:
    """The forwards `transplant_item` makes for an item of lengths `n`: live with its suffix, the fresh
    construction with its own (neither suffix where it is carried over from matched: `n.looks`), then one
    continuation per direction (transplant and control) and, with a sweep, per direction of each of the
    3 x `n_layers` bands (sweep continuations are not recorded: `n.suffix`)."""
    c, carried = cfg.fresh, dict(n.looks)
    out = live_forwards(n.prompt, n.stage1 or 0, None if "live" in carried else n.of("live"))
    out += construct_forwards(c, n.prompt, n.prefix, from_cache=True)
    out += continuation_forwards(carried.get(c, n.of(c)))
    for arm in (f"{p}{d}->{r}" for p in ("", "control:") for d, r in (("live", c), (c, "live"))):
        out += continuation_forwards(n.of(arm))
    if cfg.sweep:
        out += continuation_forwards(n.suffix) * (2 * len(sweep_bands(n_layers)))
    return out


def reused_arms(stage: TransplantStage, matched_stage: StageSection | None, matched: MatchedPayload | None,
                checkpoint: str) -> tuple[tuple[str, str, Arm], ...]:
    """(arm, `matched/<checkpoint>:<arm>`, that arm) for the transplant's own arms that the matched record of the
    item already decoded: live, and the fresh construction when it is the matched run's, on the same model at the
    same precision with the same settings. Empty when anything differs."""
    arms = matched_arms(stage, matched_stage, matched)
    if not arms:
        return ()
    assert matched_stage is not None
    construction = stage.config.fresh
    names = ["live"] + ([construction] if construction == matched_stage.as_stage(MatchedStage).construction else [])
    return tuple((name, f"{MATCHED}/{checkpoint}:{name}", arms[name]) for name in names if name in arms)


def check_selection(model: ModelConfig, cfg: TransplantConfig, prefixes: list[list[int]]) -> None:
    """Before the stage is frozen: `--layers` is valid and `--positions` lies inside a selected layer's cache
    for every selected item (sliding-window layers hold only their last window - 1 positions)."""
    from pathlib import Path

    from stagereplay.engine.cache import layer_windows
    from stagereplay.engine.model import load_checked_config
    from stagereplay.engine.transplant import check_positions, held_spans

    windows = layer_windows(load_checked_config(Path(model.path)))
    layers = parse_layers(cfg.layers, len(windows))
    if cfg.positions is None:
        return
    for prefix in prefixes:
        length = len(prefix) - 1
        check_positions(parse_positions(cfg.positions, length), layers, held_spans(windows, length))


# -- what verify checks, results.json and the report -------------------------------------------------------------


def transplant_claims(p: TransplantPayload, construction: str) -> list[str]:
    arms = {a.name: a.suffix_ids for a in p.arms}
    bad = []
    if "live" in arms and construction in arms and p.baseline_diverges != (arms["live"] != arms[construction]):
        bad.append("baseline_diverges does not follow from the live and fresh arms")
    for key, prefix, outcomes in (("directions", "", p.directions), ("control", "control:", p.control)):
        for direction, recorded in outcomes.items():
            donor, _, recipient = direction.partition("->")
            got = arms.get(f"{prefix}{direction}")
            if got is None or donor not in arms or recipient not in arms:
                bad.append(f"{key}.{direction}: its arms are missing")
                continue
            derived = followed(tuple(got), tuple(arms[donor]), tuple(arms[recipient]))
            for f in diff_fields(recorded.as_payload(), derived.as_payload()):
                bad.append(f"{key}.{direction}.{f} does not follow from the arms")
    return bad


def selection_findings(name: str, stage: TransplantStage, records: list[Record]) -> list[Finding]:
    """The frozen selection must be what its rule picks from the matched run's divergent items."""
    checkpoint = name.partition("/")[2]
    rule, construction = stage.config.select, stage.config.fresh
    matched = [r for r in records if r.experiment == MATCHED and r.checkpoint == checkpoint]
    picked = sorted(select(divergent_ids(matched, construction), rule))
    if picked == sorted(stage.selected):
        return []
    changed = sorted(set(picked) ^ set(stage.selected))
    return [Finding(item_id=i, what=f"{name}: selected is not what rule {rule} picks from the matched records")
            for i in changed]


class TransplantStage(StageSection):
    """The transplant's frozen section: what is swapped, the rule, and the items it picked, frozen before any
    outcome exists."""

    config: TransplantConfig = Field(description="what is swapped, for which items (its construction resolved)")
    selected: list[str] = Field(description="the items the rule picked from the matched run's divergent ones")


class Transplant(Experiment[TransplantConfig, TransplantStage, TransplantPayload | PrefixNotReproducedPayload,
                                TransplantSummary]):
    """Swap K/V between live and fresh boundary states of divergent items, both directions, and continue."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    name: ClassVar[str] = EXPERIMENT
    Summary: ClassVar[type[BaseModel]] = TransplantSummary
    Stage: ClassVar[type[StageSection]] = TransplantStage
    Options: ClassVar[type] = TransplantConfig
    shape: ClassVar[Shape] = Shape(fixed_prefix=True, label="transplant")
    smallest_run: ClassVar[SmallRun | None] = SmallRun(extends=MATCHED)
    """Every divergent pair of the smallest matched run: it has one."""

    def check(self, model: ModelConfig, options: TransplantConfig) -> None:
        from stagereplay.engine.model import load_config_and_tokenizer

        hf_config, _ = load_config_and_tokenizer(model.path)
        options.check_layers(hf_config.get_text_config().num_hidden_layers)

    def section(self, prepared: PreparedRun, options: TransplantConfig, run: Run) -> StageSection:
        """The selection is made here, from the matched run's divergent items, and frozen with the rule."""
        first = matched_stage(run.manifest.stages, prepared.checkpoint)
        construction = options.construction or (first.as_stage(MatchedStage).construction if first else "oneshot")
        cfg = replace(options, construction=construction)
        candidates = divergent_items(run.find(MATCHED, prepared.checkpoint), construction)
        chosen = set(select([i.id for i, _ in candidates], cfg.select))
        check_selection(prepared.model, cfg, [prefix for item, prefix in candidates if item.id in chosen])
        return TransplantStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                               config=cfg, selected=sorted(chosen))

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        own: TransplantStage = self.stage_of(stage)
        checkpoint, chosen = prepared.checkpoint, set(own.selected)
        first, matched = matched_stage(run.manifest.stages, checkpoint), matched_records(run, checkpoint)
        candidates = divergent_items(run.find(MATCHED, checkpoint), own.config.fresh)
        return [Batch(prepared.model, [
            Job(item, prepared.settings, TransplantParams(tuple(prefix), own.config,
                                                          reused_arms(own, first, matched.get(item.id), checkpoint)))
            for item, prefix in candidates if item.id in chosen])]

    def work(self, lm: LM, job: Job) -> PayloadModel:
        return transplant_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """Its frozen selection."""
        return [(i, "") for i in self.stage_of(stage).selected]

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        try:
            payload = PAYLOAD.validate_python(record.payload)
        except ValidationError as e:
            return [f"not a transplant payload ({first_error(e)})"]
        if not isinstance(payload, TransplantPayload):
            return []
        return transplant_claims(payload, self.stage_of(stage).config.fresh)

    def stage_findings(self, name: str, stage: StageSection, records: list[Record]) -> list[Finding]:
        return selection_findings(name, self.stage_of(stage), records)

    def replay_job(self, replay: Replay) -> Job:
        own: TransplantStage = self.stage_of(replay.stage)
        reuse = reused_arms(own, replay.matched_stage, reached(replay.matched), replay.record.checkpoint)
        return Job(replay.item, replay.settings, TransplantParams(tuple(replay.prefix or ()), own.config, reuse))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        p = PAYLOAD.validate_python(record.payload)
        if not isinstance(p, TransplantPayload):
            return None  # its prefix was not reproduced: how far live went is not recorded
        own: TransplantStage = self.stage_of(stage)
        n = lengths_of(record)
        suffix = own.settings.decode.max_new_tokens  # sweep continuations are not recorded
        carried = tuple((a.name, 0) for a in p.arms if a.same_as)  # own suffixes not decoded
        return forwards(Lengths(n.prompt, n.stage1, suffix, n.arms, looks=carried), own.config,
                        _model_layers(own))

    def peak_caches(self, stage: StageSection) -> int:
        return 4  # both boundary states, a transplanted one and its continuation's

    def planned_forwards(self, assumed: Assumed, options: TransplantConfig) -> Planned:
        """The divergent items its rule would select (`first:K`, `random:K:SEED`: K of them), its own suffixes
        carried over from matched where they would be."""
        kind, k, _ = parse_selection(options.select)
        chosen = assumed.items[: assumed.divergent if kind == "all" else min(k, assumed.divergent)]
        own = ["live"] + ([options.fresh] if options.fresh == assumed.construction else [])
        carried = tuple((name, 0) for name in own) if assumed.dedup else ()
        return {"": [(u, forwards(replace(u, looks=carried), options, assumed.layers)) for u in chosen]}

    def verdict_facts(self, results: list[TransplantSummary]) -> list[Fact]:
        return transplant_facts(results)

    def figures(self, results: list[TransplantSummary]) -> list[ReportFigure]:
        return transplant_figures(results)

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[TransplantSummary]:
        own: TransplantStage = self.stage_of(stage)
        cfg = own.config
        return [summarize_transplant(records, checkpoint, selection=cfg.select, layers=cfg.layers, kv=cfg.kv,
                                     positions=cfg.positions, n_selected=len(own.selected), sweep_layers=cfg.sweep)]

    def tables(self, results: list[TransplantSummary]) -> list[Table]:
        return [table for section in results for table in transplant_tables(section)]


def _model_layers(stage: StageSection) -> int:
    from pathlib import Path

    from stagereplay.engine.model import load_checked_config

    return int(load_checked_config(Path(stage.model.path)).get_text_config().num_hidden_layers)
