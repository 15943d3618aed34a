"""A running server behind the serving seam (`matched --engine http --url URL`): the server people deploy, with its
prefix cache, its slots and the other requests in its batch.

Two dialects, token IDs in and out (no text round trip on the measured path), detected from the server or forced
with `--api`:

    llama-server   POST /completion  {prompt: [ids], n_predict, temperature: 0, n_probs, cache_prompt}; the
                   reply's `tokens`, `completion_probabilities[].top_logprobs[].id`, `timings.cache_n` (prompt
                   positions taken from the slot's cache) and `tokens_evaluated`; /props, /tokenize, /slots
    openai         POST /v1/completions  {prompt: [ids], max_tokens, temperature: 0, logprobs,
                   return_tokens_as_token_ids, cache_salt}: `vllm serve` (and llama-server's own endpoint); ids
                   from `token_id:N` strings or `logprobs.content[].id`, `usage.prompt_tokens_details.cached_tokens`

    generate(ids, reuse=False)   the prefix cache bypassed: `cache_prompt: false` (llama-server) or a fresh
                                 `cache_salt` (vLLM), both sent in the openai dialect; `settings()["bypass"]` says
                                 which, and the check before the first item measures whether it held
    generate(ids, reuse=True)    the server may reuse what its cache holds (`cache_prompt: true`); on vLLM only what
                                 the last bypassed request cached (its salt again)
    generate_loaded(ids, others) the same request as reuse=False, issued while `--concurrency` other requests (other
                                 items' prompts, 16 tokens each, sent again as each returns, the prefix cache
                                 theirs to use) are in flight: the server batches them with it
    slot_restore(...)            llama-server with --slot-save-path (`--slot-restore`): live's slot saved, restored
                                 into another slot and continued there
    sample / score               a rollout drawn by the server's sampler, and a sequence scored in one request where
                                 the server can (`vllm serve`'s echo), `serving.http_rollout`

Before the first item `check` refuses, in one line with the fix, a server that does not answer, counts the prompt
tokens differently from the IDs sent (it does not take IDs verbatim), tokenizes probe strings differently from the
run's tokenizer, is not greedy at temperature 0 (two replicas of a probe differ), or returns no top-k logprobs.
Every reply is read and checked where it arrives (`serving.replies`): one a run cannot use (a step count other than
its tokens', an empty step, a log-probability that is not one, a token ID outside the run's tokenizer) is refused in
one line, and no record is made from it.

What the server says it is, and the settings it reports that change how it builds the cache (whether it speculates,
its speculative types, the model's type and size), are its identity (`serving.server_identity`); what it does not
report (its K/V cache types, batch sizes, repacking, a draft model) the user declares with `--server-args`, the
flags it was started with, recorded verbatim. Each request's speculation (llama-server's `timings.draft_n` and
`draft_n_accepted`; a speculating vLLM's counters read around a request sent alone) is `Generation.draft`.

The API key is read from the environment variable `--api-key-env` names (OPENAI_API_KEY by default) at each
request and sent as a bearer token; it is never kept in the engine's settings, the run directory or an error.
"""

from __future__ import annotations

import shlex
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, NotRequired, TypedDict

from stagereplay.errors import StageReplayError
from stagereplay.serving import http_rollout
from stagereplay.serving.client import Client, public_url
from stagereplay.serving.http_checks import (
    SLOT_FILE,
    Resumed,
    ServerChecks,
    check_server,
    resumed,
    server_instance,
)
from stagereplay.serving.replies import (
    NativeReply,
    OpenAIReply,
    Read,
    Steps,
    Timings,
    Usage,
    Where,
    native_steps,
    openai_steps,
)
from stagereplay.serving.seam import (
    TOP_LOGPROBS,
    ChecksFirst,
    EngineConfig,
    EngineKind,
    EngineOptions,
    Generation,
    Instance,
    LoadSeen,
    PromptScores,
    Restarts,
    RestoresSlot,
    Samples,
    Sampling,
    ScoresPrompt,
    ServesUnderLoad,
    SlotSaveRestore,
)
from stagereplay.serving.server_identity import (
    ServerIdentity,
    SpecCounters,
    identify,
    llama_server_draft,
)

__all__ = ["Client", "HttpEngine", "HttpKind", "HttpOptions", "ServerIdentity", "identify", "public_url"]

