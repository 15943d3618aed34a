"""Bridge: token-by-token incremental prefill against the retained live cache, bitwise, layer by layer."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from stagereplay.engine.cache import cache_fingerprints, compare_caches
from stagereplay.engine.forwards import (
    Lengths,
    construct_forwards,
    continuation_forwards,
    live_forwards,
    no_boundary_forwards,
)
from stagereplay.engine.lm import LM, NoBoundary
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.arms import arm_record, compare, no_boundary
from stagereplay.experiments.diagnose import diagnose
from stagereplay.experiments.jobs import Job, ReplaySettings, execute
from stagereplay.experiments.precision_2x2 import fixed_prefixes
from stagereplay.records.ledger import Run
from stagereplay.records.payloads import BitDifference, BridgePayload, LayerFingerprints, NoBoundaryPayload

EXPERIMENT = "bridge"
PAYLOAD: TypeAdapter[BridgePayload | NoBoundaryPayload] = TypeAdapter(
    Annotated[BridgePayload | NoBoundaryPayload, Field(discriminator="status")])
"""A bridge record's payload (`records.payloads`): live reached its boundary again, or not."""


def bridge_item(lm: LM, job: Job) -> dict[str, Any]:
    item, s = job.item, job.settings
    try:
        live = lm.live(item, s.rule(), s.decode)
    except NoBoundary as nb:
        return no_boundary(item, nb.generated, nulls=False).as_payload()
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
        answer=item.answer, prefix_matches_matched_run=list(live.prefix) == list(job.get("prefix")),
        cache_equal=not diffs,
        differences=[BitDifference(**d.as_dict()) for d in diffs],
        layers={name: [LayerFingerprints(**layer) for layer in layers] for name, (_, layers) in hashed.items()},
        arms=arms,
        comparisons=[compare(item.id, arms[0], arms[1])],
        diagnostics=diagnose(runs, [("live", "incremental")], cache_pairs=[("live", "incremental")]),
    ).as_payload()


def forwards(n: Lengths) -> list[int]:
    """The forwards `bridge_item` makes for a row of lengths `n`: live with its suffix, incremental, its suffix."""
    if n.stage1 is None:
        return no_boundary_forwards(n.prompt, n.generated)
    return (live_forwards(n.prompt, n.stage1, n.of("live")) + construct_forwards("incremental", n.prompt, n.prefix)
            + continuation_forwards(n.of("incremental")))


def run_bridge(run: Run, model: ModelConfig, settings: ReplaySettings, checkpoint: str, rows: int,
               ex: ExecConfig, quiet: bool = False) -> None:
    run.begin_stage(f"{EXPERIMENT}/{checkpoint}", {"model": model.as_dict(), "settings": settings.as_dict(),
                                                  "rows": rows})
    jobs = [Job(item, settings, extra=(("prefix", prefix),)) for item, prefix in fixed_prefixes(run, checkpoint)]
    execute(run, EXPERIMENT, checkpoint, model, bridge_item, jobs[:rows], ex, None, quiet)
