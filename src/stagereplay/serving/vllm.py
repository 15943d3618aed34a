"""vLLM behind the serving seam (`serving.seam`): in-process, one greedy request at a time, prefix caching on.

vLLM runs in its own virtual environment (its transformers cap differs from ours; docs/how-to/vllm.md). The settings
that fix its numbers on a CPU are environment variables read when vLLM is imported, so `load` sets them first
(keeping any the user set) and records the values in effect:

    VLLM_ENABLE_V1_MULTIPROCESSING=0   the engine core in this process (no worker process to start or leak)
    VLLM_CPU_OMP_THREADS_BIND=nobind   no thread pinning on a machine shared with other work
    OMP_NUM_THREADS=<--threads>        the thread count, fixed and recorded, as for our engine
    VLLM_CPU_KVCACHE_SPACE=<GiB>       the CPU K/V pool

The prefix cache reuses whole blocks of `block_size` tokens, those filled while decoding included; the CPU
default of 128 exceeds the toy's prefixes, so nothing would be reused, hence 32.

As an RL rollout engine (`Samples`, `ScoresPrompt`): `sample` is one request with vLLM's own sampler
(`SamplingParams(temperature, top_k, top_p, seed, logprobs=1)`: the emitted token's log-probability and the step's
most likely token), `score` one request for the sequence with `prompt_logprobs=1` and `max_tokens=1` (its prompt
logprobs, the prefix cache not read). Which distribution the log-probabilities are taken from is vLLM's
`logprobs_mode`, an engine setting: `raw_logprobs` or `processed_logprobs` as the engine config says
(`EngineConfig.logprobs_mode`). Prompt logprobs skip the sampler in vLLM, so they are raw in either mode: a processed
run's sequences are not scored in vLLM (`VllmKind.prompt_scoring`).

The options that change how vLLM builds the cache are passed as vLLM takes them, and a load vLLM refuses with one of
them set ends in one line naming it (`refused`): `kv_cache_dtype` (fp8 e4m3 or e5m2; the CPU build of 0.32 takes
them only where the head size is a multiple of 32), `max_num_batched_tokens` (a prompt past it is prefilled in
chunks) and `speculative_config` (vLLM's JSON; the CPU build runs `ngram` and `draft_model`). A speculating engine's
request records what it drafted and accepted: the engine's counters (`LLM.get_metrics`, stats on) before and after
it, one request at a time.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypedDict

from stagereplay.errors import StageReplayError
from stagereplay.serving.seam import (
    LOGPROBS_MODES,
    TOP_LOGPROBS,
    Draft,
    EngineConfig,
    EngineKind,
    EngineOptions,
    Generation,
    PromptScores,
    Samples,
    Sampling,
    ScoresPrompt,
)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""The K/V cache types vLLM takes (`kv_cache_dtype`): auto is the model's dtype; fp8 is e4m3."""
KNOB_WORDS = {"block_size": ("block size", "block_size"),
              "kv_cache_dtype": ("kv cache", "kv_cache", "fp8", "cache_dtype"),
              "max_num_batched_tokens": ("batched_tokens", "max_num_batched"),
              "speculative_config": ("specul", "draft", "ngram", "eagle", "suffix", "mtp")}
"""What a vLLM error says when it is about each cache option (`refused` names the option)."""
DEFAULT_BLOCK = 32
"""Our default `block_size`: what the CPU build's attention takes (a multiple of 32)."""
SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
"""vLLM's counters of speculated tokens (drafted, accepted), which `LLM.get_metrics` reads with stats on."""
ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
       "VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES")


class CacheKnobs(TypedDict, total=False):
    """The options that change how vLLM builds the cache, as its `LLM` takes them: each only where it is not vLLM's
    default."""

    kv_cache_dtype: str
    max_num_batched_tokens: int
    speculative_config: dict[str, object] | None  # vLLM's own JSON object, passed through as the user wrote it


class LoadArguments(TypedDict, total=False):
    """The other arguments of vLLM's `LLM` that depend on where and how it runs."""

    gpu_memory_utilization: float
    disable_log_stats: bool


