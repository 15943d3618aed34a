"""A fake of the servers `--engine http` audits, in the standard library only: llama-server's API (/props,
/tokenize, /completion, /slots) or vLLM's OpenAI-style one (/v1/models, /version, /metrics, /tokenize,
/v1/completions with token IDs and `echo`), over a tokenizer, misbehaving on purpose where asked. It is for the
refusals and faults only: no test that claims to test a server runs on it (tests/servers.py starts the real ones).

`fake_server(...)` serves one on 127.0.0.1 at a free port in a thread for the `with` block, and stops by itself
after `lifetime` seconds (a test that hangs does not leave it running); `plain_server()` is Python's own
`http.server`, a server that speaks neither API.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = ("short-logprobs", "empty-top", "null-logprob", "positive-logprob", "nan-logprob", "token-out-of-range",
          "token-as-float", "stop-word")
"""What `Fake.fault` breaks in a completion's reply (`Fake.faulty`)."""
LIFETIME = 300.0
"""Seconds a fake serves at most."""


class Fake:
    """A fake llama-server (`api` "llama-server": /props, /tokenize, /completion, /slots) or `vllm serve` (`api`
    "openai": /v1/models, /version, /metrics, /tokenize, /v1/completions) over `tokenizer`, greedy and verbatim
    unless `mode` says:

    as-text      the prompt's JSON list of IDs taken as text and tokenized (counts those tokens)
    no-logprobs  no completion_probabilities
    sampling     each request's tokens drawn at random
    tokenizer    /tokenize answers one ID off
    error        HTTP 500 on /completion
    refuse-ids   HTTP 422 on /completion (as `transformers serve` answers a token-ID prompt)
    stall        /completion answers after `stall` seconds
    no-reuse     reports no cached position on any request (a server that cannot reuse a sliding-window model's
                 cache: its slot restores are fresh prefills)

Otherwise each slot holds the tokens of its last request, as llama-server's do: a request with `cache_prompt`
reports as cached the common prefix of its prompt and its slot's tokens, less the last prompt token; `/slots/N`
saves, restores and erases them. `marker` = (step, id) puts token `id` at that step of a generation from a prompt
that lacks it (stage 1's end), and never elsewhere; tokens in `avoid` (an EOS) are never generated. `draft` =
(drafted, accepted) makes it a speculating server, as llama-server with --spec-type is: its /slots say `speculative`
and, once a slot ran a request, `speculative.types`; each reply's `timings` carry `draft_n` and `draft_n_accepted`,
`draft` per 8 generated tokens, rounded down (absent where no token was drafted, as llama-server leaves them out);
in a reply that drafted, every step after the first has no candidates and a log-probability of 0, as llama-server
emits the tokens a verification accepts.
`ftype` is the model's type its /props say (`model_ftype`, as llama-server's do).

`fault` (one of `FAULTS`) breaks every completion's reply after the first `fault_after` (the check before a run's
first item sends 4): `Fake.faulty` says how. Each step's emitted token has log-probability -0.1 and one other
candidate -2.5, in either dialect; an echoed prompt token (vLLM's `echo`) has -0.2 and one other -1.5, the first none.
"""

    def __init__(self, tokenizer: Any, mode: str = "", stall: float = 5.0, slots: int = 1, n_ctx: int = 4096,
                 marker: tuple[int, int] | None = None, avoid: tuple[int, ...] = (),
                 draft: tuple[int, int] | None = None, ftype: str | None = None, api: str = "llama-server",
                 fault: str = "", fault_after: int = 0):
        assert api in ("llama-server", "openai") and fault in ("", *FAULTS), (api, fault)
        self.tokenizer, self.mode, self.stall, self.ftype, self.api = tokenizer, mode, stall, ftype, api
        self.vocab = len(tokenizer)
        self.fault, self.fault_after = fault, fault_after
        self.requests = 0  # completions answered: the task counter /slots shows
        self.fail_after: int | None = None  # completions past this many answer HTTP 500 (a server gone bad mid-run)
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.paths: list[str] = []  # each request's path
        self.rng = random.Random(0)
        self.slots, self.n_ctx, self.marker, self.avoid, self.draft = slots, n_ctx, marker, set(avoid), draft
        self.held: dict[int | str, list[int]] = {}  # slot (or vLLM cache salt) -> the tokens its cache holds
        self.saved: list[int] = []
        self.asked: list[tuple[int, int]] = []  # per completion: (prompt length, tokens asked for)
        self.lock = threading.Lock()

    # -- what a completion generates ---------------------------------------------------------------------------

    def generate(self, ids: list[int], n: int) -> list[int]:
        tokens, last = [], ids[-1]
        marks = self.marker is not None and self.marker[1] not in ids
        for i in range(n):
            last = self.rng.randrange(self.vocab) if self.mode == "sampling" else (last * 7 + 3) % self.vocab
            while last in self.avoid or (self.marker is not None and last == self.marker[1]):
                last = (last + 1) % self.vocab
            if marks and self.marker is not None and i == self.marker[0]:
                last = self.marker[1]
            tokens.append(last)
        return tokens

    def cached(self, key: int | str, ids: list[int], reuse: bool) -> int:
        """The prompt positions a request reusing the cache under `key` takes from it; the request's tokens held."""
        with self.lock:
            held = self.held.get(key, [])
        cached = 0
        if reuse and self.mode != "no-reuse":
            while cached < min(len(held), len(ids) - 1) and held[cached] == ids[cached]:
                cached += 1
        return cached

    def faulty(self) -> str:
        """The fault this completion's reply carries ('' : none)."""
        return self.fault if self.fault and self.requests > self.fault_after else ""

    # -- llama-server ----------------------------------------------------------------------------------------

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(t) for t in body["prompt"]]
        counted = len(ids)
        if self.mode == "as-text":
            counted = len(self.tokenizer.encode(json.dumps(ids), add_special_tokens=False))
        slot = max(0, int(body.get("id_slot", -1)))
        with self.lock:
            self.asked.append((len(ids), int(body["n_predict"])))
        cached = self.cached(slot, ids, bool(body.get("cache_prompt")))
        tokens = self.generate(ids, int(body["n_predict"]))
        processed = bool(body.get("post_sampling_probs"))
        steps: list[dict[str, Any]] = []
        for last in tokens:
            other = (last + 1) % self.vocab
            if processed:
                steps.append({"id": last, "prob": 0.9, "top_probs": [{"id": last, "prob": 0.9},
                                                                     {"id": other, "prob": 0.08}]})
            else:
                steps.append({"id": last, "logprob": -0.1, "top_logprobs": [{"id": last, "logprob": -0.1},
                                                                            {"id": other, "logprob": -2.5}]})
        with self.lock:
            self.held[slot] = ids + tokens[:-1]  # the last token emitted is never fed back
        timings: dict[str, int] = {"cache_n": cached}
        if self.draft is not None and self.draft[0] * len(tokens) // 8 > 0:
            timings |= {"draft_n": self.draft[0] * len(tokens) // 8, "draft_n_accepted": self.draft[1] * len(tokens) // 8}
            for i in range(1, len(steps)):  # the tokens a verification emits: no candidates, a placeholder 0
                steps[i] = ({"id": tokens[i], "prob": 1.0, "top_probs": []} if processed
                            else {"id": tokens[i], "logprob": 0.0, "top_logprobs": []})
        reply: dict[str, Any] = {"tokens": tokens, "tokens_evaluated": counted, "stop_type": "limit",
                                 "timings": timings, "completion_probabilities": steps}
        if self.mode == "no-logprobs":
            reply.pop("completion_probabilities")
        fault = self.faulty()
        chosen, top = ("prob", "top_probs") if processed else ("logprob", "top_logprobs")
        if fault == "short-logprobs":
            steps.pop()
        elif fault == "stop-word":
            steps.pop()
            reply["stop_type"] = "word"
        elif fault == "empty-top" and len(steps) > 1:
            steps[1][top] = []
        elif fault in ("null-logprob", "positive-logprob", "nan-logprob") and len(steps) > 1:
            steps[1][chosen] = {"null-logprob": None, "positive-logprob": 0.7, "nan-logprob": float("nan")}[fault]
            if processed and fault == "positive-logprob":
                steps[1][chosen] = 1.7  # a probability above 1
        elif fault == "token-out-of-range":
            tokens[0] = steps[0]["id"] = self.vocab
        elif fault == "token-as-float":
            tokens[0] = float(tokens[0])
        return reply

    def slot_action(self, path: str) -> dict[str, Any]:
        slot, action = int(path.split("?")[0].rsplit("/", 1)[1]), path.split("action=")[1]
        with self.lock:
            if action == "save":
                self.saved = list(self.held.get(slot, []))
                return {"id_slot": slot, "n_saved": len(self.saved)}
            if action == "restore":
                self.held[slot] = list(self.saved)
                return {"id_slot": slot, "n_restored": len(self.saved)}
            self.held.pop(slot, None)
            return {"id_slot": slot, "n_erased": 0}

    def props(self) -> dict[str, Any]:
        return {"default_generation_settings": {"n_ctx": self.n_ctx}, "build_info": "fake-1", "model_alias": "toy",
                "model_path": "toy.gguf", "total_slots": self.slots,
                **({"model_ftype": self.ftype} if self.ftype else {})}

    def slots_state(self) -> list[dict[str, Any]]:
        slot: dict[str, Any] = {"id": 0, "is_processing": False, "id_task": self.requests,
                                "speculative": self.draft is not None}
        if self.requests:
            slot["params"] = {"speculative.types": "none,ngram-simple" if self.draft is not None else "none"}
        return [slot]

    # -- vllm serve ------------------------------------------------------------------------------------------

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """/v1/completions as `vllm serve` answers token IDs with `return_tokens_as_token_ids`: the generated
        tokens' steps, after the prompt's where `echo` (its first token with no log-probability)."""
        ids = [int(t) for t in body["prompt"]]
        n = int(body["max_tokens"])
        with self.lock:
            self.asked.append((len(ids), n))
        salt = str(body.get("cache_salt", ""))
        cached = self.cached(salt, ids, bool(salt) and salt in self.held)
        tokens = self.generate(ids, n)
        with self.lock:
            self.held[salt] = ids + tokens[:-1]
        names, chosen, top = [], [], []
        if body.get("echo"):
            for i, t in enumerate(ids):
                names.append(f"token_id:{t}")
                chosen.append(None if i == 0 else -0.2)
                top.append(None if i == 0 else {f"token_id:{t}": -0.2, f"token_id:{(t + 1) % self.vocab}": -1.5})
        for t in tokens:
            names.append(f"token_id:{t}")
            chosen.append(-0.1)
            top.append({f"token_id:{t}": -0.1, f"token_id:{(t + 1) % self.vocab}": -2.5})
        fault, last = self.faulty(), len(names) - 1
        if fault == "short-logprobs":
            chosen.pop()
        elif fault == "empty-top":
            top[last] = {}
        elif fault in ("null-logprob", "positive-logprob", "nan-logprob"):
            chosen[last] = {"null-logprob": None, "positive-logprob": 0.7, "nan-logprob": float("nan")}[fault]
        elif fault == "token-out-of-range":
            names[last] = f"token_id:{self.vocab}"
        elif fault == "token-as-float":
            names[last] = f"token_id:{tokens[-1]}.0"
        logprobs = {"tokens": names, "token_logprobs": chosen, "top_logprobs": top, "text_offset": [0] * len(names)}
        counted = len(self.tokenizer.encode(json.dumps(ids), add_special_tokens=False)) if self.mode == "as-text" \
            else len(ids)
        return {"object": "text_completion", "model": "toy",
                "choices": [{"index": 0, "text": "", "logprobs": None if self.mode == "no-logprobs" else logprobs,
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": counted, "completion_tokens": len(tokens),
                          "prompt_tokens_details": {"cached_tokens": cached}}}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "toy", "object": "model", "owned_by": "vllm", "root": "toy",
                                            "max_model_len": self.n_ctx}]}

    # -- HTTP ------------------------------------------------------------------------------------------------

    def handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, body: Any, content_type: str = "application/json") -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.authorization.append(self.headers.get("Authorization"))
                fake.paths.append(self.path)
                llama = fake.api == "llama-server"
                if llama and self.path == "/props":
                    self.reply(200, fake.props())
                elif llama and self.path == "/slots":
                    self.reply(200, fake.slots_state())
                elif llama and self.path == "/metrics":  # as llama-server started without --metrics answers
                    self.reply(501, {"error": {"code": 501, "message": "This server does not support metrics "
                                               "endpoint. Start it with `--metrics`", "type": "not_supported_error"}})
                elif not llama and self.path == "/v1/models":
                    self.reply(200, fake.models())
                elif not llama and self.path == "/version":
                    self.reply(200, {"version": "fake-vllm-1"})
                elif not llama and self.path == "/metrics":
                    self.reply(200, "process_start_time_seconds 1700000000.0\n", "text/plain")
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                fake.authorization.append(self.headers.get("Authorization"))
                fake.paths.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                completion = "/completion" if fake.api == "llama-server" else "/v1/completions"
                if self.path == "/tokenize":
                    text = body.get("content", body.get("prompt"))
                    ids = fake.tokenizer.encode(text, add_special_tokens=False)
                    self.reply(200, {"tokens": [t + (fake.mode == "tokenizer") for t in ids]})
                elif fake.api == "llama-server" and self.path.startswith("/slots/"):
                    self.reply(200, fake.slot_action(self.path))
                elif self.path == completion:
                    fake.requests += 1
                    if fake.mode == "error" or (fake.fail_after is not None and fake.requests > fake.fail_after):
                        self.reply(500, {"error": "the model crashed"})
                        return
                    if fake.mode == "refuse-ids":
                        self.reply(422, {"detail": [{"loc": ["body", "prompt"], "msg": "Input should be a valid "
                                                     "string", "type": "string_type"}]})
                        return
                    if fake.mode == "stall":
                        time.sleep(fake.stall)
                    self.reply(200, fake.completion(body) if fake.api == "llama-server" else fake.completions(body))
                else:
                    self.reply(404, {"error": "not found"})

        return Handler


