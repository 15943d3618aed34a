"""What a running server says it is (`--engine http`): its software, build and model, and the settings it reports
that change how it builds the K/V cache, as one model (`ServerIdentity`). It goes into the run's server identity (the
manifest's and every record's `environment.engine.server`), so that `compare` names a difference between two
deployments, and the part that fixes the numbers (`ServerIdentity.build_of`) is what the audit compares with the
server it finds.

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
from typing import Any, TypedDict, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from stagereplay.errors import StageReplayError
from stagereplay.records.payloads import first_error
from stagereplay.serving.client import URL_FIX, Client, gist
from stagereplay.serving.replies import Reply, Where
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


class ServerIdentity(BaseModel):
    """What a server says it is, each field as the server reported it: set (null where the endpoint that has it
    did not say) where the server's dialect has it, absent where it does not (`as_json` writes the fields set, in
    this order: the manifest's `environment.engine.server`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, protected_namespaces=())

    server: str | None = Field(None, description="its software: llama-server, or /v1/models' `owned_by` (vllm, ...)")
    build: str | None = Field(None, description="its build (llama-server's build_info; vLLM's /version)")
    model: str | None = Field(None, description="the model it serves, by the name requests give it")
    model_path: str | None = Field(None, description="llama-server: the model file it loaded (a location)")
    root: str | None = Field(None, description="/v1/models: the model's root (a path or a hub id)")
    max_model_len: int | None = Field(None, description="/v1/models: the longest sequence it serves")
    total_slots: int | None = Field(None, description="llama-server: its slots (requests served at once)")
    n_ctx: int | None = Field(None, description="llama-server: each slot's context")
    model_ftype: str | None = Field(None, description="llama-server: the model's weight type")
    model_meta: dict[str, object] | None = Field(None, description="llama-server's /v1/models `meta` as it says it "
                                                               "(n_params, size, n_ctx_train, ...: its JSON)")
    speculative: bool | None = Field(None, description="whether it speculates (llama-server's /slots; vLLM's "
                                                       "speculation counters exist)")
    speculative_types: str | None = Field(None, description="llama-server: the speculative types of the last "
                                                            "request a slot ran")
    cache_config: dict[str, str] | None = Field(None, description="vLLM: its cache configuration's labels that "
                                                                  "say how the cache is built (`CACHE_LABELS`)")

    @classmethod
    def said(cls, url: str, **fields: Any) -> ServerIdentity:
        """The fields a server reported, as its identity; a value of another type than its field's is refused in
        one line (nothing a server says is converted)."""
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise StageReplayError(f"the server at {url} says what this stagereplay does not read "
                                   f"({first_error(exc)})", "serve with llama-server or vllm serve") from None

    def with_(self, more: ServerIdentity) -> ServerIdentity:
        """This identity with the fields `more` sets (`check` reads the slots again once a request ran)."""
        return self.model_copy(update=more.model_dump(exclude_unset=True))

    def as_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)

    @property
    def llama_server(self) -> bool:
        """Whether it is llama-server (under either dialect)."""
        return self.server in LLAMA_SERVER

    def build_of(self) -> dict[str, Any]:
        """What fixes a server's numbers, as far as it says: its software and build, the model it serves, and
        whether it speculates (named only where it does, so a record made before this was read compares equal with
        a server that does not). The audit compares it as it compares our kernels: another build, model or
        speculation is "not reproduced here". A server's cache types and batch sizes are not said, so not compared:
        `--server-args` declares them."""
        said = self.as_json()
        build = {k: said[k] for k in BUILD_KEYS if said.get(k) is not None}
        return {**build, **({"speculative": True} if self.speculative else {})}