@dataclass(frozen=True)
class VllmOptions(EngineOptions):
    """vLLM's settings (`--engine vllm`)."""

    block_size: int = field(default=DEFAULT_BLOCK, metadata={
        "help": "tokens per K/V block: the prefix cache reuses whole blocks, so it must be below the prefixes"})
    enforce_eager: bool = field(default=True, metadata={"help": "no CUDA graphs or compilation"})
    kv_cache_gib: int = field(default=1, metadata={"help": "CPU K/V cache space in GiB (VLLM_CPU_KVCACHE_SPACE)"})
    gpu_memory_utilization: float = field(default=0.5, metadata={
        "help": "GPU share for weights and cache (leaves room for the transformers model of --cross hf)"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "the K/V cache's type: auto (the model's) | fp8 | fp8_e4m3 | fp8_e5m2"})
    max_num_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens one engine step may process: a prompt past it is prefilled in chunks (None: vLLM's default)"})
    speculative_config: str = field(default="", metadata={
        "help": "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                "\"prompt_lookup_max\": 4} or a draft model (\"method\": \"draft_model\", \"model\": PATH); empty: none"})

    def check(self) -> None:
        if self.block_size < 1:
            raise StageReplayError(f"--block-size must be at least 1, got {self.block_size}", "pass e.g. 32")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise StageReplayError(f"unknown --kv-cache-dtype {self.kv_cache_dtype!r}",
                                   f"use one of {', '.join(KV_CACHE_DTYPES)}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise StageReplayError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}",
                                   "pass e.g. 2048, or leave it to vLLM")
        self.speculative()

    def speculative(self) -> dict[str, object] | None:
        """`speculative_config` as the dict vLLM takes (None: no speculation), its JSON as given (vLLM reads it);
        refused in one line where it is no JSON object."""
        if not self.speculative_config:
            return None
        try:
            config = json.loads(self.speculative_config)
        except json.JSONDecodeError as e:
            config = e
        if not isinstance(config, dict):
            raise StageReplayError(f"--speculative-config {self.speculative_config!r} is not a JSON object",
                                   "pass e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                                   "\"prompt_lookup_max\": 4}'")
        return config

    def knobs(self) -> CacheKnobs:
        """The options that change how vLLM builds the cache, as its `LLM` takes them, where they differ from its
        defaults."""
        knobs: CacheKnobs = {}
        if self.kv_cache_dtype != "auto":
            knobs["kv_cache_dtype"] = self.kv_cache_dtype
        if self.max_num_batched_tokens is not None:
            knobs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.speculative_config:
            knobs["speculative_config"] = self.speculative()
        return knobs


def require() -> None:
    """Refuse up front, without importing vLLM (its settings are read at import: `load` sets them first)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise StageReplayError("--engine vllm needs vLLM installed",
                               "pip install 'stagereplay[vllm]' on a GPU machine; on a CPU, its own venv as "
                               "docs/how-to/vllm.md says")


class VLLMEngine(Samples, ScoresPrompt):
    """One `vllm.LLM` with prefix caching; `generate` is the seam's greedy request, `sample` and `score` a rollout
    engine's (`serving.seam`'s capabilities)."""

    name = "vllm"

    def __init__(self, llm: Any, config: EngineConfig, precision: str, env: dict[str, str | None]) -> None:
        self.llm = llm
        self.config = config
        self.options = config.own(VllmOptions)
        self.precision = precision
        self.env = env

    def generate(self, ids: Sequence[int], max_tokens: int, reuse: bool = False) -> Generation:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not reuse and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still holds blocks)")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS, detokenize=False,
                                seed=self.config.seed)
        before = self.spec_counters()
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        after = self.spec_counters()
        (choice,) = out.outputs
        top = []
        for step in choice.logprobs or []:  # one {token id: Logprob} per generated token, the pick included
            # By logprob, ties by token id: greedy argmax picks the lowest id among tied logits (bf16 ties are
            # common exactly at near-ties), so the pick comes first, as in our engine's record.
            ranked = sorted(step.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:TOP_LOGPROBS]
            top.append(tuple((int(t), float(lp.logprob)) for t, lp in ranked))
        draft = None if before is None or after is None else Draft(after[0] - before[0], after[1] - before[1])
        return Generation(tuple(int(t) for t in choice.token_ids), tuple(top), int(out.num_cached_tokens or 0),
                          str(choice.finish_reason), draft)

    def sample(self, ids: Sequence[int], max_tokens: int, sampling: Sampling) -> Generation:
        """One request from nothing cached, drawn by vLLM's sampler (greedy at temperature 0), each step's emitted
        token's log-probability and most likely token from vLLM's own logprobs (`logprobs=1`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._reset()
        params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                seed=sampling.seed, max_tokens=max_tokens, logprobs=1, detokenize=False)
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        (choice,) = out.outputs
        tokens = tuple(int(t) for t in choice.token_ids)
        steps = choice.logprobs or []
        chosen = tuple(float(step[t].logprob) for step, t in zip(steps, tokens, strict=True))
        top = tuple(((int(best), float(lp.logprob)),) for best, lp in (_best(step) for step in steps))
        return Generation(tokens, top, int(out.num_cached_tokens or 0), str(choice.finish_reason), None, chosen)

    def score(self, ids: Sequence[int], start: int, sampling: Sampling) -> PromptScores:
        """One request for `ids` with prompt logprobs (the token's and the most likely one at each position): a
        prefill of the whole sequence, the prefix cache emptied and not read."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._reset()
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        rows = out.prompt_logprobs or []  # [len(ids)]: None, then per position {token id: Logprob}
        logprobs, argmax = [], []
        for position in range(start, len(ids)):
            step = rows[position]
            logprobs.append(float(step[int(ids[position])].logprob))
            argmax.append(int(_best(step)[0]))
        return PromptScores(tuple(logprobs), tuple(argmax))

    def _reset(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (a request still holds blocks)")

    def precision_name(self) -> str:
        return DTYPES[self.precision]

    def spec_counters(self) -> tuple[int, int] | None:
        """The engine's speculation counters (drafted, accepted) since it loaded; None where it does not speculate.
        One request at a time in one engine, so their change over a request is that request's."""
        if not self.options.speculative_config:
            return None
        values = {m.name: int(getattr(m, "value", 0)) for m in self.llm.get_metrics() if m.name in SPEC_COUNTERS}
        return values.get(SPEC_COUNTERS[0], 0), values.get(SPEC_COUNTERS[1], 0)

    def version(self) -> str:
        import vllm

        return str(vllm.__version__)

    def settings(self) -> dict[str, Any]:
        return {"engine": self.name, "version": self.version(), **self.config.as_dict(),
                "dtype": DTYPES[self.precision], "prefix_caching": True, "top_logprobs": TOP_LOGPROBS,
                "env": dict(self.env)}


    def close(self) -> None:
        """Free the engine (vLLM holds one per process comfortably; two precisions load one after the other)."""
        self.llm = None
        gc.collect()


