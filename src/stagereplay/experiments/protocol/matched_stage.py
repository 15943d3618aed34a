"""Matched's name, options and frozen section, and its records as the stages after it read them: the items that
reached their boundary with their fixed prefixes (`fixed_prefixes`), and the state a construction rebuilds from one
(`fixed_state`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import Field

from stagereplay.engine.constructions import parse_construction
from stagereplay.engine.decode import derive_seed
from stagereplay.engine.generated import Generated
from stagereplay.engine.lm import LM, BoundaryState
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.jobs import ReplaySettings
from stagereplay.experiments.protocol.matched_summary import PAYLOAD
from stagereplay.experiments.protocol.payloads import MatchedPayload
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import StageSection
from stagereplay.tasks.base import Item

EXPERIMENT = "matched"


STAGE1_TOP = 2
"""Tokens kept per stage-1 step of live (`stage1_top`): the margin and the runner-up, at a size a trace of thousands
of steps can carry in every record."""


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


def stage_constructions(stage: MatchedStage) -> str:
    """A matched stage's fresh constructions as the comma list its jobs take."""
    return ",".join(stage.arms or [stage.construction])


def fixed_prefixes(run: Run, checkpoint: str) -> list[tuple[Item, list[int]]]:
    """The items of the matched run at `checkpoint` that reached their boundary, with their prefixes: what the
    experiments after matched start from."""
    out = []
    for r in run.find(EXPERIMENT, checkpoint):
        p = PAYLOAD.validate_python(r.payload)
        if isinstance(p, MatchedPayload):
            out.append((Item(r.item_id, tuple(p.prompt_ids), p.answer), p.prefix_ids))
    return out


def matched_ok(records: list[Record], checkpoint: str) -> list[str]:
    """The item ids whose matched record at `checkpoint` reached its boundary, in ledger order."""
    return [r.item_id for r in records if r.experiment == EXPERIMENT and r.checkpoint == checkpoint
            and isinstance(PAYLOAD.validate_python(r.payload), MatchedPayload)]


def matched_stage(stages: Mapping[str, StageSection], checkpoint: str) -> StageSection | None:
    """The matched stage at `checkpoint`, where the run has one."""
    return stages.get(f"{EXPERIMENT}/{checkpoint}")


def matched_records(run: Run, checkpoint: str) -> dict[str, MatchedPayload]:
    """The matched payloads at `checkpoint` that reached their boundary, by item id."""
    read = {r.item_id: PAYLOAD.validate_python(r.payload) for r in run.find(EXPERIMENT, checkpoint)}
    return {i: p for i, p in read.items() if isinstance(p, MatchedPayload)}


def fixed_state(item: Item, prefix: list[int], settings: ReplaySettings, lm: LM) -> BoundaryState:
    """A boundary state with no cache yet: what `lm.construct` needs to rebuild one from fixed token IDs (a static
    cache is allocated for the positions the item's live run had, `LM.cache_len`)."""
    return BoundaryState(prefix=tuple(prefix), prompt_len=len(item.prompt_ids), construction="fixed", cache=None,
                         seed=derive_seed(settings.decode.seed, item.id, "suffix"),
                         cache_len=lm.cache_len(len(item.prompt_ids), settings.decode))
