"""llama.cpp behind the serving seam (`serving.seam`), through llama-cpp-python: one context, greedy, in-process.

Requests run on one `llama_cpp.Llama` context, batch size 1, the way llama-server runs a slot:

    generate(ids, reuse=False)   the context's memory cleared, `ids` processed as a batch (in `n_batch` chunks,
                                 each split into `n_ubatch` micro-batches), then one token per decode step
    generate(ids, reuse=True)    the longest common prefix of `ids` and what the context holds is kept, at most
                                 all of `ids` but its last token, and the rest is processed: the prefix match of
                                 llama-cpp-python's `Llama.generate` and llama-server's `cache_prompt` (both always
                                 recompute the last prompt token to get its logits). `Generation.cached` = positions
                                 kept, decode-written ones included
    snapshot / restore           a sequence's K/V as llama-server's slot save writes it
                                 (`llama_state_seq_get_data`), and loaded back into a cleared context
                                 (`llama_state_seq_set_data`), the whole-cache transplant
    sample / score               a rollout drawn by llama.cpp's sampler chain, and a sequence scored by one prefill
                                 with every position's logits (`serving.llamacpp_rollout`)

The pick is the argmax of the step's logits, lowest token id among ties (llama.cpp's greedy sampler picks the
same); the top-k logprobs come from the same logits (log-softmax in float64). A request stops at llama.cpp's own
end-of-generation tokens (`llama_vocab_is_eog`) or at `max_tokens`.

Weights are loaded without llama.cpp's extra buffer types (no repacking into the CPU's wider layouts) unless
`--repack` asks for them (`extra_buffers`): they run other kernels, so they are a construction of their own.

`--precision` picks the K/V cache type (fp16: llama.cpp's default f16, bf16, fp32: f32): the weights' types are
the GGUF file's own. The build's compiled CPU features choose its kernels, so `build_info()` (version, the
features `llama_print_system_info` reports) goes into the environment of every record with the CPU's flags, and
the audit compares the build (records.kernels): re-executed under another build, a record is "not reproduced here".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypedDict

from stagereplay.errors import StageReplayError
from stagereplay.serving import llamacpp_rollout
from stagereplay.serving.seam import (
    LOGPROBS_MODES,
    TOP_LOGPROBS,
    EngineConfig,
    EngineKind,
    EngineOptions,
    Generation,
    PrefillsInChunks,
    PromptScores,
    Samples,
    Sampling,
    SavedState,
    SavesState,
    ScoresPrompt,
)

CACHE_TYPES = {"fp16": ("f16", 1), "bf16": ("bf16", 30), "fp32": ("f32", 0)}
"""--precision -> the K/V cache's ggml type (name, enum value in ggml.h)."""
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
"""The x86 extensions ggml has code paths for: which of them a build uses is in its system info."""


@dataclass(frozen=True)
class LlamaCppOptions(EngineOptions):
    """llama.cpp's settings (`--engine llama.cpp`)."""

    n_ctx: int = field(default=4096, metadata={"help": "context positions (prompt + stage 1 + suffix must fit)"})
    n_batch: int = field(default=512, metadata={"help": "prompt tokens per llama_decode (llama-server's -b)"})
    n_ubatch: int = field(default=512, metadata={"help": "micro-batch: tokens per graph compute (-ub)"})
    flash_attn: bool = field(default=False, metadata={"help": "llama.cpp's flash attention (-fa)"})
    repack: bool = field(default=False, metadata={"help": (
        "llama.cpp's extra buffer types: weights repacked for the CPU's wider kernels (other kernels, other bits; "
        "llama-server repacks unless --no-repack)")})

    def check(self) -> None:
        for name in ("n_ctx", "n_batch", "n_ubatch"):
            if getattr(self, name) < 1:
                raise StageReplayError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}",
                                       "pass a positive size")


def require() -> None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise StageReplayError("--engine llama.cpp needs llama-cpp-python installed",
                               "pip install 'stagereplay[llamacpp]' (a source build: docs/how-to/llamacpp.md)")


def _cpu_flags() -> list[str] | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in CPU_FLAGS if flag in have]
    except OSError:
        pass
    return None


class LlamaCppBuild(TypedDict):
    """llama.cpp's build as `build_info` reads it."""

    version: str  # llama-cpp-python's, which names the vendored llama.cpp commit
    system_info: str  # llama.cpp's system info line: the CPU features the build compiled in


