"""`echo`: the greedy continuation of each prompt of a matched run, an experiment declared outside stagereplay by an
entry point (this package's pyproject.toml), with its own options, stage section, payload model, summary and table.
Installed, it has its command (`stagereplay echo RUN_DIR`) and every reading command reads its records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter

from stagereplay.engine.lm import LM
from stagereplay.experiments.core.experiment import Batch, Experiment, Replay, SmallRun
from stagereplay.experiments.core.format import Table, as_rows
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.prepared import PreparedRun
from stagereplay.experiments.core.shape import Shape
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import PayloadModel
from stagereplay.records.summary import SummaryModel
from stagereplay.tasks.base import Item

EXTENDS = "matched"
"""The experiment whose run an echo stage extends: its records hold the prompts."""


@dataclass(frozen=True)
class EchoOptions:
    echo_tokens: int = field(default=3, metadata={"help": "tokens each prompt is continued by"})


class EchoStage(StageSection):
    echo_tokens: int = Field(description="tokens each prompt is continued by")


class EchoPayload(PayloadModel):
    """One item's greedy continuation."""

    status: Literal["ok"] = Field(description="continued")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    echoed_ids: list[int] = Field(description="the greedy continuation's token IDs")
    echo_length: int = Field(description="how many tokens it holds")


class EchoSummary(SummaryModel):
    """Echo at one checkpoint: its section of results.json (a list of them)."""

    checkpoint: str = Field(description="the stage's checkpoint")
    items: int = Field(description="items continued")
    echo_length: int = Field(description="tokens continued, over every item")


@dataclass(frozen=True)
class EchoParams(Params):
    echo_tokens: int = 3


class Echo(Experiment[EchoOptions, EchoStage, EchoPayload, EchoSummary]):
    """Each prompt of the run continued greedily."""

    name: ClassVar[str] = "echo"
    shape: ClassVar[Shape] = Shape(continuations=False, label="echo")
    Options: ClassVar[type] = EchoOptions
    Stage: ClassVar[type[StageSection]] = EchoStage
    payload: ClassVar[TypeAdapter[Any]] = TypeAdapter(EchoPayload)
    Summary: ClassVar[type[BaseModel]] = EchoSummary
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--echo-tokens", "2"), extends=EXTENDS)

    def section(self, prepared: PreparedRun, options: EchoOptions, run: Run) -> StageSection:
        return EchoStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                         echo_tokens=options.echo_tokens)

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        """One job per item of the run's matched stage."""
        items = [Item(r.item_id, tuple(r.payload["prompt_ids"]), "") for r in run.find(EXTENDS, prepared.checkpoint)]
        tokens = self.stage_of(stage).echo_tokens
        return [Batch(prepared.model, [Job(item, prepared.settings, EchoParams(tokens)) for item in items])]

    def work(self, lm: LM, job: Job) -> PayloadModel:
        echoed = list(lm.generate(list(job.item.prompt_ids), job.params.echo_tokens))
        return EchoPayload(status="ok", prompt_ids=list(job.item.prompt_ids), echoed_ids=echoed,
                           echo_length=len(echoed))

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        return [(i, "") for i in config.item_ids]

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        echo = self.read(record)
        return [] if len(echo.echoed_ids) == echo.echo_length else ["echo_length is not the continuation's length"]

    def replay_job(self, replay: Replay) -> Job:
        return Job(replay.item, replay.settings, EchoParams(self.stage_of(replay.stage).echo_tokens))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """A prefill of the prompt, then one forward per token after the first."""
        echo = self.read(record)
        return [len(echo.prompt_ids), *[1] * (echo.echo_length - 1)]

    def unit_positions(self, record: Record) -> int:
        echo = self.read(record)
        return len(echo.prompt_ids) + echo.echo_length

    def peak_caches(self, stage: StageSection) -> int:
        return 1

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[EchoSummary]:
        lengths = [self.read(r).echo_length for r in records]
        return [EchoSummary(checkpoint=checkpoint, items=len(lengths), echo_length=sum(lengths))]

    def tables(self, results: list[EchoSummary]) -> list[Table]:
        return [Table("table-echo", f"Echo ({s.checkpoint}): greedy continuations", ("items", "echo_length"),
                      as_rows([[str(s.items), str(s.echo_length)]])) for s in results]

    def read(self, record: Record) -> EchoPayload:
        payload: EchoPayload = self.payload.validate_python(record.payload)
        return payload
