"""A serving engine as a run uses it (`experiments.prepared.RunEngine`): the experiments it builds arms for, each
with its own section, batches and item function, and a one-line refusal for the others.

    matched         live, oneshot and prefix-cache (and what the engine's capabilities add), each with a replica,
                    in the engine; `--cross hf` replays its prefixes in ours (`serving.matched`)
    precision_2x2   its arms on the matched run's prefixes crossed with precision (`serving.precision_2x2`)
    mismatch        the engine's sampled rollouts and its own prefill of them, our engine's scores of the same
                    tokens (incremental, and the trainer's one-shot per precision) (`serving.mismatch`)
    attest          the engine's served response to each prompt, greedy or seeded as claimed; the claimed model's
                    honest variants and reference scores in ours (`serving.attest`)

Matched and the 2x2 run greedy (their arms are compared across engines, whose samplers differ); mismatch draws its
rollouts with the run's sampling, in the engine's own sampler (every other side is teacher-forced on those tokens).

An experiment that needs the cache itself (fingerprints, the bridge, a transplant, draws from a boundary state) is
refused: the engine exposes no cache. A stage that names an engine (`StageSection.engine`) is run, re-executed and
priced through `stage_engine`, the one place that tells a serving stage from one of ours.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from typing import Any

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.execution.local import WorkerDied
from stagereplay.experiments.attest import AttestOptions, AttestStage
from stagereplay.experiments.experiment import Batch, Replay
from stagereplay.experiments.jobs import Job, JobResult, with_environment
from stagereplay.experiments.matched import MatchedOptions, MatchedStage, fixed_prefixes
from stagereplay.experiments.mismatch import MismatchOptions
from stagereplay.experiments.precision_2x2 import GridOptions, GridStage
from stagereplay.experiments.prepared import OURS, PreparedRun, RunEngine, Runnable
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import EngineSection, ModelSection, StageSection
from stagereplay.serving.attest import ServedAttestParams, served_attest_item
from stagereplay.serving.attest import served_params as attest_params
from stagereplay.serving.engines import config_from_dict, kind_of
from stagereplay.serving.matched import (
    ServingArms,
    ServingMatchedParams,
    arms_of,
    cached_engine,
    check_serving_precision,
    note_resume,
    serving_arms,
    serving_matched_item,
    with_engine_environment,
)
from stagereplay.serving.mismatch import (
    NO_TRANSPLANT,
    ServedMismatchParams,
    ServedMismatchStage,
    served_mismatch_item,
    served_params,
)
from stagereplay.serving.precision_2x2 import (
    ServingGridParams,
    check_serving_constructions,
    serving_grid_item,
)
from stagereplay.serving.seam import EngineConfig, Restarts, Samples, refuse_cache_access

log = logging.getLogger(__name__)


class Served(ABC):
    """How a serving engine runs one experiment (`experiment`), in the form the experiment asks for (`FORMS`)."""

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


class ServedMatched(Served):
    """Matched in the engine (`serving.matched.serving_matched_item`)."""

    work = staticmethod(serving_matched_item)

    def check(self, arms: ServingArms, model: ModelConfig, options: MatchedOptions) -> None:
        engine = arms.engine.name
        if options.construction != "oneshot":
            raise StageReplayError(f"--construction {options.construction} is our engine's; --engine {engine} runs "
                                   "oneshot and prefix-cache", "drop --construction")
        if options.generated():
            raise StageReplayError(f"{options.generated().describe()} builds live in our engine, through transformers",
                                   "a serving engine's own option is its own: drop --speculate/--quantized-cache")

    def section(self, arms: ServingArms, prepared: PreparedRun, options: Any, run: Run) -> StageSection:
        return MatchedStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                            construction="oneshot", engine=EngineSection.model_validate(arms.engine.as_dict()),
                            cross=arms.cross, arms=list(arms.fresh), runs_at=runs_at(arms, prepared.model))

    def batches(self, arms: ServingArms, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        """Every item with the prompts of the items in flight around its under-load arms. A resumed run asks an
        engine that restarts (a server) whether it did since the last record (its caches are then cold)."""
        done = run.find(self.experiment.name, prepared.checkpoint)
        if done:
            from stagereplay.execution.models import cached_lm

            engine = cached_engine(arms.engine, cached_lm(prepared.model))
            if isinstance(engine, Restarts):
                note_resume(run, done, engine)
        items = list(prepared.items)
        return [Batch(prepared.model, [Job(item, prepared.settings, ServingMatchedParams(arms, arms.traffic(items, i)))
                                       for i, item in enumerate(items)], at=stage.runs_at)]

    def replay_job(self, arms: ServingArms, replay: Replay) -> Job:
        """One request at a time: the under-load arms are not re-executed (`serving.replay.replayable`)."""
        return Job(replay.item, replay.settings, ServingMatchedParams(arms))

    def exec_config(self, arms: ServingArms) -> ExecConfig:
        # An engine of native code that may crash runs in a worker process: a crash there ends in one line, and the
        # run resumes.
        return ExecConfig(isolated=arms.kind.isolated)


class ServedGrid(Served):
    """The 2x2 in the engine on the matched run's prefixes (`serving.precision_2x2.serving_grid_item`)."""

    work = staticmethod(serving_grid_item)

    def check(self, arms: ServingArms, model: ModelConfig, options: GridOptions) -> None:
        check_serving_constructions(options.constructions or arms.grid, arms)
        for p in options.precisions:
            check_serving_precision(arms, p)

    def section(self, arms: ServingArms, prepared: PreparedRun, options: GridOptions, run: Run) -> StageSection:
        return GridStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                         constructions=list(options.constructions or arms.grid), precisions=list(options.precisions),
                         engine=EngineSection.model_validate(arms.engine.as_dict()), cross=arms.cross)

    def batches(self, arms: ServingArms, prepared: PreparedRun, stage: StageSection, run: Run) -> list[Batch]:
        own = stage.as_stage(GridStage)
        fixed = fixed_prefixes(run, prepared.checkpoint)
        return [Batch(prepared.model.with_precision(p),
                      [Job(item, prepared.settings, ServingGridParams(tuple(prefix), tuple(own.constructions), p, arms))
                       for item, prefix in fixed])
                for p in own.precisions]

    def replay_job(self, arms: ServingArms, replay: Replay) -> Job:
        own = replay.stage.as_stage(GridStage)
        return Job(replay.item, replay.settings, ServingGridParams(
            tuple(replay.prefix or ()), tuple(own.constructions), replay.record.part, arms))


