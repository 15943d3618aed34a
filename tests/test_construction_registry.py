"""Constructions as typed objects in one registry (engine.constructions): names parse and round-trip, bad names are
refused in one line, spans are the ones the string dispatch gave, and `LM.construct` builds the caches the string
dispatch built, on the embedded toy model, with a negative control."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from stagereplay.engine.constructions import (
    REGISTRY,
    Built,
    Chunked,
    Construction,
    Oneshot,
    Retokenized,
    Roundtrip,
    parse_construction,
    token_by_token,
)
from stagereplay.engine.forwards import construct_forwards, construction_spans, live_forwards
from stagereplay.engine.kv_roundtrip import FORMATS
from stagereplay.errors import StageReplayError

CANONICAL = ["live", "incremental", "oneshot", "chunked:1", "chunked:4", "chunked:16", "retokenized",
             *(f"roundtrip:{f}" for f in FORMATS)]
FIX = ("use live, incremental, oneshot, chunked:<n> (n > 0), retokenized or "
       "roundtrip:<fp8-e4m3|fp8-e5m2|int8>")


def old_spans(construction: str, prompt_len: int, body_len: int) -> list[tuple[int, int]]:
    """engine.forwards.construction_spans as it was before the registry: the string dispatch, verbatim."""
    if construction == "incremental" or construction.startswith("roundtrip:"):
        return [(0, prompt_len), *((p, p + 1) for p in range(prompt_len, body_len))]
    if construction.startswith("chunked:"):
        n = int(construction.split(":")[1])
        return [(s, min(s + n, body_len)) for s in range(0, body_len, n)]
    return [(0, body_len)]  # oneshot, retokenized


# -- names ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CANONICAL)
def test_every_canonical_name_parses_and_round_trips(name):
    made = parse_construction(name)
    assert made.name == name and parse_construction(made.name) == made
    assert type(made) is REGISTRY[name.partition(":")[0]]
    assert made.fixed_prefix is (name != "live")


def test_the_registry_holds_each_base_once_under_its_own_name():
    assert list(REGISTRY) == ["live", "incremental", "oneshot", "chunked", "retokenized", "roundtrip"]
    assert all(kind.base == base for base, kind in REGISTRY.items())


@pytest.mark.parametrize("name", ["chunked:0", "chunked:x", "roundtrip:nope", "oneshot:3", "bogus", "", "chunked",
                                  "chunked:", "oneshot:", "chunked:016", "chunked:-1", "chunked:\u00b2", "Oneshot",
                                  "roundtrip:", "live:1"])
def test_a_malformed_name_is_refused_in_one_line(name):
    for parse in (parse_construction, lambda n: construction_spans(n, 3, 7)):
        with pytest.raises(StageReplayError) as e:
            parse(name)
        assert str(e.value) == f"unknown construction {name!r}; {FIX}"
        assert "\n" not in str(e.value)


def test_an_object_made_directly_is_checked_as_its_name_would_be():
    with pytest.raises(StageReplayError, match="unknown construction 'chunked:0'"):
        Chunked(0)
    with pytest.raises(StageReplayError, match="unknown construction 'roundtrip:fp4'"):
        Roundtrip("fp4")


def test_adding_a_construction_is_one_class_and_one_registry_line(monkeypatch):
    """The refusal's list, parsing and the planner's counts all come from the registry: nothing else names it."""

    @dataclass(frozen=True)
    class Halves(Construction):
        base = "halves"

        def spans(self, prompt_len: int, body_len: int) -> list[tuple[int, int]]:
            return [(0, body_len // 2), (body_len // 2, body_len)]

    monkeypatch.setitem(REGISTRY, "halves", Halves)
    assert parse_construction("halves") == Halves()
    assert construct_forwards("halves", 3, 8) == [3, 4]
    with pytest.raises(StageReplayError, match=r"retokenized, roundtrip:<fp8-e4m3\|fp8-e5m2\|int8> or halves$"):
        parse_construction("thirds")


# -- spans and forwards --------------------------------------------------------------------------------------------


def test_spans_at_prompt_3_body_7():
    """Literal spans for a prompt of 3 tokens and a cached body of 7 (T = 8)."""
    by_token = [(0, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    expected = {"oneshot": [(0, 7)], "retokenized": [(0, 7)], "incremental": by_token,
                "chunked:1": [(p, p + 1) for p in range(7)], "chunked:3": [(0, 3), (3, 6), (6, 7)],
                "chunked:4": [(0, 4), (4, 7)], "chunked:16": [(0, 7)], "live": by_token,
                **{f"roundtrip:{f}": by_token for f in FORMATS}}
    for name, spans in expected.items():
        assert parse_construction(name).spans(3, 7) == spans, name
        assert construction_spans(name, 3, 7) == spans, name


def test_spans_and_forwards_equal_the_string_dispatch_they_replace():
    names = [c for c in CANONICAL if c != "live"] + ["chunked:3", "chunked:7"]
    for name in names:
        for prompt in (1, 2, 5):
            for body in range(prompt, prompt + 20):
                assert construction_spans(name, prompt, body) == old_spans(name, prompt, body), (name, prompt, body)
                counts = [b - a for a, b in old_spans(name, prompt, body)]
                assert construct_forwards(name, prompt, body + 1) == counts
                from_cache = [] if name.startswith("roundtrip:") else counts
                assert construct_forwards(name, prompt, body + 1, from_cache=True) == from_cache


def test_live_makes_the_live_loops_forwards():
    """Live's spans are the loop's: the prompt, then stage 1 but its pending token one at a time."""
    for prompt, stage1 in ((3, 5), (1, 1), (7, 12)):
        assert construct_forwards("live", prompt, prompt + stage1) == live_forwards(prompt, stage1, None)


# -- building, without a model -------------------------------------------------------------------------------------


@dataclass
class FakeState:
    prefix: tuple[int, ...]
    prompt_len: int
    cache: object = None
    cache_len: int | None = None


class FakeTokenizer:
    """Decodes IDs to letters; encodes every letter 'c' back as two IDs (a prefix that re-encodes longer)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [j for ch in text for j in ([2, 2] if ch == "c" else [ord(ch) - ord("a")])]


