"""Boundary rules: where stage 1 of the model's own output ends, decided on the generated token IDs.

A rule is asked after every generated token whether stage 1 has just ended; the answer fixes the prefix
`P = prompt + generated[:k]`, whose last token `P[T-1]` is the pending token of the boundary state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from stagereplay.errors import StageReplayError


class BoundaryRule(Protocol):
    def bind(self, tokenizer: Any) -> BoundaryRule:
        """Resolve anything that needs the tokenizer (a marker's token IDs)."""
        ...

    def reached(self, generated: Sequence[int]) -> bool:
        """True when `generated` (all stage-1 tokens so far) has just completed stage 1."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Marker:
    """Stage 1 ends with the marker's token IDs, matched on the generated IDs (never on re-encoded text)."""

    text: str
    ids: tuple[int, ...] = ()

    def bind(self, tokenizer: Any) -> Marker:
        ids = tuple(tokenizer.encode(self.text, add_special_tokens=False))
        if not ids:
            raise StageReplayError(f"boundary marker {self.text!r} encodes to no tokens", "pass a non-empty marker")
        return Marker(self.text, ids)

    def reached(self, generated: Sequence[int]) -> bool:
        if not self.ids:
            raise RuntimeError("Marker.bind(tokenizer) must be called before use")
        n = len(self.ids)
        return len(generated) >= n and tuple(generated[-n:]) == self.ids

    def describe(self) -> str:
        return f"marker:{self.text}"


@dataclass(frozen=True)
class Regex:
    """Stage 1 ends at the first generated token whose decoded text so far contains a match of `pattern`."""

    pattern: str
    tokenizer: Any = None

    def __post_init__(self) -> None:
        try:
            compiled = re.compile(self.pattern)
        except re.error as exc:
            raise StageReplayError(f"invalid --boundary-regex {self.pattern!r}: {exc}", "fix the pattern") from None
        if compiled.search("") is not None:  # it would end stage 1 before its first token
            raise StageReplayError(f"--boundary-regex {self.pattern!r} matches the empty text",
                                   "pass a pattern that matches the end of stage 1")

    def bind(self, tokenizer: Any) -> Regex:
        return Regex(self.pattern, tokenizer)

    def reached(self, generated: Sequence[int]) -> bool:
        if self.tokenizer is None:
            raise RuntimeError("Regex.bind(tokenizer) must be called before use")
        # Decoding the whole stage so far each step is quadratic, but stage 1 is short next to a forward pass.
        text = self.tokenizer.decode(list(generated), skip_special_tokens=False)
        return re.search(self.pattern, text) is not None

    def describe(self) -> str:
        return f"regex:{self.pattern}"


@dataclass(frozen=True)
class After:
    """Stage 1 is the first `n` generated tokens."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise StageReplayError(f"--boundary-after must be at least 1, got {self.n}", "pass a positive count")

    def bind(self, tokenizer: Any) -> After:
        return self

    def reached(self, generated: Sequence[int]) -> bool:
        return len(generated) == self.n

    def describe(self) -> str:
        return f"after:{self.n}"


def parse_boundary(spec: str) -> BoundaryRule:
    """Inverse of `describe()`: `marker:TEXT`, `regex:PATTERN` or `after:N`."""
    kind, _, value = spec.partition(":")
    if kind == "marker":
        return Marker(value)
    if kind == "regex":
        return Regex(value)
    if kind == "after" and value.isdigit():
        return After(int(value))
    raise StageReplayError(f"unknown boundary rule {spec!r}", "use marker:TEXT, regex:PATTERN or after:N")


def boundary_from_options(marker: str | None, regex: str | None, after: int | None) -> BoundaryRule | None:
    """The CLI's three mutually exclusive options; None when none was given."""
    given = [x for x in (marker, regex, after) if x is not None]
    if len(given) > 1:
        raise StageReplayError(
            "more than one boundary rule given",
            "pass only one of --boundary-marker, --boundary-regex, --boundary-after",
        )
    if marker is not None:
        return Marker(marker)
    if regex is not None:
        return Regex(regex)
    if after is not None:
        return After(after)
    return None
