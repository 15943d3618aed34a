"""Mismatch on a serving engine (`mismatch --engine NAME`): the engine as the RL rollout engine, our engine as the
trainer, on the same token IDs (`experiments.mismatch` owns the experiment; this is its part '' in an engine).

Per item, part '', in this order:

    rollout           the engine samples the response (`Samples.sample`: its own sampler, greedy or with the run's
                      temperature, top-k, top-p and the item's derived seed, as ours derives it) and says each
                      emitted token's log-probability; or the rollout is read from a file (`--rollouts`)
    rollout#replica   the same request again: the same tokens and bits where the engine is deterministic
    prefill           the engine's own one-shot prefill of prompt + response (`ScoresPrompt.score`), where the engine
    prefill#replica   scores a sequence in one request under the run's mode (`EngineKind.prompt_scoring`); else not
                      built, and the stage says why (`prefill`)
    incremental       ours, teacher-forced one token per forward (our model, with its weights)

The trainer parts (ours, one-shot, per precision) are `experiments.mismatch.experiment`'s own. A serving engine exposes no cache,
so no K/V transplant is made: the stage's `transplant` says so. Arms computed in the engine name it (`engine`) and
its own precision (`Samples.precision_name`: vLLM's dtype, a GGUF's type and the K/V cache's); ours name ours.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from pydantic import Field

from stagereplay.engine.decode import derive_seed
from stagereplay.engine.lm import LM, ids_fingerprint
from stagereplay.engine.model import ModelConfig
from stagereplay.engine.scoring import Mode
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.experiments.core.jobs import Batch, Job, Params, Replay
from stagereplay.experiments.core.prepared import PreparedRun
from stagereplay.experiments.core.served import Served, served_environment
from stagereplay.experiments.mismatch.item import (
    MismatchParams,
    RolloutEngine,
    Sampled,
    mismatch_item,
    rollout_part,
    scored_arm,
)
from stagereplay.experiments.mismatch.payloads import MismatchPayload, ScoredArm
from stagereplay.experiments.mismatch.stage import MismatchOptions, MismatchStage
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import EngineSection, ModelSection, StageSection
from stagereplay.serving.arms import ServingArms, arms_of, cached_engine
from stagereplay.serving.seam import Generation, PromptScores, Restarts, Samples, Sampling, ScoresPrompt

log = logging.getLogger(__name__)

NO_TRANSPLANT = "none: a serving engine exposes no K/V cache to transplant"


class ServedMismatchStage(MismatchStage):
    """Mismatch's frozen section on a serving engine: what the engine builds of it."""

    prefill: str = Field(description="built: the engine scores each sequence in one request (the prefill arms); "
                                     "else why it is not built")
    transplant: str = Field(description="why no K/V transplant is made")


@dataclass(frozen=True)
class ServedMismatchParams(Params):
    """Part '' of a served mismatch job: the experiment's parameters, the engine's arms (its config carries the
    run's logprobs mode), and whether the engine's prefill arms are built."""

    mismatch: MismatchParams
    arms: ServingArms
    prefill: bool

    @property
    def part(self) -> str:
        return self.mismatch.part


def sampling_of(job: Job[Any]) -> Sampling:
    """The rollout's sampling: the run's decoding with the item's seed, derived as our engine's rollout derives it."""
    dc = job.settings.decode
    return Sampling.of(dc.sample, dc.temperature, dc.top_k, dc.top_p, derive_seed(dc.seed, job.item.id, "rollout"))


def _served(name: str, engine: Any, scores: Generation | PromptScores, tokens_fp: str, mode: Mode, start: int,
            construction: str) -> ScoredArm:
    """An arm the engine computed: its log-probabilities (a rollout's `chosen`, a score's `logprobs`), and the argmax
    of each step where the engine said it."""
    import numpy as np

    from stagereplay.engine.scoring import Scored

    if isinstance(scores, Generation):
        if scores.chosen is None:
            at = f" at {engine.address}" if isinstance(engine, Restarts) else ""
            raise StageReplayError(f"the {engine.name} engine{at} returned no log-probability for every token it "
                                   "drew (a speculating llama-server gives none for the tokens its drafts emit): a "
                                   "rollout this run cannot score, so nothing was recorded from it",
                                   "serve with log-probabilities and without speculative decoding (llama-server: no "
                                   "--spec-type or -md; vLLM: --max-logprobs 1 or more)")
        lps = scores.chosen
        best = tuple(step[0][0] for step in scores.top) if len(scores.top) == len(scores.chosen) else None
    else:
        lps, best = scores.logprobs, scores.argmax
    scored = Scored(np.asarray(lps, dtype=np.float32), None if best is None else np.asarray(best, dtype=np.int32))
    return scored_arm(name, scored, tokens_fp, mode, start, engine.precision_name(), engine=engine.name,
                      construction=construction)