class FakeLM:
    """A Builder that records what it was asked to feed instead of running a model."""

    tokenizer = FakeTokenizer()

    def __init__(self):
        self.fed: list[tuple] = []

    def prefill(self, body, prompt_len, spans, length):
        self.fed.append((tuple(body), prompt_len, list(spans), length))
        return ("cache", tuple(body))


def test_build_feeds_the_construction_spans_of_the_body():
    lm, state = FakeLM(), FakeState((0, 1, 3, 4, 5, 6), 2, cache_len=40)
    assert Chunked(2).build(lm, state) == Built((0, 1, 3, 4, 5, 6), ("cache", (0, 1, 3, 4, 5)), 40)
    assert lm.fed == [((0, 1, 3, 4, 5), 2, [(0, 2), (2, 4), (4, 5)], 40)]


def test_retokenized_builds_the_reencoded_prefix_and_says_whether_it_round_trips():
    lm = FakeLM()
    same = Retokenized().build(lm, FakeState((0, 1, 3), 1, cache_len=10))
    assert (same.prefix, same.roundtrip, same.cache_len) == ((0, 1, 3), True, 10)
    longer = Retokenized().build(lm, FakeState((0, 2, 3), 1, cache_len=10))  # 'c' re-encodes as two IDs
    assert (longer.prefix, longer.roundtrip, longer.cache_len) == ((0, 2, 2, 3), False, 11)
    assert lm.fed[-1] == ((0, 2, 2), 1, [(0, 3)], 11)
    assert Retokenized().build(lm, FakeState((0, 2, 3), 1)).cache_len is None  # a dynamic cache has no length


