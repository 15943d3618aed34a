"""The options that several commands share, and the library values they build (typer reads the annotations)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from stagereplay.cli.app import say_on_stderr

if TYPE_CHECKING:  # the CLI imports the library lazily, so that --help is instant
    from stagereplay.audit.relocate import Relocation
    from stagereplay.engine.decode import DecodeConfig

# Options shared by commands that load a model.
Model = Annotated[str | None, typer.Option("--model", help=(
    "local model directory, or a .gguf file (default: the embedded toy)"))]
Data = Annotated[str | None, typer.Option("--data", help=(
    "items: a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk folder, or hf:NAME[:CONFIG][:SPLIT] "
    "(default: the toy task's held-out items)"))]
Columns = Annotated[str | None, typer.Option("--columns", help=(
    "map the data's fields: TARGET=COLUMN,... with TARGET prompt, messages, user (a one-message chat), answer or "
    "id (GSM8K and MATH-style problem/answer/unique_id rows need none)"))]
N = Annotated[int | None, typer.Option("--n", help="run the first N items")]
Out = Annotated[Path, typer.Option("--out", help="run directory (created, or resumed)")]
Precision = Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32 | fp32-compute")]
Device = Annotated[str, typer.Option("--device", help="cpu | cuda | cuda:<i>")]
Threads = Annotated[int, typer.Option("--threads", help="torch threads per process (fixed, recorded)")]
AttnImpl = Annotated[str, typer.Option("--attn-impl", help="auto (what transformers picks for the model: sdpa where "
                                                            "it has it, else eager; recorded) | eager | sdpa")]
Cache = Annotated[str, typer.Option("--cache", help=(
    "dynamic (the default: grows per step, equals generate()) | static (preallocated, equals "
    "generate(cache_implementation='static'); CUDA-graph captured on a GPU)"))]
Marker = Annotated[str | None, typer.Option("--boundary-marker", help=(
    "stage 1 ends at the first token whose text completes this (default for a reasoning model: </think>)"))]
Regex = Annotated[str | None, typer.Option("--boundary-regex", help=(
    "stage 1 ends when its text matches (searched in the last 1024 characters and the new token's text)"))]
After = Annotated[int | None, typer.Option("--boundary-after", help="stage 1 is the first N generated tokens")]
Scorer = Annotated[str | None, typer.Option("--scorer", help=(
    "last-number | exact | math (LaTeX answers: the last \\boxed{}, through math-verify) | regex:PATTERN"))]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="suffix length limit")]
MaxStage1 = Annotated[int | None, typer.Option("--max-stage1-tokens", help=(
    "tokens allowed to reach the boundary (default: 8192 or what the context leaves)"))]
Sample = Annotated[bool, typer.Option("--sample/--greedy", help="seeded sampling instead of greedy")]
Temperature = Annotated[float, typer.Option("--temperature")]
TopK = Annotated[int, typer.Option("--top-k", help="sample from the top k tokens only (0 = all)")]
TopP = Annotated[float, typer.Option("--top-p", help="sample from the smallest set of this mass (1 = all)")]
Seed = Annotated[int, typer.Option("--seed", help="base seed for sampling")]
Workers = Annotated[int, typer.Option("--workers", help="local worker processes")]
Executor = Annotated[str, typer.Option("--executor", help="local | ray")]


def _quiet(value: bool) -> bool:
    if value:
        say_on_stderr(quiet=True)
    return value


Quiet = Annotated[bool, typer.Option("--quiet", callback=_quiet, help="no progress bar or tables; on stderr, errors only")]
Batch = Annotated[int, typer.Option("--batch", help=(
    "items stepping together: up to C items' decode steps share one forward of C rows, each row batch-invariant "
    "(its attention per item; recorded, and later stages and the audit follow it); 1 = one item at a time"))]
Kernels = Annotated[str, typer.Option("--kernels", help=(
    "CPU kernels: native (this machine's own) | portable (ATen and oneDNN on AVX2, MKL on its branch for every "
    "vendor: the same bits on every x86-64 CPU with AVX2) | auto (portable for the embedded toy on a CPU, else native)"))]

# Options of `paper` and of `plan`, which prices what `paper` would run.
LaterModel = Annotated[str | None, typer.Option("--later-model", help="second checkpoint")]
Items = Annotated[int, typer.Option("--n")]
Select = Annotated[str, typer.Option("--select", help="transplant selection at the primary checkpoint")]
BridgeRows = Annotated[int, typer.Option("--rows", help="bridge rows")]
Sweep = Annotated[bool, typer.Option("--sweep/--no-sweep", help="layer sweep at the primary checkpoint")]
Resample = Annotated[int, typer.Option("--resample", help="K sampled draws per state (0: no resample stage)")]
ResampleItems = Annotated[int, typer.Option("--resample-items", help="items the resample stage draws on")]
Processes = Annotated[int, typer.Option("--workers", help="processes; 0 = one per core on CPU (at most 2)")]


def decode_config(max_new: int, max_stage1: int | None, sample: bool, temperature: float, top_k: int, seed: int,
            top_p: float = 1.0) -> DecodeConfig:
    from stagereplay.engine.decode import DecodeConfig

    return DecodeConfig(max_new, max_stage1, sample, temperature, top_k, seed, top_p)



# A serving engine's own options: None (or off) unless given, so that one another engine does not take is refused
# (serving.seam.options_of), never silently dropped. Each engine's module says its default.
BlockSize = Annotated[int | None, typer.Option("--block-size", help=(
    "vllm: tokens per K/V block (its prefix cache reuses whole blocks; default 32)"))]
NCtx = Annotated[int | None, typer.Option("--n-ctx", help="llama.cpp: context positions (default 4096)")]
NBatch = Annotated[int | None, typer.Option("--n-batch", help="llama.cpp: prompt tokens per batch (-b; default 512)")]
NUbatch = Annotated[int | None, typer.Option("--n-ubatch", help="llama.cpp: micro-batch size (-ub; default 512)")]
FlashAttn = Annotated[bool, typer.Option("--flash-attn", help="llama.cpp: flash attention (-fa)")]
Repack = Annotated[bool, typer.Option("--repack", help=(
    "llama.cpp: weights repacked for this CPU's wider kernels (its extra buffer types: other kernels, other bits)"))]
Url = Annotated[str | None, typer.Option("--url", help="http: the running server, http://HOST:PORT")]
Api = Annotated[str | None, typer.Option("--api", help=(
    "http: auto (the default) | llama-server (/completion) | openai (/v1/completions: vllm serve)"))]
ApiKeyEnv = Annotated[str | None, typer.Option("--api-key-env", help=(
    "http: the environment variable holding the API key (default OPENAI_API_KEY; the key is never recorded)"))]
SlotRestore = Annotated[bool, typer.Option("--slot-restore", help=(
    "http: live's slot saved and restored into another, continued there (llama-server --slot-save-path)"))]
Concurrency = Annotated[int | None, typer.Option("--concurrency", help=(
    "http: other items' requests in flight around the under-load arms (default 0: none)"))]
Timeout = Annotated[float | None, typer.Option("--timeout", help="http: seconds per request (default 600)")]
Retries = Annotated[int | None, typer.Option("--retries", help="http: retries of an unanswered request (default 2)")]
ServerArgs = Annotated[str | None, typer.Option("--server-args", help=(
    "http: the flags the server was started with (recorded verbatim; no --api-key): what it does not report of how it "
    "builds the cache, e.g. '-ctk q8_0 -ctv q8_0 -fa on -ub 16'"))]
KvCacheDtype = Annotated[str | None, typer.Option("--kv-cache-dtype", help=(
    "vllm: the K/V cache's type, auto | fp8 | fp8_e4m3 | fp8_e5m2 (default auto)"))]
MaxNumBatchedTokens = Annotated[int | None, typer.Option("--max-num-batched-tokens", help=(
    "vllm: tokens per engine step; a longer prompt is prefilled in chunks (default: vLLM's)"))]
SpeculativeConfig = Annotated[str | None, typer.Option("--speculative-config", help=(
    "vllm: speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
    "\"prompt_lookup_max\": 4}' (default: none)"))]


def given(**options: Any) -> dict[str, Any]:
    """The engine options the command line gave: those not left at None (or off)."""
    return {k: v for k, v in options.items() if v is not None and v is not False}


RunDir = Annotated[Path, typer.Argument(help="a run directory made by `stagereplay matched` or `paper`")]
Checkpoint = Annotated[str, typer.Option("--checkpoint", help="which model of the run")]
# Inputs that moved since the run was made: each is checked against the run's hashes before anything runs.
MovedModel = Annotated[str | None, typer.Option("--model", help=(
    "where the run's primary model is now, if it moved (checked against the run's hashes)"))]
MovedLater = Annotated[str | None, typer.Option("--later-model", help=(
    "where the run's later model is now, if it moved (checked against the run's hashes)"))]
MovedData = Annotated[str | None, typer.Option("--data", help=(
    "where the run's data file is now, if it moved (checked against the run's dataset hash)"))]


MovedServer = Annotated[str | None, typer.Option("--url", help=(
    "where the run's server is now, if it moved (--engine http runs; its build and model are compared with the "
    "recorded ones)"))]


def relocation(model: str | None, later_model: str | None, data: str | None = None, server: str | None = None
               ) -> Relocation:
    from stagereplay.audit.relocate import Relocation

    return Relocation(model, later_model, data, server)

