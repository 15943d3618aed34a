"""Constructions: how a boundary state's cache over P[0:T-1] is built from the prefix P, one class each.

    live              the loop's own cache, snapshotted as P[T-1] was emitted (only `LM.live` makes it)
    incremental       the prompt in one forward, then one token per forward: live's operations (the bridge)
    oneshot           one forward over P[0:T-1]
    chunked:<n>       forwards of n tokens at a time (what serving engines do)
    retokenized       P decoded to text and re-encoded, then one forward (records whether the IDs round-trip)
    roundtrip:<fmt>   the state's own K/V (live's; else incremental's) through a lower-precision format and back

A construction's `name` is what records, manifests and the CLI carry; `parse_construction` gives the typed object
back for a name, and refuses any name that is not some construction's canonical spelling, so one construction has
one name in a ledger. Its `spans` are the forwards it makes, the same list `LM.construct` feeds and
`stagereplay plan` counts (engine.forwards). Adding a construction is one class here and one line in `REGISTRY`.

Nothing here imports torch or the LM at import time (the planner imports this module): `build` reaches the model
through `Builder`, which `engine.lm.LM` satisfies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from stagereplay.engine.kv_roundtrip import FORMATS
from stagereplay.errors import StageReplayError

Spans = list[tuple[int, int]]
"""Half-open [start, stop) absolute positions of P, one model forward each, in the order they are fed."""


def token_by_token(prompt_len: int, body_len: int) -> Spans:
    """The prompt in one forward, then one token per forward: what live generation does."""
    return [(0, prompt_len), *((p, p + 1) for p in range(prompt_len, body_len))]


class Builder(Protocol):
    """What building a cache needs of the model (`engine.lm.LM` is one)."""

    @property
    def tokenizer(self) -> Any: ...

    def prefill(self, body: Sequence[int], prompt_len: int, spans: Sequence[tuple[int, int]], length: int | None
                ) -> Any:
        """A new cache (a static one of `length` positions) with body[start:stop] fed at `start` for each span."""
        ...


class Source(Protocol):
    """The state a construction rebuilds (`engine.lm.BoundaryState`): its prefix P, how much of it is prompt, its
    cache if it holds one (live's), and the positions a static cache is allocated for (None: dynamic)."""

    @property
    def prefix(self) -> tuple[int, ...]: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def cache(self) -> Any: ...
    @property
    def cache_len(self) -> int | None: ...


@dataclass(frozen=True)
class Built:
    """What a construction built: the prefix it covers (retokenized's may differ from the source's), the cache over
    prefix[0:T-1] (per layer K and V, [B, H_kv, T-1, D]), the static length it was allocated for, and, for
    `retokenized`, whether decode -> encode gave the source's IDs back."""

    prefix: tuple[int, ...]
    cache: Any = field(repr=False)
    cache_len: int | None
    roundtrip: bool | None = None


@dataclass(frozen=True)
class Construction:
    """One way to build a boundary state. The base class is the one-forward prefill that `oneshot` is."""

    base: ClassVar[str]
    fixed_prefix: ClassVar[bool] = True
    """Whether it rebuilds a state from a prefix's token IDs alone: every construction but live."""

    @classmethod
    def of(cls, arg: str) -> Construction | None:
        """The construction `base:arg` names (`arg` "" for a bare base), or None where `arg` is malformed. A name
        that parses to a construction of another spelling is refused by `parse_construction`."""
        return cls()

    @classmethod
    def usage(cls) -> str:
        """How the refusal of a bad name spells this construction's names."""
        return cls.base

    @property
    def name(self) -> str:
        return self.base

    def spans(self, prompt_len: int, body_len: int) -> Spans:
        """The forwards this construction makes over P[0:body_len], of which the first `prompt_len` are prompt."""
        return [(0, body_len)]

    def forwards(self, prompt_len: int, prefix_len: int, from_cache: bool = False) -> list[int]:
        """Token counts of the forwards that build the state of a prefix of `prefix_len` (T) tokens; `from_cache`:
        from a state that holds its cache already (live's), which a round trip reuses."""
        return [stop - start for start, stop in self.spans(prompt_len, prefix_len - 1)]

    def build(self, lm: Builder, state: Source) -> Built:
        """The cache over state.prefix[0:T-1], built afresh by this construction's spans."""
        body = state.prefix[:-1]
        cache = lm.prefill(body, state.prompt_len, self.spans(state.prompt_len, len(body)), state.cache_len)
        return Built(tuple(state.prefix), cache, state.cache_len)


@dataclass(frozen=True)
class Oneshot(Construction):
    """One forward over P[0:T-1]."""

    base = "oneshot"


@dataclass(frozen=True)
class Incremental(Construction):
    """The prompt in one forward, then one token per forward: the operations of live generation, so its cache
    should equal live's bit for bit (the bridge)."""

    base = "incremental"

    def spans(self, prompt_len: int, body_len: int) -> Spans:
        return token_by_token(prompt_len, body_len)


@dataclass(frozen=True)
class Live(Construction):
    """The live loop's own cache, snapshotted as P[T-1] was emitted. Only generation makes it (`LM.live`), so it
    refuses to be built from a prefix; its spans are the live loop's (engine.forwards.live_forwards)."""

    base = "live"
    fixed_prefix = False

    def spans(self, prompt_len: int, body_len: int) -> Spans:
        return token_by_token(prompt_len, body_len)

    def build(self, lm: Builder, state: Source) -> Built:
        raise StageReplayError("the live construction comes only from live generation", "use lm.live(...)")


@dataclass(frozen=True)
class Chunked(Construction):
    """Forwards of `n` tokens at a time from position 0, the last one shorter: a serving engine's prefill chunks."""

    base = "chunked"
    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise refusal(self.name)

    @classmethod
    def of(cls, arg: str) -> Construction | None:
        return cls(int(arg)) if arg.isascii() and arg.isdigit() and int(arg) > 0 else None

    @classmethod
    def usage(cls) -> str:
        return "chunked:<n> (n > 0)"

    @property
    def name(self) -> str:
        return f"chunked:{self.n}"

    def spans(self, prompt_len: int, body_len: int) -> Spans:
        return [(s, min(s + self.n, body_len)) for s in range(0, body_len, self.n)]


def reencoded(tokenizer: Any, ids: Sequence[int]) -> tuple[int, ...]:
    """`ids` decoded to text (special tokens kept) and encoded again (none added): the IDs the text route gives."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class Retokenized(Construction):
    """P decoded to text and re-encoded, then one forward: the text route stage-replay methods often take. Its
    prefix is the re-encoded one; a plan assumes it round-trips, so its spans are oneshot's over the same length."""

    base = "retokenized"

    def build(self, lm: Builder, state: Source) -> Built:
        ids = reencoded(lm.tokenizer, state.prefix)
        cache_len = state.cache_len
        if cache_len is not None:  # room for the same continuation after a prefix that re-encodes longer
            cache_len += max(0, len(ids) - len(state.prefix))
        body = ids[:-1]
        cache = lm.prefill(body, state.prompt_len, self.spans(state.prompt_len, len(body)), cache_len)
        return Built(ids, cache, cache_len, roundtrip=ids == tuple(state.prefix))


@dataclass(frozen=True)
class Roundtrip(Construction):
    """The state's own K/V (live's), or incremental's where it holds none, sent through `format` and back
    (engine.kv_roundtrip): the precision a quantized K/V cache keeps, applied once at the boundary. From a fixed
    prefix it makes incremental's forwards; from a state with its cache, none."""

    base = "roundtrip"
    format: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise refusal(self.name)

    @classmethod
    def of(cls, arg: str) -> Construction | None:
        return cls(arg) if arg in FORMATS else None

    @classmethod
    def usage(cls) -> str:
        return f"roundtrip:<{'|'.join(FORMATS)}>"

    @property
    def name(self) -> str:
        return f"roundtrip:{self.format}"

    def spans(self, prompt_len: int, body_len: int) -> Spans:
        return token_by_token(prompt_len, body_len)

    def forwards(self, prompt_len: int, prefix_len: int, from_cache: bool = False) -> list[int]:
        return [] if from_cache else super().forwards(prompt_len, prefix_len)

    def build(self, lm: Builder, state: Source) -> Built:
        from stagereplay.engine.cache import clone_cache
        from stagereplay.engine.kv_roundtrip import roundtrip_cache

        source = state.cache if state.cache is not None else Incremental().build(lm, state).cache
        cache = clone_cache(source)  # the source state is never touched
        roundtrip_cache(cache, self.format)
        return Built(tuple(state.prefix), cache, state.cache_len)


REGISTRY: dict[str, type[Construction]] = {c.base: c for c in (
    Live, Incremental, Oneshot, Chunked, Retokenized, Roundtrip,
)}
"""Every construction by its base name (the part of a name before `:`), in the order a refusal lists them."""


def refusal(name: str) -> StageReplayError:
    usages = [kind.usage() for kind in REGISTRY.values()]
    return StageReplayError(f"unknown construction {name!r}", f"use {', '.join(usages[:-1])} or {usages[-1]}")


def parse_construction(name: str) -> Construction:
    """The construction `name` spells (e.g. "chunked:16"); one line refusing a name that is unknown, malformed or
    not the canonical spelling of one (`oneshot:3`, `chunked:016`)."""
    base, _, arg = name.partition(":")
    kind = REGISTRY.get(base)
    made = kind.of(arg) if kind is not None else None
    if made is None or made.name != name:
        raise refusal(name)
    return made
