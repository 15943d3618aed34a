"""A trusted deployment as an honest variant of a claim (`attest --honest-url URL`): your own llama-server or
`vllm serve` of the claimed file, asked for each prompt greedily, its replies in the null beside the in-process
variants. It holds what only a deployment has: the server's own build and flags, its slots and its batching.

    url        the first URL `--honest-url` names
    url/N      the N-th (N >= 2)

The deployment is identified (`serving.server_identity.identify`) and checked as the server under test is
(`serving.http_checks.check_server`: token IDs taken verbatim, greedy at temperature 0, the claimed tokenizer) on its
first request; a reply without a log-probability for each token is refused in one line (the null's log-probability
statistic needs them). One engine per URL lives for the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib import parse

from stagereplay.errors import StageReplayError
from stagereplay.serving.seam import EngineConfig, Sampling

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.serving.http import HttpEngine

FAMILY = "url"
USAGE = "url (the first --honest-url), url/N (the N-th)"


def index(settings: tuple[str, ...]) -> int:
    """The URL a variant's settings name, as an index into `--honest-url` (0 for `url`); refused otherwise."""
    if not settings:
        return 0
    n = settings[0]
    if len(settings) > 1 or not (n.isascii() and n.isdigit() and int(n) >= 2):
        raise StageReplayError(f"unknown honest variant {'/'.join((FAMILY, *settings))!r}", f"use {USAGE}")
    return int(n) - 1


def check_url(url: str) -> str:
    """`url` as a deployment's address; refused in one line where it is not one, or holds credentials (the run
    records it)."""
    if not url.startswith(("http://", "https://")) or not url.split("://", 1)[1].strip("/"):
        raise StageReplayError(f"--honest-url {url!r} is not a server's address", "pass --honest-url http://HOST:PORT")
    parts = parse.urlsplit(url)
    if parts.username or parts.password:
        raise StageReplayError("--honest-url holds credentials, and the run records it",
                               "pass the address alone (the API key reaches the server from $OPENAI_API_KEY)")
    return url.rstrip("/")


def engine_name(url: str) -> str:
    """The engine the deployment at `url` runs, as a claim names engines: llama.cpp (llama-server), vllm, or what
    the server says it is."""
    from stagereplay.serving.http import HttpOptions
    from stagereplay.serving.server_identity import identify

    _, identity = identify(HttpOptions(url=url).client(), "auto")
    if identity.llama_server:
        return "llama.cpp"
    return "vllm" if (identity.server or "").lower().startswith("vllm") else (identity.server or "server")


_LOADED: dict[str, HttpEngine] = {}


def _engine(url: str, lm: LM) -> HttpEngine:
    from stagereplay.serving.http import HttpOptions, load

    if url not in _LOADED:
        engine = load(EngineConfig("http", HttpOptions(url=url)), lm.config.path, lm.config.precision, 1, "cpu")
        engine.check(lm.tokenizer)
        _LOADED[url] = engine
    return _LOADED[url]


class HttpHonesty:
    """A trusted deployment's honest variants (module docstring)."""

    defaults: tuple[str, ...] = ()

    def check(self, settings: tuple[str, ...]) -> None:
        index(settings)

    def serve(self, lm: LM, settings: tuple[str, ...], prompt: Sequence[int], limit: int, greedy: bool,
              where: str | None = None) -> tuple[list[int], str, list[float], str]:
        if where is None:
            raise StageReplayError(f"honest variant {'/'.join((FAMILY, *settings))} asks a deployment, and no "
                                   "--honest-url names it", "pass --honest-url URL (your own server of the file)")
        if not greedy:
            raise StageReplayError("a deployment's honest variants serve greedy claims only",
                                   "drop --honest-url for a seeded claim")
        engine = _engine(where, lm)
        g = engine.sample(list(prompt), limit, Sampling.of(False, 1.0, 0, 1.0, 0))
        chosen = list(g.chosen or ())
        if len(chosen) != len(g.tokens):
            raise StageReplayError(f"the deployment at {where} returned {len(chosen)} log-probabilities for "
                                   f"{len(g.tokens)} tokens", "serve it with log-probabilities (vLLM: --max-logprobs 5)")
        tokens: list[Any] = list(g.tokens)
        return tokens, "eos" if g.finish == "stop" else "length", chosen, engine.precision_name()


__all__ = ["FAMILY", "HttpHonesty", "check_url", "engine_name", "index"]
