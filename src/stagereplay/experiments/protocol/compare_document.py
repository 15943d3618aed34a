"""compare.json as models: the two runs, what differs between their manifests, each item side by side and the
aggregates, with a description on every field (`experiments.protocol.compare` builds it, `report.compare_render` draws it).

A run is always side `a` or side `b` (`Sides`). The models write exactly the JSON compare.json held as a dict:
the fields in this order, a field left unset absent (an item neither run took to its boundary has only its id and
statuses; an arm pair has `built` only where a server says whether it built the arm as named), a field set to None
written as null. `read_compare` reads a compare.json back, refusing another schema version by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Final, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.difference import PairedDifference
from stagereplay.records.differences import Differences
from stagereplay.records.payloads import TopEntry, first_error

COMPARE_VERSION = 1
"""compare.json's schema version: a reader refuses another."""

Side = Literal["a", "b"]
Where = Literal["stage 1", "suffix", "boundary"]
"""Where a first divergence falls: in both runs' stage 1, in both runs' suffix, or where one run's stage 1 has
ended and the other's has not (their boundaries differ)."""
STAGE1: Final = "stage 1"
SUFFIX: Final = "suffix"
BOUNDARY: Final = "boundary"
T = TypeVar("T")


class CompareModel(BaseModel):
    """A part of compare.json: frozen, no field it does not declare."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    def as_json(self) -> dict[str, Any]:
        """The JSON this part holds: the fields that were set (None included), nothing else."""
        return self.model_dump(mode="json", exclude_unset=True)


class Sides(CompareModel, Generic[T]):
    """One value per run: A's and B's."""

    a: T = Field(description="run A's")
    b: T = Field(description="run B's")

    def of(self, side: Side) -> T:
        return self.a if side == "a" else self.b

    def by_side(self) -> tuple[tuple[Side, T], tuple[Side, T]]:
        return ("a", self.a), ("b", self.b)


class Count(CompareModel):
    """k of n."""

    k: int = Field(description="how many")
    n: int = Field(description="of how many")


# -- the runs and their manifests ----------------------------------------------------------------------------------


class RunInfo(CompareModel):
    """What names a run in the report."""

    path: str = Field(description="its folder")
    command: str | None = Field(description="the command that made it")
    created: str | None = Field(description="when (UTC, ISO 8601)")
    tool_version: str | None = Field(description="the stagereplay that made it")
    precision: str = Field(description="the matched stage's precision")
    engine: str = Field(description="the engine that ran the matched stage: ours, or a serving engine's name")
    construction: str | None = Field(description="the matched stage's fresh construction(s), as its section says")


# -- one item ------------------------------------------------------------------------------------------------------


class SideAt(CompareModel):
    """One run at the position where the two trajectories first differ."""

    stage: Literal["stage 1", "suffix"] = Field(description="whether that step is in its stage 1 or its suffix")
    step: int = Field(description="the step within that stage")
    token: int | None = Field(description="its token there (null: its trajectory ended before)")
    margin: float | None = Field(description="top-1 minus top-2 there, a logit or a logprob (null: not recorded)")
    top: list[TopEntry] | None = Field(description="its top candidates there, [token id, value], best first (null: "
                                                   "not recorded)")
    recorded: Literal["stage1_top", "top_logprobs", "margins"] | None = Field(
        description="the record's field the margin and candidates come from (null: none reaches that step)")


class DivergenceAt(CompareModel):
    """The first position where the two live trajectories differ."""

    position: int = Field(description="its index in the trajectory (stage 1, then the suffix)")
    in_: Where = Field(alias="in", description="in both runs' stage 1, both runs' suffix, or where one run's "
                                                "stage 1 ended (boundary)")
    a: SideAt = Field(description="run A there")
    b: SideAt = Field(description="run B there")

    def side(self, side: Side) -> SideAt:
        return self.a if side == "a" else self.b


class ArmPair(CompareModel):
    """One arm of one item in both runs."""

    suffix_equal: bool = Field(description="whether the two suffixes are the same tokens")
    first_divergence: int | None = Field(description="the first suffix step where they differ (null: none)")
    label_equal: bool = Field(description="whether the two correctness labels agree")
    correct: Sides[bool] = Field(description="each run's correctness label")
    built: Sides[bool | None] | None = Field(None, description="a server's arm: whether each run's engine built it "
                                                               "as named (absent: neither says)")


class ComparedItem(CompareModel):
    """An item both runs took to their boundary, side by side."""

    item_id: str = Field(description="the item")
    compared: Literal[True] = Field(description="both runs reached the boundary")
    trajectory_equal: bool = Field(description="whether live's stage 1 and suffix are the same tokens in both runs")
    stage1_equal: bool = Field(description="whether live's stage 1 is")
    stage1_len: Sides[int] = Field(description="each run's stage-1 length")
    first_divergence: DivergenceAt | None = Field(description="where the trajectories first differ (null: equal)")
    replicas: Sides[dict[str, bool]] = Field(description="per arm with a replica, whether it is exact in each run "
                                                         "(`experiments.protocol.compare.replicas_exact`)")
    arms: dict[str, ArmPair] = Field(description="per arm both runs have (replicas left out)")
    token_texts: dict[str, str] = Field(description="the decoded text of each token shown at the divergence, from "
                                                    "the records")


class NotCompared(CompareModel):
    """An item one run or both did not take to its boundary: nothing to set side by side."""

    item_id: str = Field(description="the item")
    compared: Literal[False] = Field(description="not compared")
    status: Sides[str] = Field(description="each run's record status (no_boundary, ...)")


ItemComparison = Annotated[ComparedItem | NotCompared, Field(discriminator="compared")]


# -- the aggregates ------------------------------------------------------------------------------------------------


class Uncompared(CompareModel):
    """An item left out of the trajectories, and why."""

    item_id: str = Field(description="the item")
    status: Sides[str] = Field(description="each run's record status")


class WhereCounts(CompareModel):
    """Items by where their trajectories first diverge."""

    stage1: int = Field(alias="stage 1", description="in both runs' stage 1")
    suffix: int = Field(description="in both runs' suffix")
    boundary: int = Field(description="where one run's stage 1 had ended and the other's had not")

    def of(self, where: Where) -> int:
        return {STAGE1: self.stage1, SUFFIX: self.suffix, BOUNDARY: self.boundary}[where]


class Trajectories(CompareModel):
    """Live trajectories over the items both runs took to their boundary."""

    n: int = Field(description="items of both runs")
    not_compared: list[Uncompared] = Field(description="items one run or both did not take to their boundary")
    equal: Count = Field(description="items whose trajectories are equal, of those compared")
    first_divergence_in: WhereCounts = Field(description="where the others first diverge")
    self_consistent: Count = Field(description="the same over the items where both runs' live replicas are exact")


class ReplicaCounts(CompareModel):
    """One run's replicas: is it self-consistent?"""

    exact: dict[str, Count] = Field(description="per arm with a replica, the items where it is exact")
    live_inexact: list[str] = Field(description="the items whose live replica is not exact")