def build_info() -> LlamaCppBuild:
    """What fixes llama.cpp's kernels here: its version (the vendored llama.cpp commit comes with it) and the CPU
    features the build compiled in, as llama.cpp reports them (a native build's are the CPU's own)."""
    import llama_cpp

    return {"version": str(llama_cpp.__version__),
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}


@dataclass(frozen=True)
class Snapshot:
    """A sequence's K/V over `ids` (llama-server's slot file without its header): the boundary state's cache, the
    pending token fed after a restore."""

    ids: tuple[int, ...]
    data: bytes = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class LlamaCppEngine(SavesState, PrefillsInChunks, Samples, ScoresPrompt):
    """One llama.cpp context; `generate` is the seam's request; it saves and restores a sequence's state, prefills
    in chunks, samples and scores a sequence (`serving.seam`'s capabilities)."""

    name = "llama.cpp"

    def __init__(self, llm: Any, config: EngineConfig, precision: str, threads: int) -> None:
        import llama_cpp

        self.llm, self.config, self.precision, self.threads = llm, config, precision, threads
        self.options = config.own(LlamaCppOptions)
        self.lib = llama_cpp
        self.vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))

    # -- the context ------------------------------------------------------------------------------------

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.llm.ctx), True)
        self.llm.n_tokens = 0

    def check_room(self, n: int) -> None:
        if n > self.options.n_ctx:
            raise StageReplayError(f"a llama.cpp request of {n} positions exceeds its context of {self.options.n_ctx}",
                                   "pass a larger --n-ctx")

    def eval(self, ids: Sequence[int], chunk: int | None = None) -> None:
        """Process `ids` after what the context holds, `chunk` tokens per llama_decode (default n_batch)."""
        size = chunk or self.options.n_batch
        if size > self.options.n_batch:
            raise StageReplayError(f"chunks of {size} tokens exceed the context's batch of {self.options.n_batch}",
                                   f"pass --n-batch {size} or more")
        saved, self.llm.n_batch = self.llm.n_batch, size  # Llama.eval splits by n_batch
        try:
            self.llm.eval(list(ids))
        finally:
            self.llm.n_batch = saved

    def _logits(self) -> Any:
        import numpy as np

        return self.logits32().astype(np.float64)

    @property
    def n_batch(self) -> int:
        return self.options.n_batch

    def logits32(self, row: int = -1) -> Any:
        """A copy of the fp32 logits [V] of the last decode's row `row` (-1: its last)."""
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def _pick(self, logits: Any) -> tuple[int, tuple[tuple[int, float], ...]]:
        """The greedy token (lowest id among tied maxima) and the step's top-k (id, logprob), best first."""
        import numpy as np

        k = min(TOP_LOGPROBS, logits.shape[0])
        part = np.argpartition(-logits, k - 1)[:k]
        top_ids = sorted(part.tolist(), key=lambda t: (-logits[t], t))
        if logits[top_ids[-1]] == logits[part].min():  # ties at the k-th value: take the lowest ids among them
            edge = logits[top_ids[-1]]
            above = [t for t in top_ids if logits[t] > edge]
            tied = np.flatnonzero(logits == edge)[: k - len(above)].tolist()
            top_ids = above + tied
        m = logits.max()
        lse = m + np.log(np.exp(logits - m).sum())
        return int(top_ids[0]), tuple((int(t), float(logits[t] - lse)) for t in top_ids)

    def _decode(self, max_tokens: int, save: Callable[[int], bool] | None
                ) -> tuple[list[int], list[tuple[tuple[int, float], ...]], str, Snapshot | None]:
        tokens: list[int] = []
        top: list[tuple[tuple[int, float], ...]] = []
        snap = None
        logits = self._logits()
        while True:
            token, step = self._pick(logits)
            tokens.append(token)
            top.append(step)
            if save is not None and snap is None and save(token):
                snap = self.snapshot()  # the cache holds everything before `token`, the pending token
            if self.lib.llama_vocab_is_eog(self.vocab, token):
                return tokens, top, "stop", snap
            if len(tokens) >= max_tokens:
                return tokens, top, "length", snap
            self.eval([token], 1)
            logits = self._logits()

    # -- requests ---------------------------------------------------------------------------------------

    def run(self, ids: Sequence[int], max_tokens: int, reuse: bool = False, chunk: int | None = None,
            save: Callable[[int], bool] | None = None) -> tuple[Generation, Snapshot | None]:
        """`generate`, with the prompt processed `chunk` tokens per batch, and the cache saved before the first
        emitted token that `save` accepts (None: never)."""
        ids = list(ids)
        self.check_room(len(ids) + max_tokens)
        keep = 0
        if reuse and self.llm.n_tokens > 0:
            held = self.llm.input_ids[: self.llm.n_tokens].tolist()
            while keep < min(len(held), len(ids)) and held[keep] == ids[keep]:
                keep += 1
            keep = min(keep, len(ids) - 1)  # the last prompt token is recomputed for its logits
        if keep > 0 and self.llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            self.llm.n_tokens = keep
        else:
            keep = 0
            self.clear()
        self.eval(ids[keep:], chunk)
        tokens, top, finish, snap = self._decode(max_tokens, save)
        return Generation(tuple(tokens), tuple(top), keep, finish), snap

    def generate(self, ids: Sequence[int], max_tokens: int, reuse: bool = False) -> Generation:
        return self.run(ids, max_tokens, reuse)[0]

    def chunked(self, ids: Sequence[int], max_tokens: int, chunk: int) -> Generation:
        return self.run(ids, max_tokens, chunk=chunk)[0]

    def sample(self, ids: Sequence[int], max_tokens: int, sampling: Sampling) -> Generation:
        return llamacpp_rollout.sample(self, ids, max_tokens, sampling)

    def score(self, ids: Sequence[int], start: int, sampling: Sampling) -> PromptScores:
        return llamacpp_rollout.score(self, ids, start, sampling)

    def precision_name(self) -> str:
        """The GGUF's weights as llama.cpp describes the model (architecture, size, file type) and the K/V cache's
        type."""
        import ctypes

        buf = ctypes.create_string_buffer(256)
        self.lib.llama_model_desc(self.llm.model, buf, len(buf))
        return f"{buf.value.decode(errors='replace')}, K/V {CACHE_TYPES[self.precision][0]}"

    def snapshot(self) -> Snapshot:
        """The sequence's K/V as it stands (what llama-server's slot save writes)."""
        import ctypes

        ctx = self.llm.ctx
        size = int(self.lib.llama_state_seq_get_size(ctx, 0))
        buf = (ctypes.c_uint8 * size)()
        n = int(self.lib.llama_state_seq_get_data(ctx, buf, size, 0))
        return Snapshot(tuple(int(t) for t in self.llm.input_ids[: self.llm.n_tokens]), bytes(buf[:n]))

    def build_state(self, ids: Sequence[int], chunk: int | None = None) -> Snapshot:
        """A fresh prefill of `ids` (P[0:T-1]) in batches of `chunk`, saved: the one-shot boundary state."""
        self.check_room(len(ids))
        self.clear()
        self.eval(ids, chunk)
        return self.snapshot()

    def restore(self, state: SavedState, pending: int, max_tokens: int) -> tuple[Generation, str]:
        """Load `state` into the cleared context (slot restore), feed the pending token as a decode step and
        continue. Also returns the fingerprint of the cache as re-read after the load, before the pending token."""
        import ctypes

        if not isinstance(state, Snapshot):
            raise TypeError(f"llama.cpp restores its own snapshots, not {type(state).__name__}")
        self.check_room(len(state.ids) + 1 + max_tokens)
        self.clear()
        buf = (ctypes.c_uint8 * len(state.data)).from_buffer_copy(state.data)
        if int(self.lib.llama_state_seq_set_data(self.llm.ctx, buf, len(state.data), 0)) != len(state.data):
            raise RuntimeError("llama.cpp refused the saved sequence state")
        self.llm.input_ids[: len(state.ids)] = state.ids
        self.llm.n_tokens = len(state.ids)
        loaded = self.snapshot().fingerprint
        self.eval([pending], 1)
        tokens, top, finish, _ = self._decode(max_tokens, None)
        return Generation(tuple(tokens), tuple(top), len(state.ids), finish), loaded

    # -- what fixes its numbers -------------------------------------------------------------------------

    def version(self) -> str:
        import llama_cpp

        return str(llama_cpp.__version__)

    def settings(self) -> dict[str, Any]:
        return {"engine": self.name, "version": self.version(), **self.config.as_dict(),
                "cache_type": CACHE_TYPES[self.precision][0], "n_threads": self.threads,
                "n_threads_batch": self.threads, "n_gpu_layers": 0, "top_logprobs": TOP_LOGPROBS,
                "build": build_info(), "cpu_flags": _cpu_flags()}

    def close(self) -> None:
        self.llm.close()


