"""What a user asks a run to be made of, as typed option groups: each group one frozen dataclass, each field with its
`help`. The command line's options are made from these fields (`cli.options_from`), grouped in the panels the classes
name; a notebook builds the same objects.

    Input       the model, the items and how to read and score them, which of them (--n, --shard)
    Boundary    where stage 1 ends: a marker, a regex or a count (one of them; none: the model's default rule)
    DecodeConfig  how continuations are decoded (engine.decode)
    Numerics    what fixes the numbers: precision, device, threads, attention, cache kind, rows, kernels
    ExecConfig  processes and backend (execution.config)
    EngineChoice  whose arms: ours, or a serving engine (each engine's own options: its `EngineKind.options`)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as fields_of
from typing import Any, ClassVar

from stagereplay.engine.boundary import BoundaryRule, boundary_from_options
from stagereplay.engine.decode import DecodeConfig
from stagereplay.execution.kernels import check_kernels
from stagereplay.records.shards import parse_shard


@dataclass(frozen=True)
class Input:
    """The model and the items."""

    panel: ClassVar[str] = "Input"

    model: str | None = field(default=None, metadata={"help": (
        "local model directory, or a .gguf file (default: the embedded toy)")})
    data: str | None = field(default=None, metadata={"help": (
        "items: a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk folder, or hf:NAME[:CONFIG][:SPLIT] "
        "(default: the toy task's held-out items)")})
    columns: str | None = field(default=None, metadata={"help": (
        "map the data's fields: TARGET=COLUMN,... with TARGET prompt, messages, user (a one-message chat), answer or "
        "id (GSM8K and MATH-style problem/answer/unique_id rows need none)")})
    n: int | None = field(default=None, metadata={"help": "run the first N items"})
    shard: str | None = field(default=None, metadata={"help": "I/N: run every N-th item from the I-th"})
    scorer: str | None = field(default=None, metadata={"help": (
        "last-number | exact | math (LaTeX answers: the last \\boxed{}, through math-verify) | regex:PATTERN "
        "(default: last-number)")})

    def __post_init__(self) -> None:
        parse_shard(self.shard)


@dataclass(frozen=True)
class Boundary:
    """Where stage 1 ends (one rule at most; none: `</think>` for a reasoning model)."""

    panel: ClassVar[str] = "Stage boundary"

    marker: str | None = field(default=None, metadata={"flag": "--boundary-marker", "help": (
        "stage 1 ends at the first token whose text completes this (default for a reasoning model: </think>)")})
    regex: str | None = field(default=None, metadata={"flag": "--boundary-regex", "help": (
        "stage 1 ends when its text matches (searched in the last 1024 characters and the new token's text)")})
    after: int | None = field(default=None, metadata={"flag": "--boundary-after", "help": (
        "stage 1 is the first N generated tokens")})

    def __post_init__(self) -> None:
        self.rule()

    def rule(self) -> BoundaryRule | None:
        return boundary_from_options(self.marker, self.regex, self.after)

    @classmethod
    def of(cls, rule: BoundaryRule | None) -> Boundary:
        """The group that gives `rule` (a notebook's Marker, Regex or After)."""
        if rule is None:
            return cls()
        kind, _, value = rule.describe().partition(":")
        if kind == "after":
            return cls(after=int(value))
        return cls(marker=value) if kind == "marker" else cls(regex=value)


@dataclass(frozen=True)
class Numerics:
    """What fixes the numbers a forward produces."""

    panel: ClassVar[str] = "Numerics"

    precision: str = field(default="bf16", metadata={"help": "bf16 | fp16 | fp32 | fp32-compute"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda | cuda:<i>"})
    threads: int = field(default=1, metadata={"help": "torch threads per process (fixed, recorded)"})
    attn_impl: str = field(default="auto", metadata={"help": (
        "auto (what transformers picks for the model: sdpa where it has it, else eager; recorded) | eager | sdpa")})
    cache: str = field(default="dynamic", metadata={"help": (
        "dynamic (the default: grows per step, equals generate()) | static (preallocated, equals "
        "generate(cache_implementation='static'); CUDA-graph captured on a GPU)")})
    static_len: int | None = field(default=None, metadata={"help": (
        "with --cache static: positions each cache is allocated, where more than an item needs (the padded keys "
        "change the attention's blocking: a setting to compare). On CUDA the default is the longest item's, one "
        "length for all, so one proof covers the run's graphs")})
    batch: int = field(default=1, metadata={"help": (
        "items stepping together: up to C items' decode steps share one forward of C rows, each row batch-invariant "
        "(its attention per item; recorded, and later stages and the audit follow it); 1 = one item at a time")})
    kernels: str = field(default="auto", metadata={"help": (
        "CPU kernels: native (this machine's own) | portable (ATen and oneDNN on AVX2, MKL on its branch for every "
        "vendor: the same bits on every x86-64 CPU with AVX2) | auto (portable for the embedded toy on a CPU, else "
        "native)")})

    def __post_init__(self) -> None:
        check_kernels(self.kernels)


@dataclass(frozen=True)
class Inputs:
    """What a run is made of, as given: the model and items, the stage boundary, decoding and the numerics. What is
    not given follows from the model (a reasoning model's `</think>`), or is the embedded toy's (its checkpoint, its
    held-out items)."""

    input: Input = field(default_factory=Input)
    boundary: Boundary = field(default_factory=Boundary)
    decode: DecodeConfig = field(default_factory=DecodeConfig, metadata={"panel": "Decoding"})
    numerics: Numerics = field(default_factory=Numerics)

    @classmethod
    def of(cls, boundary: BoundaryRule | None = None, decode: DecodeConfig | None = None, **fields: Any) -> Inputs:
        """The groups from one flat list of their fields, as a notebook writes them:
        `Inputs.of(model=PATH, n=50, boundary=After(16), precision="fp32")`. A name no group has is refused."""
        groups: dict[str, dict[str, Any]] = {"input": {}, "numerics": {}}
        known = {f.name: group for group, kind in (("input", Input), ("numerics", Numerics)) for f in fields_of(kind)}
        for name, value in fields.items():
            if name not in known:
                raise TypeError(f"Inputs.of() got an unexpected field {name!r}")
            groups[known[name]][name] = value
        return cls(Input(**groups["input"]), Boundary.of(boundary), decode or DecodeConfig(),
                   Numerics(**groups["numerics"]))


@dataclass(frozen=True)
class EngineChoice:
    """Whose arms the run records: ours, or a serving engine's (its own options: each engine's panel)."""

    panel: ClassVar[str] = "Engine"

    engine: str = field(default="hf", metadata={"help": (
        "hf (ours) | vllm: live, oneshot and prefix-cache arms in vLLM | llama.cpp: those and the state-restore "
        "arms, on a --model .gguf | http: those arms on a running server (--url; docs/engines.md)")})
    cross: str | None = field(default=None, metadata={"help": (
        "hf: also continue the serving engine's prefixes in ours (the hf-oneshot arm)")})
