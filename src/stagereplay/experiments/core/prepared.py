"""What a command settled before its first item, and the engine its stages run on.

One frozen `PreparedRun` is made once (`runs.prepare`) and read by everything after it (the manifest is made from it,
and every experiment makes its stage from it). Nothing downstream re-derives or changes what it holds.

    model        the model as this run loads it: its path resolved, its attention, a shared static length
    settings     the boundary rule and the stage-1 budget resolved for this model and these items
    stage1       the typed facts of that resolution (what the manifest records and the header line says)
    items        the items in run order (this shard's), and the hash of their source
    determinism  what fixes the numbers in this process: threads, deterministic algorithms, the fast steps
    engine       the engine whose arms the stages record (ours, or a serving engine) and its identity

The engine (`RunEngine`) is what the side that makes, re-executes and prices a run asks. Our engine (over
transformers) runs every experiment with its own item functions: `Ours` hands each question to the experiment. A
serving engine (`experiments.core.serving_run.ServingRun`) runs the experiments it can build its arms for (matched, the 2x2 and
mismatch's rollouts: it exposes no cache to fingerprint or transplant) with item functions of its own, and refuses the others in one line. An
experiment's `run` asks its prepared run's engine for the section, the batches and the item function, so making a
stage reads the same for both; the audit and plan ask a recorded stage's engine (`experiments.core.serving_run.stage_engine`) for
the job that re-executes a unit and the forwards it made.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.experiments.core.jobs import ReplaySettings
from stagereplay.records.manifest import Stage1Facts, StageSection
from stagereplay.tasks import DataConfig
from stagereplay.tasks.base import Item

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.experiments.core.jobs import Batch, Job, Replay
    from stagereplay.records.ledger import Record, Run
    from stagereplay.records.payloads import PayloadModel


def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only view of a copy of `mapping`."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class PreparedRun:
    """Everything a stage of a run is made from (module docstring)."""

    command: str = field(metadata={"help": "the command that makes or extends the run"})
    model: ModelConfig = field(metadata={"help": "the model as this run loads it"})
    data: DataConfig = field(metadata={"help": "where the items come from"})
    settings: ReplaySettings = field(metadata={"help": "boundary rule, budgets, decoding and scorer, resolved"})
    stage1: Stage1Facts | None = field(metadata={"help": "what the resolution of stage 1 found (None: a run made "
                                                         "before it was recorded)"})
    items: tuple[Item, ...] = field(repr=False, metadata={"help": "the items in run order"})
    data_hash: str = field(metadata={"help": "sha256 of the items' source"})
    engine: RunEngine = field(metadata={"help": "the engine whose arms the stages record"})
    determinism: Mapping[str, Any] = field(default_factory=lambda: frozen({}), metadata={
        "help": "what fixes the numbers in this process (engine.model.set_determinism, the fast steps' outcome)"})
    engine_identity: Mapping[str, Any] | None = field(default=None, metadata={
        "help": "a serving engine's version and settings as it runs them (None: ours)"})
    ex: ExecConfig = field(default_factory=ExecConfig, metadata={"help": "processes and backend"})
    checkpoint: str = field(default="primary", metadata={"help": "which model of the run its stages are at"})
    quiet: bool = field(default=False, metadata={"help": "no progress bars"})

    def at(self, checkpoint: str, model: ModelConfig) -> PreparedRun:
        """The same run at another checkpoint with its model (paper's later one)."""
        from dataclasses import replace

        return replace(self, checkpoint=checkpoint, model=model)


class Runnable(Protocol):
    """What an engine asks of an experiment (`experiments.core.experiment.Experiment` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def command(self) -> str: ...

    @property
    def served(self) -> type | None:
        """How a serving engine runs it (`Experiment.served`: a `core.served.Served` subclass), or None."""

    def check(self, model: ModelConfig, options: Any) -> None: ...

    def identity(self, options: Any) -> dict[str, Any]: ...

    def section(self, prepared: PreparedRun, options: Any, run: Run) -> StageSection: ...

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterable[Batch]: ...

    def work(self, lm: LM, job: Job) -> PayloadModel: ...

    def replay_job(self, replay: Replay) -> Job: ...

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None: ...


class RunEngine(ABC):
    """An engine as a run uses it (module docstring)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The engine's name as `--engine` takes it."""

    def model(self, model: ModelConfig) -> ModelConfig:
        """Our model as this engine's run loads it (a serving engine's without its weights where ours steps
        nothing)."""
        return model

    def run_options(self) -> dict[str, Any]:
        """What the run's identity records of the engine beside the command's options ({} for ours)."""
        return {}

    @property
    def serves(self) -> str | None:
        """The serving engine a run asks for what it serves, whose forwards are not ours (None: ours)."""
        return None

    def run_identity(self, experiment: Runnable, options: Any) -> dict[str, Any]:
        """The run's identity: the experiment's options as this engine runs them, and the engine's own."""
        return {**experiment.identity(options), **self.run_options()}

    def check_source(self, model: str | None) -> None:  # noqa: B027  # ours runs any model
        """Refuse in one line a model it cannot run (None: the embedded toy's folder)."""

    def context(self) -> tuple[int, str] | None:
        """The positions one of its requests may hold, and their name for an error, where its settings bound them
        below the model's context (None: only the model's context does)."""
        return None

    def check_run(self, experiment: Runnable, ex: ExecConfig, decode: DecodeConfig  # noqa: B027  # ours runs anything
                  ) -> None:
        """Refuse in one line, before anything loads, what it cannot run of a run of `experiment` as a whole (its
        processes, its sampling)."""

    @abstractmethod
    def check(self, experiment: Runnable, model: ModelConfig, options: Any) -> None:
        """Refuse in one line, before anything loads, what this engine cannot run of `experiment`."""

    def identity(self, model: ModelConfig) -> dict[str, Any] | None:
        """Its version and settings as it runs them, frozen in the manifest before the first item (None: ours,
        whose environment says it)."""
        return None

    @abstractmethod
    def section(self, experiment: Runnable, prepared: PreparedRun, options: Any, run: Run) -> StageSection: ...

    @abstractmethod
    def batches(self, experiment: Runnable, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterable[Batch]: ...

    @abstractmethod
    def work(self, experiment: Runnable) -> Work:
        """The item function of `experiment` on this engine."""

    def env_work(self, experiment: Runnable) -> Work | None:
        """A job's payload and environment together, where the engine adds its own to the environment (None: the
        environment of the process that ran it, `experiments.core.jobs.with_environment`)."""
        return None

    def exec_config(self, experiment: Runnable, ex: ExecConfig) -> ExecConfig:
        """Where the jobs of `experiment` run."""
        return ex

    @contextmanager
    def failures(self) -> Iterator[None]:
        """Within: its own failures (native code that crashed) become its one-line errors."""
        yield

    @abstractmethod
    def replay_job(self, experiment: Runnable, replay: Replay) -> Job:
        """The job that re-executes one recorded unit of `experiment` on this engine."""

    @abstractmethod
    def unit_forwards(self, experiment: Runnable, record: Record, stage: StageSection) -> list[int] | None:
        """The forwards of ours one recorded unit made (None: not counted)."""


class Ours(RunEngine):
    """Our engine: every experiment, with its own item functions."""

    @property
    def name(self) -> str:
        return "hf"

    def check(self, experiment: Runnable, model: ModelConfig, options: Any) -> None:
        experiment.check(model, options)

    def section(self, experiment: Runnable, prepared: PreparedRun, options: Any, run: Run) -> StageSection:
        return experiment.section(prepared, options, run)

    def batches(self, experiment: Runnable, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterable[Batch]:
        return experiment.batches(prepared, stage, run)

    def work(self, experiment: Runnable) -> Work:
        return experiment.work

    def replay_job(self, experiment: Runnable, replay: Replay) -> Job:
        return experiment.replay_job(replay)

    def unit_forwards(self, experiment: Runnable, record: Record, stage: StageSection) -> list[int] | None:
        return experiment.unit_forwards(record, stage)


OURS = Ours()
