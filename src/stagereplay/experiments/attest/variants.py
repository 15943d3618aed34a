"""The claimed model's honest variants: how an honest server may build a prompt's cache and step its decode, each at
a precision. A variant's name is its record's part.

    <precision>               live: the prompt in one forward, then one token per forward from the retained cache
    <precision>/chunked:<n>   the prompt prefilled n tokens at a time (a serving engine's chunked prefill)
    <precision>/prefix:<b>    the prompt asked before: its whole blocks of b tokens (at least its last token left out)
                              come from the cache the earlier request left, computed in that request's forward over the
                              whole prompt, and the rest is prefilled on top (prefix caching: vLLM, SGLang, llama-server;
                              a sliding-window layer reuses what the earlier cache still holds)
    <precision>/batched:<r>   the prompt decoded as one of r concurrent requests for it: every forward has r rows, so
                              the kernels see a batch of r (a server under load)

    <engine>[/<setting>...]   served by a serving engine with its own settings (`EngineVariant`: llama.cpp in this
                              process for a GGUF claim, `serving.llamacpp_honest`; `url`, a trusted deployment that
                              `--honest-url` names, `serving.http_honest`), registered by the engine's module

    variant_of(name)                   the variant a name spells (ours or an engine's); refused in one line otherwise
    HonestVariant.parse(name)          ours
    variant.forwards(prompt, n)        token counts of the forwards a response of n tokens takes (rows included)
    variant.prefill(lm, prompt, cap)   the cache the variant's server holds after the prompt, and the last logits
    variant.step(lm, cache, t, past)   one decode step on it
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from stagereplay.engine.constructions import Chunked
from stagereplay.errors import StageReplayError
from stagereplay.serving.engines import HONEST_VARIANTS

if TYPE_CHECKING:
    import torch

    from stagereplay.engine.lm import LM

PRECISIONS = ("bf16", "fp16", "fp32")
KINDS = ("live", "chunked", "prefix", "batched")
MAX_ROWS = 64
USAGE = "PRECISION or PRECISION/chunked:N, PRECISION/prefix:B, PRECISION/batched:R, with PRECISION one of " + ", ".join(
    PRECISIONS)


@dataclass(frozen=True)
class HonestVariant:
    """One honest way to serve the claimed model (module docstring)."""

    precision: str
    kind: str = "live"
    n: int = 0

    @classmethod
    def parse(cls, name: str) -> HonestVariant:
        """The variant `name` spells, in its one canonical spelling; anything else refused in one line."""
        precision, _, construction = name.partition("/")
        kind, _, arg = construction.partition(":")
        variant = None
        if precision in PRECISIONS and not construction:
            variant = cls(precision)
        elif precision in PRECISIONS and kind in KINDS[1:] and arg.isascii() and arg.isdigit() and int(arg) > 0:
            variant = cls(precision, kind, int(arg))
        if variant is None or variant.name != name:
            raise StageReplayError(f"unknown honest variant {name!r}", f"use {USAGE}")
        if variant.kind == "batched" and not 2 <= variant.n <= MAX_ROWS:
            raise StageReplayError(f"honest variant {name!r}: a batch of {variant.n} rows",
                                   f"use batched:R with R from 2 to {MAX_ROWS}")
        return variant

    @property
    def name(self) -> str:
        return self.precision if self.kind == "live" else f"{self.precision}/{self.kind}:{self.n}"

    @property
    def construction(self) -> str:
        """How its prompt's cache is built, as a scored side records it."""
        return "live" if self.kind == "live" else f"{self.kind}:{self.n}"

    @property
    def rows(self) -> int:
        return self.n if self.kind == "batched" else 1

    def reused(self, prompt_len: int) -> int:
        """prefix:<b>: the prompt's positions served from the earlier request's cache (whole blocks, its last token
        left out); 0 for every other variant."""
        return (prompt_len - 1) // self.n * self.n if self.kind == "prefix" else 0

    def spans(self, prompt_len: int) -> list[tuple[int, int]]:
        """The prompt's forwards on the cache the response decodes from, [start, stop) each."""
        if self.kind == "chunked":
            return Chunked(self.n).spans(prompt_len, prompt_len)
        k = self.reused(prompt_len)
        return [(0, k), (k, prompt_len)] if k else [(0, prompt_len)]

    def forwards(self, prompt_len: int, response_len: int) -> list[int]:
        """Token counts of the forwards a response of `response_len` tokens takes, rows counted: the earlier
        request's forward over the whole prompt first where a prefix is reused."""
        earlier = [prompt_len] if self.reused(prompt_len) else []
        prompt = [(stop - start) * self.rows for start, stop in self.spans(prompt_len)]
        return [*earlier, *prompt, *[self.rows] * max(0, response_len - 1)]

    def prefill(self, lm: LM, prompt: Sequence[int], limit: int) -> tuple[Any, torch.Tensor]:
        """The cache this variant's server holds once the prompt is in, with room for `limit` new tokens, and the
        prompt's last logits [V] (row 0's)."""
        prompt = list(prompt)
        length = len(prompt) + limit - 1
        if self.kind == "batched":
            from stagereplay.engine.cache import new_cache

            cache = new_cache(lm.model, "dynamic")  # a cache of `rows` rows, grown as the batch decodes
            return cache, lm.stepper.forward_rows(prompt, cache, 0, self.rows)
        cache = lm.new_cache(length)
        k = self.reused(len(prompt))
        if k:
            earlier = lm.new_cache(length)
            lm.stepper.forward(prompt, earlier, 0, prompt=prompt)  # the earlier request's forward
            lm.stepper.forward(prompt[:k], cache, 0, prompt=prompt)  # allocates the rows the reuse fills
            _reuse(cache, earlier, k)
        logits = None
        for start, stop in self.spans(len(prompt)):
            if start >= k:
                logits = lm.stepper.forward(prompt[start:stop], cache, start, prompt=prompt)
        assert logits is not None
        return cache, logits

    def step(self, lm: LM, cache: Any, token: int, past: int, prompt: Sequence[int]) -> torch.Tensor:
        """One decode step at `past` on this variant's cache: the next logits [V] (row 0's)."""
        if self.kind == "batched":
            return lm.stepper.forward_rows([token], cache, past, self.rows)
        return lm.stepper.forward([token], cache, past, prompt=prompt)