def identify(client: Client, api: str) -> tuple[str, ServerIdentity]:
    """Which dialect the server speaks (`api` unless auto) and what it says it is: build, model, slots, and the
    settings it reports that change how it builds the cache. A server that has neither llama-server's /props nor
    an OpenAI /v1/models is refused in one line with what it answered."""
    props = client.call("/props", quiet_status=QUIET) if api in ("auto", "llama-server") else None
    if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict):
        return ("llama-server" if api == "auto" else api), llama_server(client, cast(LlamaServerProps, props))
    if api == "llama-server":
        raise StageReplayError(f"the server at {client.url} has no llama-server /props", "pass --api openai")
    status, text = client.reply("/v1/models")
    if status >= 400:
        asked = "/props nor /v1/models" if api == "auto" else "/v1/models"
        if status in QUIET:
            raise StageReplayError(f"the server at {client.url} has neither {asked} (HTTP {status}"
                                   + (f": {gist(text)}" if gist(text) else "") + "): it is not llama-server or an "
                                   "OpenAI-style server", URL_FIX)
        raise client.refused("/v1/models", status, gist(text))
    models = Where(client.url, "/v1/models").read(ModelList, client.parse("/v1/models", text))
    if not models.data:
        raise StageReplayError(f"the server at {client.url} lists no model at /v1/models",
                               "start it with a model, or check --url")
    first = models.data[0]
    version = client.call("/version", quiet_status=(404, 405))
    identity = ServerIdentity.said(client.url, server=first.get("owned_by"),
                                   build=version.get("version") if isinstance(version, dict) else None,
                                   model=first.get("id"), root=first.get("root"),
                                   max_model_len=first.get("max_model_len"))
    if identity.llama_server:  # llama-server under --api openai: what its own endpoints say
        meta = first.get("meta")
        if isinstance(meta, dict):
            identity = identity.with_(ServerIdentity.said(client.url, model_meta=meta))
        return "openai", identity.with_(slots_identity(client))
    return "openai", identity.with_(metrics_identity(client.text("/metrics") or "", client.url))


class ModelList(Reply):
    """An OpenAI-style /v1/models reply: the models it serves, each as the server describes it."""

    data: list[dict[str, Any]] = Field(default_factory=list)


class SlotDefaults(TypedDict, total=False):
    """llama-server's /props `default_generation_settings`, the part read here."""

    n_ctx: int  # each slot's context


class LlamaServerProps(TypedDict, total=False):
    """llama-server's /props reply, the fields read here (as the server sends them: `ServerIdentity.said` refuses
    one of another type)."""

    build_info: str
    model_alias: str
    model_path: str
    total_slots: int
    model_ftype: str
    default_generation_settings: SlotDefaults


class MetricsSaid(TypedDict, total=False):
    """What vLLM's /metrics say of its cache, as `ServerIdentity` fields."""

    cache_config: dict[str, str]  # `CACHE_CONFIG`'s labels that say how the cache is built
    speculative: bool  # its speculation counters exist


def llama_server(client: Client, props: LlamaServerProps) -> ServerIdentity:
    """A llama-server's identity from its /props (the server's JSON), /v1/models and /slots."""
    settings = props.get("default_generation_settings") or {}  # a dict: `identify` read it as one
    identity = ServerIdentity.said(
        client.url, server="llama-server", build=props.get("build_info"), model=props.get("model_alias"),
        model_path=props.get("model_path"), total_slots=props.get("total_slots"), n_ctx=settings.get("n_ctx"),
        model_ftype=props.get("model_ftype"))
    models = client.call("/v1/models", quiet_status=QUIET)
    data = models.get("data") if isinstance(models, dict) else None
    meta = data[0].get("meta") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    if isinstance(meta, dict):
        identity = identity.with_(ServerIdentity.said(client.url, model_meta=meta))
    return identity.with_(slots_identity(client))


def slots_identity(client: Client) -> ServerIdentity:
    """What llama-server's /slots say of speculation: whether its slots speculate, and the speculative types of the
    last request a slot ran (none before the first request). Nothing where /slots is off."""
    slots = client.call("/slots", quiet_status=QUIET)
    if not isinstance(slots, list) or not slots or not all(isinstance(s, dict) for s in slots):
        return ServerIdentity()
    speculative = any(bool(s.get("speculative")) for s in slots)
    types = [p.get("speculative.types") if isinstance(p := s.get("params"), dict) else None for s in slots]
    ran = [t for t in types if t is not None]
    if ran:
        return ServerIdentity.said(client.url, speculative=speculative, speculative_types=ran[0])
    return ServerIdentity(speculative=speculative)


def metrics_identity(text: str, url: str = "") -> ServerIdentity:
    """What vLLM's /metrics say of its cache: its cache configuration's labels, and whether it speculates (its
    speculation counters exist). Nothing for a server without those metrics."""
    said: MetricsSaid = {}
    for name, labels, _ in samples(text):
        if name == CACHE_CONFIG:
            said["cache_config"] = {k: labels[k] for k in CACHE_LABELS if k in labels}
        elif name.startswith(SPEC_DRAFTED):
            said["speculative"] = True
    return ServerIdentity.said(url, **said)


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
