"""What differs between two runs' manifests and environments, in groups: the part of compare.json every
experiment's comparison holds (`experiments.core.compare_manifests.manifest_differences` finds them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Difference(BaseModel):
    """One field whose value differs between the two runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    field: str = Field(description="its dotted name (`config.model.precision`, `environment.engine.server.build`)")
    a: Any = Field(description="its value in run A, as the manifest or environment holds it (null: A lacks it)")
    b: Any = Field(description="its value in run B (null: B lacks it)")


class Differences(BaseModel):
    """What differs between the runs, in groups."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    settings: list[Difference] = Field(description="the config and the compared stage's section")
    server: list[Difference] = Field(description="a serving engine's identity and settings, less what changes "
                                                 "with each start")
    kernels: list[Difference] = Field(description="what chooses the kernels of the process that computed the "
                                                  "records (`records.kernels`)")
    environment: list[Difference] = Field(description="the rest of that process: packages, commit, proofs")
    locations: list[Difference] = Field(description="where a file or a server lies, which is no setting")

    def group(self, name: str) -> list[Difference]:
        return list(getattr(self, name))
