"""Matched: per item, the retained live continuation and a fresh construction of the same token IDs, each
with an exact replica from scratch."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from stagereplay.engine.forwards import (
    Lengths,
    construct_forwards,
    continuation_forwards,
    live_forwards,
    no_boundary_forwards,
)
from stagereplay.engine.lm import LM, BoundaryState, Continuation, NoBoundary, check_construction
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.arms import arm_record, compare, no_boundary_payload, with_token_texts
from stagereplay.experiments.diagnose import diagnose
from stagereplay.experiments.jobs import Job, ReplaySettings, execute
from stagereplay.records.ledger import Run
from stagereplay.records.payloads import Arm, MatchedPayload, NoBoundaryPayload
from stagereplay.tasks import DataConfig

EXPERIMENT = "matched"
PAYLOAD: TypeAdapter[MatchedPayload | NoBoundaryPayload] = TypeAdapter(
    Annotated[MatchedPayload | NoBoundaryPayload, Field(discriminator="status")])
"""A matched record's payload (`records.payloads`): the item reached its boundary, or not (a serving run's too)."""


@dataclass(frozen=True)
class MatchedConfig:
    """One matched experiment at one checkpoint."""

    model: ModelConfig
    settings: ReplaySettings
    data: DataConfig = field(default_factory=DataConfig)
    construction: str = field(default="oneshot", metadata={"help": "the fresh construction set against live"})
    checkpoint: str = field(default="primary", metadata={"help": "name of this model in the run"})
    bootstrap_seed: int = field(default=0, metadata={"help": "seed of the paired bootstrap"})
    n_resamples: int = field(default=10_000, metadata={"help": "bootstrap resamples"})

    def __post_init__(self) -> None:
        check_construction(self.construction)

    def stage(self) -> dict[str, Any]:
        return {"model": self.model.as_dict(), "settings": self.settings.as_dict(), "construction": self.construction}


def matched_item(lm: LM, job: Job) -> dict[str, Any]:
    """Live + replica, construction + replica; the comparisons between them. Pure in (model, item, settings).

    Each replica's cache is dropped as soon as its record (with the cache fingerprint) is made: comparisons need
    only the fingerprints, and the diagnostics compare the caches of live and the fresh construction alone (a
    replica watches its pair's first arm, so its logits at their first divergent step are kept as it runs). So
    at most four K/V caches are alive at once: live's and the fresh construction's boundary states, and a
    replica's boundary state with the cache its continuation grows (README, "caches alive").
    """
    item, s = job.item, job.settings
    construction = job.get("construction", "oneshot")
    rule = s.rule()
    try:
        live = lm.live(item, rule, s.decode)
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
        replica = lm.live(item, rule, s.decode, watch=[live.live_suffix.suffix])
    except NoBoundary:
        replica = None
    replica_prefix_equal = replica is not None and replica.prefix == live.prefix
    if replica is not None and replica.live_suffix is not None:
        record("live#replica", replica, replica.live_suffix, keep_cache=False)
    del replica
    for name, keep, first in ((construction, True, "live"), (f"{construction}#replica", False, construction)):
        fresh = lm.construct(live, construction)
        record(name, fresh, lm.continue_from(fresh, s.decode, watch=[runs[first][1].suffix]), keep_cache=keep)
        del fresh
    by = {a.name: a for a in arms}
    pairs = [("live", construction), ("live", "live#replica"), (construction, f"{construction}#replica")]
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
        diagnostics=diagnose(runs, pairs, cache_pairs=pairs[:1]),
    )
    return with_token_texts(lm, payload).as_payload()


def forwards(n: Lengths, construction: str = "oneshot") -> list[int]:
    """The forwards `matched_item` makes for an item of lengths `n` (token counts, engine.forwards): live and its
    replica from scratch, then the fresh construction and its replica with their continuations."""
    if n.stage1 is None:
        return no_boundary_forwards(n.prompt, n.generated)
    out = live_forwards(n.prompt, n.stage1, n.of("live")) + live_forwards(n.prompt, n.stage1, n.of("live#replica"))
    for arm in (construction, f"{construction}#replica"):
        out += construct_forwards(construction, n.prompt, n.prefix) + continuation_forwards(n.of(arm))
    return out


def run_matched(run: Run, config: MatchedConfig, items: list[Any], ex: ExecConfig, lm: LM | None = None,
                quiet: bool = False) -> None:
    """Append a matched record for every item not yet in the ledger."""
    stage = f"{EXPERIMENT}/{config.checkpoint}"
    run.begin_stage(stage, config.stage())
    jobs = [Job(item, config.settings, extra=(("construction", config.construction),)) for item in items]
    execute(run, EXPERIMENT, config.checkpoint, config.model, matched_item, jobs, ex, lm, quiet)
