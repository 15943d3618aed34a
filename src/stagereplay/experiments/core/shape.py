"""What an experiment's runs and records are like: the facts run making, `verify`, `plan` and the report read of
every experiment alike (`Experiment.shape`), one frozen object rather than a flag each."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Shape:
    """An experiment's shape. The defaults are a stage added to a matched run on its prefixes' continuations."""

    starts_run: bool = False
    """Whether its command makes a run directory from a model and items (`--out`), rather than extending a run."""
    uses_boundary: bool = True
    """Whether a run it makes finds a stage boundary (its stage-1 rule and budget resolved before the first item)."""
    continuations: bool = True
    """Whether its records hold the protocol's arms (continuations from boundary states, `records.payloads.Arm`:
    a prefix, suffixes, labels and the comparisons between them), which `verify` checks alike for every such
    experiment; otherwise its own `claims` are all there is to check."""
    fixed_prefix: bool = False
    """Whether its records hold the matched run's prefix of the item (`verify` checks that they do)."""
    per_precision: bool = False
    """Whether a unit's `part` is the precision it ran at (a stage crossing precisions)."""
    many: bool = True
    """Whether results.json holds a list of its sections (one per stage, arm or precision), else one section."""
    replays_diagnostics: bool = False
    """Whether its diagnostics decode an arm again to a pair's first divergent step (`plan.recorded`)."""
    label: str = ""
    """How the report names its compared pairs beside the checkpoint (`primary, 2x2`); '' for matched's."""

    def labelled(self, label: str) -> Shape:
        """This shape under another label."""
        return replace(self, label=label)


RESPONSES = Shape(starts_run=True, uses_boundary=False, continuations=False)
"""The shape of an experiment on whole responses (`experiments.core.response`): a run of its own, no boundary, no
continuations."""
