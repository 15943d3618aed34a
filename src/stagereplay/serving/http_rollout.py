"""A running server as an RL rollout engine (`serving.http.HttpEngine`'s `Samples` and `ScoresPrompt`): a response
drawn by the server's own sampler, and, where the server can, a sequence scored teacher-forced in one request.

    llama-server   POST /completion {prompt: [ids], n_predict, temperature, top_k, top_p, min_p: 0, seed,
                   samplers: [temperature, top_k, top_p], n_probs: 1, post_sampling_probs, cache_prompt: false}.
                   The sampler order is named (llama-server's default puts temperature last, and min_p at 0.05):
                   generate()'s. Each step's `logprob` is raw (the softmax of the logits); with `post_sampling_probs`
                   the step's `prob` is after the sampler chain (processed), its log taken here. No sequence is
                   scored: llama-server refuses `echo` and returns no prompt log-probabilities
    openai         POST /v1/completions {prompt: [ids], max_tokens, temperature, top_k, top_p, seed, logprobs: 1,
                   return_tokens_as_token_ids, cache_salt (fresh: nothing cached)}; the emitted tokens'
                   log-probabilities in the distribution the server was started with (vLLM: `--logprobs-mode`, which
                   `--server-args` declares; raw_logprobs by default). `vllm serve` scores a sequence with `echo` and
                   `logprobs` (its prompt logprobs, max_tokens 1), raw in any of its modes

Seeds are sent as 32-bit numbers (`serving.seam.SEED_SPAN`).
"""

from __future__ import annotations

import shlex
import uuid
from collections.abc import Sequence
from typing import Protocol, TypedDict

from stagereplay.errors import StageReplayError
from stagereplay.serving.client import Client
from stagereplay.serving.replies import NativeReply, OpenAIReply, Timings, Where, native_steps, openai_steps
from stagereplay.serving.seam import LOGPROBS_MODES, EngineConfig, Generation, PromptScores, Sampling
from stagereplay.serving.server_identity import LLAMA_SERVER, ServerIdentity

SAMPLERS = ["temperature", "top_k", "top_p"]
"""llama-server's sampler chain for a rollout, in generate()'s order (its `dist` is added after them)."""


class Server(Protocol):
    """What a rollout needs of the engine (`serving.http.HttpEngine`): the server, its dialect and identity."""

    client: Client
    api: str
    identity: ServerIdentity
    config: EngineConfig
    vocab: int | None  # the run's tokenizer's size: an emitted token's bound (None: not known yet)


def declared_mode(server_args: str) -> str | None:
    """The logprobs mode a `vllm serve` was started with, as `--server-args` declares it (`--logprobs-mode`;
    raw_logprobs where it is not declared), in our words: raw | processed; None for a mode of logits."""
    words = shlex.split(server_args)
    value = "raw_logprobs"
    for i, word in enumerate(words):
        if word == "--logprobs-mode" and i + 1 < len(words):
            value = words[i + 1]
        elif word.startswith("--logprobs-mode="):
            value = word.partition("=")[2]
    mode = value.removesuffix("_logprobs")
    return mode if mode in LOGPROBS_MODES else None


def modes(api: str, identity: ServerIdentity, server_args: str) -> tuple[str, ...]:
    """The distributions a server's drawn tokens' log-probabilities can be taken from (module docstring)."""
    if api == "llama-server":
        return LOGPROBS_MODES
    if identity.server in LLAMA_SERVER:
        return ("raw",)
    mode = declared_mode(server_args)
    return () if mode is None else (mode,)


def prompt_scoring(api: str, identity: ServerIdentity, mode: str) -> str | None:
    """None where the server scores a sequence's tokens in one request under `mode`; else why not, in one line."""
    if api == "llama-server" or identity.server in LLAMA_SERVER:
        return ("llama-server scores no sequence in one request: it refuses `echo`, and its /completion returns no "
                "prompt log-probabilities")
    if mode != "raw":
        return f"vLLM's prompt logprobs skip its sampler: a sequence is not scored under {mode} log-probabilities"
    return None


