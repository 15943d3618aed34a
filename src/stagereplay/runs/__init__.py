"""The library entry points the CLI wraps; each makes or extends a run directory and returns its results. Each
takes typed configs, built by the CLI or in a notebook:

    matched(out, Inputs(...), construction, ExecConfig(...), shard, serving_arms(...))   (runs/make.py)
    precision_2x2(run_dir, constructions, precisions, Extension(...))                      (runs/extend.py)
    bridge(run_dir, rows, Extension(...))
    transplant(run_dir, TransplantConfig(...), Extension(...))
    resample(run_dir, ResampleConfig(...), Extension(...))
    audit(run_dir, AuditConfig(...), verify_only, Extension(...))
    merge(shards, out)                                                                      join `--shard I/N` runs
    paper(out, Inputs(...), PaperConfig(...))                                               (runs/protocol.py)
    compare(run_a, run_b, out, checkpoint)                                                  (runs/compare.py)
"""

from stagereplay.audit.reexecute import AuditConfig
from stagereplay.audit.relocate import Relocation
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.resample import ResampleConfig
from stagereplay.experiments.transplant import TransplantConfig
from stagereplay.runs.compare import compare
from stagereplay.runs.extend import Extension, audit, bridge, merge, precision_2x2, resample, transplant
from stagereplay.runs.make import Inputs, matched
from stagereplay.runs.protocol import PaperConfig, paper
from stagereplay.serving.matched import serving_arms

__all__ = ["AuditConfig", "ExecConfig", "Extension", "Inputs", "PaperConfig", "Relocation", "ResampleConfig",
           "TransplantConfig", "audit", "bridge", "compare", "matched", "merge", "paper", "precision_2x2", "resample",
           "serving_arms", "transplant"]