def test_live_refuses_to_be_built():
    with pytest.raises(StageReplayError, match="the live construction comes only from live generation"):
        parse_construction("live").build(FakeLM(), FakeState((0, 1, 2), 1))


# -- building, on the embedded toy model ---------------------------------------------------------------------------


def old_construct(lm, state, name):
    """`LM.construct` as it was before the registry, verbatim but for its return value: (prefix, cache,
    cache_len, roundtrip)."""
    from stagereplay.engine.cache import clone_cache
    from stagereplay.engine.kv_roundtrip import roundtrip_cache

    prefix, n_prompt = state.prefix, state.prompt_len
    body = prefix[:-1]
    cache_len = state.cache_len
    roundtrip = None
    if name.startswith("roundtrip:"):
        source_cache = state.cache if state.cache is not None else old_construct(lm, state, "incremental")[1]
        cache = clone_cache(source_cache)
        roundtrip_cache(cache, name.partition(":")[2])
        return tuple(prefix), cache, cache_len, None
    if name == "retokenized":
        text = lm.tokenizer.decode(list(prefix), skip_special_tokens=False)
        ids = tuple(lm.tokenizer.encode(text, add_special_tokens=False))
        roundtrip = ids == tuple(prefix)
        if cache_len is not None:
            cache_len += max(0, len(ids) - len(prefix))
        prefix = ids
        body = prefix[:-1]
    cache = lm.new_cache(cache_len)
    for start, stop in old_spans(name, n_prompt, len(body)):
        lm.stepper.forward(body[start:stop], cache, start)
    return tuple(prefix), cache, cache_len, roundtrip


@pytest.fixture(scope="module")
def toy():
    """The embedded toy (bf16, as `stagereplay paper` runs it) and live's boundary state on one held-out item."""
    from stagereplay.engine.boundary import Marker
    from stagereplay.engine.lm import load
    from stagereplay.tasks.toy import HELDOUT_SEED, toy_items
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), "bf16")
    item = toy_items(1, HELDOUT_SEED, lm.tokenizer)[0]
    return lm, lm.live(item, Marker("</think>"), keep_going=False)


@pytest.mark.parametrize("name", ["oneshot", "incremental", "chunked:4", "retokenized", "roundtrip:int8"])
def test_construct_builds_the_cache_the_string_dispatch_built(toy, name):
    from stagereplay.engine.cache import cache_fingerprint

    lm, live = toy
    for state in (live, replace(live, cache=None)):  # from live's cache, and from the fixed prefix alone
        built = lm.construct(state, name)
        prefix, cache, cache_len, roundtrip = old_construct(lm, state, name)
        assert built.fingerprint() == cache_fingerprint(cache), name
        assert (built.prefix, built.cache_len, built.roundtrip, built.construction) == (
            prefix, cache_len, roundtrip, name)
        assert built.seed == state.seed and built.prompt_len == state.prompt_len
        assert lm.construct(state, parse_construction(name)).fingerprint() == built.fingerprint()


def test_a_construction_that_misses_a_position_is_told_apart(toy):
    """Negative control: the comparison above sees a construction one position short (an off-by-one in spans)."""
    from stagereplay.engine.cache import cache_fingerprint

    @dataclass(frozen=True)
    class OneShort(Oneshot):
        def spans(self, prompt_len: int, body_len: int) -> list[tuple[int, int]]:
            return token_by_token(prompt_len, body_len - 1)

    lm, live = toy
    reference = cache_fingerprint(old_construct(lm, live, "incremental")[1])
    assert lm.construct(live, "incremental").fingerprint() == reference
    assert lm.construct(live, OneShort()).fingerprint() != reference


def test_the_registry_module_imports_no_torch():
    """The planner imports engine.forwards, and through it this module, where torch may be absent."""
    import subprocess
    import sys

    code = ("import sys; import stagereplay.engine.forwards, stagereplay.engine.constructions; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
