"""A decode step reads one number back from the device, its pick, and allocates nothing of its own.

What a step does besides its forward must not wait on the host (DESIGN.md, "Cost at scale"). On a GPU every read of
a device value into Python (`.item()`, `int()`, `bool()` and so a Python `if` on a tensor, `.tolist()`, `.cpu()`,
`torch.equal`, `nonzero`, printing) waits for every kernel queued before it, and so does a tensor made from host
data (`torch.tensor(list, device=...)`: a copy from pageable memory). So per decode step the loop reads back the
chosen token and nothing else; the bookkeeping (the fp32 widening, top-k, log-sum-exp, the watch of other arms'
suffixes, stage 1's record) runs on the device into buffers made once per continuation, and is read once per item.

A CPU has no device to wait for, so this counts where the reads are asked for, in two layers:

- a `TorchFunctionMode` sees the Python calls that bring values to the host (`READS`), some of which dispatch
  nothing on a CPU (`.tolist()`, `.cpu()`); the operators run inside such a call are its own, not counted again;
- a `TorchDispatchMode` sees the reads made inside operators (`OP_READS`: `aten._local_scalar_dense`, which
  `.item()`, `int()` and `bool()` dispatch to; `equal`, `nonzero`) and every operator's outputs, counting as new
  those on a storage none of its inputs holds (views and `out=` writes are not new).

Events inside `Stepper.forward` (the model, and the token and positions it is given) are the forward's; the rest
are ours. Steady-state figures per step are differences between two runs that differ only in their number of steps
(`per_step`), so what a run does once (prefill, proof, buffers made on a loop's first step, the boundary snapshot,
the reads once per item) cancels out. What this cannot see: a read inside a kernel's own C++ (the dispatcher does
not pass it through Python) and `.to("cpu")`, which on a CPU is the same call as the model's own `.to(x.device)`;
the profile of a GPU step sees those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import stagereplay.engine.steps as steps_module
from stagereplay.engine.boundary import After
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import load
from stagereplay.engine.steps import StepRecord
from stagereplay.toy import toy_checkpoint

pytestmark = pytest.mark.capture  # the host syncs of a run's proven fast steps

READS = frozenset({
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__format__", "__repr__",
    "__str__", "__contains__", "equal", "allclose", "nonzero", "argwhere", "masked_select", "unique",
    "unique_consecutive", "tensor", "as_tensor",
})
"""Python calls that wait for the device on a GPU: reads into Python, and tensors made from host data."""

OP_READS = frozenset({
    "_local_scalar_dense", "equal", "allclose", "is_nonzero", "nonzero", "masked_select", "_unique2", "unique_dim",
    "unique_consecutive", "repeat_interleave",
})
"""Operators that read a device value on the host (a scalar, or the size of a data-dependent output)."""

PROMPT = "Q: what is 12+7? Think.\n"
BUDGET = 16  # stage-1 tokens allowed: fixes the static cache's length and the stage-1 record's, whatever a run emits
SHORT, LONG = 4, 12  # the two lengths whose difference is the steady state (stage 1's, or the suffix's)


@dataclass
class Tally:
    """What a run asked of torch: (kind, place, name) -> count, kind 'read' | 'new', place 'ours' | 'forward'."""

    events: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    forwards: int = 0  # Stepper.forward calls
    place: str = "ours"
    reading: bool = False  # within a counted Python read: its operators are that read

    def total(self, kind: str, place: str | None = None) -> int:
        return sum(n for (k, p, _), n in self.events.items() if k == kind and place in (None, p))


class _Calls(TorchFunctionMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name not in READS or self.tally.reading or (name in ("tensor", "as_tensor") and not _to_device(args, kwargs)):
            return func(*args, **(kwargs or {}))
        self.tally.events["read", self.tally.place, name] += 1
        self.tally.reading = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.tally.reading = False


class _Ops(TorchDispatchMode):
    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        held = {t.untyped_storage().data_ptr() for t in inputs}
        if not self.tally.reading and (name in OP_READS or _to_host(name, inputs, kwargs)):
            self.tally.events["read", self.tally.place, name] += 1
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                self.tally.events["new", self.tally.place, name] += 1
        return out


def _to_device(args: Any, kwargs: Any) -> bool:
    """Whether `torch.tensor(data, device=...)` makes a device tensor of host data: a copy from pageable memory,
    which on a GPU waits for the device (one made on the host and copied with `non_blocking` does not)."""
    return (kwargs or {}).get("device") is not None and not any(isinstance(a, torch.Tensor) for a in tree_leaves(args))


def _to_host(name: str, inputs: list[torch.Tensor], kwargs: Any) -> bool:
    """A copy from another device to the CPU (never on a CPU run; the same counter on a GPU sees it)."""
    if name == "copy_" and len(inputs) == 2:
        return inputs[0].device.type == "cpu" and inputs[1].device.type != "cpu"
    device = (kwargs or {}).get("device")
    return name == "_to_copy" and device is not None and torch.device(device).type == "cpu" and any(
        t.device.type != "cpu" for t in inputs)


@contextmanager
def counting(lm: Any) -> Iterator[Tally]:
    """Within: every read and new tensor of the process counted, the forward's apart (`lm.stepper.forward` wrapped)."""
    tally = Tally()
    stepper = lm.stepper
    forward = stepper.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        tally.forwards += 1
        saved, tally.place = tally.place, "forward"
        try:
            return forward(*args, **kwargs)
        finally:
            tally.place = saved

    stepper.forward = counted
    try:
        with _Calls(tally), _Ops(tally):
            yield tally
    finally:
        stepper.forward = forward


