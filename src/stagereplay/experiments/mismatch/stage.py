"""Mismatch's name, options and frozen section."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from stagereplay.engine.scoring import LAYOUTS, MODES, Layout, Mode
from stagereplay.errors import StageReplayError
from stagereplay.experiments.mismatch.item import MicroBatch, Source
from stagereplay.records.manifest import StageSection

EXPERIMENT = "mismatch"


TRAINER_PRECISIONS = ("bf16", "fp32", "fp16", "bf16-fp32-head")
"""The trainer's precisions: our precisions, and bf16 with the LM head in fp32 (MiniMax-M1's fix)."""


@dataclass(frozen=True)
class MismatchOptions:
    """Mismatch's own options."""

    rollouts: str | None = field(default=None, metadata={"help": (
        "a rollout file to audit instead of generating rollouts: JSONL or Parquet rows of prompt_ids, response_ids and "
        "the rollout engine's logprobs, optionally an id and the row's temperature, top_p, top_k and seed (every side "
        "scores a row under its own; map other names with --columns prompt_ids=COL,response_ids=COL,logprobs=COL,"
        "id=COL,temperature=COL,...)")})
    precisions: tuple[str, ...] = field(default=("bf16", "fp32"), metadata={"help": (
        "the trainer's precisions: bf16, fp32, fp16, bf16-fp32-head (bf16 with the LM head in fp32)")})
    mode: Mode = field(default="raw", metadata={"flag": "--logprobs-mode", "help": (
        "the distribution every side's log-probabilities are taken from: raw (log_softmax of the logits) | processed "
        "(after temperature, top-k and top-p, as vLLM's logprobs_mode names it)")})
    transplant_at: float = field(default=0.5, metadata={"help": (
        "where in the response the K/V transplant happens, as a fraction of its length (0: no transplant)")})
    micro_batch: int = field(default=0, metadata={"help": (
        "also score each trainer sequence inside a micro-batch of N sequences, as trainers batch them (0: alone "
        "only): recorded as trainer@<precision>#batch, beside it the row 'batch composition'")})
    micro_batch_layout: Layout = field(default="padded", metadata={"help": (
        "padded (a row per sequence, right padding and an attention mask) | packed (one row, sequences end to end, "
        "a block-diagonal causal mask, positions per sequence: verl's remove-padding)")})

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", tuple(self.precisions))
        for p in self.precisions:
            if p not in TRAINER_PRECISIONS:
                raise StageReplayError(f"unknown trainer precision {p!r}", f"use {', '.join(TRAINER_PRECISIONS)}")
        if not self.precisions:
            raise StageReplayError("no trainer precision given", "pass --precisions bf16,fp32")
        if self.mode not in MODES:
            raise StageReplayError(f"unknown --logprobs-mode {self.mode!r}", f"use {' or '.join(MODES)}")
        if self.micro_batch < 0 or self.micro_batch == 1:
            raise StageReplayError(f"--micro-batch {self.micro_batch} is not a micro-batch of other sequences",
                                   "pass --micro-batch 2 or more, or 0 to score each sequence alone only")
        if self.micro_batch_layout not in LAYOUTS:
            raise StageReplayError(f"unknown --micro-batch-layout {self.micro_batch_layout!r}",
                                   f"use {' or '.join(LAYOUTS)}")
        if self.micro_batch_layout != "padded" and not self.micro_batch:
            raise StageReplayError(f"--micro-batch-layout {self.micro_batch_layout} lays out micro-batches, and none "
                                   "is asked for", "pass --micro-batch N with it")
        if not 0 <= self.transplant_at < 1:
            raise StageReplayError(f"--transplant-at must lie in [0, 1), got {self.transplant_at}",
                                   "pass e.g. 0.5 (half-way through the response), or 0 for none")


class MismatchStage(StageSection):
    """Mismatch's frozen section."""

    source: Source = Field(description="generated (the run's own rollouts) | file (a rollout file's)")
    precisions: list[str] = Field(description="the trainer's precisions, each a part of every item's unit")
    mode: Mode = Field(description="raw | processed: the distribution the log-probabilities are taken from")
    transplant_at: float = Field(description="the transplant's place in the response (0: none)")
    micro_batch: int | None = Field(None, description="the trainer's micro-batch size, where its sequences are also "
                                                      "scored inside one (absent: alone only)")
    micro_batch_layout: Layout | None = Field(None, description="padded | packed, with micro_batch")

    def batch(self) -> MicroBatch | None:
        """The trainer's micro-batches (None: each sequence alone only)."""
        return MicroBatch(self.micro_batch, self.micro_batch_layout or "padded") if self.micro_batch else None