class ServedMismatch(Served):
    """Mismatch with the engine as the rollout engine (`serving.mismatch.served_mismatch_item`): its rollouts, their
    replicas and its own prefill where it scores a sequence, with our incremental score (part ''); the trainer parts
    are ours, as `experiments.mismatch` makes them. Our model is loaded with its weights: it scores every rollout
    (the stage's `cross` is ours, so the audit loads it the same way)."""

    work = staticmethod(served_mismatch_item)
    samples = True

    @staticmethod
    def moded(arms: ServingArms, mode: str) -> ServingArms:
        """The arms with the engine asked for `mode`'s log-probabilities, our engine scoring its tokens."""
        return ServingArms(replace(arms.engine, logprobs_mode=mode), "hf")

    def check(self, arms: ServingArms, model: ModelConfig, options: MismatchOptions) -> None:
        self.experiment.check(model, options)
        name, kind = arms.engine.name, arms.kind
        if not issubclass(kind.engine, Samples):
            raise StageReplayError(f"the {name} engine does not sample rollouts", "run mismatch on our engine "
                                                                                  "(drop --engine)")
        config = self.moded(arms, options.mode).engine
        if options.rollouts is not None:
            reason = kind.prompt_scoring(config)
            if reason is not None:
                raise StageReplayError(f"--rollouts with --engine {name} measures nothing of the engine: {reason}",
                                       "drop --engine (our engine audits a rollout file on its own)")
            return
        modes = kind.logprobs_modes(config)
        if options.mode not in modes:
            gives = f"only {' and '.join(modes)} ones" if modes else "none"
            raise StageReplayError(f"--engine {name} gives no {options.mode} log-probabilities here ({gives}; a "
                                   "server's are those it was started with, as --server-args declares them)",
                                   f"pass --logprobs-mode {' or '.join(modes)}" if modes else "drop --engine")

    def section(self, arms: ServingArms, prepared: PreparedRun, options: MismatchOptions, run: Run) -> StageSection:
        moded = self.moded(arms, options.mode)
        reason = arms.kind.prompt_scoring(moded.engine)
        if reason is not None:
            log.info(f"note: no prefill rows (construction, engine): {reason}")
        return ServedMismatchStage(
            model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
            source="file" if options.rollouts else "generated", precisions=list(options.precisions), mode=options.mode,
            transplant_at=0.0, engine=EngineSection.model_validate(moded.engine.as_dict()), cross=moded.cross,
            prefill="built" if reason is None else f"not built: {reason}", transplant=NO_TRANSPLANT)

    def batches(self, arms: ServingArms, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterator[Batch]:
        """`experiments.mismatch`'s batches (the rollouts first, then the trainer at each precision on their
        tokens), every one on our model with its weights, part '' in the engine."""
        moded, built = arms_of(stage), stage.as_stage(ServedMismatchStage).prefill == "built"
        ours = replace(prepared, model=replace(prepared.model, weights=True))
        for batch in self.experiment.batches(ours, stage, run):
            yield Batch(batch.model, [replace(job, params=served_params(job.params, moded, built))
                                      for job in batch.jobs])

    def replay_job(self, arms: ServingArms, replay: Replay) -> Job:
        job = self.experiment.replay_job(replay)
        built = replay.stage.as_stage(ServedMismatchStage).prefill == "built"
        return replace(job, params=served_params(job.params, arms, built))

    def exec_config(self, arms: ServingArms) -> ExecConfig:
        return ExecConfig(isolated=arms.kind.isolated)

    def env_work(self, arms: ServingArms) -> Work:
        return partial(_served_environment, work=self.work, served=ServedMismatchParams, arms=arms)

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """A trainer part's, as ours counts them; part '': our incremental score (the prompt, then one token each)."""
        if record.part:
            return self.experiment.unit_forwards(record, stage)
        ours = next((a for a in record.payload.get("arms", []) if a.get("name") == "incremental"), None)
        if ours is None:
            return None
        n = len(arrays.decode(ours["logprobs"]))
        return [int(ours["start"]), *[1] * (n - 1)]


def _served_environment(lm: Any, job: Job, work: Work, served: type, arms: ServingArms) -> JobResult:
    """A part the engine runs (its params a `served`) with the engine's settings in its environment; a part of ours,
    which the engine does not run, with the engine's build as installed here (what the audit compares for every
    record of the stage), the engine not loaded."""
    if isinstance(job.params, served):
        return with_engine_environment(work, lm, job)
    out = with_environment(work, lm, job)
    build = _build(arms.engine)
    return out if build is None else replace(out, environment={**out.environment, "engine": {"build": build}})


class ServedAttest(Served):
    """Attest with the engine as the server under test (`serving.attest.served_attest_item`): its served response
    to each prompt (part ''); the honest variants and the reference's scores are ours, as `experiments.attest`
    makes them, on our model with its weights (the stage's `cross` is ours, so the audit loads it the same way)."""

    work = staticmethod(served_attest_item)
    samples = True

    def check(self, arms: ServingArms, model: ModelConfig, options: AttestOptions) -> None:
        """The served outputs come from the engine: a file of them, or a simulated server's setting, is refused with
        it; so are the arms an engine option adds (matched's), which attest does not make."""
        self.experiment.check(model, options)
        name = arms.engine.name
        if options.served is not None:
            raise StageReplayError(f"--served gives the served outputs, and --engine {name} asks a server for them",
                                   f"pass one of --served FILE or --engine {name}")
        given = [flag for flag, on in (("--served-precision", options.served_precision != AttestOptions.served_precision),
                                       ("--served-checkpoint", bool(options.served_checkpoint))) if on]
        if given:
            raise StageReplayError(f"{', '.join(given)} simulate a server, and --engine {name} asks a real one",
                                   f"drop {', '.join(given)}")
        if not issubclass(arms.kind.engine, Samples):
            raise StageReplayError(f"the {name} engine does not serve a response as asked",
                                   "attest a running server (--engine http --url URL), or a file of its outputs")
        plain = EngineConfig(name, arms.kind.options())  # the engine's own arms, with no option given
        extra = [a for a in arms.kind.arms(arms.engine) if a not in arms.kind.arms(plain)]
        if extra:
            raise StageReplayError(f"attest sends one request per prompt: the {', '.join(extra)} arms an option of "
                                   f"--engine {name} adds are matched's", "drop the option that adds them")

    def identity(self, options: AttestOptions) -> dict[str, Any]:
        """The served outputs are the server's: no simulated setting is part of the run."""
        own = self.experiment.identity(options)
        return {**{k: v for k, v in own.items() if not k.startswith("served_")}, "source": "server"}

    def check_decode(self, arms: ServingArms, decode: DecodeConfig) -> None:
        """A seeded claim needs a server whose seeded draws are the sampler the reference replays."""
        reason = arms.kind.seeded_draws(arms.engine) if decode.sample else None
        if reason is not None:
            raise StageReplayError(f"a seeded claim (--sample) cannot be checked here: {reason}",
                                   "check the server's greedy outputs (drop --sample)")

    @staticmethod
    def ours(arms: ServingArms) -> ServingArms:
        return ServingArms(arms.engine, "hf")

    def section(self, arms: ServingArms, prepared: PreparedRun, options: AttestOptions, run: Run) -> StageSection:
        own = self.experiment.section(prepared, options, run).as_stage(AttestStage)
        return own.model_copy(update={
            "source": "server", "served_model": None, "served_precision": None,
            "engine": EngineSection.model_validate(arms.engine.as_dict()), "cross": self.ours(arms).cross,
            "runs_at": runs_at(arms, prepared.model)})

    def batches(self, arms: ServingArms, prepared: PreparedRun, stage: StageSection, run: Run) -> Iterator[Batch]:
        """`experiments.attest`'s batches (the served responses, the honest variants, the reference's scores of
        them), every one on our model with its weights, part '' asked of the engine."""
        ours = replace(prepared, model=replace(prepared.model, weights=True))
        for batch in self.experiment.batches(ours, stage, run):
            yield replace(batch, jobs=[replace(job, params=attest_params(job.params, arms)) for job in batch.jobs])

    def replay_job(self, arms: ServingArms, replay: Replay) -> Job:
        job = self.experiment.replay_job(replay)
        return replace(job, params=attest_params(job.params, arms))

    def exec_config(self, arms: ServingArms) -> ExecConfig:
        return ExecConfig(isolated=arms.kind.isolated)

    def env_work(self, arms: ServingArms) -> Work:
        return partial(_served_environment, work=self.work, served=ServedAttestParams, arms=arms)

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """Ours, as the experiment counts them (part '': none, the server's own)."""
        return self.experiment.unit_forwards(record, stage)


@lru_cache(maxsize=4)
def _build(config: EngineConfig) -> Mapping[str, object] | None:
    return kind_of(config.name).build(config)


FORMS: dict[str, type[Served]] = {"arms": ServedMatched, "prefix_arms": ServedGrid, "rollouts": ServedMismatch,
                                  "served": ServedAttest}
"""How a serving engine runs an experiment, by the form the experiment asks for (`Experiment.serving`): arms from
the prompt (matched's), arms on the matched run's prefixes per precision (the 2x2's), rollouts sampled in the engine
and scored teacher-forced (mismatch's), a served response per prompt checked against the claimed model (attest's)."""


@dataclass(frozen=True)
class ServingRun(RunEngine):
    """A serving engine with the arms of a run (`ServingArms`), as `experiments.prepared.RunEngine`."""

    arms: ServingArms

    @property
    def name(self) -> str:
        return self.arms.engine.name

    def served(self, experiment: Runnable) -> Served:
        """The experiment in the form it asks of a serving engine (`Experiment.serving`); refused where it asks
        for none (it needs the cache itself)."""
        form = FORMS.get(experiment.serving or "")
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
