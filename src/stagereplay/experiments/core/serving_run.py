"""A serving engine as a run uses it (`experiments.core.prepared.RunEngine`): each experiment it runs in the form the
experiment declares (`Experiment.served`, a `core.served.Served` of the experiment's own package), with its own
section, batches and item function, and a one-line refusal for an experiment that declares none (it needs the cache
itself: fingerprints, the bridge, a transplant, draws from a boundary state; the engine exposes no cache).

A stage that names an engine (`StageSection.engine`) is run, re-executed and priced through `stage_engine`, the one
place that tells a serving stage from one of ours.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.execution.local import WorkerDied
from stagereplay.experiments.core.jobs import Batch, Job, Replay
from stagereplay.experiments.core.prepared import OURS, PreparedRun, RunEngine, Runnable
from stagereplay.experiments.core.served import Served
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import StageSection
from stagereplay.serving.arms import ServingArms, cached_engine, check_serving_precision, serving_arms
from stagereplay.serving.engines import config_from_dict
from stagereplay.serving.seam import refuse_cache_access


@dataclass(frozen=True)
class ServingRun(RunEngine):
    """A serving engine with the arms of a run (`ServingArms`), as `experiments.core.prepared.RunEngine`."""

    arms: ServingArms

    @property
    def name(self) -> str:
        return self.arms.engine.name

    def served(self, experiment: Runnable) -> Served:
        """The experiment in the form it declares for a serving engine (`Experiment.served`); refused where it
        declares none (it needs the cache itself)."""
        form = experiment.served
        if form is None:
            raise refuse_cache_access(self.name, f"{experiment.command or experiment.name}")
        return form(experiment)

    def model(self, model: ModelConfig) -> ModelConfig:
        return self.arms.our_model(model)

    def run_options(self) -> dict[str, Any]:
        return {"engine": self.arms.engine.as_dict(), "cross": self.arms.cross}

    @property
    def serves(self) -> str | None:
        return self.name

    def run_identity(self, experiment: Runnable, options: Any) -> dict[str, Any]:
        return {**self.served(experiment).identity(options), **self.run_options()}

    def check(self, experiment: Runnable, model: ModelConfig, options: Any) -> None:
        served = self.served(experiment)
        served.check(self.arms, model, options)
        check_serving_precision(self.arms, model.precision)
        self.arms.kind.require()

    def check_source(self, model: str | None) -> None:
        self.arms.kind.check_model(model)

    def context(self) -> tuple[int, str] | None:
        return self.arms.kind.context(self.arms.engine)  # a request must fit the engine's context too

    def check_run(self, experiment: Runnable, ex: ExecConfig, decode: DecodeConfig) -> None:
        if ex.workers != 1 or ex.executor != "local":
            raise StageReplayError(f"--engine {self.name} runs in this process", "pass --workers 1 --executor local")
        if decode.sample and not self.served(experiment).samples:
            raise StageReplayError(f"--engine {self.name} runs greedy: its sampler is not ours, so draws would not "
                                   "compare across engines", "drop --sample")
        self.served(experiment).check_decode(self.arms, decode)

    def section(self, experiment: Runnable, prepared: PreparedRun, options: Any, run: Run) -> StageSection:
        return self.served(experiment).section(self.arms, prepared, options, run)

    def batches(self, experiment: Runnable, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterable[Batch]:
        return self.served(experiment).batches(self.arms, prepared, stage, run)

    def work(self, experiment: Runnable) -> Work:
        return self.served(experiment).work

    def env_work(self, experiment: Runnable) -> Work | None:
        return self.served(experiment).env_work(self.arms)

    def exec_config(self, experiment: Runnable, ex: ExecConfig) -> ExecConfig:
        return self.served(experiment).exec_config(self.arms)

    @contextmanager
    def failures(self) -> Iterator[None]:
        """A worker whose native code died ends in the engine's one line (the run resumes from the item)."""
        try:
            yield
        except WorkerDied as e:
            raise self.arms.kind.crashed(self.arms.engine, e.problem) from e

    def identity(self, model: ModelConfig) -> dict[str, Any]:
        """The engine's version and settings as it runs them, frozen in the manifest before the first item."""
        from stagereplay.execution.models import cached_lm

        return cached_engine(self.arms.engine, cached_lm(model)).settings()

    def replay_job(self, experiment: Runnable, replay: Replay) -> Job:
        return self.served(experiment).replay_job(self.arms, replay)

    def unit_forwards(self, experiment: Runnable, record: Record, stage: StageSection) -> list[int] | None:
        return self.served(experiment).unit_forwards(record, stage)


def engine_of(name: str, cross: str | None = None, options: Mapping[str, Any] | None = None) -> RunEngine:
    """The engine called `name` with the options given for it: ours for `hf`, else the serving engine's run; an
    option the engine does not take, or a cross arm on our own engine, is refused in one line."""
    arms = serving_arms(name, cross, options)
    return OURS if arms is None else ServingRun(arms)


def stage_engine(stage: StageSection) -> RunEngine:
    """The engine a recorded stage ran on: ours, or the serving engine it names."""
    if stage.engine is None:
        return OURS
    return ServingRun(ServingArms(config_from_dict(stage.engine.as_json()), stage.cross or ""))
