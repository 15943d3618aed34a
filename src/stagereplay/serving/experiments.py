"""Matched and the fixed-prefix 2x2 on a serving engine: the same experiments (their units, claims, summaries and
tables), with the engine's item functions and jobs. A stage that names an engine (`"engine"` in its section) is
run and re-executed in that engine; `experiment_for` finds the experiment of any stage.
"""

from __future__ import annotations

from stagereplay.engine.lm import LM
from stagereplay.errors import StageReplayError
from stagereplay.experiments import registry
from stagereplay.experiments.experiment import Experiment, Replay, Stage
from stagereplay.experiments.jobs import Job
from stagereplay.experiments.matched import Matched
from stagereplay.experiments.precision_2x2 import PrecisionGrid
from stagereplay.records.ledger import Record
from stagereplay.records.payloads import Payload
from stagereplay.serving.matched import ServingMatchedParams, arms_of, serving_matched_item
from stagereplay.serving.precision_2x2 import ServingGridParams, serving_grid_item


class ServingMatched(Matched):
    """Matched on a serving engine (`serving.matched`)."""

    def work(self, lm: LM, job: Job) -> Payload:
        return serving_matched_item(lm, job)

    def replay_job(self, replay: Replay) -> Job:
        """One request at a time: the under-load arms are not re-executed (`serving.replay.replayable`)."""
        return Job(replay.item, replay.settings, ServingMatchedParams(arms_of(replay.stage)))

    def unit_forwards(self, record: Record, stage: Stage) -> list[int] | None:
        return None  # the engine's forwards are its own (a --cross arm's are ours, but not counted apart)


class ServingGrid(PrecisionGrid):
    """The 2x2 on a serving engine's matched run (`serving.precision_2x2`)."""

    def work(self, lm: LM, job: Job) -> Payload:
        return serving_grid_item(lm, job)

    def replay_job(self, replay: Replay) -> Job:
        return Job(replay.item, replay.settings, ServingGridParams(
            tuple(replay.prefix or ()), tuple(replay.stage["constructions"]), replay.record.part,
            arms_of(replay.stage)))

    def unit_forwards(self, record: Record, stage: Stage) -> list[int] | None:
        return None


SERVING: dict[str, Experiment] = {e.name: e for e in (ServingMatched(), ServingGrid())}
"""The experiments a serving engine runs, by name."""


def experiment_for(stage_name: str, stage: Stage) -> Experiment:
    """The experiment that runs and re-executes a manifest stage: its registry entry, or that experiment on the
    serving engine the stage names."""
    experiment = registry.of_stage(stage_name)
    if "engine" not in stage:
        return experiment
    if experiment.name not in SERVING:
        raise StageReplayError(f"stage {stage_name} names a serving engine, which runs no {experiment.name}",
                               f"a serving engine runs {', '.join(SERVING)}")
    return SERVING[experiment.name]