def seeded_draws(api: str, identity: ServerIdentity) -> str | None:
    """None where the server's seeded draws are vLLM's sampler's (`EngineKind.seeded_draws`): a `vllm serve`; else
    why not, in one line."""
    if api == "llama-server" or identity.server in LLAMA_SERVER:
        return ("llama-server draws from its own sampler chain and random generator, not vLLM's seeded pick that a "
                "seeded claim is replayed with")
    return None


class SamplerFields(TypedDict):
    """How a sampled request draws, in the fields both servers' completion bodies take."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float  # 0: off (llama-server's default is not)
    seed: int
    samplers: list[str]  # llama-server's sampler chain, in generate()'s order (vLLM ignores it)


def _sampler(sampling: Sampling) -> SamplerFields:
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": 0.0,
            "seed": sampling.seed, "samplers": SAMPLERS}


def sample(engine: Server, ids: Sequence[int], max_tokens: int, sampling: Sampling) -> Generation:
    """`Samples.sample` on the server (module docstring): the reply read and checked where it arrives
    (`serving.replies`); each step's best candidate and each token's log-probability, read whole (None: the server
    gave none)."""
    ids = [int(t) for t in ids]
    if engine.api == "llama-server":
        processed = engine.config.logprobs_mode == "processed"
        where = Where(engine.client.url, "/completion")
        reply = where.read(NativeReply, engine.client.call(where.path, {
            "prompt": ids, "n_predict": max_tokens, **_sampler(sampling), "n_probs": 1,
            "post_sampling_probs": processed, "cache_prompt": False, "return_tokens": True, "stream": False}))
        read = native_steps(reply, where, processed).read(where, engine.vocab, top="whole", chosen="whole")
        finish = "stop" if reply.stop_type in ("eos", "word") else "length"
        cached = (reply.timings or Timings()).cache_n
        return Generation(read.tokens, tuple(step[:1] for step in read.top), cached, finish, None, read.chosen)
    body = {"model": engine.identity.model, "prompt": ids, "max_tokens": max_tokens, **_sampler(sampling),
            "logprobs": 1, "return_tokens_as_token_ids": True, "cache_prompt": False, "cache_salt": uuid.uuid4().hex}
    where = Where(engine.client.url, "/v1/completions")
    choice = where.read(OpenAIReply, engine.client.call(where.path, body)).choice(where)
    read = openai_steps(choice.logprobs, where).read(where, engine.vocab, top="whole", chosen="whole")
    finish = "stop" if choice.finish_reason == "stop" else "length"
    return Generation(read.tokens, tuple(step[:1] for step in read.top), None, finish, None, read.chosen)


def score(engine: Server, ids: Sequence[int], start: int, sampling: Sampling) -> PromptScores:
    """`ScoresPrompt.score` on a `vllm serve`: one request for `ids` with `echo` and `logprobs` (its prompt logprobs
    and one generated token), under a fresh cache salt; every scored token's log-probability and candidates read
    from the reply, checked where it arrives."""
    reason = prompt_scoring(engine.api, engine.identity, engine.config.logprobs_mode)
    if reason is not None:
        raise StageReplayError(reason, "score the rollouts with our engine only (the trainer parts)")
    ids = [int(t) for t in ids]
    body = {"model": engine.identity.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "echo": True,
            "logprobs": 1, "return_tokens_as_token_ids": True, "cache_prompt": False, "cache_salt": uuid.uuid4().hex}
    where = Where(engine.client.url, "/v1/completions")
    steps = openai_steps(where.read(OpenAIReply, engine.client.call(where.path, body)).choice(where).logprobs, where)
    if steps.tokens[: len(ids)] != tuple(ids):
        raise StageReplayError(f"the server at {engine.client.url} echoed other tokens than the {len(ids)} sent",
                               "serve with return_tokens_as_token_ids support (vllm serve)")
    read = steps.read(where, engine.vocab, top="every", chosen="every", start=start)
    chosen = read.chosen or ()
    return PromptScores(tuple(chosen[start : len(ids)]), tuple(step[0][0] for step in read.top[start : len(ids)]))