@dataclass(frozen=True)
class ServedEngine(RolloutEngine):
    """A serving engine as the rollout engine: its own sampler with the item's seed (`Samples.sample`), its prefill
    where it scores a sequence in one request (`ScoresPrompt.score`), no transplant (it exposes no cache)."""

    engine: Samples
    sampled: Sampling
    """The rollout's sampling (`sampling_of`)."""
    mode: Mode
    prefill: bool
    """Whether the engine's prefill arms are built."""
    max_new: int

    def sampling(self) -> dict[str, float | int | bool]:
        return self.sampled.as_dict()

    def sample(self, prompt: list[int]) -> Sampled:
        engine, sampling = self.engine, self.sampled
        first = engine.sample(prompt, self.max_new, sampling)
        again = engine.sample(prompt, self.max_new, sampling)
        response = list(first.tokens)
        fp = ids_fingerprint([*prompt, *response])
        arms = [_served("rollout", engine, first, fp, self.mode, len(prompt), "live"),
                _served("rollout#replica", engine, again, ids_fingerprint([*prompt, *again.tokens]), self.mode,
                        len(prompt), "live")]
        return Sampled(response, arms, "eos" if first.finish == "stop" else "length", sampling.as_dict(),
                       again.tokens == first.tokens)

    def prefills(self, prompt: list[int], response: list[int], tokens_fp: str) -> list[ScoredArm]:
        if not self.prefill:
            return []
        assert isinstance(self.engine, ScoresPrompt)
        return [_served(name, self.engine, self.engine.score([*prompt, *response], len(prompt), self.sampled),
                        tokens_fp, self.mode, len(prompt), "oneshot") for name in ("prefill", "prefill#replica")]


def served_mismatch_item(lm: LM, job: Job[Any]) -> MismatchPayload:
    """One item's part: part '' in the engine and ours (module docstring); a trainer part, ours
    (`experiments.mismatch.item.mismatch_item`)."""
    if not isinstance(job.params, ServedMismatchParams):
        return mismatch_item(lm, job)
    p = job.params
    engine = cached_engine(p.arms.engine, lm)
    if not isinstance(engine, Samples):
        raise StageReplayError(f"the {engine.name} engine does not sample rollouts", "run mismatch on our engine")
    side = ServedEngine(engine, sampling_of(job), p.mismatch.mode, p.prefill, job.settings.decode.max_new_tokens)
    return rollout_part(lm, job, p.mismatch, side)


def served_params(params: MismatchParams, arms: ServingArms, prefill: bool) -> Params:
    """A job's parameters on the engine: part '' wrapped with the engine's arms; a trainer part as it is (ours)."""
    return params if params.part else ServedMismatchParams(replace(params, transplant_at=0.0), arms, prefill)


class ServedMismatch(Served):
    """Mismatch with the engine as the rollout engine (`experiments.mismatch.served.served_mismatch_item`): its rollouts, their
    replicas and its own prefill where it scores a sequence, with our incremental score (part ''); the trainer parts
    are ours, as `experiments.mismatch.experiment` makes them. Our model is loaded with its weights: it scores every rollout
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
        """`experiments.mismatch.experiment`'s batches (the rollouts first, then the trainer at each precision on their
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
        return partial(served_environment, work=self.work, served=ServedMismatchParams, arms=arms)

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """A trainer part's, as ours counts them; part '': our incremental score (the prompt, then one token each)."""
        if record.part:
            return self.experiment.unit_forwards(record, stage)
        arms = MismatchPayload.model_validate(record.payload).arms
        ours = next((a for a in arms if a.name == "incremental"), None)
        if ours is None:
            return None
        n = len(arrays.decode(ours.logprobs))
        return [ours.start, *[1] * (n - 1)]
