"""Fixed-prefix 2x2 on a serving engine's matched run: its prefixes held fixed, the arms `oneshot`, `prefix-cache`
and (with `--cross hf`) `hf-oneshot` crossed with precision.

Per item and precision p, in one engine at p (and ours at p for the cross arm):

    oneshot@p         reset; a request for P
    prefix-cache@p    reset; live at p (a request for the prompt, as many tokens as stage 1 has), then a request
                      for P reusing what live left: blocks its decoding wrote, as far as its stage 1 is P's.
                      `live_prefix_equal` says whether live at p wrote P's stage 1 exactly (at the run's own
                      precision it should; at another, its blocks past the first differing token are not P's
                      and are not reused, which `cached_from_decode` shows)
    hf-oneshot@p      our engine prefills P[0:T-1] and continues from P[T-1]
    oneshot-restore@p (llama.cpp) a prefill of P[0:T-1] saved, restored into a cleared context and continued
    chunked:<n>@p     (llama.cpp) a request for P with its prompt processed n tokens per batch (`--n-batch`)
"""

from __future__ import annotations

from dataclasses import dataclass

from stagereplay.engine.constructions import Chunked, parse_construction
from stagereplay.engine.lm import LM
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.jobs import Batch, Job, Params, Replay
from stagereplay.experiments.core.prepared import PreparedRun
from stagereplay.experiments.core.served import Served
from stagereplay.experiments.protocol.arms import compare, engine_arm, top_k_diagnostics, with_token_texts
from stagereplay.experiments.protocol.grid_stage import GridOptions, GridStage
from stagereplay.experiments.protocol.matched_stage import fixed_prefixes, fixed_state
from stagereplay.experiments.protocol.payloads import GridPayload
from stagereplay.experiments.protocol.served_matched import served_arm
from stagereplay.records.ledger import Run
from stagereplay.records.manifest import EngineSection, ModelSection, StageSection
from stagereplay.records.payloads import Arm
from stagereplay.serving.arms import (
    ServingArms,
    cached_engine,
    check_serving_precision,
    hf_top_logprobs,
    with_took_place,
)
from stagereplay.serving.seam import TOP_LOGPROBS, PrefillsInChunks, SavesState


def _chunk(construction: str) -> int | None:
    """n of `chunked:<n>` (engine.constructions.Chunked), else None."""
    try:
        made = parse_construction(construction)
    except StageReplayError:  # a serving arm's name, not a construction of ours
        return None
    return made.n if isinstance(made, Chunked) else None


def check_serving_constructions(constructions: tuple[str, ...], arms: ServingArms) -> None:
    allowed = arms.grid
    chunks = issubclass(arms.kind.engine, PrefillsInChunks)
    for c in constructions:
        if c not in allowed and not (chunks and _chunk(c) is not None):
            raise StageReplayError(f"construction {c!r} is not an arm of this {arms.engine.name} run's 2x2",
                                   f"use {', '.join(allowed)}" + (" or chunked:<n>" if chunks else ""))


@dataclass(frozen=True)
class ServingGridParams(Params):
    """A serving 2x2 job's parameters: the fixed prefix, the arms crossed with precision, the precision (the
    record's part), and the engine."""

    prefix: tuple[int, ...]
    constructions: tuple[str, ...]
    precision: str
    arms: ServingArms

    @property
    def part(self) -> str:
        return self.precision


def serving_grid_item(lm: LM, job: Job[ServingGridParams]) -> GridPayload:
    """Every arm at this process's precision on one fixed prefix, and their pairwise comparisons."""
    item, s = job.item, job.settings
    prefix, constructions = list(job.params.prefix), job.params.constructions
    engine = cached_engine(job.params.arms.engine, lm)
    prompt, max_new, precision = list(item.prompt_ids), s.decode.max_new_tokens, lm.config.precision
    stage1 = prefix[len(prompt) :]
    arms: list[Arm] = []
    for c in constructions:
        name = f"{c}@{precision}"
        if c == "oneshot":
            arms.append(served_arm(lm, engine.name, name, c, engine.generate(prefix, max_new), 0, max_new, stage1,
                                   item, s.scorer, len(prompt)))
        elif c == "prefix-cache":
            live = engine.generate(prompt, len(stage1))  # from a reset: live at this precision writes the blocks
            hit = engine.generate(prefix, max_new, reuse=True)
            arms.append(served_arm(lm, engine.name, name, c, hit, 0, max_new, stage1, item, s.scorer, len(prompt),
                                   live_prefix_equal=list(live.tokens) == stage1))
        elif c == "oneshot-restore" and isinstance(engine, SavesState):
            state = engine.build_state(prefix[:-1])
            g, loaded = engine.restore(state, prefix[-1], max_new)
            arms.append(engine_arm(lm, name, c, engine.name, g.tokens[:max_new], g.top[:max_new], stage1, item,
                                   s.scorer, loaded))
        elif (n := _chunk(c)) is not None and isinstance(engine, PrefillsInChunks):
            g = engine.chunked(prefix, max_new, n)
            arms.append(served_arm(lm, engine.name, name, c, g, 0, max_new, stage1, item, s.scorer, len(prompt)))
        else:  # <cross>-oneshot: ours, on the same IDs
            built = lm.construct(fixed_state(item, prefix, s, lm), "oneshot")
            cont = lm.continue_from(built, s.decode)
            arms.append(engine_arm(lm, name, "oneshot", c.removesuffix("-oneshot"), cont.suffix,
                                   hf_top_logprobs(cont.record, TOP_LOGPROBS), stage1, item, s.scorer,
                                   built.fingerprint()))
    arms = with_took_place(arms, len(prompt), len(prefix))  # whether the engine built each as named
    by = {a.name: a for a in arms}
    pairs = [(a.name, b.name) for i, a in enumerate(arms) for b in arms[i + 1 :]]
    comparisons = {(a, b): compare(item.id, by[a], by[b]) for a, b in pairs}
    payload = GridPayload(status="ok", precision=precision, prompt_ids=prompt, prefix_ids=prefix,
                          boundary=len(prefix), answer=item.answer, arms=arms,
                          comparisons=list(comparisons.values()), diagnostics=top_k_diagnostics(by, pairs, comparisons))
    return with_token_texts(lm, payload)


class ServedGrid(Served):
    """The 2x2 in the engine on the matched run's prefixes (`experiments.protocol.served_grid.serving_grid_item`)."""

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
