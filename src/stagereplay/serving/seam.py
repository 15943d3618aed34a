"""The seam to a serving engine (vLLM first): what `matched --engine NAME` needs from an engine other than ours.

Our engine (`engine.lm`) owns its K/V cache, so every experiment runs on it. A serving engine gives only token
IDs in and out, so an engine here provides exactly four things (docs/engines.md says which experiment needs
which):

    generate(ids, max_tokens, reuse=False)   greedy tokens after `ids`, with the prefix cache emptied first
    generate(ids, max_tokens, reuse=True)    the same request, reusing whatever the prefix cache holds
    Generation.top                           the top-k (token id, logprob) of every step, best first
    version() / settings()                   what fixes its numbers, for the manifest and the environment

Another engine is one module (`require()`, `load(...)` and a class of this shape) and one line in `ENGINES`:
llama.cpp is `serving.llamacpp`, whose context state adds the `state-restore` arms (`EXTRA_ARMS`); a running
server is `serving.http`, whose `generate_loaded` adds the under-load arms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from stagereplay.errors import StageReplayError

TOP_LOGPROBS = 5
"""Top-k logprobs recorded per step: enough for the margin (top-1 minus top-2) and a look at the near-ties."""

ENGINES: dict[str, str] = {"vllm": "stagereplay.serving.vllm",
                           "llama.cpp": "stagereplay.serving.llamacpp",
                           "http": "stagereplay.serving.http"}
"""Engine name -> the module whose `load(config)` returns a `ServingEngine`."""
EXTRA_ARMS: dict[str, tuple[str, ...]] = {"llama.cpp": ("state-restore", "oneshot-restore")}
"""Arms an engine runs beside oneshot and prefix-cache: llama.cpp saves and restores a sequence's K/V."""


