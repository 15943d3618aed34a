"""JSON over HTTP to one server (`--engine http`): bounded timeouts and retries, the API key read from the environment
at each request and never kept, and errors that name the server's address without its credentials."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from http import client
from typing import Any
from urllib import parse

from stagereplay.errors import StageReplayError


def public_url(url: str) -> str:
    """`url` without credentials (a `user:password@` part is never recorded)."""
    parts = parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


class Client:
    """JSON over HTTP to one server, with bounded timeouts and retries; errors name the URL, never the key."""

    def __init__(self, url: str, key_env: str, timeout: float, retries: int):
        if not url:
            raise StageReplayError("--engine http needs the server's address", "pass --url http://HOST:PORT")
        if parse.urlsplit(url).scheme not in ("http", "https"):
            raise StageReplayError(f"--url {public_url(url)!r} is not an http(s) address",
                                   "pass --url http://HOST:PORT")
        self.url, self.key_env, self.timeout, self.retries = public_url(url), key_env, timeout, retries

    def call(self, path: str, body: Mapping[str, object] | None = None, quiet_status: tuple[int, ...] = ()) -> Any:
        """GET (no body) or POST `body` (a request's JSON) to `path`; the JSON reply. None for a status in `quiet_status` (an
        endpoint the server does not have)."""
        text = self.text(path, body, quiet_status)
        if text is None:
            return None
        try:
            return json.loads(text or "{}")
        except json.JSONDecodeError as e:
            raise StageReplayError(f"the server at {self.url} answered {path} with no JSON: {text[:120]!r}",
                                   "check --url: it must name the server itself, not a page in front of it") from e

    def refused(self, path: str, status: int, reply: str) -> StageReplayError:
        """The one line for a request the server answered with a 4xx: what it refused, and whether that is the key
        or a request it cannot serve (and then which servers can)."""
        if status in (401, 403):
            return StageReplayError(f"the server at {self.url} refused {path} ({reply}): its API key is missing or "
                                    "wrong", f"set ${self.key_env} to the server's key (--api-key-env names another "
                                    "variable)")
        return StageReplayError(
            f"the server at {self.url} refused our request to {path} ({reply}): it cannot be audited, since an audit "
            "sends token-ID prompts and reads the top-k logprobs of every step",
            "audit a server that takes both: llama-server (/completion) or vllm serve (/v1/completions); "
            "transformers serve and llama-cpp-python's server take no token-ID prompts (docs/how-to/server.md)")

    def text(self, path: str, body: Mapping[str, object] | None = None, quiet_status: tuple[int, ...] = (404, 405, 501)
             ) -> str | None:
        """The reply's text; None for a status in `quiet_status`. Connection errors and 5xx are retried `retries`
        times."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.key_env, "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        parts = parse.urlsplit(self.url)
        connection = client.HTTPSConnection if parts.scheme == "https" else client.HTTPConnection
        last = ""
        for attempt in range(self.retries + 1):
            conn = connection(parts.hostname or "", parts.port, timeout=self.timeout)
            try:
                conn.request("GET" if data is None else "POST", parts.path + path, body=data, headers=headers)
                reply = conn.getresponse()
                text = reply.read().decode(errors="replace")
                if reply.status < 400:
                    return text
                if reply.status in quiet_status:
                    return None
                last = f"HTTP {reply.status} {(text.replace(key, '***') if key else text)[:200].strip()}"
                if reply.status < 500:  # the server answered, and refused: asking again changes nothing
                    raise self.refused(path, reply.status, last)
            except (OSError, client.HTTPException) as e:
                last = str(e) or type(e).__name__
            finally:
                conn.close()
            if attempt < self.retries:
                time.sleep(min(0.5 * 2**attempt, 5.0))
        raise StageReplayError(f"the server at {self.url} did not answer {path}: {last}",
                               "start the server (or fix --url); --timeout and --retries bound the wait")