TRAFFIC_TOKENS = 16
"""Tokens each request of the traffic around an under-load arm asks for (`HttpEngine.generate_loaded`): short, so
the batch changes many times within one measured request, and what is in flight when it returns soon finishes."""
SECRET_FLAGS = ("--api-key", "--api-key-file", "--hf-token", "-hft", "--ssl-key-file")
"""Server flags whose value is a secret (or names one): refused in `--server-args`, which is recorded."""


@dataclass(frozen=True)
class HttpOptions(EngineOptions):
    """How to reach a running server and what to ask of it (`--engine http`)."""

    url: str = field(default="", metadata={
        "help": "the server: http://HOST:PORT (an OpenAI base URL, http://HOST:PORT/v1, names the same server)"})
    api: str = field(default="auto", metadata={
        "help": "auto | llama-server (/completion) | openai (/v1/completions)"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "the environment variable holding the server's API key (the key itself is never recorded)"})
    timeout: float = field(default=600.0, metadata={"help": "seconds per request"})
    retries: int = field(default=2, metadata={"help": "retries of a request the server did not answer"})
    slot_restore: bool = field(default=False, metadata={
        "help": "the slot-restore arms: live's slot saved and restored into another (llama-server --slot-save-path)"})
    concurrency: int = field(default=0, metadata={
        "help": "other requests in flight around each under-load replica (0: no under-load arms)"})
    server_args: str = field(default="", metadata={
        "help": "the flags the server was started with, as the user declares them (recorded verbatim): what it does "
                "not report of how it builds the cache (-ctk/-ctv, -fa, -b/-ub, --no-repack, -md, "
                "--kv-cache-dtype ...)"})

    def check(self) -> None:
        if not self.url:
            raise StageReplayError("--engine http needs the server's address", "pass --url http://HOST:PORT")
        if self.api not in ("auto", "llama-server", "openai"):
            raise StageReplayError(f"unknown --api {self.api!r}", "use auto, llama-server or openai")
        if self.timeout <= 0 or self.retries < 0 or self.concurrency < 0:
            raise StageReplayError("--timeout must be positive, --retries and --concurrency at least 0",
                                   "pass e.g. --timeout 600 --retries 2 --concurrency 4")
        flags = [w.split("=")[0] for w in self.server_args.split()]
        secret = next((f for f in flags if f in SECRET_FLAGS or f.startswith("--api-key")), None)
        if secret is not None:
            raise StageReplayError(f"--server-args holds {secret}: a secret is never recorded, and --server-args is "
                                   "recorded verbatim",
                                   "declare the server's flags without it (the key reaches the server from "
                                   "$OPENAI_API_KEY, or the variable --api-key-env names)")
        try:
            shlex.split(self.server_args)
        except ValueError as e:
            raise StageReplayError(f"--server-args is not a command line's flags ({e})",
                                   "quote it as the shell would: --server-args '-ctk q8_0 -ctv q8_0 -fa on'") from e

    def client(self) -> Client:
        return Client(self.url, self.api_key_env, self.timeout, self.retries)


class CompletionRequest(TypedDict):
    """The body of a greedy request to an OpenAI-style /v1/completions, with token IDs in and out."""

    model: str | None
    prompt: list[int]
    max_tokens: int
    temperature: float
    logprobs: int
    return_tokens_as_token_ids: bool
    seed: int
    cache_prompt: bool
    cache_salt: NotRequired[str]  # vLLM: the blocks of a request under another salt are never reused


