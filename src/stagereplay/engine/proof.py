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

A proof covers the positions [prompt, reach) it compared, and costs what the run uses, not what the context
allows: `reach` is where the run's items can get (prompt + stage 1 + suffix, where a count boundary fixes stage 1:
proven that far exactly, at least MIN_REACH) or, where a marker ends stage 1 at a length nobody knows yet, what the
items have reached so far. The LM's stepper asks before every fast step whether its position is covered
(`Stepper.guard`, engine.prover's `Prover.guard`); one that is not is proven first, to the next reach of
`next_reach` (doubling: the last reach is under twice the furthest position a step needed, and all the proofs of
a run together under twice that reach), and a position below the proof's prompt runs eagerly. So a fast step
never runs at a position no proof compared. A difference turns the fast path off for the process (the run goes
on eagerly, exact and slower) and says so in one line; the outcome is recorded in each record's environment
(`Proof.as_dict`). A proof is kept in the store the model was given (engine.proof_stores): this process's
memory, before this machine's folder (records.proofs), so the stages of a command, the workers of a run and
later commands on the same setting reuse it. Cost: two steps per position up to `reach` per proof (`schedule`,
which `stagereplay plan` prices).

A static cache's step is proven on a cache of the length it runs at. A static forward attends over all L allocated
rows (masked), so its shapes, its kernels' blocking and on a CPU its bits follow L, and a CUDA graph replays the
kernels it recorded for the L it was captured at: a proof on a cache of another length says nothing about them.
So a proof records the static length it ran on (`Proof.allocated`), covers only steps on caches of that length,
and a step on a cache of a length no proof ran on is proven at that length first (`Prover.guard`). A run that
replays graphs allocates one length for all its items (`runs.make.prepare`), so one proof covers all of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    import torch

    from stagereplay.engine.decode import Stepper

log = logging.getLogger(__name__)


class ProofOutcome(TypedDict):
    """What a record's environment keeps of a proof (`Proof.as_dict`)."""

    path: str
    anchor: str
    equal: bool
    first_difference: int | None


class BatchCheck(TypedDict):
    """What a record's environment keeps of the batched step's check (`BatchProof`)."""

    rows: int
    steps: int
    invariant: bool
    equals_batch_1: bool


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
    seconds: float  # this proof's time (and its earlier, shorter ones')
    extensions: int = 0  # earlier proofs of the same setting, each to a shorter reach, that this one extended
    key: str = ""  # the machine and model setting it holds for (records.proofs.proof_key); "" where not kept there
    reused: bool = False  # taken from the store, made by another process (a worker, an earlier command)
    allocated: int | None = None  # the static cache's allocated positions L the proof ran on; None: a dynamic cache

    @property
    def name(self) -> str:
        """The step proven, with the static length it was proven at: what the store keeps one entry for."""
        return step_name(self.path, self.allocated)

    def covers(self, position: int, allocated: int | None = None) -> bool:
        """Whether a single-token step at `position` on a cache allocated for `allocated` positions (None: dynamic)
        was compared: the same allocation, and a position stepped (the proof's prompt was prefilled, not stepped)."""
        return self.allocated == allocated and self.prompt <= position < self.positions

    def as_dict(self) -> ProofOutcome:
        """What a record's environment keeps: what was proven and its outcome. Not how far, from which prompt, by
        whom, in how long or whether it was stored (a worker may prove or reuse, a store may be off), so that a
        run's ledger is the same bytes for any --workers or executor; the store's entry (records.proofs) keeps
        those."""
        return {"path": self.path, "anchor": self.anchor, "equal": self.equal,
                "first_difference": self.first_difference}

    def stored(self) -> dict[str, Any]:
        """Everything, for the store's entry."""
        return asdict(self)

    def line(self) -> str:
        at = "" if self.allocated is None else f" on a static cache of {self.allocated} positions"
        if self.equal:
            return f"{self.path} steps equal the {self.anchor} steps bit for bit over {self.steps} steps{at}"
        return (f"{self.path} steps differ from the {self.anchor} steps at position {self.first_difference}{at}: "
                f"running {self.anchor} steps (exact, slower)")


def step_name(path: str, allocated: int | None) -> str:
    """"captured", "cuda-graph" on a dynamic cache; "cuda-graph@L" on a static cache of L positions."""
    return path if allocated is None else f"{path}@{allocated}"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bit patterns (NaN equals itself, -0.0 differs from 0.0)."""
    import torch

    from stagereplay.engine.cache import bits

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def prove_steps(path: str, fast: Stepper, anchor: Stepper, new_cache: Callable[[], Any], prompt: Sequence[int],
                reach: int, advance: Callable[[int], None] | None = None) -> Proof:
    """Run `fast` and `anchor` in lockstep from `prompt` to position `reach` (see the module docstring), each on a
    cache `new_cache()` makes (a static one of the length the proof holds for, recorded as `allocated`);
    `advance(1)` after each compared step (a progress bar)."""
    import torch

    from stagereplay.engine.cache import allocated, clone_cache, compare_caches

    started = time.perf_counter()
    ours, theirs = new_cache(), None
    length = allocated(ours)
    logits = anchor.forward(list(prompt), ours, 0)
    theirs = clone_cache(ours)
    past, steps, first = len(prompt), 0, None
    with fast.proving():
        while past < reach:
            token = int(torch.argmax(logits.float()))
            logits = anchor.forward([token], ours, past)
            fast_logits = fast.forward([token], theirs, past)
            steps += 1
            if advance is not None:
                advance(1)
            if not same_bits(logits, fast_logits):
                first = past
                break
            past += 1
    if first is None and compare_caches(ours, theirs):
        first = past
    return Proof(path, "eager", len(prompt), reach, steps, first is None, first,
                 round(time.perf_counter() - started, 3), allocated=length)


@contextmanager
def proof_progress(label: str, total: int, show: bool) -> Iterator[Callable[[int], None] | None]:
    """A transient progress bar for a proof (nested under a run's bar where rich can nest them); None unshown."""
    if not show:
        yield None
        return
    from rich.errors import LiveError
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   transient=True)
    task = bar.add_task(escape(label), total=total)
    try:
        bar.start()
    except LiveError:  # an older rich under a run's bar: the line said after the proof is enough
        yield None
        return
    try:
        yield lambda k: bar.advance(task, k)
    finally:
        bar.stop()


def report(proof: Proof) -> None:
    """Say a failed proof in one line, a WARNING (a passed one is only recorded)."""
    if not proof.equal:
        log.warning(proof.line())


MIN_REACH = 64
"""The shortest proof. Each of its positions costs two steps (a third of a second for a 270M model on a busy
2-core CPU), so it is no longer than a short run needs; doubling from it keeps the number of proofs small."""


def next_reach(needed: int, proven: int, context: int) -> int:
    """How far to prove when a step needs positions up to `needed` (exclusive) and `proven` are covered: at least
    double what is covered (and MIN_REACH), rounded up to a power of two, within the context, and never short of
    `needed`. Doubling keeps a run's proofs together under twice its last reach (`schedule`)."""
    target = max(needed, 2 * proven, MIN_REACH)
    return max(needed, min(1 << (target - 1).bit_length(), context))


def schedule(first: int, furthest: int, context: int) -> list[int]:
    """The reaches a run proves to when its first proof needs `first` positions and its items go on to
    `furthest`: each later proof starts when a step passes the last reach (what `stagereplay plan` prices)."""
    reaches = [next_reach(first, 0, context)]
    while reaches[-1] < min(furthest, context):
        reaches.append(next_reach(reaches[-1] + 1, reaches[-1], context))
    return reaches


@dataclass(frozen=True)
class BatchProof:
    """What a batched step (engine.batched_step) was shown to be on this model and these kernels."""

    rows: int
    steps: int
    invariant: bool  # each row's logits the same bits together, alone and in another slot
    equals_batch_1: bool  # ... and the same bits as the batch-1 eager step (row-count-invariant kernels)

    def as_dict(self) -> BatchCheck:
        return {"rows": self.rows, "steps": self.steps, "invariant": self.invariant,
                "equals_batch_1": self.equals_batch_1}

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

    from stagereplay.engine.batched_step import BatchedStep
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
