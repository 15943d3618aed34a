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
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stagereplay.errors import StageReplayError
from stagereplay.serving.seam import TOP_LOGPROBS, EngineConfig, EngineKind, EngineOptions, Generation

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
       "VLLM_BATCH_INVARIANT", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class VllmOptions(EngineOptions):
    """vLLM's settings (`--engine vllm`)."""

    block_size: int = field(default=32, metadata={
        "help": "tokens per K/V block: the prefix cache reuses whole blocks, so it must be below the prefixes"})
    enforce_eager: bool = field(default=True, metadata={"help": "no CUDA graphs or compilation"})
    kv_cache_gib: int = field(default=1, metadata={"help": "CPU K/V cache space in GiB (VLLM_CPU_KVCACHE_SPACE)"})
    gpu_memory_utilization: float = field(default=0.5, metadata={
        "help": "GPU share for weights and cache (leaves room for the transformers model of --cross hf)"})

    def check(self) -> None:
        if self.block_size < 1:
            raise StageReplayError(f"--block-size must be at least 1, got {self.block_size}", "pass e.g. 32")


def require() -> None:
    """Refuse up front, without importing vLLM (its settings are read at import: `load` sets them first)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise StageReplayError("--engine vllm needs vLLM installed",
                               "pip install 'stagereplay[vllm]' on a GPU machine; on a CPU, its own venv as "
                               "docs/how-to/vllm.md says")


class VLLMEngine:
    """One `vllm.LLM` with prefix caching; `generate` is the seam's only request."""

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
        (out,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        (choice,) = out.outputs
        top = []
        for step in choice.logprobs or []:  # one {token id: Logprob} per generated token, the pick included
            # By logprob, ties by token id: greedy argmax picks the lowest id among tied logits (bf16 ties are
            # common exactly at near-ties), so the pick comes first, as in our engine's record.
            ranked = sorted(step.items(), key=lambda kv: (-kv[1].logprob, kv[0]))[:TOP_LOGPROBS]
            top.append(tuple((int(t), float(lp.logprob)) for t, lp in ranked))
        return Generation(tuple(int(t) for t in choice.token_ids), tuple(top), int(out.num_cached_tokens or 0),
                          str(choice.finish_reason))

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
    kwargs: dict[str, Any] = {}
    if device.startswith("cuda"):
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=DTYPES[precision], block_size=options.block_size,
                   enforce_eager=options.enforce_eager, enable_prefix_caching=True, seed=config.seed,
                   max_num_seqs=1, **kwargs)
    return VLLMEngine(llm, config, precision, {k: os.environ.get(k) for k in ENV})


class VllmKind(EngineKind):
    """vLLM in this process (`--engine vllm`)."""

    name: ClassVar[str] = "vllm"
    options: ClassVar[type[EngineOptions]] = VllmOptions
    engine: ClassVar[type] = VLLMEngine

    def require(self) -> None:
        require()

    def load(self, config: EngineConfig, model_path: str, precision: str, threads: int, device: str
             ) -> VLLMEngine:
        return load(config, model_path, precision, threads, device)