@dataclass(frozen=True)
class Generation:
    """What one request returned."""

    tokens: tuple[int, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] = field(repr=False)
    """Per generated token, the top-k (token id, logprob) of that step, best first: [S][k]."""
    cached: int | None
    """Prompt tokens whose K/V the engine took from its prefix cache instead of computing them (None: the engine
    does not say)."""
    finish: str  # the engine's own reason: "stop" (an EOS or stop token) | "length"


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides which numbers a serving engine produces (the model's path and precision are the
    run's `ModelConfig`; these are the engine's own settings)."""

    name: str = field(metadata={"help": "vllm | llama.cpp | http"})
    block_size: int = field(default=32, metadata={"engines": ("vllm",),
        "help": "tokens per K/V block: the prefix cache reuses whole blocks, so it must be below the prefixes"})
    enforce_eager: bool = field(default=True, metadata={"engines": ("vllm",),
                                                        "help": "no CUDA graphs or compilation"})
    kv_cache_gib: int = field(default=1, metadata={"engines": ("vllm",),
                                                   "help": "CPU K/V cache space in GiB (VLLM_CPU_KVCACHE_SPACE)"})
    gpu_memory_utilization: float = field(default=0.5, metadata={"engines": ("vllm",),
        "help": "GPU share for weights and cache (leaves room for the transformers model of --cross hf)"})
    seed: int = field(default=0, metadata={"help": "engine seed (greedy decoding does not read it)"})
    n_ctx: int = field(default=4096, metadata={"engines": ("llama.cpp",),
                                               "help": "context positions (prompt + stage 1 + suffix must fit)"})
    n_batch: int = field(default=512, metadata={"engines": ("llama.cpp",),
                                                "help": "prompt tokens per llama_decode (llama-server's -b)"})
    n_ubatch: int = field(default=512, metadata={"engines": ("llama.cpp",),
                                                 "help": "micro-batch: tokens per graph compute (-ub)"})
    flash_attn: bool = field(default=False, metadata={"engines": ("llama.cpp",),
                                                      "help": "llama.cpp's flash attention (-fa)"})
    repack: bool = field(default=False, metadata={"engines": ("llama.cpp",), "help": (
        "llama.cpp's extra buffer types: weights repacked for the CPU's wider kernels (other kernels, other bits; "
        "llama-server repacks unless --no-repack)")})
    url: str = field(default="", metadata={"engines": ("http",), "help": "the server: http://HOST:PORT"})
    api: str = field(default="auto", metadata={"engines": ("http",),
                                               "help": "auto | llama-server (/completion) | openai (/v1/completions)"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={"engines": ("http",),
        "help": "the environment variable holding the server's API key (the key itself is never recorded)"})
    timeout: float = field(default=600.0, metadata={"engines": ("http",), "help": "seconds per request"})
    retries: int = field(default=2, metadata={"engines": ("http",),
                                              "help": "retries of a request the server did not answer"})
    slot_restore: bool = field(default=False, metadata={"engines": ("http",),
        "help": "the slot-restore arms: live's slot saved and restored into another (llama-server --slot-save-path)"})
    concurrency: int = field(default=0, metadata={"engines": ("http",),
        "help": "other requests in flight around each under-load replica (0: no under-load arms)"})

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise StageReplayError(f"unknown engine {self.name!r}", f"use hf or one of {', '.join(ENGINES)}")
        if self.block_size < 1:
            raise StageReplayError(f"--block-size must be at least 1, got {self.block_size}", "pass e.g. 32")
        if self.api not in ("auto", "llama-server", "openai"):
            raise StageReplayError(f"unknown --api {self.api!r}", "use auto, llama-server or openai")
        if self.timeout <= 0 or self.retries < 0 or self.concurrency < 0:
            raise StageReplayError("--timeout must be positive, --retries and --concurrency at least 0",
                                   "pass e.g. --timeout 600 --retries 2 --concurrency 4")
        for name in ("n_ctx", "n_batch", "n_ubatch"):
            if getattr(self, name) < 1:
                raise StageReplayError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}",
                                       "pass a positive size")

    def as_dict(self) -> dict[str, Any]:
        """The settings this engine reads (a field another engine reads is left out, so a run's identity names
        only what decided its numbers)."""
        reads = {f.name for f in fields(self) if self.name in f.metadata.get("engines", (self.name,))}
        return {k: v for k, v in asdict(self).items() if k in reads}


class ServingEngine(Protocol):
    """A loaded serving engine. Batch size 1, greedy: one request at a time, as our engine runs one item."""

    name: str

    def generate(self, ids: Sequence[int], max_tokens: int, reuse: bool = False) -> Generation:
        """Greedy tokens after `ids` until EOS or `max_tokens`. `reuse=False` empties the prefix cache first
        (nothing cached: a fresh prefill); `reuse=True` lets the request reuse the blocks earlier requests
        left, those filled while decoding included."""
        ...

    def version(self) -> str: ...

    def settings(self) -> dict[str, Any]:
        """The engine's settings and the environment variables that change its numbers, as it runs them."""
        ...


def require_engine(config: EngineConfig) -> None:
    """A one-line refusal, before anything loads, when the engine is not installed here."""
    import importlib

    importlib.import_module(ENGINES[config.name]).require()


def engine_context(config: EngineConfig) -> tuple[int, str] | None:
    """The positions one request may hold in the engine, and their name for an error, where the engine's own
    settings bound them below the model's context (llama.cpp's --n-ctx, a server's per-slot context); None
    where only the model's context bounds them."""
    import importlib

    context: tuple[int, str] | None = importlib.import_module(ENGINES[config.name]).context(config)
    return context


def load_engine(config: EngineConfig, model_path: str, precision: str, threads: int, device: str
                ) -> ServingEngine:
    import importlib

    module = importlib.import_module(ENGINES[config.name])
    engine: ServingEngine = module.load(config, model_path, precision, threads, device)
    return engine


def refuse_cache_access(engine: str, what: str) -> StageReplayError:
    """The one line for an experiment that needs the K/V cache itself, which a serving engine does not expose."""
    return StageReplayError(
        f"{what} needs boundary K/V caches (to fingerprint, compare or transplant), which the {engine} engine "
        "does not expose",
        "run it on a matched run of our engine (`stagereplay matched` without --engine)")
