"""One model's proofs of its fast steps (engine.proof): which it holds, where they are kept, and the guard its
stepper asks before every fast step.

    prover = Prover(stepper, config, settings, context, store)   # engine.lm.LM makes one, with the store it is given
    prover.prove(prompt, reach, allocated)   # before a run's first item (runs.make): as far as the items are sure to go
    stepper.guard = prover.guard             # a step past what is proven is proven first, or runs eagerly
    prover.recorded()                        # {"fast_steps": ..., "batch_check": ...}: what each record's environment adds
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypedDict

from stagereplay.engine.cache import new_cache
from stagereplay.engine.decode import Stepper
from stagereplay.engine.proof import (
    MIN_REACH,
    BatchCheck,
    BatchProof,
    Proof,
    ProofOutcome,
    next_reach,
    proof_progress,
    prove_batched,
    prove_steps,
    report,
    step_name,
)
from stagereplay.engine.proof_stores import FastStep, ProofStore
from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    from stagereplay.engine.model import ModelConfig

log = logging.getLogger(__name__)


class ProofsRecorded(TypedDict, total=False):
    """The proofs' outcomes a record's environment keeps, each once it exists."""

    fast_steps: ProofOutcome
    batch_check: BatchCheck


class Prover:
    """The proofs of one model's fast steps: by the static length they ran at (None: a dynamic cache), the latest
    (the one each record's environment names), the batched step's check, the prompt proofs prefill, whether to
    say them as they run, and the store they are kept in (engine.proof_stores: passed in by whoever made the
    model)."""

    def __init__(self, stepper: Stepper, config: ModelConfig, settings: Mapping[str, Any], context: int,
                 store: ProofStore) -> None:
        self.stepper = stepper  # the fast one: a failed proof turns its fast path off
        self.config = config
        self.settings = dict(settings)  # what engine.model.set_determinism set: part of what a proof is of
        self.context = context
        self.store = store
        self.proofs: dict[int | None, Proof] = {}
        self.proof: Proof | None = None  # the latest taken, once a step has needed one
        self.batch_proof: BatchProof | None = None  # the batched step's (engine.proof.prove_batched)
        self.prompt: tuple[int, ...] = ()  # what every proof prefills: the first prompt proven from
        self.show = False  # say each proof as it runs (a command's own process, not --quiet)

    @property
    def fast(self) -> bool:
        return self.stepper.capture or self.stepper.graphs is not None

    def recorded(self) -> ProofsRecorded:
        """What every record's environment adds to the model's settings: the latest proof's outcome (`fast_steps`)
        once one was made or taken, the batched step's (`batch_check`) once it ran."""
        out: ProofsRecorded = {}
        if self.proof is not None:
            out["fast_steps"] = self.proof.as_dict()
        if self.batch_proof is not None:
            out["batch_check"] = self.batch_proof.as_dict()
        return out

    def prove(self, prompt: Sequence[int], reach: int, allocated: int | None = None) -> Proof | None:
        """Prove the fast single-token step (captured by dynamo, or a CUDA graph) equal to the eager step from
        `prompt` to at least position `reach`, now: a run's set-up before its first item (runs.make); a graphed step
        on a static cache of `allocated` positions, the length the run's caches have (a proof holds for that length
        only: engine.proof). Steps past what is proven are proven as they come (`guard`), so `reach` need only be
        what the run is sure to use. None where every step is eager anyway."""
        self.prompt = self.prompt or tuple(prompt)
        if allocated is not None and self.stepper.graphs is None:
            allocated = None  # a captured step runs on dynamic caches only
        if allocated is not None:
            reach = min(reach, allocated)  # a static cache's steps reach no further than its rows
        proof = self._held(allocated)
        if self.fast and (proof is None or proof.positions < reach):
            self._prove_to(reach, allocated, exact=True)
        return self.proofs.get(allocated, self.proof)

    def guard(self, past: int, allocated: int | None, prompt: Sequence[int]) -> bool:
        """The stepper's guard (`Stepper.guard`): whether a fast step may run at position `past` on a cache of
        `allocated` positions (None: dynamic), in a sequence that began with `prompt`. A position past the reach
        proven at that allocation is proven first (to `next_reach`), as is an allocation no proof ran on; one below
        the proof's prompt, which the proof prefilled rather than stepped, runs eagerly."""
        proof = self._held(allocated)
        if proof is None or past >= proof.positions:
            self._prove_to(past + 1, allocated, prompt)
            proof = self.proofs[allocated]
        return proof.equal and proof.covers(past, allocated)

    def adopt(self, proof: Proof) -> None:
        """Take `proof` as this model's; a failed one turns the fast path off for good."""
        self.proof = self.proofs[proof.allocated] = proof
        if not proof.equal:
            self.stepper.capture, self.stepper.graphs = False, None

    def prove_batch(self, prompts: Sequence[Sequence[int]]) -> BatchProof:
        """Show, before items step together at `config.batch` rows, that a row's bits do not depend on its
        batch-mates or slot here, and whether they equal batch 1's (engine.proof.prove_batched); say the answer
        in one line (INFO) and record it. A row that depends on its mates is refused.

        The line carries `once`, its model setting and answer: the same answer for the same setting says nothing
        new, so a command says it once however often its stages and workers load the model (cli.app)."""
        if self.batch_proof is None:
            proof = prove_batched(self.stepper.model, self.config.batch, self.config.device, prompts or [[0]],
                                  cache=self.config.cache)
            if not proof.invariant:
                raise StageReplayError(proof.line(), "run with --batch 1")
            log.info(proof.line(), extra={"once": f"{self.config}: {proof.line()}"})
            self.batch_proof = proof
        return self.batch_proof

    @property
    def _kind(self) -> str:
        return "cuda-graph" if self.stepper.graphs is not None else "captured"

    def _step(self, allocated: int | None) -> FastStep:
        return FastStep.of(self.config, self.settings, step_name(self._kind, allocated), self.stepper.eager_branches)

    def _held(self, allocated: int | None) -> Proof | None:
        """The proof at `allocated` this model holds, or else the store's (made by this process for an earlier
        load of the model, or by another process on this machine), while the fast path is on."""
        if allocated not in self.proofs and self.fast:
            kept = self.store.get(self._step(allocated))
            if kept is not None:
                self._take(kept)
        return self.proofs.get(allocated)

    def _take(self, kept: Proof) -> None:
        """Adopt a proof from the store; one another process made is said (and a failed one warned of)."""
        if kept.reused:
            self.say(f"{kept.name} step proven on this machine before ({self.store.where(self._step(kept.allocated))}"
                     f"): positions {kept.prompt}-{kept.positions}")
            report(kept)
        self.adopt(kept)

    def _prove_to(self, needed: int, allocated: int | None = None, prompt: Sequence[int] = (),
                  exact: bool = False) -> None:
        """Prove the fast step to at least `needed` positions on caches of `allocated` positions (None: dynamic),
        or take a proof as far from the store (another process's on this machine and setting). `exact`: `needed` is
        as far as the run goes (a count boundary's reach), so prove that far (at least MIN_REACH); else double what
        is proven (`next_reach`). A static proof runs on a cache of `allocated` positions and reaches no further.

        Every proof prefills the prompt the first one did (`prove`'s, or the prompt of the sequence whose step
        first needed one, passed in by that step): what the proofs cover then starts at one position for the
        model's whole life, and a step of a shorter prompt below it runs eagerly. A step whose sequence is unknown
        (a bare stepper's) passes none, and its proof prefills one token."""
        earlier, step = self.proofs.get(allocated), self._step(allocated)
        prompt = self.prompt or tuple(prompt) or (0,)
        limit = self.context if allocated is None else min(self.context, allocated)
        reach = (min(max(needed, MIN_REACH), limit) if exact
                 else next_reach(needed, earlier.positions if earlier else 0, limit))
        target = max(reach, len(prompt) + 1)
        with self.store.lock(step):
            kept = self.store.get(step)
            if kept is not None and (not kept.equal or kept.covers(needed - 1, allocated)):
                self.prompt = self.prompt or prompt
                self._take(kept)
                return
            anchor = Stepper(self.stepper.model, self.config.device)
            label = (f"proving the {step.name} step on this model: {target} positions" if earlier is None else
                     f"proving the {step.name} step further: {earlier.positions} -> {target} positions")
            with proof_progress(label, target - len(prompt), self.show) as advance:
                proof = prove_steps(self._kind, self.stepper, anchor,
                                    lambda: new_cache(self.stepper.model, self.config.cache, allocated or target),
                                    prompt, target, advance)
            self.say(f"{label}: {'equal' if proof.equal else 'different'} ({proof.seconds:.1f} s)")
            proof = self.store.put(step, replace(
                proof, seconds=round(proof.seconds + (earlier.seconds if earlier else 0.0), 3),
                extensions=earlier.extensions + 1 if earlier else 0))
        self.prompt = self.prompt or prompt
        report(proof)
        self.adopt(proof)

    def say(self, line: str) -> None:
        """A proof's progress line, at INFO, for the command's own model (`show`)."""
        if self.show:
            log.info(line)