def per_step(short: Tally, long: Tally) -> dict[str, float]:
    """Reads and new tensors per step, ours and the forward's, as the difference of two runs over their forwards."""
    steps = long.forwards - short.forwards
    assert steps > 0, "the longer run made no more steps"
    return {f"{kind} {place}": (long.total(kind, place) - short.total(kind, place)) / steps
            for kind in ("read", "new") for place in ("ours", "forward")}


def reads_named(short: Tally, long: Tally) -> dict[str, int]:
    """Which reads the extra steps made, by name: what a failure names."""
    diff = Counter({k: n for k, n in long.events.items() if k[0] == "read"})
    diff.subtract(Counter({k: n for k, n in short.events.items() if k[0] == "read"}))
    return {f"{place}: {name}": n for (_, place, name), n in sorted(diff.items()) if n}


def assert_lean(short: Tally, long: Tally, ours_new: float = 0) -> dict[str, float]:
    """At most one read per step (the pick) in all the step does, forward included; at most `ours_new` new tensors
    of ours per step."""
    counts = per_step(short, long)
    reads = counts["read ours"] + counts["read forward"]
    assert reads <= 1, f"{reads:g} host reads per step, not at most 1: {reads_named(short, long)} ({counts})"
    assert counts["new ours"] <= ours_new, f"{counts['new ours']:g} new tensors of ours per step ({counts})"
    return counts


@dataclass(frozen=True)
class Toy:
    lm: Any
    state: Any  # a boundary state to continue from, with a live suffix of LONG tokens


@pytest.fixture(scope="module")
def toys() -> dict[str, Toy]:
    """The toy on each cache kind, its fast step proven beyond every position used (a proof inside a counted run
    would count its own reads) and each path run once (dynamo compiles outside the count)."""
    made = {}
    for cache in ("dynamic", "static"):
        lm = load(str(toy_checkpoint("primary")), "bf16", cache=cache)
        prompt = lm.tokenizer.encode(PROMPT)
        lm.prove(prompt, len(prompt) + BUDGET + LONG)
        made[cache] = Toy(lm, _live(lm, SHORT, LONG))
    return made


def _config(suffix: int, sample: bool = False) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=suffix, max_stage1_tokens=BUDGET, sample=sample, temperature=0.7, top_k=50,
                        top_p=0.9)


def _live(lm: Any, stage1: int, suffix: int) -> Any:
    """`LM.live` with its live suffix: `stage1` tokens to the boundary, then `suffix` (the toy emits no EOS in them)."""
    state = lm.live(lm.tokenizer.encode(PROMPT), After(stage1), _config(suffix))
    assert len(state.stage1) == stage1 and len(state.live_suffix.suffix) == suffix, "the toy stopped early"
    return state


def _counted(lm: Any, run: Callable[[], Any]) -> Tally:
    with counting(lm) as tally:
        run()
    return tally


def _continued(lm: Any, state: Any, suffix: int, sample: bool = False) -> Tally:
    """`continue_from` over `suffix` steps, watching an arm that left the state's live suffix at its third step
    (so a step's full logits are kept, as for a divergent pair)."""
    other = list(state.live_suffix.suffix)
    other[2] = (other[2] + 1) % 200
    return _counted(lm, lambda: lm.continue_from(state, _config(suffix, sample), watch=[other]))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_live_step_reads_back_its_pick_and_nothing_else(toys, cache):
    """Stage 1's steps (LM.live's loop) and the live suffix's (decode): one read per step, no new tensor of ours."""
    toy = toys[cache]
    lm = toy.lm
    base = _counted(lm, lambda: _live(lm, SHORT, SHORT))
    stage1 = assert_lean(base, _counted(lm, lambda: _live(lm, LONG, SHORT)))
    suffix = assert_lean(base, _counted(lm, lambda: _live(lm, SHORT, LONG)))
    print(f"\n{cache}: per stage-1 step {stage1}\n{cache}: per suffix step {suffix}")
    assert stage1["read ours"] == suffix["read ours"] == 1  # the pick is read: the loop goes on from the host


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_continuation_step_reads_back_its_pick_and_nothing_else(toys, cache):
    """`continue_from` with a watched arm: one read per step, no new tensor of ours."""
    toy = toys[cache]
    lm = toy.lm
    counts = assert_lean(_continued(lm, toy.state, SHORT), _continued(lm, toy.state, LONG))
    print(f"\n{cache}: per continuation step {counts}")