def _reuse(cache: Any, earlier: Any, k: int) -> None:
    """Positions [0, k) of every layer of `cache` overwritten by the earlier request's, where its cache still holds
    them: a sliding-window layer keeps only its window, so the older positions stay as `cache` computed them (a
    server keeps no more)."""
    import torch

    from stagereplay.engine.cache import held

    with torch.inference_mode():
        for mine, theirs in zip(cache.layers, earlier.layers, strict=True):
            mine_k, mine_v, mine_at = held(mine)
            their_k, their_v, their_at = held(theirs)
            lo = max(mine_at, their_at)
            hi = min(k, mine_at + int(mine_k.shape[-2]), their_at + int(their_k.shape[-2]))
            if lo < hi:
                mine_k[:, :, lo - mine_at : hi - mine_at] = their_k[:, :, lo - their_at : hi - their_at]
                mine_v[:, :, lo - mine_at : hi - mine_at] = their_v[:, :, lo - their_at : hi - their_at]


@dataclass(frozen=True)
class EngineVariant:
    """An honest variant served by a serving engine in this process, as the claimed stack serves the model: its
    engine's family (the name's first segment) and the engine's own settings (`FAMILY/SETTING/SETTING:N`), which
    the engine's `EngineHonesty` reads. None of its forwards are ours."""

    engine: str
    settings: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return "/".join((self.engine, *self.settings))

    @property
    def construction(self) -> str:
        return "live"

    @property
    def precision(self) -> str:
        return "engine"

    def forwards(self, prompt_len: int, response_len: int) -> list[int]:
        return []

    def honesty(self) -> EngineHonesty:
        """The engine's way of serving it; refused in one line where no engine serves honest variants by that
        name."""
        found = ENGINE_VARIANTS.get(self.engine)
        if found is None:
            known = ", ".join(sorted(ENGINE_VARIANTS)) or "none installed"
            raise StageReplayError(f"honest variant {self.name!r}: no serving engine {self.engine!r} serves honest "
                                   f"variants here ({known})", f"use {USAGE}, or an engine's variants")
        found.check(self.settings)
        return found


class EngineHonesty(Protocol):
    """How a serving engine serves the claimed model as an honest variant (registered by the engine's own module,
    `register_engine`): its settings checked, and one response decoded."""

    defaults: tuple[str, ...]
    """The variants (full names) a claim of this engine measures by default."""

    def check(self, settings: tuple[str, ...]) -> None:
        """Each setting known and in range; else refused in one line."""

    def serve(self, lm: LM, settings: tuple[str, ...], prompt: Sequence[int], limit: int, greedy: bool,
              where: str | None = None) -> tuple[list[int], str, list[float], str]:
        """The response to `prompt` (at most `limit` tokens, greedy), why it stopped (eos or length), the engine's
        log-probability of each token (its raw distribution), and the engine's description of what it ran. `where`:
        the deployment a variant of a running server asks (`--honest-url`); None in process."""


ENGINE_VARIANTS: dict[str, EngineHonesty] = HONEST_VARIANTS
"""Serving engines that serve honest variants, by the family name their variants start with: the serving engines'
own (`serving.engines.HONEST_VARIANTS`), and any `register_engine` adds."""


def register_engine(family: str, honesty: EngineHonesty) -> None:
    ENGINE_VARIANTS[family] = honesty


Variant = HonestVariant | EngineVariant


def variant_of(name: str) -> Variant:
    """The variant `name` spells: ours (`HonestVariant.parse`) where it starts with a precision, else an engine's
    (`FAMILY/SETTING...`, its settings checked where the run is prepared: `EngineVariant.honesty`)."""
    head, *rest = name.split("/")
    if head in PRECISIONS:
        return HonestVariant.parse(name)
    if not head or not all(c.isalnum() or c in ".-_" for c in head) or any(not r for r in rest):
        raise StageReplayError(f"unknown honest variant {name!r}", f"use {USAGE}, or ENGINE/SETTING (llama.cpp)")
    return EngineVariant(head, tuple(rest))


def parse_variants(names: Sequence[str]) -> tuple[Variant, ...]:
    """Each name's variant, in order; a name given twice is refused."""
    variants = tuple(variant_of(n) for n in names)
    seen = [v.name for v in variants]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise StageReplayError(f"honest variant {twice[0]} given twice", "name each variant once")
    return variants


__all__ = ["ENGINE_VARIANTS", "PRECISIONS", "EngineHonesty", "EngineVariant", "HonestVariant", "Variant",
           "parse_variants", "register_engine", "variant_of"]
