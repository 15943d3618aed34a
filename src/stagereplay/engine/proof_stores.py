"""Where proofs of fast steps (engine.proof) are kept: what a proof is of, the protocol every store follows, this
process's memory, and stores layered one before another.

A model's proofs are looked up and kept in the store it is given when it is made (`engine.lm.load(proofs=...)`,
engine.prover): this process's memory (`IN_PROCESS`), so that a model loaded again in the process (the stages of a
command, a test's second load) is not proven twice, layered before this machine's folder (records.proofs), so
that the workers of a run and later commands on the same setting are not either. The engine knows only the
protocol and the memory; who loads a model composes the layers (execution.models.cached_lm), with the folder a run
passes down (`MachineStore`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from stagereplay.engine.model import ModelConfig
    from stagereplay.engine.proof import Proof


@dataclass(frozen=True)
class FastStep:
    """What a proof is of, as the engine knows it: the step (`name`: its kind and the static length it runs at,
    engine.proof.step_name) on a model setting, loaded under `settings` (engine.model.set_determinism's, as
    sorted pairs), with library switches held at their eager values or not (engine.decode.EAGER_BRANCHES). A
    store keys its proofs on it; records.proofs adds the machine, the code and the model files."""

    model: ModelConfig
    settings: tuple[tuple[str, Any], ...]
    name: str  # "captured", "cuda-graph", "cuda-graph@4096"
    eager_branches: bool

    @classmethod
    def of(cls, model: ModelConfig, settings: Mapping[str, Any], name: str, eager_branches: bool) -> FastStep:
        return cls(model, tuple(sorted(settings.items())), name, eager_branches)


class ProofStore(Protocol):
    """Where proofs are kept and looked up, by what they are of."""

    def lock(self, step: FastStep) -> AbstractContextManager[None]:
        """Within: nobody else proves `step` (the first to need it proves, the rest then take its proof)."""
        ...

    def get(self, step: FastStep) -> Proof | None:
        """The furthest proof of `step` kept here, if any (`Proof.reused` where another process made it)."""
        ...

    def put(self, step: FastStep, proof: Proof) -> Proof:
        """Keep `proof` as `step`'s; return it as kept (with the store's `key` where it has one)."""
        ...

    def where(self, step: FastStep) -> str:
        """Where `step`'s proof is kept, for the line that says one was taken rather than made."""
        ...


class MemoryStore:
    """Proofs held in this process, by what they are of and the model files' modification time (a model saved
    again is another model)."""

    def __init__(self) -> None:
        self._proofs: dict[tuple[FastStep, int], Proof] = {}

    def lock(self, step: FastStep) -> AbstractContextManager[None]:
        return nullcontext()  # one process: whoever holds the model proves in its own thread

    def get(self, step: FastStep) -> Proof | None:
        return self._proofs.get((step, _stamp(step.model.path)))

    def put(self, step: FastStep, proof: Proof) -> Proof:
        self._proofs[(step, _stamp(step.model.path))] = proof
        return proof

    def where(self, step: FastStep) -> str:
        return "this process"

    def clear(self) -> None:
        """Forget every proof, as a fresh process starts."""
        self._proofs.clear()


def _stamp(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


class Layered:
    """Stores one before another: this process's memory before this machine's folder. A lookup asks every layer
    and takes the furthest proof (a failed one before any, as it ends the fast path): another process may have
    proven further since this one last looked. What a later layer had is kept in the layers before it."""

    def __init__(self, *stores: ProofStore) -> None:
        self.stores = stores

    @contextmanager
    def lock(self, step: FastStep) -> Iterator[None]:
        with ExitStack() as held:
            for store in self.stores:
                held.enter_context(store.lock(step))
            yield

    def get(self, step: FastStep) -> Proof | None:
        found = [store.get(step) for store in self.stores]
        held = [(k, p) for k, p in enumerate(found) if p is not None]
        if not held:
            return None
        source, best = max(held, key=lambda kp: (not kp[1].equal, kp[1].positions, -kp[0]))
        for store in self.stores[:source]:
            store.put(step, best)
        return best

    def put(self, step: FastStep, proof: Proof) -> Proof:
        for store in reversed(self.stores):  # the outermost first: its key is the one the proof carries
            proof = store.put(step, proof)
        return proof

    def where(self, step: FastStep) -> str:
        """The outermost layer's: where the proof outlives this process."""
        return self.stores[-1].where(step)


def layered(*stores: ProofStore | None) -> ProofStore:
    """The given stores (None: none there, as `STAGEREPLAY_PROOFS=off` gives for the folder) in order."""
    kept = [s for s in stores if s is not None]
    return kept[0] if len(kept) == 1 else Layered(*kept)


IN_PROCESS = MemoryStore()
"""This process's proofs: the store of a model loaded without one, and the front layer of every model
execution.models.cached_lm loads."""

MachineStore = Callable[[], "ProofStore | None"]
"""What finds this machine's store (records.proofs.machine_store), called in the process that loads the model: what a
run hands its worker processes and Ray actors in place of a store, as one may run on another machine, with a folder
of its own."""
