"""What a run checks of a running server before its first item, and how it tells one server's life from another's
(`serving.http.HttpEngine.check`, `.instance`, `.note_resume`).

`check_server` refuses, in one line with the fix, a server that counts the prompt tokens differently from the IDs
sent (it does not take IDs verbatim), returns no top-k logprobs, is not greedy at temperature 0 (two replicas of a
probe differ), cannot save a slot when `--slot-restore` asks for it, or tokenizes probe strings differently from the
run's tokenizer; and measures what its prefix cache took of a probe sent again with and without reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypedDict

from stagereplay.errors import StageReplayError
from stagereplay.serving.client import Client
from stagereplay.serving.replies import Tokenized, Where
from stagereplay.serving.seam import TOP_LOGPROBS, Generation, Instance
from stagereplay.serving.server_identity import ServerIdentity, slots_identity

SLOT_FILE = "stagereplay-slot.bin"
"""The file a slot is saved to, in the server's --slot-save-path: one, overwritten by each item (a long trace's K/V
can take hundreds of MB)."""
PROBES = ("Hello world", " 12+7=19.", "The answer is 42\n", "naïve café", "</think>\n\nSo")
"""Strings the server's tokenizer must split as the run's does (a merged `</think>\n`, spaces, non-ASCII)."""


class ServerChecks(TypedDict, total=False):
    """What `check_server` measured of the server before any item (empty until it ran)."""

    verbatim_ids: bool
    greedy: bool
    top_logprobs: int
    tokenizer: str  # "compared" | "no endpoint"
    cached_when_reused: int | None
    cached_when_bypassed: int | None
    instance: Instance


class Resumed(TypedDict):
    """A resumed run's view of the server (`resumed`): the item the run resumed after, whether the server restarted
    since (None: cannot tell), and its instance then and now."""

    after: str
    restarted: bool | None
    before: Instance
    now: Instance


class Checked(Protocol):
    """What `check_server` asks of the engine it checks (`serving.http.HttpEngine`)."""

    client: Client
    api: str
    identity: ServerIdentity
    options: Any  # its HttpOptions: `slot_restore`

    def counted(self, ids: Sequence[int], max_tokens: int, reuse: bool) -> tuple[Generation, int]: ...

    def instance(self) -> Instance: ...


def check_server(engine: Checked, tokenizer: Any) -> ServerChecks:
    """Refuse a server whose numbers the run could not compare with ours (module docstring); what was measured."""
    url = engine.client.url
    instance = engine.instance()  # before the probes, which the server counts as tasks
    canonical = list(tokenizer.encode(" The answer to 12+7 is", add_special_tokens=False))
    split = [int(t) for c in "nineteen" for t in tokenizer.encode(c, add_special_tokens=False)]
    probe = canonical + split  # a server that detokenizes and tokenizes again merges the split characters
    g, counted = engine.counted(probe, 8, reuse=False)
    if counted != len(probe):
        raise StageReplayError(
            f"the server at {url} counted {counted} prompt tokens for the {len(probe)} token IDs sent: it does "
            "not take token IDs verbatim",
            "serve with an API that takes token-ID prompts (llama-server's /completion, vLLM's /v1/completions)")
    if not g.tokens or not any(g.top) or any(0 < len(step) < 2 for step in g.top):  # (): a speculated step
        raise StageReplayError(f"the server at {url} returned no top-{TOP_LOGPROBS} logprobs",
                               "serve with logprobs enabled (vLLM: --max-logprobs 5 or more)")
    again, _ = engine.counted(probe, 8, reuse=False)
    if again.tokens != g.tokens:
        raise StageReplayError(
            f"the server at {url} is not greedy at temperature 0: two requests for one prompt gave "
            f"{list(g.tokens)} and {list(again.tokens)}",
            "serve without a sampler override (no --samplers forcing sampling) and audit again")
    reused, _ = engine.counted(probe, 8, reuse=True)
    bypassed, _ = engine.counted(probe, 8, reuse=False)
    if engine.identity.llama_server:  # its slots now say the speculative types requests run with
        engine.identity = engine.identity.with_(slots_identity(engine.client))
    if engine.options.slot_restore:
        _check_slot_save(engine.client, engine.api)
    differs, endpoint = tokenizer_differs(engine.client, engine.api, engine.identity.model, tokenizer)
    if differs is not None:
        text, theirs, ours = differs
        raise StageReplayError(f"the server at {url} tokenizes {text!r} as {theirs}, the run's tokenizer as {ours}",
                               "pass --model the model folder or GGUF file the server serves")
    return {"verbatim_ids": True, "greedy": True, "top_logprobs": len(g.top[0]),
            "tokenizer": "compared" if endpoint else "no endpoint",
            "cached_when_reused": reused.cached, "cached_when_bypassed": bypassed.cached, "instance": instance}


def _check_slot_save(client: Client, api: str) -> None:
    if api != "llama-server":
        raise StageReplayError("--slot-restore needs llama-server's slot save and restore",
                               "drop --slot-restore, or audit a llama-server")
    try:
        client.call("/slots/0?action=save", {"filename": SLOT_FILE})
    except StageReplayError as e:
        raise StageReplayError(f"the server at {client.url} cannot save a slot ({e.problem})",
                               "start llama-server with --slot-save-path DIR, or drop --slot-restore") from e


def tokenizer_differs(client: Client, api: str, model: str | None, tokenizer: Any
                      ) -> tuple[tuple[str, list[int], list[int]] | None, bool]:
    """The first probe the server tokenizes otherwise than `tokenizer` (the text, theirs, ours; None: none), and
    whether the server has a /tokenize endpoint to ask (llama-server always; vLLM where it serves one)."""
    for text in PROBES:
        ours = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        if api == "llama-server":
            reply = client.call("/tokenize", {"content": text, "add_special": False})
        else:
            # vLLM's body, with llama-server's `content` beside it (each server ignores the other's field)
            reply = client.call("/tokenize", {"model": model, "prompt": text, "content": text,
                                              "add_special_tokens": False}, quiet_status=(404, 405))
            if reply is None:
                return None, False
        theirs = Where(client.url, "/tokenize").read(Tokenized, reply).ids()
        if theirs != ours:
            return (text, theirs, ours), True
    return None, True


def server_instance(client: Client, api: str) -> Instance:
    """What tells this server's life from another's: vLLM's process start time (its /metrics'
    `process_start_time_seconds`); llama-server's task counter (the highest task id its /slots show: it only grows
    while the server runs, and starts again from 0). Empty where the server says neither."""
    if api == "llama-server":
        slots = client.call("/slots", quiet_status=(404, 405, 501))
        if slots is None:
            return {}
        tasks = [s.get("id_task") for s in slots if isinstance(s, dict)] if isinstance(slots, list) else []
        return {"tasks": max((t for t in tasks if isinstance(t, int)), default=-1)}
    for line in (client.text("/metrics") or "").splitlines():
        if line.startswith("process_start_time_seconds "):
            return {"started": float(line.split()[1])}
    return {}


def resumed(before: Instance, now: Instance, requests: int, after: str) -> Resumed:
    """Whether the server restarted (its caches then cold) since a run's last record, `after` (the item), was made
    by a process that saw the server as `before` (its instance) and sent it at least `requests` completions since:
    True where it surely did (another start time; a task counter below where those requests left it), False where
    it surely did not (the same start time), None where it cannot tell (a counter above: a restarted server may since
    have counted past it)."""
    restarted: bool | None = None
    if "started" in now and "started" in before:
        restarted = now["started"] != before["started"]
    elif "tasks" in now and "tasks" in before and now["tasks"] < before["tasks"] + requests:
        restarted = True
    return {"after": after, "restarted": restarted, "before": before, "now": now}
