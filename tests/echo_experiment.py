"""An experiment defined outside the package, in this one module: `echo`, the greedy continuation of each of a run's
prompts, with its own payload model, section, results and table. Registered by a test (`registry.register(Echo())`,
the one registry line), it has its command and every reading command reads its records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field, TypeAdapter

from stagereplay.engine.lm import LM
from stagereplay.experiments.experiment import Batch, Experiment, Replay
from stagereplay.experiments.format import Table, as_rows
from stagereplay.experiments.jobs import Job, Params
from stagereplay.records.ledger import Record
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import PayloadModel
from stagereplay.tasks.base import Item


@dataclass(frozen=True)
class EchoOptions:
    echo_tokens: int = field(default=3, metadata={"help": "tokens the prompt is continued by"})


class EchoStage(StageSection):
    echo_tokens: int = Field(description="tokens each prompt is continued by")


class EchoPayload(PayloadModel):
    """One item's greedy continuation."""

    status: Literal["ok"] = Field(description="continued")
    prompt_ids: list[int] = Field(description="the prompt's token IDs")
    echoed_ids: list[int] = Field(description="the greedy continuation's token IDs")
    echo_length: int = Field(description="how many tokens it holds")


@dataclass(frozen=True)
class EchoParams(Params):
    echo_tokens: int = 3


class Echo(Experiment):
    """Each prompt of the run continued greedily: a stage defined outside the package."""

    name: ClassVar[str] = "echo"
    Stage: ClassVar[type[StageSection]] = EchoStage
    Options: ClassVar[type] = EchoOptions
    payload: ClassVar[TypeAdapter[Any]] = TypeAdapter(EchoPayload)
    command: ClassVar[str] = "echo"
    continuations: ClassVar[bool] = False
    label: ClassVar[str] = "echo"

    def section(self, prepared: Any, options: EchoOptions, run: Any) -> StageSection:
        return EchoStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                         echo_tokens=options.echo_tokens)

    def batches(self, prepared: Any, stage: StageSection, run: Any) -> list[Batch]:
        """One job per item of the run's matched stage (the stage it extends)."""
        items = [Item(r.item_id, tuple(r.payload["prompt_ids"]), "") for r in run.find("matched", prepared.checkpoint)]
        return [Batch(prepared.model, [Job(item, prepared.settings, EchoParams(self.stage_of(stage).echo_tokens))
                                       for item in items])]

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
        echo = self.read(record)
        return [len(echo.prompt_ids), *[1] * (echo.echo_length - 1)]

    def unit_positions(self, record: Record) -> int:
        echo = self.read(record)
        return len(echo.prompt_ids) + echo.echo_length

    def peak_caches(self, stage: StageSection) -> int:
        return 1

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[dict[str, Any]]:
        lengths = [self.read(r).echo_length for r in records]
        return [{"checkpoint": checkpoint, "items": len(lengths), "echo_length": sum(lengths)}]

    def tables(self, results: Any) -> list[Table]:
        return [Table("table-echo", f"Echo ({s['checkpoint']}): greedy continuations", ("items", "echo_length"),
                      as_rows([[str(s["items"]), str(s["echo_length"])]])) for s in results or []]