class Discordant(CompareModel):
    """Items whose labels disagree, by which run is correct (McNemar's counts)."""

    a_only: int = Field(description="correct in A only")
    b_only: int = Field(description="correct in B only")


class ArmSummary(CompareModel):
    """One arm, A against B, over the items where both runs built it as named: the matched table's numbers with A
    and B in place of live and the construction."""

    arm: str = Field(description="the arm's name")
    n: int = Field(description="items compared")
    not_built: int = Field(description="items left out: a run's engine did not build the arm as named")
    suffix_disagreements: Count = Field(description="items whose suffixes differ")
    suffix_disagreements_same_stage1: Count = Field(description="the same over the items whose stage 1 is equal")
    label_disagreements: Count = Field(description="items whose correctness labels differ")
    accuracy: Sides[float | None] = Field(description="each run's accuracy (null: no items)")
    accuracy_diff: PairedDifference | None = Field(description="A - B (null: no items)")
    discordant: Discordant = Field(description="the discordant labels")
    mcnemar_p: float | None = Field(description="McNemar's exact p on the discordant labels (null: no items)")
    first_divergence: list[int] = Field(description="per item whose suffixes differ over the same stage 1, the "
                                                    "first step where they do")
    replica_exact: Sides[Count | None] = Field(description="each run's replica of the arm, exact on k of n items "
                                                           "(null: the run has no replica of it)")


# -- the document --------------------------------------------------------------------------------------------------


class CompareDocument(CompareModel):
    """compare.json: two runs of the same items under two settings, item by item."""

    schema_version: int = Field(description="compare.json's schema version (`COMPARE_VERSION`)")
    checkpoint: str = Field(description="the checkpoint compared (primary, later, ...)")
    runs: Sides[RunInfo] = Field(description="the two runs")
    differences: Differences = Field(description="what differs between their manifests")
    trajectories: Trajectories = Field(description="live trajectories, A vs B")
    replicas: Sides[ReplicaCounts] = Field(description="each run's replicas")
    arms: list[ArmSummary] = Field(description="per arm both runs have, A vs B")
    arms_only_in: Sides[list[str]] = Field(description="the arms only one run has (not compared)")
    items: list[ItemComparison] = Field(description="each item of both runs, in run order")

    def arm(self, name: str) -> ArmSummary | None:
        return next((a for a in self.arms if a.arm == name), None)

    def write(self) -> str:
        """compare.json's text."""
        return json.dumps(self.as_json(), indent=2) + "\n"


def read_compare(path: Path) -> CompareDocument:
    """A compare.json as its model; another schema version, or a file that is not one, refused in one line."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != COMPARE_VERSION:
        raise StageReplayError(f"{path} has compare.json schema_version {version}, not this stagereplay's "
                               f"{COMPARE_VERSION}", "compare the two runs again with this stagereplay")
    try:
        return CompareDocument.model_validate(raw)
    except ValidationError as exc:
        raise StageReplayError(f"{path} is not a compare.json ({first_error(exc)})",
                               "compare the two runs again") from None
