"""Bridge: token-by-token incremental prefill against the retained live cache, bitwise, layer by layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from stagereplay.engine.cache import cache_fingerprints, compare_caches
from stagereplay.engine.forwards import (
    Lengths,
    construct_forwards,
    continuation_forwards,
    live_forwards,
    no_boundary_forwards,
)
from stagereplay.engine.lm import LM, NoBoundary
from stagereplay.errors import FLAGGED, OK, StageReplayError
from stagereplay.experiments.core.experiment import Assumed, Batch, Experiment, Planned, Replay, SmallRun
from stagereplay.experiments.core.format import NA, Table, as_rows, k_of_n, yes_no
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.lengths import lengths_of
from stagereplay.experiments.core.shape import Shape
from stagereplay.experiments.protocol.arms import arm_record, compare, no_boundary
from stagereplay.experiments.protocol.diagnose import diagnose
from stagereplay.experiments.protocol.matched_stage import EXPERIMENT as MATCHED
from stagereplay.experiments.protocol.matched_stage import fixed_prefixes, matched_ok
from stagereplay.experiments.protocol.payloads import (
    BitDifference,
    BridgePayload,
    LayerFingerprints,
    NoBoundaryPayload,
)
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payload_readers import ItemHead
from stagereplay.records.payloads import PayloadModel, first_error
from stagereplay.records.summary import SummaryModel

if TYPE_CHECKING:
    from stagereplay.experiments.core.prepared import PreparedRun

EXPERIMENT = "bridge"
PAYLOAD: TypeAdapter[BridgePayload | NoBoundaryPayload] = TypeAdapter(
    Annotated[BridgePayload | NoBoundaryPayload, Field(discriminator="status")])
"""A bridge record's payload (`records.payloads`): live reached its boundary again, or not."""


@dataclass(frozen=True)
class BridgeParams(Params):
    """A bridge job's parameters: the matched run's prefix of the item (whether live reaches it again is recorded)."""

    prefix: tuple[int, ...]


def bridge_item(lm: LM, job: Job[BridgeParams]) -> BridgePayload | NoBoundaryPayload:
    item, s = job.item, job.settings
    try:
        live = lm.live(item, s.rule(), s.decode)
    except NoBoundary as nb:
        return no_boundary(item, nb.generated, nulls=False)
    assert live.live_suffix is not None
    inc = lm.construct(live, "incremental")
    diffs = compare_caches(live.cache, inc.cache)
    runs = {"live": (live, live.live_suffix), "incremental": (inc, lm.continue_from(inc, s.decode))}
    # Each cache is streamed to the host once, for its whole fingerprint and its per-layer ones together.
    hashed = {name: cache_fingerprints(state.cache) for name, (state, _) in runs.items()}
    arms = [arm_record(lm, name, state, cont, live.stage1, item, s.scorer, cache_fp=hashed[name][0])
            for name, (state, cont) in runs.items()]
    return BridgePayload(
        status="ok", prompt_ids=list(item.prompt_ids), prefix_ids=list(live.prefix), boundary=len(live.prefix),
        answer=item.answer, prefix_matches_matched_run=list(live.prefix) == list(job.params.prefix),
        cache_equal=not diffs,
        differences=[BitDifference(**d.as_dict()) for d in diffs],
        layers={name: [LayerFingerprints(**layer) for layer in layers] for name, (_, layers) in hashed.items()},
        arms=arms,
        comparisons=[compare(item.id, arms[0], arms[1])],
        diagnostics=diagnose(runs, [("live", "incremental")], cache_pairs=[("live", "incremental")]),
    )


def forwards(n: Lengths) -> list[int]:
    """The forwards `bridge_item` makes for a row of lengths `n`: live with its suffix, incremental, its suffix."""
    if n.stage1 is None:
        return no_boundary_forwards(n.prompt, n.generated)
    return (live_forwards(n.prompt, n.stage1, n.of("live")) + construct_forwards("incremental", n.prompt, n.prefix)
            + continuation_forwards(n.of("incremental")))


# -- what verify checks, results.json and the report -------------------------------------------------------------


def bridge_claims(p: BridgePayload, matched: Record | None) -> list[str]:
    bad = []
    bitwise = p.layers.get("live") == p.layers.get("incremental")
    if p.cache_equal != bitwise:
        bad.append("cache_equal does not follow from the layer fingerprints")
    if (not p.differences) != bitwise:
        bad.append("first_difference does not follow from the layer fingerprints")
    if (p.comparisons[0].cache_equal if p.comparisons else None) != p.cache_equal:
        bad.append("cache_equal differs from its comparison's")
    if matched is not None and p.prefix_matches_matched_run != (p.prefix_ids == _matched_prefix(matched)):
        bad.append("prefix_matches_matched_run does not follow from the matched record")
    return bad


def _matched_prefix(matched: Record) -> list[int] | None:
    """The matched record's prefix (None: it reached no boundary, or does not read as one)."""
    try:
        return ItemHead.model_validate(matched.payload).prefix_ids
    except ValidationError:
        return None


class BridgeRow(SummaryModel):
    """One row of the bridge: an item's incremental cache against live's."""

    item_id: str = Field(description="the item")
    cache_equal: bool = Field(description="whether the two boundary caches are bit-exact")
    first_difference: BitDifference | None = Field(description="where they first differ (null: nowhere)")
    suffix_equal: bool = Field(description="whether their continuations' suffixes are equal")


