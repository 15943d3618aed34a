"""Attest's name, options and frozen section: the claim, its honest variants and the decision's level."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from stagereplay.engine.seeded import DEFAULT as DEFAULT_SAMPLER
from stagereplay.engine.seeded import SAMPLERS
from stagereplay.errors import StageReplayError
from stagereplay.experiments.attest.stats import ALPHA
from stagereplay.experiments.attest.variants import PRECISIONS, parse_variants
from stagereplay.records.manifest import StageSection
from stagereplay.serving.http_honest import check_url

EXPERIMENT = "attest"


HONEST = ("bf16", "fp16", "fp32", "bf16/chunked:16", "bf16/prefix:16", "bf16/batched:4")
"""The default honest variants of a claim of our engine: live decode at each precision, then the constructions a
serving engine uses, at bf16."""


GGUF_OURS = ("fp32",)
"""Our engine's honest variants in the default of a claim of another engine: its fp32 live decode (the reference's
arithmetic, decoded), beside the engine's own defaults (`EngineHonesty.defaults`)."""


CLAIM_ENGINES = ("hf", "llama.cpp", "vllm")
"""The engines a claim may name as serving the model: ours over transformers, llama.cpp, vLLM."""


@dataclass(frozen=True)
class AttestOptions:
    """Attest's own options."""

    served: str | None = field(default=None, metadata={"help": (
        "a file of served outputs to check: JSONL or Parquet rows of prompt_ids, response_ids, and optionally "
        "logprobs and a per-request seed (map other names with --columns); without it the served outputs are decoded here "
        "under --served-precision and --served-checkpoint (a simulation of a server)")})
    served_precision: str = field(default="bf16", metadata={"help": (
        "without --served: the precision the simulated server decodes at (bf16, fp16, fp32)")})
    served_checkpoint: str = field(default="", metadata={"help": (
        "without --served: the checkpoint the simulated server runs: a model folder, or the toy's primary or later "
        "(default: the claimed model itself)")})
    honest: tuple[str, ...] = field(default=(), metadata={"help": (
        "the claimed model's honest variants measured as the null: PRECISION (live decode at bf16, fp16 or fp32), "
        "PRECISION/chunked:N (the prompt prefilled N tokens at a time), PRECISION/prefix:B (the prompt's whole blocks "
        "of B tokens reused from an earlier request's cache), PRECISION/batched:R (one of R concurrent requests), "
        "ENGINE[/SETTING...] (a serving engine's own: llama.cpp, llama.cpp/repack, llama.cpp/flash, "
        "llama.cpp/ubatch:N, llama.cpp/threads:N; url, url/N: the deployments --honest-url names); default: " + ",".join(HONEST) + " for a claim of our engine; "
        + ",".join(GGUF_OURS) + " and the engine's own defaults for another engine's")})
    honest_url: tuple[str, ...] = field(default=(), metadata={"help": (
        "trusted deployments of the claimed model (your own llama-server or vllm serve of the same file), comma-"
        "separated: their greedy answers to every prompt join the null as honest variants url, url/2, ...")})
    alpha: float = field(default=ALPHA, metadata={"help": "the false-positive rate the decision is made at"})
    split_seed: int = field(default=0, metadata={"help": (
        "the seed of the rule that splits the items into calibration (the null) and held-out prompts")})
    seeded_sampler: str = field(default=DEFAULT_SAMPLER, metadata={"help": (
        "a seeded claim (--sample): the server's sampler, replayed with each request's seed: vllm (vLLM on GPUs, "
        "Token-DiFR's replay) or vllm-cpu (vLLM's CPU build)")})
    claim_engine: str = field(default="", metadata={"help": (
        "the engine the claim says serves the model: hf, llama.cpp or vllm (default: llama.cpp for a .gguf file, "
        "else hf); a flag is said only where the honest variants run on it, else the run is inconclusive")})

    def __post_init__(self) -> None:
        object.__setattr__(self, "honest", tuple(self.honest))
        object.__setattr__(self, "honest_url", tuple(check_url(u) for u in self.honest_url))
        parse_variants(self.honest)  # the default's are checked where the claim's engine is known
        if self.seeded_sampler not in SAMPLERS:
            raise StageReplayError(f"unknown seeded sampler {self.seeded_sampler!r}",
                                   f"pass --seeded-sampler {' or '.join(SAMPLERS)}")
        if self.served_precision not in PRECISIONS:
            raise StageReplayError(f"unknown precision {self.served_precision!r} for a decode",
                                   f"use {', '.join(PRECISIONS)}")
        if self.claim_engine and self.claim_engine not in CLAIM_ENGINES:
            raise StageReplayError(f"unknown --claim-engine {self.claim_engine!r}",
                                   f"pass one of {', '.join(CLAIM_ENGINES)}")
        if not 0 < self.alpha < 0.5:
            raise StageReplayError(f"--alpha must lie in (0, 0.5), got {self.alpha}", "pass e.g. --alpha 0.01")


class AttestStage(StageSection):
    """Attest's frozen section."""

    source: str = Field(description="generated (a simulated server, decoded here) | file (served outputs) | server "
                                    "(asked of a running server: the stage's engine)")
    served_model: str | None = Field(None, description="generated: the simulated server's checkpoint folder")
    served_precision: str | None = Field(None, description="generated: the simulated server's precision")
    honest: list[str] = Field(description="the honest variants (experiments.attest.variants), each a part of every "
                                          "item")
    alpha: float = Field(description="the false-positive rate of the decision")
    split_seed: int = Field(description="the seed of the calibration split")
    calibration: list[str] = Field(description="the item ids whose honest responses make the null")
    seeded_sampler: str = Field(DEFAULT_SAMPLER, description="a seeded claim: the server's sampler replayed "
                                                    "(engine.seeded.SAMPLERS)")
    claim_engine: str = Field("hf", description="the engine the claim says serves the model (hf, llama.cpp, vllm)")
    honest_urls: list[str] = Field(default_factory=list, description="the trusted deployments `--honest-url` names: "
                                                                     "honest variants url, url/2, ... ask them")
    honest_engines: dict[str, str] = Field(default_factory=dict, description="per variant of a deployment, the engine "
                                                                             "it runs (llama.cpp, vllm), as it said")

    def served_label(self) -> str:
        if self.source == "file":
            return "a file of served outputs"
        if self.source == "server" and self.engine is not None:
            return f"a running server ({self.engine.name}{': ' + self.runs_at if self.runs_at else ''})"
        return f"simulated: {Path(self.served_model or self.model.path).name} at {self.served_precision}, live decode"

    def claim_label(self) -> str:
        dc = self.settings.decode
        if not dc.sample:
            return "greedy"
        return f"seeded sampling at temperature {dc.temperature:g}, {SAMPLERS[self.seeded_sampler].label}"
