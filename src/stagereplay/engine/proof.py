"""Proofs that a fast step is its anchor's step, bit for bit, on the user's own model, before a run relies on it.

A fast path (a step captured by dynamo, a CUDA graph, a batched row) is argued equal to the eager step it
replaces, and tests check the argument on tiny models. That is not enough: the argument holds for the code and
kernels someone read, and a library update, another CPU's kernels or a model shape nobody tested can break it
where no replica or audit can see (both would re-run the same fast step). So before a process uses a fast step
on a model, it runs the two side by side, in lockstep:

    anchor: a plain eager Stepper on its own cache       fast: the Stepper the run will use, on a clone
    prefill the prompt once (multi-token forwards are eager in both), then per position p up to `reach`:
        token = argmax(anchor logits)     (greedy, as live generation picks)
        compare the two steps' logits [V] bit for bit; stop at the first difference
    and at the end the two caches, layer by layer, bit for bit.

`reach` is the furthest position the run can reach (prompt + stage-1 budget + suffix budget), so the steps cross
every sliding window and every shape the run's steps take. A difference turns the fast path off for the
process (the run goes on eagerly, exact and slower) and says so in one line; the outcome is recorded in each
record's environment (`Proof.as_dict`). Cost: two steps per position up to `reach`, once per process and model
(`stagereplay plan` counts them).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from stagereplay.engine.decode import Stepper


@dataclass(frozen=True)
class Proof:
    """The outcome of running a fast step beside its anchor."""

    path: str  # what was proven: "captured" (dynamo) | "cuda-graph"
    anchor: str  # what it was compared with: "eager"
    prompt: int  # tokens prefilled before the first compared step
    positions: int  # the furthest position compared (exclusive)
    steps: int  # single-token steps compared
    equal: bool
    first_difference: int | None  # the position whose logits (or, at the end, cache) first differed
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """What a record's environment keeps: what was proven and its outcome. Not how far or from which prompt
        (a worker proves from its first item, the command's process from the longest prompt), nor the time, so
        that a run's ledger is the same bytes for any --workers."""
        return {"path": self.path, "anchor": self.anchor, "equal": self.equal,
                "first_difference": self.first_difference}

    def line(self) -> str:
        if self.equal:
            return f"{self.path} steps equal the {self.anchor} steps bit for bit over {self.steps} steps"
        return (f"{self.path} steps differ from the {self.anchor} steps at position {self.first_difference}: "
                f"running {self.anchor} steps (exact, slower)")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bit patterns (NaN equals itself, -0.0 differs from 0.0)."""
    import torch

    from stagereplay.engine.cache import bits

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def prove_steps(path: str, fast: Stepper, anchor: Stepper, new_cache: Callable[[], Any], prompt: Sequence[int],
                reach: int) -> Proof:
    """Run `fast` and `anchor` in lockstep from `prompt` to position `reach` (see the module docstring)."""
    import torch

    from stagereplay.engine.cache import clone_cache, compare_caches

    started = time.perf_counter()
    ours, theirs = new_cache(), None
    logits = anchor.forward(list(prompt), ours, 0)
    theirs = clone_cache(ours)
    past, steps, first = len(prompt), 0, None
    while past < reach:
        token = int(torch.argmax(logits.float()))
        logits = anchor.forward([token], ours, past)
        fast_logits = fast.forward([token], theirs, past)
        steps += 1
        if not same_bits(logits, fast_logits):
            first = past
            break
        past += 1
    if first is None and compare_caches(ours, theirs):
        first = past
    return Proof(path, "eager", len(prompt), reach, steps, first is None, first,
                 round(time.perf_counter() - started, 3))


def report(proof: Proof) -> None:
    """Say a failed proof in one line (a passed one is only recorded)."""
    if not proof.equal:
        print(f"warning: {proof.line()}", file=sys.stderr)


def proof_reach(reach: int, proven: int, context: int) -> int:
    """How far to prove when a run needs `reach`: the next power of two (at least 256), within the context, so that
    items whose prompts differ in length share one proof."""
    target = max(256, 1 << max(0, reach - 1).bit_length())
    return max(reach, min(target, context), proven)


_PROVEN: dict[tuple[Any, int], Proof] = {}
"""This process's proofs by model setting and the model files' modification time: a model loaded again (the
stages of a command, a test's second load) runs the same steps on the same kernels, and is not proven twice."""


def _key(config: Any) -> tuple[Any, int]:
    import os

    try:
        stamp = os.stat(config.path).st_mtime_ns
    except OSError:
        stamp = -1
    return config, stamp


def proven(config: Any) -> Proof | None:
    """The proof this process made for the model setting `config` (engine.model.ModelConfig), if any."""
    return _PROVEN.get(_key(config))


def remember(config: Any, proof: Proof) -> None:
    _PROVEN[_key(config)] = proof


@dataclass(frozen=True)
class BatchProof:
    """What a batched step (engine.batch) was shown to be on this model and these kernels."""

    rows: int
    steps: int
    invariant: bool  # each row's logits the same bits together, alone and in another slot
    equals_batch_1: bool  # ... and the same bits as the batch-1 eager step (row-count-invariant kernels)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        if not self.invariant:
            return f"--batch {self.rows}: a row's bits depend on its batch-mates here"
        if self.equals_batch_1:
            return (f"--batch {self.rows}: each row's bits are independent of its batch-mates and equal to --batch 1's "
                    "here: batching changes no bit")
        return (f"--batch {self.rows}: each row's bits are independent of its batch-mates, but differ from --batch 1's "
                f"here (the kernels' bits follow the row count): records are exact at --batch {self.rows}, and are "
                f"audited at it")


def prove_batched(model: Any, rows: int, device: str, prompts: Sequence[Sequence[int]], steps: int = 8,
                  cache: str = "dynamic") -> BatchProof:
    """Run up to three prompts' greedy steps at `rows` rows together (slots 0, 1, 2), each alone (in the last slot),
    and at batch 1 eagerly, and compare every step's logits bit for bit, on caches of the run's kind (a static
    one sized as generate() sizes it: prompt + steps positions, so its rows attend over their own lengths)."""
    import torch

    from stagereplay.engine.batch import BatchedStep
    from stagereplay.engine.cache import new_cache
    from stagereplay.engine.decode import Stepper

    eager, batched = Stepper(model, device), BatchedStep(model, rows, device)
    prompts = [list(p) for p in prompts[: min(3, rows)]]

    def fresh(k: int) -> Any:
        return new_cache(model, cache, len(prompts[k]) + steps)

    def run(slots: dict[int, int]) -> dict[int, list[torch.Tensor]]:
        caches = {k: fresh(k) for k in slots}
        logits = {k: eager.forward(prompts[k], caches[k], 0) for k in slots}
        out: dict[int, list[torch.Tensor]] = {k: [] for k in slots}
        for t in range(steps):
            row: list[tuple[int, Any, int] | None] = [None] * rows
            for k, slot in slots.items():
                row[slot] = (int(torch.argmax(logits[k].float())), caches[k], len(prompts[k]) + t)
            made = batched.forward(row)
            for k, slot in slots.items():
                out[k].append(made[slot])  # type: ignore[arg-type]  # an active slot's logits
                logits[k] = made[slot]  # type: ignore[assignment]
        return out

    def single(k: int) -> list[torch.Tensor]:
        own = fresh(k)
        logits = eager.forward(prompts[k], own, 0)
        out = []
        for t in range(steps):
            logits = eager.forward([int(torch.argmax(logits.float()))], own, len(prompts[k]) + t)
            out.append(logits)
        return out

    together = run({k: k for k in range(len(prompts))})
    alone = {k: run({k: rows - 1})[k] for k in range(len(prompts))}
    invariant = all(same_bits(a, b) for k in together for a, b in zip(together[k], alone[k], strict=True))
    equal = all(same_bits(a, b) for k in together for a, b in zip(together[k], single(k), strict=True))
    return BatchProof(rows, steps, invariant, equal)
