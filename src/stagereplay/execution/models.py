"""The models this process has loaded: one at a time, shared by every stage of a command that runs here (the
command's own process, a local worker or a Ray actor)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig
    from stagereplay.engine.proof_stores import MachineStore

# The models this process has loaded, so that the stages of one command that share a model setting load it (and
# capture its steps) once. One at a time, in the command's own process and in each worker alike: no comparison
# needs two models resident (the 2x2 runs each precision as its own jobs, the audit groups its jobs by model),
# and at 14B two would be 28-56 GiB. A model is released, and collected, before the next one loads.
_LMS: dict[ModelConfig, LM] = {}
MAX_MODELS = 1


def cached_lm(config: ModelConfig, keep: int = MAX_MODELS, machine_store: MachineStore | None = None) -> LM:
    """The model for `config`, loaded unless it is among the last `keep` this process used.

    A model loaded here keeps its fast step's proofs in this process's memory (engine.proof_stores.IN_PROCESS),
    layered before the store `machine_store` finds on this machine (records.proofs.machine_store; None: none).
    The models dropped to make room are collected before the next loads: a captured step holds its model in
    reference cycles, which plain reference counting would leave for the cycle collector to find later.
    """
    lm = _LMS.pop(config, None)
    if lm is None:
        import gc

        from stagereplay.engine.lm import load, load_without_weights
        from stagereplay.engine.proof_stores import IN_PROCESS, layered

        if len(_LMS) >= keep:
            while len(_LMS) >= keep:
                _LMS.pop(next(iter(_LMS)))  # the least recently used, dropped before the next one loads
            gc.collect()
        proofs = layered(IN_PROCESS, machine_store() if machine_store is not None else None)
        if not config.weights:  # a serving engine takes every step: the tokenizer is all this run reads
            lm = load_without_weights(config, proofs)
        else:
            lm = load(config.path, config.precision, config.device, config.threads, config.attn_impl, config.cache,
                      config.batch, proofs)
    _LMS[config] = lm
    return lm


def release_models() -> None:
    """Drop every model this process holds (at a command's end)."""
    _LMS.clear()
