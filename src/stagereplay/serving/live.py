"""Live's request on a serving engine, sized to what the run uses.

A live request generates stage 1 and the suffix in one uninterrupted request. How many tokens it asks for follows
the boundary rule:

    after:N            stage 1 is N tokens (at most the stage-1 budget): N + the suffix budget, one request
    marker or regex    stage 1 ends where nobody knows yet: first `FIRST_STAGE1` + suffix; while the output runs
                       on past that without reaching the boundary (no EOS), the same request again from nothing
                       with twice the stage-1 allowance, up to the budget (the reach of a proof grows the same way,
                       `engine.proof.next_reach`)

A greedy request's first tokens do not depend on how many follow, so the request that found the boundary is live's,
and its replicas ask for the same size. The size asked for is a function of the item's own trajectory, so an audit
asks for the same. Asking for the whole stage-1 budget instead would make a base model, which rarely stops early,
generate to the end of its context on every live request.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from stagereplay.engine.boundary import After, BoundaryMatch, BoundaryRule, Watch, stage1_end
from stagereplay.serving.seam import Generation

FIRST_STAGE1 = 256
"""Stage-1 tokens the first request for a marker or regex boundary allows; doubled until the boundary is reached."""


def stage1_sizes(rule: BoundaryRule, budget: int) -> list[int]:
    """The stage-1 allowances live's requests try in turn, smallest first: one for a count boundary, doubling from
    `FIRST_STAGE1` to the budget for a marker or a regex."""
    if isinstance(rule, After):
        return [max(1, min(rule.n, budget))]
    sizes = [min(FIRST_STAGE1, budget)]
    while sizes[-1] < budget:
        sizes.append(min(2 * sizes[-1], budget))
    return sizes


def boundary_saver(watch: Watch, eos: Collection[int], budget: int) -> Callable[[int], bool]:
    """Called on each emitted token in order: True on the boundary token, the decision `boundary.stage1_end`
    makes afterwards (the first token the watch accepts, unless an EOS or the stage-1 budget comes first)."""
    seen = 0
    done = False

    def save(token: int) -> bool:
        nonlocal seen, done
        if done:
            return False
        seen += 1
        if seen > budget:
            done = True
            return False
        if watch.step(token):
            done = True
            return True
        if token in eos:
            done = True
        return False

    return save


@dataclass(frozen=True)
class Live:
    """Live's request as it ran: what it generated, where stage 1 ended (None: never), how the boundary was found,
    the tokens it asked for and how many requests it took to find the boundary, and the boundary state the engine
    saved (engines that save one)."""

    generation: Generation
    end: int | None
    match: BoundaryMatch | None
    max_tokens: int
    tries: int
    state: Any = None

    @property
    def request(self) -> dict[str, int]:
        """What the record keeps of the request: its size and the requests it took."""
        return {"max_tokens": self.max_tokens, "tries": self.tries}


Send = Callable[[int, Callable[[int], bool] | None], tuple[Generation, Any]]
"""Sends live's request for `max_tokens` tokens, with a boundary saver where the engine saves states: (its
generation, the state saved or None)."""


def request_live(send: Send, rule: BoundaryRule, eos: Collection[int], budget: int, max_new: int,
                 saves: bool, sizes: Sequence[int] | None = None) -> Live:
    """Live's request, grown as `stage1_sizes` says until the boundary is reached, the output stops (an EOS) or the
    budget is spent; `sizes` fixes the allowances instead (a replica asks for live's size). `rule` is bound."""
    tries = 0
    for size in sizes if sizes is not None else stage1_sizes(rule, budget):
        tries += 1
        saver = boundary_saver(rule.watch(), eos, size) if saves else None
        g, state = send(size + max_new, saver)
        watch = rule.watch()
        end = stage1_end(g.tokens, watch, eos, size)
        stopped = any(t in eos for t in g.tokens[:size]) or len(g.tokens) < size
        if end is not None or stopped or size >= budget:
            return Live(g, end, watch.detail() if end is not None else None, size + max_new, tries, state)
    return Live(g, None, None, size + max_new, tries, state)
