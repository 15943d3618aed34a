"""The library entry points the CLI wraps; each makes or extends a run directory and returns its results.

    matched(out, ...)            live vs a fresh construction, with replicas     (runs/make.py)
    precision_2x2(run_dir, ...)  fixed prefixes, construction x precision        (runs/extend.py)
    bridge(run_dir, ...)         incremental vs live caches, bitwise
    transplant(run_dir, ...)     K/V swapped between the two boundary states
    resample(run_dir, ...)       K sampled draws per boundary state: is the answer distribution kept?
    audit(run_dir, ...)          re-execute the ledger and check every claim
    merge(shards, out)           join `--shard I/N` runs
    paper(out, ...)              all of it, as the reference paper runs it        (runs/protocol.py)
"""

from stagereplay.runs.extend import audit, bridge, merge, precision_2x2, resample, transplant
from stagereplay.runs.make import matched
from stagereplay.runs.protocol import paper

__all__ = ["audit", "bridge", "matched", "merge", "paper", "precision_2x2", "resample", "transplant"]