class _QuietServer(ThreadingHTTPServer):
    """Says nothing of a client that went away before its reply (a cancelled request, `serving.http.Cancel`)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@contextmanager
def _serving(httpd: ThreadingHTTPServer, lifetime: float) -> Iterator[str]:
    """`httpd` served in a thread for the block, and at most `lifetime` seconds; its address."""
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    timer = threading.Timer(lifetime, httpd.shutdown)
    timer.daemon = True
    timer.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        timer.cancel()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@contextmanager
def fake_server(tokenizer: Any, mode: str = "", stall: float = 5.0, port: int = 0, lifetime: float = LIFETIME,
                **kwargs: Any) -> Iterator[tuple[str, Fake]]:
    """A `Fake` served on 127.0.0.1 (`port` 0: a free one) for the block; its URL and itself."""
    fake = Fake(tokenizer, mode, stall, **kwargs)
    with _serving(_QuietServer(("127.0.0.1", port), fake.handler()), lifetime) as url:
        yield url, fake


@contextmanager
def plain_server(lifetime: float = LIFETIME) -> Iterator[str]:
    """Python's `http.server` (as `python3 -m http.server` runs it) over an empty folder: its 404 page for every
    path an audit asks."""
    with tempfile.TemporaryDirectory() as folder:

        class Quiet(SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=folder, **kwargs)

            def log_message(self, *args: Any) -> None:
                pass

        with _serving(_QuietServer(("127.0.0.1", 0), Quiet), lifetime) as url:
            yield url