def test_a_sampled_step_reads_back_its_pick_and_nothing_else(toys):
    """Seeded sampling through every warper: still one read per step; the warpers make their own tensors."""
    toy = toys["dynamic"]
    lm = toy.lm
    counts = assert_lean(_continued(lm, toy.state, SHORT, sample=True), _continued(lm, toy.state, LONG, sample=True),
                         ours_new=float("inf"))
    print(f"\nsampled: per continuation step {counts}")


READBACKS: dict[str, Callable[[torch.Tensor], Any]] = {
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),  # dispatches nothing on a CPU: the function layer sees it
    "cpu": lambda t: t.cpu(),  # the same
    "if": lambda t: 1 if t > 0 else 0,
    "equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("how", sorted(READBACKS))
def test_a_record_that_reads_its_margin_back_each_step_is_caught(toys, monkeypatch, how):
    """Negative control: a StepRecord that reads the step's margin back (as a per-step report would) makes two reads
    a step, and the check fails."""
    toy = toys["dynamic"]
    lm = toy.lm
    add = StepRecord.add

    def reading(self: StepRecord, logits: torch.Tensor, token: int) -> None:
        add(self, logits, token)
        READBACKS[how](self.values[-1, 0] - self.values[-1, 1])

    monkeypatch.setattr(StepRecord, "add", reading)
    short, long = _continued(lm, toy.state, SHORT), _continued(lm, toy.state, LONG)
    assert per_step(short, long)["read ours"] == 2
    with pytest.raises(AssertionError, match="2 host reads per step"):
        assert_lean(short, long)


def test_a_step_that_widens_into_a_new_tensor_is_caught(toys, monkeypatch):
    """Negative control: `logits.float()` in place of the reused buffer (the record's cast) is one new tensor a step."""
    toy = toys["static"]
    lm = toy.lm
    monkeypatch.setattr(steps_module, "widened", lambda logits, buffer: logits.float())
    short, long = _continued(lm, toy.state, SHORT), _continued(lm, toy.state, LONG)
    with pytest.raises(AssertionError, match="1 new tensors of ours per step"):
        assert_lean(short, long)


def test_a_read_in_the_forward_is_caught(toys, monkeypatch):
    """Negative control: a Python `if` on a tensor where the step's positions are made counts as the forward's, and
    with the pick that is two reads a step."""
    toy = toys["dynamic"]
    lm = toy.lm
    positions = lm.stepper.positions

    def checked(past: int, n: int) -> torch.Tensor:
        made = positions(past, n)
        assert made[0, 0] >= 0
        return made

    monkeypatch.setattr(lm.stepper, "positions", checked)
    short, long = _continued(lm, toy.state, SHORT), _continued(lm, toy.state, LONG)
    assert per_step(short, long)["read forward"] == 1
    with pytest.raises(AssertionError, match="2 host reads per step"):
        assert_lean(short, long)


def _batched(lm: Any, step: Any, n: int) -> Tally:
    """`n` batched forwards of two items' steps in four slots (engine.batched_step), counted: the forwards the
    item threads of `--batch 4` share (each thread's own reads are its pick, counted above)."""
    prompt = lm.tokenizer.encode(PROMPT)
    caches = [lm.new_cache(len(prompt) + n + 1) for _ in range(2)]
    for cache in caches:
        lm.stepper.forward(prompt, cache, 0)
    tally = Tally(forwards=n, place="forward")  # all of it is the batched forward's
    with _Calls(tally), _Ops(tally):
        for k in range(n):
            step.forward([(5, caches[0], len(prompt) + k), None, (7, caches[1], len(prompt) + k), None])
    return tally


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_batched_forward_reads_nothing_back(toys, cache):
    """The batched step's tokens and positions go to the device in a copy the host does not wait for."""
    from stagereplay.engine.batched_step import BatchedStep

    lm = toys[cache].lm
    step = BatchedStep(lm.model, 4, "cpu")
    _batched(lm, step, 1)  # its first forward made
    counts = per_step(_batched(lm, step, SHORT), _batched(lm, step, LONG))
    print(f"\n{cache}: per batched forward {counts}")
    assert counts["read ours"] + counts["read forward"] == 0, counts


def test_a_batched_forward_that_copies_its_tokens_from_pageable_memory_is_caught(toys, monkeypatch):
    """Negative control: tokens made on the device from host data (`torch.tensor(..., device=)`) are one read a
    forward."""
    from stagereplay.engine.batched_step import BatchedStep

    lm = toys["dynamic"].lm

    class Pageable(BatchedStep):
        def forward(self, rows: Any) -> Any:
            torch.tensor([[r[0] if r else 0] for r in rows], dtype=torch.long, device=self.device)
            return super().forward(rows)

    step = Pageable(lm.model, 4, "cpu")
    _batched(lm, step, 1)
    assert per_step(_batched(lm, step, SHORT), _batched(lm, step, LONG))["read forward"] == 1
