"""stagereplay: audit stage replay in LLMs.

Retained live cache vs fresh prefill of identical token IDs, exact replicas, a construction x precision 2x2,
a bit-exact incremental bridge, K/V cache transplantation and a re-executing ledger audit, on any Hugging Face
causal LM.

Beside the names below, what a registered experiment's package exports (its `__all__`: mismatch's
`mismatch_metrics`, for a training loop) is here by name, found in the registry when first asked for.
"""

import importlib
from typing import Any

from stagereplay.engine.boundary import After, Marker, Regex
from stagereplay.engine.cache import cache_fingerprint, compare_caches
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM, BoundaryState, Continuation, NoBoundary, load
from stagereplay.engine.transplant import TransplantSpec, transplant
from stagereplay.errors import StageReplayError
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
    "transplant",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """A name a registered experiment's package exports (`mismatch_metrics`)."""
    if not name.startswith("_"):
        from stagereplay.experiments.core.registry import EXPERIMENTS

        for experiment in EXPERIMENTS.values():
            module = importlib.import_module(type(experiment).__module__)
            package = importlib.import_module(module.__package__ or module.__name__)  # the package it lives in
            if name in getattr(package, "__all__", ()):
                return getattr(package, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
