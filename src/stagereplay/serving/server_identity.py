"""What a running server says it is (`--engine http`): its software, build and model, and the settings it reports
that change how it builds the K/V cache. They go into the run's server identity (the manifest's and every record's
`environment.engine.server`), so that `compare` names a difference between two deployments, and the part that fixes
the numbers (`build_of`) is what the audit compares with the server it finds.

llama-server (the build llama-cpp-python 0.3.36 vendors) reports:

    /props        build_info, model_alias, model_path, model_ftype, total_slots, the per-slot context
                  (default_generation_settings.n_ctx). Its `params["speculative.types"]` are a request's defaults
                  built without the server's speculative settings (always "none"), so they are not read
    /slots        per slot `speculative`: whether it speculates (--spec-type, or a draft model -md); once the slot ran
                  a request, that request's params, whose `speculative.types` are the server's (read after the check's
                  probes). Off with --no-slots
    /v1/models    data[0].meta: n_params, size, ftype, n_ctx_train, n_ctx, n_vocab, n_embd

and nothing of the K/V cache types (-ctk/-ctv), flash attention (-fa), the batch and micro-batch sizes (-b/-ub),
weight repacking (--no-repack), the draft model (-md) or the speculation's sizes: those the user declares, as the
flags the server was started with (`--server-args`, recorded verbatim in the engine's options).

vllm serve (0.32) reports /v1/models (id, root, max_model_len), /version, and in /metrics (on by default) its cache
configuration (`vllm:cache_config_info`'s labels: cache dtype, block size, prefix caching ...) and, when it
speculates, the counters of drafted and accepted tokens (`vllm:spec_decode_num_draft_tokens`, `..._accepted_tokens`),
which a request sent alone reads before and after itself (`SpecCounters`): its replies say nothing of speculation.
Not its speculative method, `--max-num-batched-tokens` or chunked prefill: `--server-args` declares them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.serving.client import Client
from stagereplay.serving.seam import Draft

LLAMA_SERVER = ("llama-server", "llamacpp")
"""The server's name in its identity: llama-server's /props, or its /v1/models' `owned_by` (under --api openai)."""
QUIET = (404, 405, 501)
"""Statuses of an endpoint the server does not have (or has switched off)."""
BUILD_KEYS = ("server", "build", "model", "model_path", "root")
"""The identity's fields that name the server's software and the model it serves."""
CACHE_CONFIG = "vllm:cache_config_info"
"""vLLM's gauge whose labels are its cache configuration."""
CACHE_LABELS = ("cache_dtype", "block_size", "effective_attention_block_size", "enable_prefix_caching",
                "kv_cache_dtype_skip_layers", "kv_cache_layout", "sliding_window", "prefix_caching_hash_algo")
"""The labels of `CACHE_CONFIG` that say how the cache is built (not how much memory it was given)."""
SPEC_DRAFTED, SPEC_ACCEPTED = "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"
"""vLLM's counters of speculated tokens (present only when the server speculates)."""
_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def identify(client: Client, api: str) -> tuple[str, dict[str, Any]]:
    """Which dialect the server speaks (`api` unless auto) and what it says it is: build, model, slots, and the
    settings it reports that change how it builds the cache."""
    props = client.call("/props", quiet_status=QUIET) if api in ("auto", "llama-server") else None
    if props is not None and "default_generation_settings" in props:
        return ("llama-server" if api == "auto" else api), llama_server(client, props)
    if api == "llama-server":
        raise StageReplayError(f"the server at {client.url} has no llama-server /props", "pass --api openai")
    models = client.call("/v1/models") or {}
    data = models.get("data") or []
    if not data:
        raise StageReplayError(f"the server at {client.url} lists no model at /v1/models",
                               "start it with a model, or check --url")
    first = data[0]
    version = client.call("/version", quiet_status=(404, 405)) or {}
    identity = {"server": first.get("owned_by"), "build": version.get("version"), "model": first.get("id"),
                "root": first.get("root"), "max_model_len": first.get("max_model_len")}
    if identity["server"] in LLAMA_SERVER:  # llama-server under --api openai: what its own endpoints say
        return "openai", {**identity, **({"model_meta": first["meta"]} if isinstance(first.get("meta"), dict) else {}),
                          **slots_identity(client)}
    return "openai", {**identity, **metrics_identity(client.text("/metrics") or "")}