def check_model(model_path: str | None) -> None:
    """llama.cpp runs a GGUF file (None: the embedded toy, a folder)."""
    if model_path is None or not str(model_path).lower().endswith(".gguf") or not Path(model_path).is_file():
        raise StageReplayError(f"--engine llama.cpp runs a GGUF file, and {model_path or 'the embedded toy'} is not "
                               "one", "pass --model PATH.gguf (llama.cpp's convert_hf_to_gguf.py writes one from a "
                               "folder)")


def load(config: EngineConfig, model_path: str, precision: str, threads: int, device: str) -> LlamaCppEngine:
    if precision not in CACHE_TYPES:
        raise StageReplayError(f"--engine llama.cpp does not run precision {precision} (it sets the K/V cache type)",
                               f"use one of {', '.join(CACHE_TYPES)}")
    check_model(model_path)
    options = config.own(LlamaCppOptions)
    if device != "cpu":
        raise StageReplayError(f"--engine llama.cpp runs here on the CPU build only, not on {device}",
                               "pass --device cpu")
    require()
    from llama_cpp import Llama

    cache_type = CACHE_TYPES[precision][1]
    with extra_buffers(options.repack):
        llm = Llama(model_path=str(model_path), n_ctx=options.n_ctx, n_batch=options.n_batch,
                    n_ubatch=options.n_ubatch, n_threads=threads, n_threads_batch=threads, flash_attn=options.flash_attn,
                    seed=config.seed, n_gpu_layers=0, type_k=cache_type, type_v=cache_type, logits_all=False,
                    verbose=False)
    return LlamaCppEngine(llm, config, precision, threads)


