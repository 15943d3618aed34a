"""Boundary rules: where stage 1 of the model's own output ends, decided token by token as it is generated.

A rule, bound to a tokenizer, hands out a `Watch` per generation; the watch is told each generated token and
says when stage 1 has just ended. That token is the boundary token `P[T-1]`, the pending token of the
boundary state. Watches work incrementally: per step they look at the new token's text (and, for a regex, a
bounded tail window), never at a re-decode of the whole of stage 1, whose length a reasoning trace puts in
the thousands.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict

from stagereplay.errors import StageReplayError

THINK_MARKER = "</think>"
"""The default rule for a model whose tokenizer has this token and whose chat template opens a think block."""


class BoundaryMatch(TypedDict, total=False):
    """How a marker matched on decoded text found the boundary, as the item's record keeps it: both keys, always
    together (total=False only so that a record's fields can be unpacked from `match or {}`)."""

    boundary_match: Literal["text"]
    marker_inside_token: bool  # the marker ended inside the boundary token (a merged token such as `</think>\n`)


class Watch(Protocol):
    def step(self, token: int) -> bool:
        """Take the next generated token; True when it has just completed stage 1."""
        ...

    def detail(self) -> BoundaryMatch | None:
        """How the boundary was found, for the item's record; None where there is nothing to add."""
        ...


class BoundaryRule(Protocol):
    def bind(self, tokenizer: Any) -> BoundaryRule:
        """Resolve anything that needs the tokenizer (a marker's token IDs)."""
        ...

    def watch(self) -> Watch:
        """A fresh watch for one generation (bound rules only)."""
        ...

    def match_kind(self) -> str:
        """How the rule matches (`token`, `text`, `regex` or `count`), for the manifest (bound rules only)."""
        ...

    def describe(self) -> str: ...


class Detokenizer:
    """The text each new token adds, with work per token bounded by a few tokens, not by the sequence.

    Decoding token by token is not decoding the whole: byte-level BPE splits a character over several tokens
    (each alone decodes to U+FFFD), and SentencePiece decoders drop the leading space of a decode. So each
    step decodes only a short window, `[prefix:read]` with and without the new tokens, and keeps the
    difference (the method of the incremental detokenizers in serving engines); text ending in an incomplete
    character is held back until a later token completes it. The pieces join to `decode(all ids)`
    (tests/test_reasoning.py checks it on the tokenizers the tests build).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window: tokens decoded again only for their effect on the next
        self.read = 0  # tokens whose text has been handed out

    def push(self, token: int) -> str:
        """The text `token` completes (empty while a character is still incomplete)."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=False)
        after = decode(self.ids[self.prefix :], skip_special_tokens=False)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return str(after[len(before) :])


class _IdWatch:
    """A one-token marker: stage 1 ends when its ID is generated."""

    def __init__(self, token: int) -> None:
        self.token = token

    def step(self, token: int) -> bool:
        return token == self.token

    def detail(self) -> BoundaryMatch | None:
        return None


class _TextWatch:
    """A marker matched on decoded text: it may end inside a merged token, which is then the boundary token."""

    def __init__(self, text: str, tokenizer: Any) -> None:
        self.text = text
        self.text_of = Detokenizer(tokenizer)
        self.tail = ""  # the last len(text) - 1 characters: all an occurrence can start in before the new text
        self.after = ""  # the boundary token's text after the marker (non-empty: the marker ended inside it)

    def step(self, token: int) -> bool:
        new = self.text_of.push(token)
        if not new:
            return False
        window = self.tail + new
        at = window.find(self.text)
        if at >= 0:
            # Not found in the previous window, so this occurrence ends in `new`: in this token's text.
            self.after = window[at + len(self.text) :]
            return True
        self.tail = window[-(len(self.text) - 1) :] if len(self.text) > 1 else ""
        return False

    def detail(self) -> BoundaryMatch | None:
        return {"boundary_match": "text", "marker_inside_token": bool(self.after)}


@dataclass(frozen=True)
class Marker:
    """Stage 1 ends at the first generated token whose decoded text completes the marker.

    A marker that is exactly one token is matched on that token's ID. Otherwise it is matched on the decoded
    text, so a marker the tokenizer writes only as part of a merged token (a token for `</think>\\n` and none
    for `</think>`) still ends stage 1, at the merged token; the record then says the marker ended inside it.
    """

    text: str
    ids: tuple[int, ...] = ()
    tokenizer: Any = None

    def bind(self, tokenizer: Any) -> Marker:
        if not self.text:
            raise StageReplayError("empty boundary marker", "pass a non-empty --boundary-marker")
        ids = tuple(tokenizer.encode(self.text, add_special_tokens=False))
        if not ids:
            raise StageReplayError(f"boundary marker {self.text!r} encodes to no tokens", "pass a non-empty marker")
        return Marker(self.text, ids, tokenizer)

    def single_token(self) -> bool:
        return len(self.ids) == 1 and self.tokenizer.decode(list(self.ids), skip_special_tokens=False) == self.text

    def watch(self) -> Watch:
        if self.tokenizer is None:
            raise RuntimeError("Marker.bind(tokenizer) must be called before use")
        return _IdWatch(self.ids[0]) if self.single_token() else _TextWatch(self.text, self.tokenizer)

    def match_kind(self) -> str:
        return "token" if self.single_token() else "text"

    def describe(self) -> str:
        return f"marker:{self.text}"


class _RegexWatch:
    """A regex searched in the tail of the decoded text: the last `Regex.WINDOW` characters plus the new text."""

    def __init__(self, pattern: re.Pattern[str], tokenizer: Any) -> None:
        self.pattern = pattern
        self.text_of = Detokenizer(tokenizer)
        self.tail = ""
        self.cut = False  # whether text before `tail` was dropped (then one guard character leads `tail`)

    def step(self, token: int) -> bool:
        new = self.text_of.push(token)
        if not new:
            return False
        window = self.tail + new
        # With text dropped, the guard character keeps `^` and lookbehinds from seeing a false start of text.
        if self.pattern.search(window, 1 if self.cut else 0) is not None:
            return True
        if len(window) > Regex.WINDOW + 1:
            window, self.cut = window[-(Regex.WINDOW + 1) :], True
        self.tail = window
        return False

    def detail(self) -> BoundaryMatch | None:
        return None


@dataclass(frozen=True)
class Regex:
    """Stage 1 ends at the first generated token whose decoded text so far contains a match of `pattern`.

    The text is searched incrementally: each step searches the last `WINDOW` characters and the new token's
    text, so a match must fit within that window (any marker-like pattern does).
    """

    pattern: str
    tokenizer: Any = None
    WINDOW = 1024  # characters of stage 1 kept for the search, besides the new token's text

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

    def watch(self) -> Watch:
        if self.tokenizer is None:
            raise RuntimeError("Regex.bind(tokenizer) must be called before use")
        return _RegexWatch(re.compile(self.pattern), self.tokenizer)

    def match_kind(self) -> str:
        return "regex"

    def describe(self) -> str:
        return f"regex:{self.pattern}"


class _CountWatch:
    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def step(self, token: int) -> bool:
        self.seen += 1
        return self.seen == self.n

    def detail(self) -> BoundaryMatch | None:
        return None


@dataclass(frozen=True)
class After:
    """Stage 1 is the first `n` generated tokens."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise StageReplayError(f"--boundary-after must be at least 1, got {self.n}", "pass a positive count")

    def bind(self, tokenizer: Any) -> After:
        return self

    def watch(self) -> Watch:
        return _CountWatch(self.n)

    def match_kind(self) -> str:
        return "count"

    def describe(self) -> str:
        return f"after:{self.n}"


def stage1_end(tokens: Sequence[int], watch: Watch, eos: Collection[int], budget: int) -> int | None:
    """Index of the boundary token in an uninterrupted generation, or None where stage 1 never ended.

    The decision `LM.live` makes token by token, made afterwards on a serving engine's whole output: the first
    token the watch says completes stage 1, unless an EOS or the stage-1 budget comes first.
    """
    for i, token in enumerate(tokens[:budget]):
        if watch.step(token):
            return i
        if token in eos:
            return None
    return None


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


def default_rule(tokenizer: Any) -> BoundaryRule | None:
    """`</think>` for a reasoning model: its tokenizer has that token and its chat template opens a think block."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "<think>" not in template:
        return None
    marker = Marker(THINK_MARKER).bind(tokenizer)
    return marker if marker.single_token() else None