def llama_server(client: Client, props: dict[str, Any]) -> dict[str, Any]:
    """A llama-server's identity from its /props, /v1/models and /slots."""
    settings = props.get("default_generation_settings") or {}
    identity: dict[str, Any] = {
        "server": "llama-server", "build": props.get("build_info"), "model": props.get("model_alias"),
        "model_path": props.get("model_path"), "total_slots": props.get("total_slots"), "n_ctx": settings.get("n_ctx"),
        "model_ftype": props.get("model_ftype")}
    models = client.call("/v1/models", quiet_status=QUIET) or {}
    meta = ((models.get("data") or [{}])[0] or {}).get("meta")
    if isinstance(meta, dict):
        identity["model_meta"] = meta
    return {**identity, **slots_identity(client)}


def slots_identity(client: Client) -> dict[str, Any]:
    """What llama-server's /slots say of speculation: whether its slots speculate, and the speculative types of the
    last request a slot ran (none before the first request). Empty where /slots is off."""
    slots = client.call("/slots", quiet_status=QUIET)
    if not isinstance(slots, list) or not slots:
        return {}
    out: dict[str, Any] = {"speculative": any(bool(s.get("speculative")) for s in slots)}
    types = [(s.get("params") or {}).get("speculative.types") for s in slots]
    ran = [t for t in types if t is not None]
    if ran:
        out["speculative_types"] = ran[0]
    return out


def metrics_identity(text: str) -> dict[str, Any]:
    """What vLLM's /metrics say of its cache: its cache configuration's labels, and whether it speculates (its
    speculation counters exist). Empty for a server without those metrics."""
    out: dict[str, Any] = {}
    for name, labels, _ in samples(text):
        if name == CACHE_CONFIG:
            out["cache_config"] = {k: labels[k] for k in CACHE_LABELS if k in labels}
        elif name.startswith(SPEC_DRAFTED):
            out["speculative"] = True
    return out


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition: (name, labels, value) per sample line."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out.append((name, dict(_LABEL.findall(labels or "")), number))
    return out


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculation counters at one moment: tokens drafted and accepted since the server started, summed
    over its engines."""

    drafted: float
    accepted: float

    @classmethod
    def read(cls, client: Client) -> SpecCounters:
        drafted = accepted = 0.0
        for name, _, value in samples(client.text("/metrics") or ""):
            if name in (SPEC_DRAFTED + "_total", SPEC_DRAFTED):
                drafted += value
            elif name in (SPEC_ACCEPTED + "_total", SPEC_ACCEPTED):
                accepted += value
        return cls(drafted, accepted)

    def since(self, before: SpecCounters) -> Draft:
        """What a request sent alone between `before` and this reading drafted and accepted."""
        return Draft(int(self.drafted - before.drafted), int(self.accepted - before.accepted))


def llama_server_draft(timings: dict[str, Any], speculative: bool) -> Draft | None:
    """A llama-server request's speculation from its reply's `timings`: `draft_n` and `draft_n_accepted`, which the
    server writes only where the request drafted a token (so 0 and 0 on a speculating server that did not; None on
    one that does not speculate)."""
    if "draft_n" in timings:
        return Draft(int(timings["draft_n"]), int(timings.get("draft_n_accepted") or 0))
    return Draft(0, 0) if speculative else None


def build_of(identity: dict[str, Any]) -> dict[str, Any]:
    """What fixes a server's numbers, as far as it says: its software and build, the model it serves, and whether
    it speculates (named only where it does, so a record made before this was read compares equal with a server that
    does not). The audit compares it as it compares our kernels: another build, model or speculation is "not
    reproduced here". A server's cache types and batch sizes are not said, so not compared: `--server-args`
    declares them."""
    build = {k: identity.get(k) for k in BUILD_KEYS if identity.get(k) is not None}
    return {**build, **({"speculative": True} if identity.get("speculative") else {})}
