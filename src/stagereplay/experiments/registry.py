"""The experiments, by name: what run making, verify, the audit, plan and the report look an experiment up in.

A new experiment is one module (its `Experiment` subclass and what it declares) and one line in `EXPERIMENTS`; an
extension (or a test) adds one at run time with `register`. The order is the report's order.
"""

from __future__ import annotations

from collections.abc import Iterator

from stagereplay.errors import StageReplayError
from stagereplay.experiments.attest import Attest
from stagereplay.experiments.bridge import Bridge
from stagereplay.experiments.experiment import Experiment
from stagereplay.experiments.matched import Matched
from stagereplay.experiments.mismatch import Mismatch
from stagereplay.experiments.precision_2x2 import PrecisionGrid
from stagereplay.experiments.resample import Resample
from stagereplay.experiments.transplant import Transplant

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (Matched(), PrecisionGrid(), Bridge(), Transplant(),
                                                         Resample(), Mismatch(), Attest())}


def experiment(name: str) -> Experiment:
    """The experiment called `name`; refused in one line when the registry does not know it."""
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise StageReplayError(f"unknown experiment {name!r} (this stagereplay knows "
                               f"{', '.join(EXPERIMENTS)})", "upgrade stagereplay, or register the experiment that "
                               "made the run (stagereplay.experiments.registry.register)") from None


def of_stage(stage_name: str) -> Experiment:
    """The experiment of a manifest stage `<experiment>/<checkpoint>`."""
    return experiment(stage_name.partition("/")[0])


def register(e: Experiment) -> None:
    """Add (or replace) an experiment: an extension's, or a test's."""
    EXPERIMENTS[e.name] = e


def unregister(name: str) -> None:
    EXPERIMENTS.pop(name, None)


def starts_run(name: str) -> bool:
    """Whether the experiment called `name` makes runs (its records hold the prefixes later stages start from)."""
    e = EXPERIMENTS.get(name)
    return e is not None and e.starts_run


def all_experiments() -> Iterator[Experiment]:
    """Every known experiment, in the report's order."""
    yield from list(EXPERIMENTS.values())
