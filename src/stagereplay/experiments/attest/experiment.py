"""Attest: is a server running the model it claims? Its served tokens scored against the claimed model's one-shot
reference, and tested against the honest floor measured here on the same prompts.

Per item, four kinds of unit (`experiments.attest.payloads`):

    ''            the served response: a file's row (`--served FILE`, the rollout-file format: prompt_ids,
                  response_ids, logprobs, optional seed), asked of a running server (`--engine http --url URL`,
                  `experiments.attest.served`), or decoded here under a stated served setting (`--served-precision`,
                  `--served-checkpoint`): a simulation of a server, not a server
    <variant>     an honest variant (`--honest`, `experiments.attest.variants`): the claimed model decoded at a
                  precision (bf16, fp16, fp32) from a live cache, a chunked prefill, a reused prefix, or as one of
                  several concurrent requests, with the claimed sampler (greedy, or vLLM's seeded Gumbel-max pick
                  with the request's seed)
    reference     the claimed model at the run's precision, one forward over prompt + response per side, scoring
                  the served response and every honest one (`engine.reference.reference_scores`)

The items split into calibration and held-out by a seeded rule frozen in the stage (`calibration`): the honest
responses to the calibration prompts make the null; the served run is decided against it at `--alpha`
(`experiments.attest.stats.decide`), and the honest variants' own responses to held-out prompts, each decided alone,
give the false-positive rate (`experiments.attest.summary`).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from stagereplay.engine.decode import DecodeConfig, derive_seed
from stagereplay.engine.lm import ids_fingerprint
from stagereplay.engine.model import ModelConfig
from stagereplay.engine.seeded import DEFAULT as DEFAULT_SAMPLER
from stagereplay.errors import FLAGGED, INCONCLUSIVE, OK, StageReplayError
from stagereplay.experiments.attest.item import (
    EXTRA_SCORES,
    LIVE,
    REFERENCE,
    SCORES,
    AttestParams,
    attest_item,
    scores_fingerprint,
)
from stagereplay.experiments.attest.payloads import MODELS, AttestPayload, Source
from stagereplay.experiments.attest.served import ServedAttest
from stagereplay.experiments.attest.stage import EXPERIMENT, GGUF_OURS, HONEST, AttestOptions, AttestStage
from stagereplay.experiments.attest.summary import AttestSummary
from stagereplay.experiments.attest.variants import (
    ENGINE_VARIANTS,
    EngineVariant,
    HonestVariant,
    Variant,
    parse_variants,
    variant_of,
)
from stagereplay.experiments.core.experiment import (
    Assumed,
    Batch,
    Planned,
    Replay,
    SmallRun,
)
from stagereplay.experiments.core.figures import ReportFigure
from stagereplay.experiments.core.format import Table
from stagereplay.experiments.core.jobs import Job
from stagereplay.experiments.core.response import ResponseExperiment
from stagereplay.experiments.core.served import Served
from stagereplay.experiments.core.shape import RESPONSES, Shape
from stagereplay.experiments.core.verdict import Fact
from stagereplay.records.ledger import Record, Run
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payloads import first_error
from stagereplay.serving.http_honest import FAMILY as DEPLOYMENT
from stagereplay.serving.http_honest import engine_name as deployment_engine
from stagereplay.serving.http_honest import index as deployment_index

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.experiments.core.compared import RunComparison
    from stagereplay.experiments.core.prepared import PreparedRun
    from stagereplay.records.differences import Differences

MIN_ITEMS = 2
"""A decision needs a calibration prompt and a held-out one: its interval is over responses."""
PAYLOAD: TypeAdapter[AttestPayload] = TypeAdapter(AttestPayload)


def calibration_split(item_ids: list[str], seed: int) -> list[str]:
    """The calibration items: half of them (rounded up, at least one, at most all but one), chosen by each id's
    seeded draw, in the items' order."""
    ranked = sorted(item_ids, key=lambda i: random.Random(derive_seed(seed, i, "calibration")).random())
    k = min(max(1, (len(item_ids) + 1) // 2), max(1, len(item_ids) - 1))
    chosen = set(ranked[:k])
    return [i for i in item_ids if i in chosen]


def honest_of(model: ModelConfig, options: AttestOptions) -> tuple[str, ...]:
    """The honest variants of the run: the option's, else the claim's engine's default (module `HONEST`,
    `GGUF_OURS` and the engine's own `EngineHonesty.defaults`); then a variant per trusted deployment
    (`--honest-url`) the option does not name already."""
    urls = deployment_variants(options)
    if options.honest:
        return (*options.honest, *(u for u in urls if u not in options.honest))
    engine = claim_engine(model, options)
    found = ENGINE_VARIANTS.get(engine)
    return (*(HONEST if found is None else (*GGUF_OURS, *found.defaults)), *urls)


def deployment_variants(options: AttestOptions) -> tuple[str, ...]:
    """The honest variants of the trusted deployments `--honest-url` names: url, url/2, ..."""
    return tuple(DEPLOYMENT if i == 0 else f"{DEPLOYMENT}/{i + 1}" for i in range(len(options.honest_url)))


def claim_engine(model: ModelConfig, options: AttestOptions) -> str:
    """The engine the claim names: the option's, else llama.cpp for a GGUF file (what serves one), else ours."""
    return options.claim_engine or ("llama.cpp" if model.path.endswith(".gguf") else "hf")


def served_path(model: ModelConfig, checkpoint: str) -> str:
    """The simulated server's checkpoint folder: the claimed model's, a toy checkpoint's, or a folder given."""
    if not checkpoint:
        return model.path
    from stagereplay.toy import TOY_CHECKPOINTS, toy_checkpoint

    if checkpoint in TOY_CHECKPOINTS and not Path(checkpoint).exists():
        return str(toy_checkpoint(checkpoint))
    from stagereplay.engine.model import check_model_dir

    return str(Path(check_model_dir(str(Path(checkpoint).resolve()))))


class Attest(ResponseExperiment[AttestOptions, AttestStage, AttestPayload, AttestSummary]):
    """The served tokens against the claimed model's reference, decided against its honest variants."""

    payload: ClassVar[TypeAdapter[Any]] = PAYLOAD
    payload_models: ClassVar[tuple[type[BaseModel], ...]] = MODELS
    name: ClassVar[str] = EXPERIMENT
    Stage: ClassVar[type[StageSection]] = AttestStage
    Summary: ClassVar[type[BaseModel]] = AttestSummary
    Options: ClassVar[type] = AttestOptions
    shape: ClassVar[Shape] = RESPONSES.labelled("attest")
    responses: ClassVar[str] = "served"
    served: ClassVar[type[Served] | None] = ServedAttest
    helps: ClassVar[dict[str, str]] = {
        "decode.max_new_tokens": "response length limit of a simulated server (a file's responses keep their length)",
        "decode.sample": "the claim: seeded sampling (vLLM's per-request seed) instead of greedy",
        "decode.seed": "base seed; each item's request derives its own where a file's row gives none",
        "input.data": ("prompts a simulated server answers: a JSONL, JSON, CSV or Parquet file, or hf:NAME (default: "
                       "the toy task's held-out items); a file of served outputs: --served"),
        "input.columns": ("map the data's fields: TARGET=COLUMN,... With --served, TARGET prompt_ids, response_ids, "
                          "logprobs, seed or id; with --data, prompt, messages, user or id"),
        "input.n": "check (or simulate) the first N items",
        "numerics.precision": ("the precision of the claimed model's reference (one-shot prefill): fp32, so that no "
                               "honest engine's rounding is the reference's own"),
    }
    defaults: ClassVar[dict[str, Any]] = {"numerics.precision": "fp32"}
    smallest_run: ClassVar[SmallRun | None] = SmallRun(("--n", "3", "--max-new-tokens", "4", "--honest",
                                                        "bf16,fp32"))

    def check_inputs(self, inputs: Any, options: AttestOptions) -> None:
        """A file holds its responses: a response length or a simulated server is refused with it, not ignored; a
        run of fewer than `MIN_ITEMS` responses is refused before anything is written."""
        n = inputs.input.n
        if n is not None and n < MIN_ITEMS:
            raise StageReplayError(f"--n {n} is too few responses to decide on: the null calibrates on some prompts "
                                   "and the decision's interval is over responses", f"pass --n {MIN_ITEMS} or more")
        if options.seeded_sampler != DEFAULT_SAMPLER and not inputs.decode.sample:
            raise StageReplayError("--seeded-sampler names the sampler of a seeded claim, and this claim is greedy",
                                   "add --sample (with --temperature and --seed), or drop --seeded-sampler")
        if options.served is None:
            return
        given = [flag for flag, on in (("--max-new-tokens", inputs.decode.max_new_tokens != DecodeConfig().max_new_tokens),
                                       ("--served-precision", options.served_precision != "bf16"),
                                       ("--served-checkpoint", bool(options.served_checkpoint))) if on]
        if given:
            raise StageReplayError(f"{', '.join(given)} simulate a server, and --served gives its outputs",
                                   f"drop {', '.join(given)}, or simulate without --served")
        from stagereplay.tasks.rollout_fields import SERVED
        from stagereplay.tasks.rollouts import scan

        rows, _ = scan(options.served, inputs.input.columns, 1 << 31, 1 << 31, kind=SERVED)
        dc = inputs.decode  # the reference replays the claim's sampling, so a row's own must be the claim's
        claim = {"temperature": dc.temperature, "top_k": dc.top_k, "top_p": dc.top_p} if dc.sample else {"temperature": 0}
        said = "samples with " + ", ".join(f"{k} {v:g}" for k, v in claim.items()) if dc.sample else "is greedy"
        other = next(((r, k) for r in rows[:n] for k, v in claim.items() if r.sampling.get(k, v) != v), None)
        if other is not None:
            row, key = other
            raise StageReplayError(f"{row.where}: {key} is {row.sampling[key]:g}, and the claim {said}",
                                   "state the claim the server was asked for (--sample, --temperature, --top-k, "
                                   "--top-p), or drop the rows sampled otherwise")
        if len(rows) < MIN_ITEMS:
            raise StageReplayError(f"{options.served} holds {len(rows)} served response(s): too few to decide on (a "
                                   "calibration prompt and a held-out one at least)",
                                   f"give at least {MIN_ITEMS} served responses, more for a decision with power")

    def check(self, model: ModelConfig, options: AttestOptions) -> None:
        super().check(model, options)
        served_path(model, options.served_checkpoint)  # an unknown checkpoint is refused before anything loads
        for v in parse_variants(honest_of(model, options)):
            if isinstance(v, EngineVariant):
                v.honesty()  # its engine serves it, and its settings are in range
                if v.engine == DEPLOYMENT and deployment_index(v.settings) >= len(options.honest_url):
                    raise StageReplayError(f"honest variant {v.name} asks deployment {deployment_index(v.settings) + 1}, "
                                           f"and --honest-url names {len(options.honest_url)}",
                                           "pass one --honest-url per deployment (comma-separated)")
        for url in options.honest_url:
            deployment_engine(url)  # it answers, as llama-server or an OpenAI-style server, before anything is written

    def identity(self, options: AttestOptions) -> dict[str, Any]:
        generated = options.served is None
        return {"source": "generated" if generated else "file", "honest": list(options.honest),
                "alpha": options.alpha, "split_seed": options.split_seed,
                **({"seeded_sampler": options.seeded_sampler} if options.seeded_sampler != DEFAULT_SAMPLER else {}),
                **({"claim_engine": options.claim_engine} if options.claim_engine else {}),
                **({"served_precision": options.served_precision, "served_checkpoint": options.served_checkpoint}
                   if generated else {})}

    def section(self, prepared: PreparedRun, options: AttestOptions, run: Run) -> StageSection:
        generated = options.served is None
        return AttestStage(
            model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
            source="generated" if generated else "file",
            served_model=served_path(prepared.model, options.served_checkpoint) if generated else None,
            served_precision=options.served_precision if generated else None,
            honest=list(honest_of(prepared.model, options)),
            alpha=options.alpha, split_seed=options.split_seed, seeded_sampler=options.seeded_sampler,
            claim_engine=claim_engine(prepared.model, options),
            calibration=calibration_split([i.id for i in prepared.items], options.split_seed),
            **({"honest_urls": list(options.honest_url),
                "honest_engines": {v: deployment_engine(u) for v, u in zip(deployment_variants(options),
                                                                           options.honest_url, strict=True)}}
               if options.honest_url else {}))

    def _params(self, own: AttestStage, which: str, columns: str | None = None,
                sides: tuple[Any, ...] = ()) -> AttestParams:
        generated = own.source == "generated" and not which
        source: Source = "generated" if own.source == "generated" else "server" if own.source == "server" else "file"
        return AttestParams(which, source, columns, sides, own.served_model if generated else None,
                            own.served_precision if generated else None, seeded=own.seeded_sampler,
                            deployments=tuple(own.honest_urls))

    def batches(self, prepared: PreparedRun, stage: StageSection, run: Run) -> Any:
        """The served responses, each honest variant's, then (once their tokens are recorded) the reference's
        scores of them all (a generator: each batch made when it is due)."""
        own: AttestStage = self.stage_of(stage)
        columns = prepared.data.columns
        yield Batch(prepared.model, [Job(item, prepared.settings, self._params(own, "", columns))
                                     for item in prepared.items], at="served")
        for p in own.honest:
            yield Batch(self.unit_model(prepared.model, p), [Job(item, prepared.settings, self._params(own, p, columns))
                                                             for item in prepared.items], at=f"honest {p}")
        recorded = {(r.item_id, r.part): PAYLOAD.validate_python(r.payload)
                    for r in run.find(EXPERIMENT, prepared.checkpoint)}
        yield Batch(prepared.model, [
            Job(item, prepared.settings, self._params(own, REFERENCE, columns, sides_of(item.id, own, recorded)))
            for item in prepared.items if (item.id, "") in recorded], at=f"reference {prepared.model.precision}")

    def unit_model(self, model: ModelConfig, part: str) -> ModelConfig:
        if part in ("", REFERENCE):
            return model
        variant = variant_of(part)
        return model.with_precision(variant.precision) if isinstance(variant, HonestVariant) else model

    def unit_positions(self, record: Record) -> int:
        p = PAYLOAD.validate_python(record.payload)
        responses = [p.response_ids or [], *[a.response_ids for a in p.arms]]
        return len(p.prompt_ids) + max(len(r) for r in responses)

    def work(self, lm: LM, job: Job) -> AttestPayload:
        return attest_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        """Every item: its served response, each honest variant, its reference scores."""
        own: AttestStage = self.stage_of(stage)
        return [(i, part) for part in ("", *own.honest, REFERENCE) for i in config.item_ids]

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        """Every fingerprint is its arrays' or tokens', and every score array has one entry per response token."""
        from stagereplay.records import arrays

        try:
            p = PAYLOAD.validate_python(record.payload)
        except ValidationError as e:
            return [f"not an attest payload ({first_error(e)})"]
        bad = []
        if p.response_ids is not None and p.tokens_fp != ids_fingerprint([*p.prompt_ids, *p.response_ids]):
            bad.append("tokens_fp is not the fingerprint of prompt_ids + response_ids")
        for arm in p.arms:
            scores: dict[str, str | None] = {k: getattr(arm, k) for k in (*SCORES, *EXTRA_SCORES)}
            if arm.tokens_fp != ids_fingerprint([*p.prompt_ids, *arm.response_ids]):
                bad.append(f"side {arm.name}: tokens_fp is not the fingerprint of its tokens")
            if arm.scores_fp != scores_fingerprint(scores):
                bad.append(f"side {arm.name}: scores_fp is not the fingerprint of its scores")
            elif any(len(arrays.decode(v)) != len(arm.response_ids) for v in scores.values() if v):
                bad.append(f"side {arm.name}: a score array's length is not its response's")
        return bad

    def replay_job(self, replay: Replay) -> Job:
        """A served or honest unit decoded (or read) again; the reference part re-scores the tokens it recorded."""
        own: AttestStage = self.stage_of(replay.stage)
        part = replay.record.part
        sides: tuple[Any, ...] = ()
        if part == REFERENCE:
            sides = tuple((a.name, a.engine, a.construction, a.precision, tuple(a.response_ids))
                          for a in PAYLOAD.validate_python(replay.record.payload).arms)
        return Job(replay.item, replay.settings, self._params(own, part, None, sides))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        """A decoded response: its prompt's prefill (as its variant builds it) and one step per token after the
        first (none for a file's or a server's); the reference: one forward of prompt + response - 1 per side."""
        p = PAYLOAD.validate_python(record.payload)
        prompt = len(p.prompt_ids)
        if record.part == REFERENCE:
            return [prompt + len(a.response_ids) - 1 for a in p.arms]
        if p.source != "generated" and not record.part:
            return []  # a file's response, or a server's: none of ours
        n = len(p.response_ids or [])
        variant = variant_of(record.part) if record.part else LIVE
        return variant.forwards(prompt, n) if n else None

    def planned_forwards(self, assumed: Assumed, options: AttestOptions) -> Planned:
        """The forwards `unit_forwards` counts, on the lengths a plan assumes (each response at its suffix)."""
        honest = options.honest or HONEST

        def decoded(u: Any, variant: Variant = LIVE) -> list[int]:
            return variant.forwards(u.prompt, u.suffix)

        return {"": [(u, [] if options.served or assumed.served_by else decoded(u)) for u in assumed.items],
                **{v.name: [(u, decoded(u, v)) for u in assumed.items] for v in parse_variants(honest)},
                REFERENCE: [(u, [u.prompt + u.suffix - 1] * (1 + len(honest))) for u in assumed.items]}

    def peak_caches(self, stage: StageSection) -> int:
        return 1

    def plan_notes(self, options: AttestOptions, items: int) -> list[str]:
        """How many prompts a decision at the stated alpha needs, beside how many the run has."""
        from stagereplay.experiments.attest.decision import min_calibration, prompts_needed

        need, calibrate = prompts_needed(options.alpha), len(calibration_split([str(i) for i in range(items)],
                                                                             options.split_seed))
        said = (f"decision at alpha {options.alpha:g}: {need} prompts needed ({min_calibration(options.alpha)} "
                f"calibrate); this run has {items} ({calibrate} calibrate)")
        if calibrate < min_calibration(options.alpha):
            return [f"{said}: a statistic that exceeds its null reads inconclusive, never flagged; pass --n {need} "
                    "or more"]
        return [f"{said}: enough"]

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[AttestSummary]:
        from stagereplay.experiments.attest.summary import summarize_attest

        return [summarize_attest(records, self.stage_of(stage), checkpoint)]

    def tables(self, results: list[AttestSummary]) -> list[Table]:
        from stagereplay.experiments.attest.tables import attest_tables

        return [t for s in results for t in attest_tables(s)]

    def verdict_facts(self, results: list[AttestSummary]) -> list[Fact]:
        from stagereplay.experiments.attest.tables import attest_verdict

        return [f for s in results for f in attest_verdict(s)]

    def figures(self, results: list[AttestSummary]) -> list[ReportFigure]:
        from stagereplay.experiments.attest.tables import attest_figures

        return [f for s in results for f in attest_figures(s)]

    def compared(self, records: tuple[list[Record], list[Record]], item_ids: list[str], checkpoint: str,
                 runs: tuple[str, str], sections: tuple[AttestSummary, AttestSummary], differences: Differences
                 ) -> RunComparison:
        from stagereplay.experiments.attest.compare import compared

        return compared(records, item_ids, checkpoint, runs, sections, differences)

    def exit_code(self, summaries: Any) -> int:
        """FLAGGED where a served run is flagged (not the claimed model at the stated rate), else INCONCLUSIVE where
        one is inconclusive, else OK."""
        outcomes = {s.outcome for s in summaries or []}
        return FLAGGED if "flagged" in outcomes else INCONCLUSIVE if "inconclusive" in outcomes else OK

    def told(self, records: list[Record]) -> list[str]:
        """Per side: its tokens, how many match the reference's argmax, and its mean margin."""
        from stagereplay.experiments.attest.summary import per_token
        from stagereplay.records import arrays

        lines = []
        for record in sorted(records, key=lambda r: r.part != REFERENCE):
            p = PAYLOAD.validate_python(record.payload)
            if p.kind != "reference":
                lines.append(f"{self.where(record)}: {p.kind} response of {len(p.response_ids or [])} tokens "
                             f"({p.precision}{', ' + p.stop if p.stop else ''})")
                continue
            lines.append(f"{self.where(record)}: the claimed model's reference")
            for a in p.arms or []:
                match = arrays.decode(a.match)
                lines.append(f"  {a.name}: {len(match)} tokens, {int(match.sum())} the reference's argmax, mean "
                             f"score {float(per_token(a).mean()):.4g}")
        return lines


def sides_of(item_id: str, own: AttestStage, recorded: dict[tuple[str, str], AttestPayload]
             ) -> tuple[tuple[str, str, str, str, tuple[int, ...]], ...]:
    """The responses an item's reference part scores: the served one, then each honest variant recorded."""
    served = recorded[(item_id, "")]
    file = served.source == "file"
    engine = "file" if file else own.engine.name if served.source == "server" and own.engine is not None else "hf"
    out = [("served", engine, "file" if file else "live", str(served.precision), tuple(served.response_ids or ()))]
    variants = [variant_of(p) for p in own.honest]
    out += [(f"honest@{v.name}", own.honest_engines.get(v.name, v.engine) if isinstance(v, EngineVariant) else "hf",
             v.construction,
             str(recorded[(item_id, v.name)].precision), tuple(recorded[(item_id, v.name)].response_ids or ()))
            for v in variants if (item_id, v.name) in recorded]
    return tuple(out)


__all__ = ["Attest", "AttestOptions", "AttestStage", "calibration_split"]
