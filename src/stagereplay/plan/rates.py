"""What a forward costs on a machine: rates given by the user, or measured on the real model (`calibrate`).

`stagereplay plan` prices each stage's forwards at these rates (`plan.paper`); `bench/paper.py` brackets a
run with `calibrate` to price the run's own plan at the pace the machine had around it. A step is timed after a
warm-up round that captures it, on the cache kind and kernels the run would use; `together` > 1 times that many
fresh processes at once, as a run's workers step at once on a shared CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from stagereplay.errors import StageReplayError


class Priced(Protocol):
    """What a rate prices: a stage's forwards, its prefill tokens and its units (`stage_plan.StagePlan`)."""

    @property
    def precision(self) -> str: ...

    @property
    def forwards(self) -> int: ...

    @property
    def prefill_tokens(self) -> int: ...

    @property
    def units(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def rows(self) -> int: ...


@dataclass(frozen=True)
class Rates:
    """Forwards per second (a decode step; any forward costs at least one) and, where known, prefill tokens
    per second on top, per precision."""

    steps: dict[str, float]
    prefill_tokens: dict[str, float] = field(default_factory=dict)
    source: str = "given"
    row_seconds: dict[str, float] = field(default_factory=dict)
    """What each row beyond the first adds to a batched step (its attention over its own cache, its share of the
    row-wise work), per precision or under "": a forward of C rows costs a step plus C - 1 of these."""

    def seconds(self, stage: Priced) -> float:
        """Per precision, or for every precision under the key ""."""
        x = self.steps.get(stage.precision) or self.steps[""]
        y = self.prefill_tokens.get(stage.precision) or self.prefill_tokens.get("")
        extra = 0.0
        if stage.rows > 1:  # each batched forward's rows beyond the first (the last forward's rows counted too)
            row = self.row_seconds.get(stage.precision, self.row_seconds.get("", 0.0))
            extra = (stage.steps - -(-stage.steps // stage.rows)) * row
        return stage.forwards / x + extra + (stage.prefill_tokens / y if y else 0.0)

    def wall(self, stage: Priced, workers: int) -> float:
        """Seconds of `stage` spread over `workers` processes (no more of them busy than it has units)."""
        return self.seconds(stage) / max(1, min(workers, stage.units))


@dataclass(frozen=True)
class RateOptions:
    """The rates a plan prices its forwards at: given, or measured on the real model (`calibrate`); with neither the
    plan counts forwards and gives no time."""

    panel: ClassVar[str] = "Rates"

    tokens_per_second: float | None = field(default=None, metadata={
        "help": "decode steps per second (any forward costs one)"})
    prefill_tokens_per_second: float | None = field(default=None, metadata={
        "help": "prefill tokens per second, on top of the forward's step"})
    calibrate: bool = field(default=False, metadata={
        "help": "measure the rates on the real model (on a CPU, in as many processes at once as --workers)"})
    row_ms: float | None = field(default=None, metadata={
        "help": "with --batch: what each row beyond the first adds to a batched step, in ms (--calibrate measures it)"})

    def __post_init__(self) -> None:
        for name, rate in (("--tokens-per-second", self.tokens_per_second),
                           ("--prefill-tokens-per-second", self.prefill_tokens_per_second)):
            if rate is not None and not 0 < rate < float("inf"):
                raise StageReplayError(f"{name} must be positive, got {rate}", f"pass e.g. {name} 40")
        if self.row_ms is not None and not 0 <= self.row_ms < float("inf"):
            raise StageReplayError(f"--row-ms must be 0 or more, got {self.row_ms}", "pass e.g. --row-ms 2")

    def given(self, batch: int) -> Rates | None:
        """The rates given, for items stepping `batch` together (None: none given; `calibrate` may measure them)."""
        if self.tokens_per_second is None:
            if batch > 1 and self.row_ms is not None and not self.calibrate:
                raise StageReplayError("--row-ms prices a batched step on top of --tokens-per-second",
                                       "pass --tokens-per-second too, or --calibrate")
            return None
        steps, prefill, row = self.tokens_per_second, self.prefill_tokens_per_second, self.row_ms
        return Rates({"": steps}, {"": prefill} if prefill else {},
                     f"{steps:g} steps/s" + (f", {prefill:g} prefill tokens/s" if prefill else "")
                     + (f", {row:g} ms per extra row" if batch > 1 and row is not None else ""),
                     {"": row / 1e3} if row is not None else {})


def calibrate(path: str, precisions: Sequence[str], device: str = "cpu", threads: int = 1,
              prompt: int = 256, steps: int = 32, rounds: int = 3, clock: Callable[[], float] | None = None,
              cache: str = "dynamic", together: int = 1, batch: int = 1) -> Rates:
    """Measure a decode step and a prefill of `prompt` tokens on the real model, per precision: one warm-up
    round (it captures the step), then the median of `rounds` timed ones. `clock`: wall time by default
    (`time.process_time` times this process's CPU, steadier on a shared CPU).

    `together` > 1: that many fresh processes measure at the same time, each rate the mean of theirs
    (`calibrate_each`). A run's workers share the CPU, its caches and its memory bandwidth, and a core of a busy
    machine may run slower than one of an idle one, so a step of one of `together` workers costs more than a
    step measured alone (docs/reference/performance.md).

    `batch` > 1: also a batched step of that many rows (engine.batched_step), each row on its own cache of `prompt`
    positions, which gives what a row beyond the first adds (`Rates.row_seconds`)."""
    if together > 1:
        each = calibrate_each(together, path, precisions, device=device, threads=threads, prompt=prompt,
                              steps=steps, rounds=rounds, cache=cache, batch=batch)
        return mean_rates([r for _, r in each], f"{together} processes at once")
    return _calibrate(path, precisions, device, threads, prompt, steps, rounds, clock, cache, batch=batch)


def _calibrate(path: str, precisions: Sequence[str], device: str, threads: int, prompt: int, steps: int,
               rounds: int, clock: Callable[[], float] | None, cache: str,
               ready: Callable[[], Any] | None = None, batch: int = 1) -> Rates:
    """`calibrate` in this process; `ready()` is called after each precision's warm-up round, before the timed
    ones (a barrier, so that processes measuring together time the same seconds)."""
    import statistics
    import time

    clock = clock or time.perf_counter

    from stagereplay.engine.lm import load

    rates, prefill, rows = {}, {}, {}
    for p in precisions:
        lm = load(path, precision=p, device=device, threads=threads, cache=cache)
        vocab = int(lm.model.config.get_text_config().vocab_size)
        length = max(2, min(prompt, lm.context - steps - 1))
        ids = [(7 * i + 3) % vocab for i in range(length)]
        timed: list[tuple[float, float]] = []  # (prefill s, one step s)
        for r in range(rounds + 1):
            if r == 1 and ready is not None:
                ready()
            kv = lm.new_cache(length + steps)
            t0 = clock()
            lm.stepper.forward(ids, kv, 0)
            t1 = clock()
            for k in range(steps):
                lm.stepper.forward([ids[k % length]], kv, length + k)
            timed.append((t1 - t0, (clock() - t1) / steps))
        step = statistics.median(t for _, t in timed[1:])
        rates[p] = 1 / step
        extra = statistics.median(t for t, _ in timed[1:]) - step  # a prefill costs a step plus its tokens
        if extra > 0:
            prefill[p] = length / extra
        if batch > 1:
            rows[p] = max(0.0, (_batched_step(lm, ids, batch, steps, rounds, clock) - step) / (batch - 1))
        del lm
    how = f"calibrated on {Path(path).name}, {device}, {threads} thread(s), {cache} cache"
    return Rates(rates, prefill, how + (f", batch {batch}" if batch > 1 else ""), rows)


def _batched_step(lm: Any, ids: list[int], batch: int, steps: int, rounds: int, clock: Callable[[], float]
                  ) -> float:
    """Seconds of one batched step of `batch` rows, each on its own cache over `ids` (median of `rounds`)."""
    import statistics

    from stagereplay.engine.batched_step import BatchedStep

    step = BatchedStep(lm.model, batch, lm.config.device)
    timed = []
    for _ in range(rounds + 1):
        caches = [lm.new_cache(None) for _ in range(batch)]
        for kv in caches:
            lm.stepper.forward(ids, kv, 0)
        t0 = clock()
        for k in range(steps):
            step.forward([(ids[k % len(ids)], kv, len(ids) + k) for kv in caches])
        timed.append((clock() - t0) / steps)
    return float(statistics.median(timed[1:]))


def _calibrate_in_turn(barrier: Any, kwargs: dict[str, Any]) -> tuple[int, Rates]:
    """One of `calibrate_each`'s processes; a failure breaks the barrier, so that the others stop waiting."""
    import os

    try:
        return os.getpid(), _calibrate(**kwargs, clock=None, ready=barrier.wait)
    except BaseException:
        barrier.abort()
        raise


def calibrate_each(together: int, path: str, precisions: Sequence[str], device: str = "cpu", threads: int = 1,
                   prompt: int = 256, steps: int = 32, rounds: int = 3, cache: str = "dynamic", batch: int = 1
                   ) -> list[tuple[int, Rates]]:
    """`calibrate` in `together` fresh processes at once, started from this one's environment (its kernel
    variables included) and timing their rounds together (a barrier after each warm-up): (pid, rates) of
    each."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, ProcessPoolExecutor(max_workers=together, mp_context=context) as pool:
        barrier = manager.Barrier(together, timeout=600)
        kwargs = {"path": path, "precisions": tuple(precisions), "device": device, "threads": threads,
                  "prompt": prompt, "steps": steps, "rounds": rounds, "cache": cache, "batch": batch}
        futures = [pool.submit(_calibrate_in_turn, barrier, kwargs) for _ in range(together)]
        return [f.result() for f in futures]


def mean_rates(measured: Sequence[Rates], how: str) -> Rates:
    """Per precision, the mean of the `measured` rates (what each of as many workers makes at once); a prefill
    rate only where every one measured it."""
    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known and len(known) == len(values) else None

    steps = {p: mean([r.steps.get(p) for r in measured]) or 0.0 for p in measured[0].steps}
    prefill = {p: x for p in steps if (x := mean([r.prefill_tokens.get(p) for r in measured]))}
    rows = {p: x for p in steps if (x := mean([r.row_seconds.get(p) for r in measured])) is not None}
    return Rates(steps, prefill, f"{measured[0].source}, {how}", rows)