@contextmanager
def extra_buffers(on: bool) -> Iterator[None]:
    """Models loaded inside get llama.cpp's extra buffer types (`use_extra_bufts`: weights repacked for the CPU's
    wider kernels, AMX tiles included) only if `on`. Repacked weights run other kernels, so other bits, and a
    native build on an AMX CPU dies in its first decode with them (llama.cpp issue 20824), so they are off unless
    asked for (`--repack`). `Llama()` takes no such argument: the default model parameters it starts from are
    changed while it loads, and put back after."""
    from llama_cpp import llama_cpp as lib

    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = on
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaCppKind(EngineKind):
    """llama.cpp in this process, through llama-cpp-python (`--engine llama.cpp --model FILE.gguf`)."""

    name: ClassVar[str] = "llama.cpp"
    title: ClassVar[str] = "llama.cpp"
    options: ClassVar[type[EngineOptions]] = LlamaCppOptions
    engine: ClassVar[type] = LlamaCppEngine
    isolated: ClassVar[bool] = True  # its native code may crash: the items run in a worker process
    own_types: ClassVar[bool] = True  # the GGUF's weight types; --precision sets the K/V cache's

    def require(self) -> None:
        require()

    def check_model(self, model: str | None) -> None:
        check_model(model)

    def logprobs_modes(self, config: EngineConfig) -> tuple[str, ...]:
        return LOGPROBS_MODES  # raw from its logits, processed by its sampler chain (serving.llamacpp_rollout)

    def prompt_scoring(self, config: EngineConfig) -> str | None:
        return None  # both modes: every position's logits, processed by the chain where asked

    def context(self, config: EngineConfig) -> tuple[int, str]:
        """The context every request must fit (`--n-ctx`)."""
        n_ctx = config.own(LlamaCppOptions).n_ctx
        return n_ctx, f"llama.cpp's context (--n-ctx {n_ctx})"

    def load(self, config: EngineConfig, model_path: str, precision: str, threads: int, device: str
             ) -> LlamaCppEngine:
        return load(config, model_path, precision, threads, device)

    def build(self, config: EngineConfig) -> LlamaCppBuild:
        require()
        return build_info()

    def crashed(self, config: EngineConfig, problem: str) -> StageReplayError:
        if config.own(LlamaCppOptions).repack:
            return StageReplayError(
                f"{problem}: llama.cpp's native code crashed with --repack; a build for this CPU on AMX tiles is the "
                "known cause (its AMX matmul puts repacked weights in AMX buffers, llama.cpp issue 20824)",
                "run without --repack in a new run directory, or install the portable build "
                "(docs/how-to/llamacpp.md) and run the same command again: the run resumes from this item")
        return StageReplayError(
            f"{problem}: llama.cpp's native code crashed (weights not repacked); a build for other CPU "
            "features than this one's is a likely cause",
            "install the portable build (docs/how-to/llamacpp.md) and run the same command again: the run resumes "
            "from this item")
