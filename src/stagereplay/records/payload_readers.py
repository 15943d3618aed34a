"""A recorded item payload read back as a model whoever reads it, without knowing which experiment made it:
`ItemHead` (what every item payload holds, an experiment registered from outside included: `audit.verify`'s
claims, the export) and `read_payload` (a payload of any of stagereplay's experiments, as the model that
experiment's `PAYLOAD` gives it: the report's explorer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter

from stagereplay.records.payloads import (
    Arm,
    BridgePayload,
    Comparison,
    Draw,
    GridPayload,
    MatchedPayload,
    NoBoundaryPayload,
    PayloadModel,
    PrefixNotReproducedPayload,
    ResamplePayload,
    TransplantPayload,
    optional,
)


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


ItemPayload = (MatchedPayload | NoBoundaryPayload | GridPayload | BridgePayload | TransplantPayload
               | PrefixNotReproducedPayload | ResamplePayload)
"""An item record's payload as its model, whichever of stagereplay's experiments made it."""
DIAGNOSED = (MatchedPayload, GridPayload, BridgePayload)
"""The payloads with a diagnostics block (why their compared arms diverged)."""

OWN_FIELD: tuple[tuple[str, type[PayloadModel]], ...] = (
    ("live_source", ResamplePayload), ("directions", TransplantPayload), ("layers", BridgePayload),
    ("precision", GridPayload))
"""A payload whose status is ok is the model of the one field only it has (a matched payload has none of them)."""
OF_STATUS: dict[str, type[PayloadModel]] = {"no_boundary": NoBoundaryPayload,
                                            "prefix_not_reproduced": PrefixNotReproducedPayload,
                                            "not_reproduced": ResamplePayload}
"""A payload whose status says the item reached no prefix is the model of that status."""


def _kind(raw: Any) -> str | None:
    """The name of the model a raw payload is (None: no model's status)."""
    if not isinstance(raw, Mapping):
        return type(raw).__name__ if isinstance(raw, PayloadModel) else None
    status = raw.get("status")
    if status == "ok":
        return next((model.__name__ for name, model in OWN_FIELD if name in raw), MatchedPayload.__name__)
    model = OF_STATUS.get(status) if isinstance(status, str) else None
    return model.__name__ if model is not None else None


ITEM_PAYLOAD: TypeAdapter[ItemPayload] = TypeAdapter(Annotated[
    Annotated[MatchedPayload, Tag("MatchedPayload")] | Annotated[NoBoundaryPayload, Tag("NoBoundaryPayload")]
    | Annotated[GridPayload, Tag("GridPayload")] | Annotated[BridgePayload, Tag("BridgePayload")]
    | Annotated[TransplantPayload, Tag("TransplantPayload")]
    | Annotated[PrefixNotReproducedPayload, Tag("PrefixNotReproducedPayload")]
    | Annotated[ResamplePayload, Tag("ResamplePayload")],
    Discriminator(_kind, custom_error_type="status", custom_error_message="no payload has this status")])
"""A payload of any of stagereplay's experiments: the model its status and its own field say (the model that
experiment's `PAYLOAD` gives it)."""


def read_payload(raw: Mapping[str, Any]) -> ItemPayload:
    """A payload recorded by one of stagereplay's experiments, as its model (an experiment registered from outside
    has its own: `ItemHead` reads what every payload holds). Raises pydantic's ValidationError when it is none
    (`first_error` says where)."""
    return ITEM_PAYLOAD.validate_python(raw)
