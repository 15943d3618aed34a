"""A section of results.json as a model: what an experiment's `Summary` and the audit's summary are made of.

A summary is built from records (`Experiment.summarize`) and read back from results.json
(`Experiment.results_of`). A field left unset is absent from the file, a field set to None is written as null, and
the fields are written in the order they are declared: so a summary writes the bytes the dict it replaced wrote.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel


class SummaryModel(BaseModel):
    """A part of a results section: frozen, no field it does not declare."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def as_json(self) -> dict[str, Any]:
        """Its JSON object as results.json holds it: the fields that were set (None included), in their order."""
        return self.model_dump(mode="json", exclude_unset=True)


class Count(SummaryModel):
    """k of n items."""

    k: int = Field(description="the items that have the property")
    n: int = Field(description="the items asked")


class Untyped(RootModel[dict[str, Any]]):
    """A results section of an experiment that declares no `Summary` of its own: its JSON object as it is."""


def section_json(section: Any) -> Any:
    """A section as results.json holds it: a summary's JSON object (a `SummaryModel`'s set fields, any other model's
    every field), an untyped section as it is."""
    if isinstance(section, SummaryModel):
        return section.as_json()
    return section.model_dump(mode="json") if isinstance(section, BaseModel) else section