class BridgeSummary(SummaryModel):
    """The bridge at one checkpoint: its section of results.json."""

    checkpoint: str = Field(description="the stage's checkpoint")
    rows: int = Field(description="items compared (those that reached the boundary)")
    cache_bit_exact: int = Field(description="rows whose caches are bit-exact")
    suffix_equal: int = Field(description="rows whose suffixes are equal")
    items: list[BridgeRow] = Field(description="every row")


def summarize_bridge(records: list[Record], checkpoint: str) -> BridgeSummary:
    read = [(r.item_id, PAYLOAD.validate_python(r.payload)) for r in records]
    ok = [(i, p) for i, p in read if isinstance(p, BridgePayload)]
    items = [BridgeRow(item_id=i, cache_equal=p.cache_equal,
                       first_difference=p.differences[0] if p.differences else None,
                       suffix_equal=p.comparisons[0].suffix_equal) for i, p in ok]
    return BridgeSummary(checkpoint=checkpoint, rows=len(ok), cache_bit_exact=sum(i.cache_equal for i in items),
                         suffix_equal=sum(i.suffix_equal for i in items), items=items)


def bridge_tables(bridge: BridgeSummary) -> list[Table]:
    n = bridge.rows
    summary = [[str(n), k_of_n(bridge.cache_bit_exact, n), k_of_n(bridge.suffix_equal, n)]]
    tables = [
        Table(
            "table-bridge",
            f"Bridge ({bridge.checkpoint}): incremental vs live cache",
            ("rows", "caches bit-exact", "suffixes equal"),
            as_rows(summary),
        )
    ]
    rows = []
    for i in bridge.items:
        if i.cache_equal and i.suffix_equal:
            continue
        fd = i.first_difference
        where = f"layer {fd.layer}, {fd.tensor}, position {fd.position}" if fd else NA
        rows.append([i.item_id, yes_no(i.cache_equal), where, yes_no(i.suffix_equal)])
    if rows:
        headers = ("item", "cache equal", "first difference", "suffix equal")
        tables.append(Table("table-bridge-differences", "Bridge rows that differ", headers, as_rows(rows)))
    return tables


@dataclass(frozen=True)
class BridgeOptions:
    """The bridge's own option: how many rows."""

    rows: int = field(default=12, metadata={"help": "items to compare (the first that reached the boundary)"})

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise StageReplayError(f"--rows must be at least 1, got {self.rows}", "pass a positive --rows")


class BridgeStage(StageSection):
    """The bridge's frozen section."""

    rows: int = Field(description="items compared: the first that reached the boundary")


class Bridge(Experiment[BridgeOptions, BridgeStage, BridgePayload | NoBoundaryPayload, BridgeSummary]):
    """Incremental vs live boundary caches, bitwise, layer by layer, K and V, and their suffixes."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    name: ClassVar[str] = EXPERIMENT
    Stage: ClassVar[type[StageSection]] = BridgeStage
    Options: ClassVar[type] = BridgeOptions
    shape: ClassVar[Shape] = Shape(many=False, replays_diagnostics=True, label="bridge")
    Summary: ClassVar[type[BaseModel]] = BridgeSummary
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--rows", "1"), extends=MATCHED)

    def section(self, prepared: PreparedRun, options: BridgeOptions, run: Run) -> StageSection:
        return BridgeStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                           rows=options.rows)

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        rows = self.stage_of(stage).rows
        jobs = [Job(item, prepared.settings, BridgeParams(tuple(prefix)))
                for item, prefix in fixed_prefixes(run, prepared.checkpoint)]
        return [Batch(prepared.model, jobs[:rows])]

    def exit_code(self, summaries: BridgeSummary | None) -> int:
        """FLAGGED where a row's caches are not bit-exact: the bridge's claim failed."""
        return FLAGGED if summaries is not None and summaries.cache_bit_exact != summaries.rows else OK

    def work(self, lm: LM, job: Job) -> PayloadModel:
        return bridge_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """The first `rows` prefixes of its matched run."""
        return [(i, "") for i in matched_ok(records, checkpoint)[: self.stage_of(stage).rows]]

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        try:
            payload = PAYLOAD.validate_python(record.payload)
        except ValidationError as e:
            return [f"not a bridge payload ({first_error(e)})"]
        return bridge_claims(payload, matched) if isinstance(payload, BridgePayload) else []

    def replay_job(self, replay: Replay) -> Job:
        return Job(replay.item, replay.settings, BridgeParams(tuple(replay.prefix or ())))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        return forwards(lengths_of(record))

    def peak_caches(self, stage: StageSection) -> int:
        return 3  # live's, incremental's, and a continuation's

    def planned_forwards(self, assumed: Assumed, options: BridgeOptions) -> Planned:
        """Its first `rows` items (live and incremental are assumed not to diverge: nothing replayed)."""
        return {"": [(u, forwards(u)) for u in assumed.items[: options.rows]]}

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[BridgeSummary]:
        return [summarize_bridge(records, checkpoint)]

    def tables(self, results: BridgeSummary | None) -> list[Table]:
        return bridge_tables(results) if results else []
