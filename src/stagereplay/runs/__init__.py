"""The library entry points the CLI wraps; each makes or extends a run directory and returns its results (`Results`: results.json as a model). Each
takes typed configs, built by the CLI or in a notebook:

    make_run(out, experiment, options, Inputs(...), engine, ExecConfig(...))   a run from a model and items
    extend(run_dir, experiment, options, Extension(...))                        another stage of a run
    matched(out, Inputs(...), MatchedOptions(...), engine, ExecConfig(...))     (make_run of matched)
    precision_2x2 / bridge / transplant / resample(run_dir, options, Extension(...))   (extend of each)
    audit(run_dir, AuditConfig(...), verify_only, Extension(...))
    merge(shards, out)                                                          join `--shard I/N` runs
    paper(out, Inputs(...), PaperConfig(...))                                   (runs/protocol.py)
    compare(run_a, run_b, out, checkpoint)                                      (runs/compare.py)

`engine_of("vllm", cross, options)` is a serving engine's `RunEngine` (ours: `engine_of("hf")`).

Every other registered experiment, an installed extension's included, is here by its name and its options by their
type's name, found in the registry when first asked for (`__getattr__`):

    mismatch(out, Inputs(...), MismatchOptions(...), engine, ExecConfig(...))   (make_run of mismatch)
    attest(out, Inputs(...), AttestOptions(...), engine, ExecConfig(...))       (make_run of attest)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagereplay.audit.reexecute import AuditConfig
from stagereplay.audit.relocate import Relocation
from stagereplay.engine.decode import DecodeConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.core.prepared import OURS, RunEngine
from stagereplay.experiments.core.registry import EXPERIMENTS
from stagereplay.experiments.core.serving_run import engine_of
from stagereplay.experiments.protocol.bridge import Bridge, BridgeOptions
from stagereplay.experiments.protocol.grid_stage import GridOptions
from stagereplay.experiments.protocol.matched import Matched
from stagereplay.experiments.protocol.matched_stage import MatchedOptions
from stagereplay.experiments.protocol.precision_2x2 import PrecisionGrid
from stagereplay.experiments.protocol.resample import Resample, ResampleConfig
from stagereplay.experiments.protocol.transplant import Transplant, TransplantConfig
from stagereplay.report.results import Results
from stagereplay.runs.compare import compare
from stagereplay.runs.extend import Extension, audit, extend, merge
from stagereplay.runs.inputs import Boundary, EngineChoice, Input, Inputs, Numerics
from stagereplay.runs.make import make_run
from stagereplay.runs.protocol import PaperConfig, paper


def matched(out: str | Path, inputs: Inputs | None = None, options: MatchedOptions | None = None,
            engine: RunEngine = OURS, ex: ExecConfig | None = None, quiet: bool = False) -> Results:
    """Live continuation vs a fresh construction of the same token IDs, each with an exact replica."""
    return make_run(out, Matched(), options, inputs, engine, ex, quiet)


def precision_2x2(run_dir: str | Path, options: GridOptions | None = None, on: Extension | None = None,
                  quiet: bool = False) -> Results:
    """Hold the matched run's prefixes fixed; cross construction with precision."""
    return extend(run_dir, PrecisionGrid(), options, on, quiet)


def bridge(run_dir: str | Path, options: BridgeOptions | None = None, on: Extension | None = None,
           quiet: bool = False) -> Results:
    """Incremental vs live boundary caches, bitwise, on the first rows that reached the boundary."""
    return extend(run_dir, Bridge(), options, on, quiet)


def transplant(run_dir: str | Path, config: TransplantConfig | None = None, on: Extension | None = None,
               quiet: bool = False) -> Results:
    """Swap K/V between live and fresh boundary states of the selected divergent items, both directions."""
    return extend(run_dir, Transplant(), config, on, quiet)


def resample(run_dir: str | Path, config: ResampleConfig | None = None, on: Extension | None = None,
             quiet: bool = False) -> Results:
    """K seeded draws from the live, live-replica and fresh boundary states of each item."""
    return extend(run_dir, Resample(), config, on, quiet)


def library_function(experiment: Experiment) -> Callable[..., Results]:
    """An experiment's library function: `make_run` of it for one that starts a run, `extend` for one that adds a
    stage to a run, with the signature of `matched` or `precision_2x2`."""
    if experiment.shape.starts_run:
        def starting(out: str | Path, inputs: Inputs | None = None, options: Any = None, engine: RunEngine = OURS,
                     ex: ExecConfig | None = None, quiet: bool = False) -> Results:
            return make_run(out, experiment, options, inputs, engine, ex, quiet)

        made: Callable[..., Results] = starting
    else:
        def extending(run_dir: str | Path, options: Any = None, on: Extension | None = None,
                      quiet: bool = False) -> Results:
            return extend(run_dir, experiment, options, on, quiet)

        made = extending
    made.__name__ = made.__qualname__ = experiment.name
    made.__doc__ = experiment.__doc__
    return made


def __getattr__(name: str) -> Any:
    """A registered experiment's library function by its name (`attest`), or its options by their type's name
    (`AttestOptions`)."""
    if not name.startswith("_"):
        for experiment in EXPERIMENTS.values():
            if experiment.name == name:
                return library_function(experiment)
            if experiment.Options.__name__ == name:
                return experiment.Options
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AuditConfig", "Boundary", "BridgeOptions", "DecodeConfig", "EngineChoice", "ExecConfig", "Extension",
           "GridOptions", "Input", "Inputs", "MatchedOptions", "Numerics", "PaperConfig",
           "Relocation", "ResampleConfig", "Results", "TransplantConfig", "audit", "bridge", "compare", "engine_of", "extend",
           "library_function", "make_run", "matched", "merge", "paper", "precision_2x2", "resample", "transplant"]
