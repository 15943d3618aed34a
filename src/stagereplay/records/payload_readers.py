"""What is read of a recorded item payload of any experiment whose records hold the protocol's arms: `ItemHead` (what
every such payload holds, an experiment registered from outside included: `audit.verify`'s claims), and `Diagnosed`
(what the report reads of a payload whose arms were compared with a diagnostics block). A payload as its own model is its experiment's to give
(`Experiment.read`, found by the record's `experiment` field in `experiments.core.registry`).
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from stagereplay.records.payloads import Arm, Comparison, Diagnostics, Draw, PayloadModel, optional


class ItemHead(PayloadModel):
    """What every item record's payload holds, whichever experiment made it (one of `records.payloads`' models, or
    that of an experiment registered from outside): what is read of a record of any experiment (`audit.verify`'s claims,
    the export). Each experiment's own model declares these fields again, as it types them, beside its own."""

    model_config = ConfigDict(extra="ignore")

    status: str = Field(description="ok, or why the item has no outcome (no_boundary, prefix_not_reproduced, ...)")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] | None = optional("P, where the item reached a prefix")
    boundary: int | None = optional("len(P), where it did")
    answer: str = Field(description="the gold answer")
    generated_ids: list[int] | None = optional("no_boundary: what the model generated instead")
    arms: list[Arm | Draw] = Field(description="the arms (or draws)")
    comparisons: list[Comparison] = Field(description="the arms compared")


class Diagnosed(PayloadModel):
    """What the report reads of a payload whose first comparison has diagnostics (matched's, the 2x2's, bridge's)."""

    model_config = ConfigDict(extra="ignore")

    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    prefix_ids: list[int] | None = optional("P, where the item reached a prefix")
    arms: list[Arm] = Field(description="the arms compared")
    comparisons: list[Comparison] = Field(description="the arms compared")
    diagnostics: Diagnostics | None = optional("why the arms diverged")
    token_texts: dict[str, str] | None = optional("each token id the record shows, decoded alone")
