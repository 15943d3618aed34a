"""The forwards each engine operation makes, as lists of token counts (one entry per model forward).

`LM.construct` feeds the spans of `construction_spans` (each construction's own: engine.constructions), and the live
loop and continuations make the forwards listed here, so an experiment's `forwards(...)` built from these functions
counts what its item function runs; `stagereplay plan` adds them up (tests/test_plan.py checks the count against
an instrumented run).

A boundary state's prefix has T = prompt + stage 1 tokens; its cache covers T - 1 of them and the pending
token P[T-1] is fed by the continuation, which then feeds every emitted token but the last:
- live generation: the prompt in one forward, then stage 1 but its last token one at a time (T - 1 - prompt);
- a continuation of `n` emitted tokens: n single-token forwards (the pending token, then n - 1 picks).
"""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.engine.constructions import parse_construction


def construction_spans(construction: str, prompt_len: int, body_len: int) -> list[tuple[int, int]]:
    """Half-open [start, stop) spans of P[0:body_len] that `construction` feeds, one forward each (its class in
    engine.constructions says which)."""
    return parse_construction(construction).spans(prompt_len, body_len)


def live_forwards(prompt_len: int, stage1_len: int, suffix_len: int | None) -> list[int]:
    """Live generation to a boundary after `stage1_len` tokens, then (unless None) its own suffix."""
    out = [prompt_len, *[1] * (stage1_len - 1)]
    return out + continuation_forwards(suffix_len) if suffix_len is not None else out


def no_boundary_forwards(prompt_len: int, generated: int) -> list[int]:
    """Live generation that stopped (EOS or the budget) after `generated` tokens without a boundary."""
    return [prompt_len, *[1] * (generated - 1)]


def construct_forwards(construction: str, prompt_len: int, prefix_len: int, from_cache: bool = False) -> list[int]:
    """The forwards of building a boundary state by `construction`; `from_cache`: from a state that holds its
    cache already (live's), which a round trip reuses."""
    return parse_construction(construction).forwards(prompt_len, prefix_len, from_cache)


def continuation_forwards(suffix_len: int) -> list[int]:
    return [1] * suffix_len


@dataclass(frozen=True)
class Lengths:
    """The token lengths of one unit of work: measured from a run's records, or assumed by a plan."""

    prompt: int
    stage1: int | None  # None: the boundary was not reached (`generated` tokens were)
    suffix: int  # the length of every arm's suffix not named in `arms`
    arms: tuple[tuple[str, int], ...] = ()  # (arm name, suffix length) as recorded
    generated: int = 0
    looks: tuple[tuple[str, int], ...] = ()
    """(construction, steps) per arm carried over from matched (`same_as`): the steps decoded again for it (a
    2x2's: as far as its diagnostics read; a transplant's own suffixes: none)."""

    @property
    def prefix(self) -> int:
        return self.prompt + (self.stage1 or 0)

    def of(self, arm: str) -> int:
        return dict(self.arms).get(arm, self.suffix)
