"""The precision 2x2's options and frozen section."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from stagereplay.records.manifest import StageSection


@dataclass(frozen=True)
class GridOptions:
    """The 2x2's own options: the constructions crossed with the precisions."""

    constructions: tuple[str, ...] = field(default=(), metadata={"help": (
        "comma list (default: incremental,oneshot; on a serving engine's run its arms, e.g. oneshot,prefix-cache"
        "[,hf-oneshot])")})
    precisions: tuple[str, ...] = field(default=("bf16", "fp32"), metadata={
        "help": "comma list of bf16, fp16, fp32, fp32-compute"})


class GridStage(StageSection):
    """The 2x2's frozen section."""

    constructions: list[str] = Field(description="the constructions crossed with precision")
    precisions: list[str] = Field(description="the precisions, each a part of every item's unit")
