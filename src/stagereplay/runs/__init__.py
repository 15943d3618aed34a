"""The library entry points the CLI wraps; each makes or extends a run directory and returns its results (`Results`: results.json as a model). Each
takes typed configs, built by the CLI or in a notebook:

    make_run(out, experiment, options, Inputs(...), engine, ExecConfig(...))   a run from a model and items
    extend(run_dir, experiment, options, Extension(...))                        another stage of a run
    matched(out, Inputs(...), MatchedOptions(...), engine, ExecConfig(...))     (make_run of matched)
    mismatch(out, Inputs(...), MismatchOptions(...), engine, ExecConfig(...))   (make_run of mismatch)
    attest(out, Inputs(...), AttestOptions(...), engine, ExecConfig(...))       (make_run of attest)
    precision_2x2 / bridge / transplant / resample(run_dir, options, Extension(...))   (extend of each)
    audit(run_dir, AuditConfig(...), verify_only, Extension(...))
    merge(shards, out)                                                          join `--shard I/N` runs
    paper(out, Inputs(...), PaperConfig(...))                                   (runs/protocol.py)
    compare(run_a, run_b, out, checkpoint)                                      (runs/compare.py)

`engine_of("vllm", cross, options)` is a serving engine's `RunEngine` (ours: `engine_of("hf")`).
"""

from __future__ import annotations

from pathlib import Path

from stagereplay.audit.reexecute import AuditConfig
from stagereplay.audit.relocate import Relocation
from stagereplay.engine.decode import DecodeConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.attest.experiment import Attest
from stagereplay.experiments.attest.stage import AttestOptions
from stagereplay.experiments.core.prepared import OURS, RunEngine
from stagereplay.experiments.core.serving_run import engine_of
from stagereplay.experiments.mismatch.experiment import Mismatch
from stagereplay.experiments.mismatch.stage import MismatchOptions
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


def mismatch(out: str | Path, inputs: Inputs | None = None, options: MismatchOptions | None = None,
             engine: RunEngine = OURS, ex: ExecConfig | None = None, quiet: bool = False) -> Results:
    """The training-inference mismatch: rollouts (generated, or a rollout file's) scored by the rollout engine and
    by a trainer's one-shot prefill on the same tokens, the gap attributed."""
    return make_run(out, Mismatch(), options, inputs, engine, ex, quiet)


def attest(out: str | Path, inputs: Inputs | None = None, options: AttestOptions | None = None,
           engine: RunEngine = OURS, ex: ExecConfig | None = None, quiet: bool = False) -> Results:
    """Is a server running the model it claims? Its served tokens against the claimed model's reference, decided
    against the claimed model's honest variants on the same prompts."""
    return make_run(out, Attest(), options, inputs, engine, ex, quiet)


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


__all__ = ["AttestOptions", "AuditConfig", "Boundary", "BridgeOptions", "DecodeConfig", "EngineChoice", "ExecConfig", "Extension",
           "GridOptions", "Input", "Inputs", "MatchedOptions", "MismatchOptions", "Numerics", "PaperConfig",
           "Relocation", "ResampleConfig", "Results", "TransplantConfig", "attest", "audit", "bridge", "compare", "engine_of", "extend",
           "make_run", "matched", "merge", "mismatch", "paper", "precision_2x2", "resample", "transplant"]
