"""stagereplay: audit stage replay in LLMs.

Retained live cache vs fresh prefill of identical token IDs, exact replicas, a construction x precision 2x2,
a bit-exact incremental bridge, K/V cache transplantation and a re-executing ledger audit, on any Hugging Face
causal LM.
"""

from stagereplay.engine.boundary import After, Marker, Regex
from stagereplay.engine.cache import cache_fingerprint, compare_caches
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM, BoundaryState, Continuation, NoBoundary, load
from stagereplay.engine.transplant import TransplantSpec, transplant
from stagereplay.errors import StageReplayError
from stagereplay.experiments.mismatch.metrics import mismatch_metrics
from stagereplay.runs import matched
from stagereplay.tasks import Item

__all__ = [
    "LM",
    "After",
    "BoundaryState",
    "Continuation",
    "DecodeConfig",
    "Item",
    "Marker",
    "NoBoundary",
    "Regex",
    "StageReplayError",
    "TransplantSpec",
    "cache_fingerprint",
    "compare_caches",
    "load",
    "matched",
    "mismatch_metrics",
    "transplant",
]
__version__ = "0.1.0"
