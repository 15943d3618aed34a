"""`paper`: the reference paper's protocol as its steps, defined once. `runs.protocol.paper` runs them into one run
directory (then the audit and the report), `plan.paper` prices them before they run.

    matched (bf16) -> bridge -> transplant -> fixed-prefix 2x2 (bf16, fp32) [-> resample (bf16, fp32)]
    -> matched and an outcome-blind transplant at a later checkpoint
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.protocol.bridge import Bridge, BridgeOptions
from stagereplay.experiments.protocol.grid_stage import GridOptions
from stagereplay.experiments.protocol.matched import Matched
from stagereplay.experiments.protocol.matched_stage import MatchedOptions
from stagereplay.experiments.protocol.precision_2x2 import PrecisionGrid
from stagereplay.experiments.protocol.resample import Resample, ResampleConfig
from stagereplay.experiments.protocol.transplant import Transplant, TransplantConfig

AUDIT_SAMPLE = 10
"""Units per stage and part the audit of `paper` re-executes by default: with every record verified without a model,
a seeded sample keeps the audit a fraction of the run (`stagereplay audit RUN` re-executes all of it). Ten
keep `paper` on the embedded toy within about ten minutes on two cores (docs/reference/performance.md); at
scale pick it for the detection wanted, 1 - (1 - f)^N for a fraction f of units that do not reproduce
(docs/how-to/plan.md)."""

PRECISION = "bf16"
"""The precision `paper` runs its model at, as the reference paper does."""
PRECISIONS = ("bf16", "fp32")
"""The precisions its fixed-prefix 2x2 (and resample) cross."""
CONSTRUCTIONS = ("incremental", "oneshot")
"""The constructions its fixed-prefix 2x2 crosses with precision."""


@dataclass(frozen=True)
class PaperConfig:
    """What `paper` runs besides matched: the later checkpoint, the transplant selection, the bridge rows, the layer
    sweep, resample, and the closing audit's sample."""

    panel: ClassVar[str] = "Protocol"

    later_model: str | None = field(default=None, metadata={
        "help": "the second checkpoint (default: the embedded toy's later one when the model is the toy, else none)"})
    select_primary: str = field(default="first:24", metadata={
        "flag": "--select", "help": "transplant selection at the primary checkpoint"})
    bridge_rows: int = field(default=12, metadata={"flag": "--rows", "help": "bridge rows"})
    sweep: bool = field(default=False, metadata={"flag": "--sweep/--no-sweep",
                                                 "help": "layer sweep at the primary checkpoint"})
    resample: int = field(default=0, metadata={"help": "K sampled draws per state (0: no resample stage)"})
    resample_items: int = field(default=50, metadata={"help": "items the resample stage draws on"})
    audit_sample: int | None = field(default=AUDIT_SAMPLE, metadata={
        "help": "units per stage and part the closing audit re-executes, after verifying every record (0 or None: every unit)"})

    def __post_init__(self) -> None:
        if self.audit_sample == 0:  # the command line's "every unit"
            object.__setattr__(self, "audit_sample", None)
        if self.bridge_rows < 1:
            raise StageReplayError(f"--rows must be at least 1, got {self.bridge_rows}", "pass a positive --rows")
        if self.resample < 0:
            raise StageReplayError(f"--resample must be 0 or more, got {self.resample}", "pass e.g. --resample 32")
        if self.resample_items < 1:
            raise StageReplayError(f"--resample-items must be at least 1, got {self.resample_items}",
                                   "pass a positive --resample-items")
        TransplantConfig(select=self.select_primary)  # a bad selection rule fails here, before any run directory

    def later_checkpoint(self, model: str | None) -> str | None:
        """The checkpoint `paper` replicates at: the one given, else the embedded toy's later one when the model is the
        toy (`model` None); None: no replication."""
        if self.later_model is None and model is None:
            from stagereplay.toy import toy_checkpoint

            return str(toy_checkpoint("later"))
        return self.later_model

    def identity(self, later_model: str | None) -> dict[str, Any]:
        """What of the protocol a run's identity records (`manifest.config`): every field but the audit's sample (the
        audit checks the run, it makes none of it), with the later checkpoint as resolved."""
        return {f.name: later_model if f.name == "later_model" else getattr(self, f.name)
                for f in fields(self) if f.name != "audit_sample"}


@dataclass(frozen=True)
class Step:
    """One stage of `paper`: an experiment with its options, at a checkpoint of the run."""

    experiment: Experiment
    options: Any
    checkpoint: str = "primary"


def paper_steps(protocol: PaperConfig, later: bool) -> list[Step]:
    """The stages `paper` makes, in the order it makes them: everything on the primary model first (worker processes
    start once for it), with `later` the replication at the later checkpoint, its transplant selection all the
    divergent items, outcome-blind."""
    steps = [
        Step(Matched(), MatchedOptions()),
        Step(Bridge(), BridgeOptions(protocol.bridge_rows)),
        Step(Transplant(), TransplantConfig(select=protocol.select_primary, sweep=protocol.sweep)),
        Step(PrecisionGrid(), GridOptions(CONSTRUCTIONS, PRECISIONS)),
    ]
    if protocol.resample:
        steps.append(Step(Resample(), ResampleConfig(k=protocol.resample, n=protocol.resample_items,
                                                     precisions=PRECISIONS)))
    if later:
        steps += [Step(Matched(), MatchedOptions(), "later"),
                  Step(Transplant(), TransplantConfig(select="all-divergent"), "later")]
    return steps
