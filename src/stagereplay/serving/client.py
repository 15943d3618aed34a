"""JSON over HTTP to one server (`--engine http`): bounded timeouts and retries, the API key read from the environment
at each request and never kept, and errors that name the server's address without its credentials, in one line
(a reply's body is quoted by its gist: a JSON error's message, or its first line of text without HTML tags).

The address is the server's root: a base URL as an OpenAI client takes it (`http://HOST:PORT/v1`) names the same
server, so its `/v1` is dropped (`base_url`); every path asked here is the server's own (/props, /v1/models, ...).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from http import client
from typing import Any
from urllib import parse

from stagereplay.errors import StageReplayError

CONNECT_TIMEOUT = 30.0
"""Seconds to wait for a connection (at most the request's `timeout`): a server that is up accepts at once, so an
address where nothing answers is given up on in seconds, not after a long request's timeout."""
GIST = 120
"""The most characters of a reply's body an error quotes."""
NOT_FOUND = (404, 405, 501)
"""Statuses of a path the server does not have."""
URL_FIX = ("pass --url the address llama-server or vllm serve listens on, http://HOST:PORT (an OpenAI base URL, "
           "http://HOST:PORT/v1, is taken too)")
_TAG = re.compile(r"<[^>]*>")


def public_url(url: str) -> str:
    """`url` without credentials (a `user:password@` part is never recorded)."""
    parts = parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def base_url(url: str) -> str:
    """The server's root that paths are asked from: `url` without credentials, and without the `/v1` that ends an
    OpenAI client's base URL (a path in front of it, a proxy's, is kept)."""
    return public_url(url).removesuffix("/v1")


def gist(text: str) -> str:
    """A reply's body in one short line: a JSON error's message (`{"error": {"message": ...}}`, `{"message": ...}`,
    `{"error": "..."}`, `{"detail": "..."}`), else its first line of text with HTML tags stripped; cut at `GIST`
    characters."""
    try:
        said = json.loads(text)
    except ValueError:
        said = None
    line = ""
    if isinstance(said, dict):
        error = said.get("error", said)
        for message in (error.get("message") if isinstance(error, dict) else error, said.get("detail")):
            if isinstance(message, str) and message.strip():
                line = message
                break
    if not line:
        line = next((s.strip() for s in _TAG.sub(" ", text).splitlines() if s.strip()), "")
    line = " ".join(line.split())
    return line if len(line) <= GIST else line[: GIST - 3] + "..."


class Client:
    """JSON over HTTP to one server, with bounded timeouts and retries; errors name the URL, never the key."""

    def __init__(self, url: str, key_env: str, timeout: float, retries: int):
        if not url:
            raise StageReplayError("--engine http needs the server's address", "pass --url http://HOST:PORT")
        if parse.urlsplit(url).scheme not in ("http", "https"):
            raise StageReplayError(f"--url {public_url(url)!r} is not an http(s) address",
                                   "pass --url http://HOST:PORT")
        self.url, self.key_env, self.timeout, self.retries = base_url(url), key_env, timeout, retries

    def call(self, path: str, body: Mapping[str, object] | None = None, quiet_status: tuple[int, ...] = ()) -> Any:
        """GET (no body) or POST `body` (a request's JSON) to `path`; the JSON reply. None for a status in `quiet_status` (an
        endpoint the server does not have)."""
        text = self.text(path, body, quiet_status)
        return None if text is None else self.parse(path, text)

    def parse(self, path: str, text: str) -> Any:
        """The JSON of the server's answer to `path`; refused in one line where it is not JSON (a page in front of
        the server, or another server)."""
        try:
            return json.loads(text or "{}")
        except json.JSONDecodeError as e:
            raise StageReplayError(f"the server at {self.url} answered {path} with no JSON ({gist(text)})",
                                   URL_FIX) from e

    def refused(self, path: str, status: int, reply: str) -> StageReplayError:
        """The one line for a request the server answered with a 4xx (`reply`: the body's gist): its API key, a
        path it does not have (not a server spoken to here), or a request it cannot serve (and which servers can)."""
        said = f"HTTP {status}" + (f": {reply}" if reply else "")
        if status in (401, 403):
            return StageReplayError(f"the server at {self.url} refused {path} ({said}): its API key is missing or "
                                    "wrong", f"set ${self.key_env} to the server's key (--api-key-env names another "
                                    "variable)")
        if status in NOT_FOUND:
            return StageReplayError(f"the server at {self.url} has no {path} ({said}): it is not llama-server or an "
                                    "OpenAI-style server", URL_FIX)
        return StageReplayError(
            f"the server at {self.url} refused our request to {path} ({said}): it cannot be audited, since an audit "
            "sends token-ID prompts and reads the top-k logprobs of every step",
            "audit a server that takes both: llama-server (/completion), or vllm serve (/v1/completions) started with "
            "--max-logprobs 5 or more; transformers serve and llama-cpp-python's server take no token-ID prompts "
            "(docs/how-to/server.md)")

    def text(self, path: str, body: Mapping[str, object] | None = None,
             quiet_status: tuple[int, ...] = NOT_FOUND) -> str | None:
        """The reply's text; None for a status in `quiet_status`; another 4xx refused in one line (`refused`)."""
        status, text = self.reply(path, body)
        if status < 400:
            return text
        if status in quiet_status:
            return None
        raise self.refused(path, status, gist(text))

    def reply(self, path: str, body: Mapping[str, object] | None = None) -> tuple[int, str]:
        """The status and text of the server's answer (the API key masked in it). Connection errors and a 5xx other
        than 501 (a path it does not implement) are retried `retries` times, then refused in one line."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.key_env, "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        parts = parse.urlsplit(self.url)
        connection = client.HTTPSConnection if parts.scheme == "https" else client.HTTPConnection
        last = ""
        for attempt in range(self.retries + 1):
            conn = connection(parts.hostname or "", parts.port, timeout=min(CONNECT_TIMEOUT, self.timeout))
            try:
                conn.connect()
                if conn.sock is not None:
                    conn.sock.settimeout(self.timeout)
                conn.request("GET" if data is None else "POST", parts.path + path, body=data, headers=headers)
                answer = conn.getresponse()
                text = answer.read().decode(errors="replace")
                text = text.replace(key, "***") if key else text
                if answer.status < 500 or answer.status in NOT_FOUND:  # asking again changes nothing
                    return answer.status, text
                last = f"HTTP {answer.status}" + (f": {gist(text)}" if gist(text) else "")
            except (OSError, client.HTTPException) as e:
                last = str(e) or type(e).__name__
            finally:
                conn.close()
            if attempt < self.retries:
                time.sleep(min(0.5 * 2**attempt, 5.0))
        raise StageReplayError(f"the server at {self.url} did not answer {path}: {last}",
                               "start the server (or fix --url); --timeout and --retries bound the wait")
