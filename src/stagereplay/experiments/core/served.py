"""How a serving engine runs an experiment (`Served`): an experiment declares the form it is served in with a class of
its own (`Experiment.served`: its section, batches and item function where the engine makes some of its arms), and
`core.serving_run.ServingRun` asks it. Here too what every form shares: what the engine's numbers are made at
(`runs_at`), and the environment a served job's record carries (`with_engine_environment`, `served_environment`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import replace
from functools import lru_cache, partial
from typing import TYPE_CHECKING, Any

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.experiments.core.jobs import Batch, Job, JobResult, Replay, with_environment
from stagereplay.experiments.core.prepared import PreparedRun, Runnable
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import StageSection
from stagereplay.records.payloads import PayloadModel
from stagereplay.records.provenance import environment
from stagereplay.serving.arms import ServingArms, cached_engine
from stagereplay.serving.engines import kind_of
from stagereplay.serving.seam import EngineConfig, Samples

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM


class Served(ABC):
    """How a serving engine runs one experiment (`experiment`), in the form the experiment declares (`Experiment.served`
    names a subclass of its own package)."""

    work: Work
    samples: bool = False
    """Whether its arms are drawn with the run's sampling (else a sampled run is refused: greedy only)."""

    def __init__(self, experiment: Runnable) -> None:
        self.experiment = experiment

    def check(self, arms: ServingArms, model: ModelConfig, options: Any) -> None:  # noqa: B027  # nothing by default
        """Refuse in one line, before anything loads, what the engine cannot run of it."""

    def identity(self, options: Any) -> dict[str, Any]:
        """The experiment's options as the run's identity records them where this engine serves it."""
        return self.experiment.identity(options)

    def check_decode(self, arms: ServingArms, decode: DecodeConfig) -> None:  # noqa: B027  # nothing by default
        """Refuse in one line, before anything loads, a decoding the engine cannot run as asked."""

    @abstractmethod
    def section(self, arms: ServingArms, prepared: PreparedRun, options: Any, run: Run) -> StageSection: ...

    @abstractmethod
    def batches(self, arms: ServingArms, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterable[Batch]:
        """Its jobs, a batch per model setting (a generator may make a batch from the records of the one before)."""

    @abstractmethod
    def replay_job(self, arms: ServingArms, replay: Replay) -> Job: ...

    def exec_config(self, arms: ServingArms) -> ExecConfig:
        return ExecConfig()

    def env_work(self, arms: ServingArms) -> Work:
        """A job's payload and the environment that ran it, the engine's settings included."""
        return partial(with_engine_environment, self.work)

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """The forwards of ours one recorded unit made (None: not counted)."""
        return None  # the engine's forwards are its own (a --cross arm's are ours, but not counted apart)


def runs_at(arms: ServingArms, model: ModelConfig) -> str | None:
    """What an engine that computes in its own types (`EngineKind.own_types`) says its numbers are made at
    (`Samples.precision_name`: a GGUF's model, size and type and the K/V cache's; a server's model type); None for
    an engine loaded at the precision asked (vLLM's dtype), which then stands. The engine is the one the manifest's
    identity was read from."""
    if not arms.kind.own_types:
        return None
    from stagereplay.execution.models import cached_lm

    engine = cached_engine(arms.engine, cached_lm(model))
    return engine.precision_name() if isinstance(engine, Samples) else None


def served_environment(lm: Any, job: Job, work: Work, served: type, arms: ServingArms) -> JobResult:
    """A part the engine runs (its params a `served`) with the engine's settings in its environment; a part of ours,
    which the engine does not run, with the engine's build as installed here (what the audit compares for every
    record of the stage), the engine not loaded."""
    if isinstance(job.params, served):
        return with_engine_environment(work, lm, job)
    out = with_environment(work, lm, job)
    build = _build(arms.engine)
    return out if build is None else replace(out, environment={**out.environment, "engine": {"build": build}})


@lru_cache(maxsize=4)
def _build(config: EngineConfig) -> Mapping[str, object] | None:
    return kind_of(config.name).build(config)


def with_engine_environment(work: Work[PayloadModel], lm: LM, job: Job) -> JobResult:
    """`work(lm, job)` and the environment that ran it, the engine's version and settings included. An engine's
    error names the item it stopped (the records before it stay; a rerun resumes from it)."""
    try:
        payload = work(lm, job)
    except StageReplayError as e:
        raise StageReplayError(f"item {job.item.id}: {e.problem}", e.fix) from e
    engine = cached_engine(job.params.arms.engine, lm)
    return JobResult(payload, {**environment(lm.config.device, lm.determinism), "engine": engine.settings()})
