"""Attest on a running server (`attest --engine http --url URL`): each item's served response (part '') asked of the
server itself, token IDs in and out; every other part (the claimed model's honest variants and its reference scores)
is `experiments.attest.experiment`'s own, in our engine, exactly as for a file of served outputs.

    served    one request for the item's prompt IDs (`Samples.sample`: llama-server's /completion, vLLM's
              /v1/completions), nothing cached, at most --max-new-tokens, greedy (temperature 0) or, for a seeded
              claim, with the run's temperature, top-k, top-p and the item's seed; the reply's token IDs, and the
              log-probability the server gave each (its raw distribution) where it gave one for every token

Every part's seed is folded below the span a server takes (`SEED_SPAN`), so the seed the reference replays is the
one the server drew with. The server was checked against the claimed model's tokenizer before the first item
(`ChecksFirst`: token IDs taken verbatim, greedy at temperature 0, the same tokenizer); every reply is read and checked
where it arrives (`serving.replies`), and one that is not token IDs of that tokenizer is refused in one line, naming
the item: exit 2, never read as a verdict, and no record made from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM, ids_fingerprint
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.experiments.attest.item import AttestParams, attest_item, item_seed, max_new
from stagereplay.experiments.attest.payloads import AttestPayload
from stagereplay.experiments.attest.stage import AttestOptions, AttestStage
from stagereplay.experiments.core.jobs import Batch, Job, Params, Replay
from stagereplay.experiments.core.prepared import PreparedRun
from stagereplay.experiments.core.served import Served, runs_at, served_environment
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import EngineSection, StageSection
from stagereplay.serving.arms import ServingArms, cached_engine
from stagereplay.serving.seam import SEED_SPAN, EngineConfig, Generation, Samples, Sampling


@dataclass(frozen=True)
class ServedAttestParams(Params):
    """Part '' of an attest job on a server: the experiment's parameters and the engine that serves it."""

    attest: AttestParams
    arms: ServingArms

    @property
    def part(self) -> str:
        return self.attest.part


def served_params(params: AttestParams, arms: ServingArms) -> Params:
    """A job's parameters on a server: every part's seeds folded to the server's span; part '' asked of the server,
    the others as they are (ours)."""
    params = replace(params, seed_span=SEED_SPAN)
    return params if params.part else ServedAttestParams(params, arms)


def token_ids(g: Generation, vocab: int, where: str) -> list[int]:
    """The reply's tokens, each a token ID of the claimed model's tokenizer; else refused in one line."""
    bad = next((t for t in g.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise StageReplayError(f"{where} returned {bad}, not a token ID of the claimed model's tokenizer "
                               f"(0..{vocab - 1})", "serve the claimed model (--model names the model the server "
                                                    "should be running)")
    if not g.tokens:
        raise StageReplayError(f"{where} returned no token IDs (a text completion only)",
                               "serve with an API that returns token IDs: llama-server's /completion, vLLM's "
                               "/v1/completions (return_tokens_as_token_ids)")
    return list(g.tokens)


def served_logprobs(g: Generation) -> str | None:
    """The server's log-probability of each served token, encoded; None where it did not give one for each."""
    import numpy as np

    chosen = g.chosen
    if chosen is None or len(chosen) != len(g.tokens) or any(math.isnan(x) for x in chosen):
        return None
    return arrays.encode(np.asarray(chosen, dtype=np.float32), "f32")


def served_part(lm: LM, job: Job[ServedAttestParams]) -> AttestPayload:
    """The item's response as the server serves it (module docstring)."""
    p, dc, item = job.params, job.settings.decode, job.item
    engine = cached_engine(p.arms.engine, lm)
    if not isinstance(engine, Samples):
        raise StageReplayError(f"the {engine.name} engine does not serve a response as asked",
                               "attest a running server (--engine http --url URL), or a file of its outputs")
    prompt = list(item.prompt_ids)
    seed = item_seed(item, dc, p.attest.columns, p.attest.seed_span)
    sampling = Sampling.of(dc.sample, dc.temperature, dc.top_k, dc.top_p, seed or 0)
    g = engine.sample(prompt, max_new(item, dc), sampling)
    response = token_ids(g, len(lm.tokenizer), f"the {engine.name} engine, asked for item {item.id},")
    return AttestPayload(status="ok", kind="served", source="server", prompt_ids=prompt, response_ids=response,
                         tokens_fp=ids_fingerprint([*prompt, *response]), precision=engine.precision_name(),
                         seed=seed, stop="eos" if g.finish == "stop" else "length", logprobs=served_logprobs(g))


def served_attest_item(lm: LM, job: Job[Any]) -> AttestPayload:
    """One item's part: part '' asked of the server; an honest or reference part, ours (`attest_item`)."""
    return served_part(lm, job) if isinstance(job.params, ServedAttestParams) else attest_item(lm, job)


class ServedAttest(Served):
    """Attest with the engine as the server under test (`experiments.attest.served.served_attest_item`): its served response
    to each prompt (part ''); the honest variants and the reference's scores are ours, as `experiments.attest.experiment`
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
        """`experiments.attest.experiment`'s batches (the served responses, the honest variants, the reference's scores of
        them), every one on our model with its weights, part '' asked of the engine."""
        ours = replace(prepared, model=replace(prepared.model, weights=True))
        for batch in self.experiment.batches(ours, stage, run):
            yield replace(batch, jobs=[replace(job, params=served_params(job.params, arms)) for job in batch.jobs])

    def replay_job(self, arms: ServingArms, replay: Replay) -> Job:
        job = self.experiment.replay_job(replay)
        return replace(job, params=served_params(job.params, arms))

    def exec_config(self, arms: ServingArms) -> ExecConfig:
        return ExecConfig(isolated=arms.kind.isolated)

    def env_work(self, arms: ServingArms) -> Work:
        return partial(served_environment, work=self.work, served=ServedAttestParams, arms=arms)

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """Ours, as the experiment counts them (part '': none, the server's own)."""
        return self.experiment.unit_forwards(record, stage)
