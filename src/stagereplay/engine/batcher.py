"""Many items at once, each told as one item's story: item threads whose single-token steps are gathered into
batched forwards (engine.batched_step).

Each item runs its own experiment function (`matched_item` and its siblings, unchanged) in a thread of its own.
Their forwards go through a `Batcher` in place of the LM's stepper: a thread that asks for a step waits until
every item thread in flight has asked for one (or finished), and then the last to ask runs them all, the
single-token steps as one `BatchedStep` forward of `rows` rows, each prefill alone at batch 1. Items
join as others finish, so the rows stay busy. Which items share a forward depends on thread timing, and need not
be deterministic: a row's bits do not depend on its batch-mates or its slot (engine.batched_step), so every item's record
is the same bits however the items were grouped.

    with batched(lm, rows=16) as batcher:          # lm.stepper is the batcher within
        results = [pool.submit(batcher.run, work, lm, job) for job in jobs]
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagereplay.engine.batched_step import BatchedStep
from stagereplay.engine.decode import Stepper

if TYPE_CHECKING:
    import torch


@dataclass
class _Request:
    ids: Sequence[int]
    cache: Any
    past: int
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)  # set once `result` or `error` is


class Batcher:
    """A stepper for item threads (`Stepper.forward`'s signature): their steps gathered into batched forwards."""

    capture = False  # the batched step is its own fast path, proven by `batch_check`, never captured
    graphs = None

    def __init__(self, model: Any, rows: int, device: str) -> None:
        self.step = BatchedStep(model, rows, device)
        self.single = Stepper(model, device)  # prefills: one item at a time, the batch-1 engine's forwards
        self.rows = rows
        self.forwards = 0  # batched forwards run, for benchmarks
        self.patience = 0.005  # seconds a step waits for items busy elsewhere before going without them
        self._lock = threading.Lock()
        self._active = 0
        self._pending: list[_Request] = []

    def run(self, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)` as one item thread: its steps wait for the other items' steps."""
        with self._lock:
            self._active += 1
        try:
            return work(*args)
        finally:
            with self._lock:
                self._active -= 1
                self._flush()

    def forward(self, ids: Sequence[int], cache: Any, past: int, device_token: torch.Tensor | None = None,
                prompt: Sequence[int] = ()) -> torch.Tensor:
        """`Stepper.forward`, as one of a batched forward's rows (`prompt` unread: the batched step is checked
        before a run, `batch_check`, not per step)."""
        request = _Request(list(ids), cache, past)
        with self._lock:
            self._pending.append(request)
            self._flush()
        # Items busy elsewhere (hashing a cache, scoring) are not waited for long: after `patience` the steps asked
        # for so far go without them (the grouping moves no bit). Each request has its own event, so a forward
        # wakes only the threads it served.
        while not request.done.wait(self.patience):
            with self._lock:
                if not request.done.is_set():
                    self._flush(force=True)
        if request.error is not None:
            raise request.error
        return request.result

    def _flush(self, force: bool = False) -> None:
        """Run what is pending once every item thread in flight is waiting on a step, or now with `force` (call
        with the lock)."""
        if not self._pending or (len(self._pending) < self._active and not force):
            return
        pending, self._pending = self._pending, []
        try:
            singles = [r for r in pending if len(r.ids) == 1]
            for r in pending:
                if len(r.ids) > 1:
                    r.result = self.single.forward(r.ids, r.cache, r.past)
            for start in range(0, len(singles), self.rows):
                chunk = singles[start : start + self.rows]
                slots: list[tuple[int, Any, int] | None] = [(r.ids[0], r.cache, r.past) for r in chunk]
                slots += [None] * (self.rows - len(chunk))
                for r, logits in zip(chunk, self.step.forward(slots), strict=False):
                    r.result = logits
                self.forwards += 1
        except BaseException as exc:  # every waiting thread gets the error, none waits forever
            for r in pending:
                r.error = exc
        for r in pending:
            r.done.set()


@contextmanager
def batched(lm: Any, rows: int) -> Iterator[Batcher]:
    """Within: `lm.stepper` is a `Batcher` of `rows` rows (engine.lm.LM); the LM's own stepper after."""
    own = lm.stepper
    batcher = Batcher(lm.model, rows, lm.config.device)
    lm.stepper = batcher
    try:
        yield batcher
    finally:
        lm.stepper = own