class HttpEngine(RestoresSlot, ServesUnderLoad, ChecksFirst, Restarts, Samples, ScoresPrompt):
    """One server; greedy requests of one item at a time (and `generate_loaded`'s traffic around one); a rollout's
    sampled request, and a sequence's score where the server gives one (`HttpKind.prompt_scoring`)."""

    name = "http"

    def __init__(self, config: EngineConfig, client: Client, api: str, identity: ServerIdentity):
        self.config, self.client, self.api, self.identity = config, client, api, identity
        self.options = config.own(HttpOptions)
        self.checked: ServerChecks = {}
        self.vocab: int | None = None  # the run's tokenizer's size, once `check` has it: an emitted token's bound
        self.resumed: Resumed | None = None  # set by `note_resume` when a run resumes on this server
        self._salt = ""  # the cache salt of the last request that bypassed the cache (openai dialect)
        # A speculating vLLM says what a request drafted only through its server-wide counters, read around a request
        # sent alone (not under load, where other requests' drafts count too).
        self._counts_drafts = bool(identity.speculative) and not identity.llama_server
        self._alone = True

    # -- requests ---------------------------------------------------------------------------------------

    def complete(self, ids: Sequence[int], max_tokens: int, reuse: bool, slot: int = -1, salt: str = ""
                 ) -> tuple[Generation, int]:
        """One greedy request (llama-server: in `slot`, -1 for any; openai: under the cache `salt`, if any); its
        generation and the prompt tokens the server says it took (-1: it did not say). The reply is read and
        checked where it arrives (`serving.replies`)."""
        ids = [int(t) for t in ids]
        if self.api == "llama-server":
            where = Where(self.client.url, "/completion")
            reply = where.read(NativeReply, self.client.call(where.path, {
                "prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "n_probs": TOP_LOGPROBS,
                "cache_prompt": reuse, "return_tokens": True, "seed": self.config.seed, "stream": False,
                "id_slot": slot}))
            read = self._greedy(native_steps(reply, where), where)
            finish = "stop" if reply.stop_type in ("eos", "word") else "length"
            timings = reply.timings or Timings()
            draft = llama_server_draft(timings.said(), bool(self.identity.speculative))
            prompt = -1 if reply.tokens_evaluated is None else reply.tokens_evaluated
            return Generation(read.tokens, read.top, timings.cache_n, finish, draft), prompt
        body: CompletionRequest = {
            "model": self.identity.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True, "seed": self.config.seed,
            "cache_prompt": reuse}
        if salt:
            body["cache_salt"] = salt
        counters = self._counts_drafts and self._alone
        before = SpecCounters.read(self.client) if counters else None
        where = Where(self.client.url, "/v1/completions")
        answer = where.read(OpenAIReply, self.client.call(where.path, body))
        choice = answer.choice(where)
        read = self._greedy(openai_steps(choice.logprobs, where), where)
        usage = answer.usage or Usage()
        details = usage.prompt_tokens_details  # null where the server does not count cached tokens
        cached = None if details is None else details.cached_tokens or 0
        finish = "stop" if choice.finish_reason == "stop" else "length"
        draft = None if answer.timings is None else llama_server_draft(answer.timings.said(),
                                                                       bool(self.identity.speculative))
        if before is not None:  # vLLM's counters, read around a request sent alone: its own speculation
            draft = SpecCounters.read(self.client).since(before)
        prompt = -1 if usage.prompt_tokens is None else usage.prompt_tokens
        return Generation(read.tokens, read.top, cached, finish, draft), prompt

    def _greedy(self, steps: Steps, where: Where) -> Read:
        """A greedy reply's steps, read: the top-k of every step."""
        if steps.top is None and steps.tokens:
            raise StageReplayError(f"the server at {self.client.url} returned no top-{TOP_LOGPROBS} logprobs",
                                   "serve with logprobs enabled (vLLM: --max-logprobs 5 or more)")
        return steps.read(where, self.vocab, top="every", chosen="whole")

    def generate(self, ids: Sequence[int], max_tokens: int, reuse: bool = False) -> Generation:
        return self.counted(ids, max_tokens, reuse)[0]

    def counted(self, ids: Sequence[int], max_tokens: int, reuse: bool) -> tuple[Generation, int]:
        """`generate`, and the prompt tokens the server counted. On vLLM a request that bypasses the cache gets a
        salt no request used before (its blocks hash anew), and a request that reuses gets the last such salt:
        it can reuse what the last bypassed request cached (live's blocks, decode-written ones included) and
        nothing that other requests or earlier runs left in the server's cache."""
        if not reuse:
            self._salt = uuid.uuid4().hex
        return self.complete(ids, max_tokens, reuse, salt=self._salt)

    @property
    def restores_slots(self) -> bool:
        return self.options.slot_restore

    def slot_restore(self, prompt: Sequence[int], live_tokens: int, prefix: Sequence[int], max_new: int
                     ) -> tuple[Generation, Generation, SlotSaveRestore]:
        """llama-server's slot save/restore (`--slot-save-path`): live's request again in slot A, that slot's K/V
        saved and restored into slot B (A itself, erased first, on a one-slot server), and the prefix continued
        in B reusing what was restored. The live request (to check it is live's) and the continuation."""
        slots = self.identity.total_slots or 1
        a, b = 0, 1 % slots
        self.client.call(f"/slots/{a}?action=erase", {})
        live, _ = self.complete(prompt, live_tokens, reuse=False, slot=a)
        saved = self.client.call(f"/slots/{a}?action=save", {"filename": SLOT_FILE}) or {}
        self.client.call(f"/slots/{b}?action=erase", {})
        restored = self.client.call(f"/slots/{b}?action=restore", {"filename": SLOT_FILE}) or {}
        g, _ = self.complete(prefix, max_new, reuse=True, slot=b)
        return live, g, {"slots": [a, b], "saved": saved.get("n_saved"), "restored": restored.get("n_restored")}

    def generate_loaded(self, ids: Sequence[int], max_tokens: int, others: Sequence[Sequence[int]]
                        ) -> tuple[Generation, LoadSeen]:
        """`generate(ids, reuse=False)` while `--concurrency` requests for `others` run without pause around it:
        each asks for `TRAFFIC_TOKENS` tokens, may reuse the server's prefix cache as any client's request would
        (the measured one may not), and is sent again as soon as it returns, so the batch the request meets keeps
        changing (others' prefills and decode steps alike) for as long as it runs. The others are
        then let finish (short, so soon), never cancelled: a server notices a cancelled request only at its next
        poll, and one still queued for an HTTP thread would run after it, beside the next quiet arm. Also what was
        seen: the concurrency, how many others were in flight when it was sent, how many returned meanwhile."""
        k = self.options.concurrency
        stop, started, failures = threading.Event(), threading.Semaphore(0), []
        lock = threading.Lock()
        in_flight, finished = [0], [0]

        def traffic(prompt: Sequence[int]) -> None:
            first = True
            while not stop.is_set():
                with lock:
                    in_flight[0] += 1
                if first:
                    started.release()
                    first = False
                try:
                    self.complete(prompt, min(TRAFFIC_TOKENS, max_tokens), reuse=True)
                except StageReplayError as e:
                    failures.append(e)
                    return
                finally:
                    with lock:
                        in_flight[0] -= 1
                        finished[0] += 1

        self._alone = False
        threads = [threading.Thread(target=traffic, args=(others[i % len(others)],), daemon=True) for i in range(k)]
        for t in threads:
            t.start()
        for _ in threads:
            started.acquire()
        time.sleep(0.05)  # the others' requests reach the server first
        with lock:
            seen = in_flight[0]
        try:
            g = self.generate(ids, max_tokens, reuse=False)
        finally:
            with lock:
                done = finished[0]
            stop.set()
            for t in threads:
                t.join()
            self._alone = True
        if failures:
            raise failures[0]
        return g, {"concurrency": k, "in_flight_at_send": seen, "returned_meanwhile": done}

    def sample(self, ids: Sequence[int], max_tokens: int, sampling: Sampling) -> Generation:
        return http_rollout.sample(self, ids, max_tokens, sampling)

    def score(self, ids: Sequence[int], start: int, sampling: Sampling) -> PromptScores:
        return http_rollout.score(self, ids, start, sampling)

    def precision_name(self) -> str:
        """What the server says of its model's type (llama-server's file type); vLLM says nothing of its dtype. The
        flags it was started with, as `--server-args` declares them, are the manifest's (`environment.engine`)."""
        meta = self.identity.model_meta or {}
        said, n = self.identity.model_ftype or meta.get("ftype"), meta.get("n_params")
        size = f" ({n / 1e9:.3g}B parameters)" if isinstance(n, int) and n >= 10**8 else (
            f" ({n / 1e6:.3g}M parameters)" if isinstance(n, int) and n > 0 else "")
        return f"the server's {said}{size}" if said is not None else "the server's own types (it does not say which)"

    # -- identity and the check before any item -----------------------------------------------------------

    def version(self) -> str:
        return str(self.identity.build)

    def close(self) -> None:
        """Nothing held open: each request has its own connection."""

    @property
    def address(self) -> str:
        return self.client.url

    def settings(self) -> dict[str, Any]:
        return {"engine": self.name, **self.config.as_dict(), "url": self.client.url, "api": self.api,
                "build": self.identity.build_of(), "server": self.identity.as_json(), "top_logprobs": TOP_LOGPROBS,
                "bypass": "cache_prompt: false" if self.api == "llama-server" else "cache_salt (+ cache_prompt: false)",
                "checked": dict(self.checked), **({"resumed": self.resumed} if self.resumed else {})}


    def check(self, tokenizer: Any) -> None:
        """Refuse a server whose numbers this run could not compare with ours (module docstring,
        `serving.http_checks`); what was measured goes into `settings()["checked"]`."""
        self.vocab = len(tokenizer)
        self.checked = check_server(self, tokenizer)

    def instance(self) -> Instance:
        """What tells this server's life from another's (`serving.http_checks.server_instance`)."""
        return server_instance(self.client, self.api)

    def note_resume(self, before: Instance, requests: int, after: str) -> bool | None:
        """Whether the server restarted since a run's last record (`serving.http_checks.resumed`), recorded in the
        settings of the records from here on."""
        self.resumed = resumed(before, self.instance(), requests, after)
        return self.resumed["restarted"]