def _best(step: dict[int, Any]) -> tuple[int, Any]:
    """The most likely token of one step's {token id: Logprob} (vLLM's rank 1; the lowest id among tied logprobs)."""
    return min(step.items(), key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30, -kv[1].logprob, kv[0]))


def load(config: EngineConfig, model_path: str, precision: str, threads: int, device: str) -> VLLMEngine:
    if precision not in DTYPES:
        raise StageReplayError(f"--engine vllm does not run precision {precision}",
                               f"use one of {', '.join(DTYPES)}")
    options = config.own(VllmOptions)
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                       ("OMP_NUM_THREADS", str(threads)), ("VLLM_CPU_KVCACHE_SPACE", str(options.kv_cache_gib))):
        os.environ.setdefault(key, value)
    require()
    import vllm
    kwargs: LoadArguments = {}
    if device.startswith("cuda"):
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    knobs = options.knobs()
    if options.speculative_config:
        kwargs["disable_log_stats"] = False  # the speculation counters each request's draft is read from
    try:
        llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=DTYPES[precision], block_size=options.block_size,
                       enforce_eager=options.enforce_eager, enable_prefix_caching=True, seed=config.seed,
                       max_num_seqs=1, logprobs_mode=f"{config.logprobs_mode}_logprobs", **knobs, **kwargs)
    except Exception as e:  # vLLM raises what its backend cannot take as any of several types
        given: dict[str, object] = {**knobs, **({"block_size": options.block_size}
                                                 if options.block_size != DEFAULT_BLOCK else {})}
        if not given:
            raise
        raise refused(given, e) from e
    return VLLMEngine(llm, config, precision, {k: os.environ.get(k) for k in ENV})


def refused(knobs: Mapping[str, object], error: Exception) -> StageReplayError:
    """The one line for a load vLLM refused with a cache option set (`knobs`: each set, by its name in
    `KNOB_WORDS`, with its value): the option its message speaks of (else every one set), and vLLM's own first
    line."""
    said = (str(error).strip().splitlines() or [""])[0][:300]
    words = said.lower().replace("-", "_")
    named = [k for k in knobs if any(w in words for w in KNOB_WORDS[k])] or list(knobs)
    flags = ", ".join(f"--{k.replace('_', '-')} {json.dumps(knobs[k]) if isinstance(knobs[k], dict) else knobs[k]}"
                      for k in named)
    return StageReplayError(f"vLLM cannot run {flags} here ({type(error).__name__}: {said})",
                            "drop the option, or run where vLLM's backend takes it (docs/engines.md says what the CPU "
                            "build runs)")


class VllmKind(EngineKind):
    """vLLM in this process (`--engine vllm`)."""

    name: ClassVar[str] = "vllm"
    title: ClassVar[str] = "vLLM"
    options: ClassVar[type[EngineOptions]] = VllmOptions
    engine: ClassVar[type] = VLLMEngine

    def require(self) -> None:
        require()

    def logprobs_modes(self, config: EngineConfig) -> tuple[str, ...]:
        return LOGPROBS_MODES  # vLLM's raw_logprobs and processed_logprobs

    def seeded_draws(self, config: EngineConfig) -> str | None:
        return None  # vLLM's own sampler, a seeded request's draws from its generator

    def prompt_scoring(self, config: EngineConfig) -> str | None:
        if config.logprobs_mode != "raw":
            return ("vLLM's prompt logprobs skip its sampler, so they are raw in any logprobs_mode: a sequence is not "
                    f"scored in vLLM under {config.logprobs_mode} log-probabilities")
        return None

    def load(self, config: EngineConfig, model_path: str, precision: str, threads: int, device: str
             ) -> VLLMEngine:
        return load(config, model_path, precision, threads, device)