def load(config: EngineConfig, model_path: str, precision: str, threads: int, device: str) -> HttpEngine:
    """The server at the config's url, identified; `precision`, `threads` and `device` are the server's to choose
    (our engine runs at `precision` for the tokenizer and `--cross hf`)."""
    options = config.own(HttpOptions)
    client = options.client()
    api, identity = identify(client, options.api)
    return HttpEngine(config, client, api, identity)


class HttpKind(EngineKind):
    """A running server, over HTTP (`--engine http --url URL`)."""

    name: ClassVar[str] = "http"
    title: ClassVar[str] = "http (a running server)"
    own_types: ClassVar[bool] = True  # the server's model, in the types it was loaded in
    options: ClassVar[type[EngineOptions]] = HttpOptions
    engine: ClassVar[type] = HttpEngine

    def context(self, config: EngineConfig) -> tuple[int, str] | None:
        """The positions one request may hold on the server: llama-server's per-slot context (its total context over
        its slots), vLLM's max_model_len; None where the server does not say."""
        options = config.own(HttpOptions)
        api, identity = identify(options.client(), options.api)
        n = identity.n_ctx if api == "llama-server" else identity.max_model_len
        if not n:
            return None
        per = "per-slot context" if api == "llama-server" else "context (max_model_len)"
        return int(n), f"the server's {per}"

    def load(self, config: EngineConfig, model_path: str, precision: str, threads: int, device: str
             ) -> HttpEngine:
        return load(config, model_path, precision, threads, device)

    def logprobs_modes(self, config: EngineConfig) -> tuple[str, ...]:
        """llama-server: raw and processed (`post_sampling_probs`); `vllm serve`: the mode it was started with, as
        `--server-args` declares it (serving.http_rollout)."""
        options = config.own(HttpOptions)
        api, identity = identify(options.client(), options.api)
        return http_rollout.modes(api, identity, options.server_args)

    def prompt_scoring(self, config: EngineConfig) -> str | None:
        options = config.own(HttpOptions)
        api, identity = identify(options.client(), options.api)
        return http_rollout.prompt_scoring(api, identity, config.logprobs_mode)

    def seeded_draws(self, config: EngineConfig) -> str | None:
        options = config.own(HttpOptions)
        return http_rollout.seeded_draws(*identify(options.client(), options.api))

    def arms(self, config: EngineConfig) -> tuple[str, ...]:
        options = config.own(HttpOptions)
        return ((RestoresSlot.ARMS if options.slot_restore else ())
                + (ServesUnderLoad.ARMS if options.concurrency else ()))

    def concurrency(self, config: EngineConfig) -> int:
        return config.own(HttpOptions).concurrency

    def build(self, config: EngineConfig) -> dict[str, Any]:
        """The build of the server at the config's url now (`ServerIdentity.build_of`), for the audit."""
        options = config.own(HttpOptions)
        return identify(options.client(), options.api)[1].build_of()

    def at_address(self, config: EngineConfig, url: str) -> EngineConfig:
        return replace(config, options=replace(config.own(HttpOptions), url=url))
