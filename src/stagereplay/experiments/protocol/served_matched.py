"""Matched on a serving engine (`matched --engine vllm`): its live trace, a fresh request and a prefix-cache hit
on the same token IDs, each with an exact replica, and (`--cross hf`) our engine continuing the engine's prefix.

Per item, in one engine and this order (the prefix cache is emptied where an arm says "reset"):

    live            reset; prompt -> stage 1 + suffix budget tokens, one uninterrupted request, sized by the
                    boundary rule (`serving.live`: a count's N, else grown until the boundary is reached). Stage 1
                    ends where the boundary rule says (`engine.boundary.stage1_end`, the rule `LM.live` runs);
                    the suffix is what follows the boundary token, cut to --max-new-tokens. The arm's `request`
                    says what was asked for
    prefix-cache    no reset: a request for P = prompt + stage 1 right after live, so the full blocks live filled
                    (while decoding, too) are reused; `num_cached_tokens` and how many of them lie past the
                    prompt (`cached_from_decode`, written by live's decode steps) are recorded
    live#replica, prefix-cache#replica    the two again, from a reset
    oneshot         reset; a request for P: nothing cached, one fresh prefill
    oneshot#replica
    state-restore, oneshot-restore (+ #replica)   an engine that saves states (llama.cpp): its saved boundary
                    states restored and continued (`serving.restore`)
    slot-restore (+ #replica)   a server that restores slots, when asked for (`--slot-restore`)
    live@load, oneshot@load     a server under load, when asked for (`--concurrency K`)
    hf-oneshot      (--cross hf) our engine prefills P[0:T-1] in one forward and continues from P[T-1]
    hf-oneshot#replica

Each served arm records `took_place`: whether the engine's own counts say its state was built as its name says
(`serving.evidence`); the report counts the items where it was not apart. Where the engine speculated and says so (llama-server's `timings`, vLLM's counters), a served arm records its
request's `draft`: tokens drafted and accepted over the whole request.

The suffixes are comparable across engines: a request whose prompt is P yields the tokens after P, and our
convention (feed P[T-1] as the first decode step over the cache of P[0:T-1]) yields the tokens after P too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stagereplay.engine.boundary import stage1_end
from stagereplay.engine.lm import LM
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.core.jobs import Batch, Job, Params, Replay
from stagereplay.experiments.core.prepared import PreparedRun
from stagereplay.experiments.core.served import Served, runs_at
from stagereplay.experiments.protocol.arms import (
    compare,
    engine_arm,
    no_boundary,
    top_k_diagnostics,
    with_token_texts,
)
from stagereplay.experiments.protocol.matched_stage import STAGE1_TOP, MatchedOptions, MatchedStage
from stagereplay.experiments.protocol.payloads import LoadFinding, MatchedPayload, NoBoundaryPayload
from stagereplay.records.ledger import Run
from stagereplay.records.manifest import EngineSection, ModelSection, StageSection
from stagereplay.records.payloads import Arm, Comparison, Drafted, LiveRequest, Load, SlotRestore
from stagereplay.serving.arms import (
    LOADED,
    ServingArms,
    cached_engine,
    hf_top_logprobs,
    note_resume,
    with_took_place,
)
from stagereplay.serving.live import Live, request_live
from stagereplay.serving.seam import (
    TOP_LOGPROBS,
    Generation,
    Restarts,
    RestoresSlot,
    SavesState,
    ServesUnderLoad,
    ServingEngine,
)
from stagereplay.tasks.base import Item


@dataclass(frozen=True)
class ServingMatchedParams(Params):
    """A serving matched job's parameters: the engine and its arms, and the prompts of the other items whose
    requests are in flight around its under-load arms."""

    arms: ServingArms
    traffic: tuple[tuple[int, ...], ...] = ()


# One engine per process, as one model per process in `execution.local`: two precisions load one after the other.


def served_arm(lm: LM, engine: str, name: str, construction: str, g: Generation, start: int, max_new: int,
               stage1: Sequence[int], item: Item, scorer: str, prompt_len: int, **more: Any) -> Arm:
    """A serving engine's arm: the suffix from `start` in its output, and what its prefix cache supplied
    (`num_cached_tokens` None: the engine does not say); `more`: the arm's other fields."""
    served: dict[str, Any] = {"num_cached_tokens": g.cached, **more}
    if g.draft is not None:  # the request's speculation, over all it generated (a live request's stage 1 too)
        served["draft"] = Drafted(drafted=g.draft.drafted, accepted=g.draft.accepted)
    if construction == "prefix-cache" and g.cached is not None:
        served["cached_from_decode"] = max(0, g.cached - prompt_len)  # cached positions past the prompt: decode's
    return engine_arm(lm, name, construction, engine, g.tokens[start : start + max_new],
                      g.top[start : start + max_new], stage1, item, scorer, **served)


def _compared(item_id: str, arms: Sequence[Arm], pairs: Sequence[tuple[str, str]]
              ) -> dict[tuple[str, str], Comparison]:
    """The pairs whose two arms were both built, compared."""
    by = {a.name: a for a in arms}
    return {(a, b): compare(item_id, by[a], by[b]) for a, b in pairs if a in by and b in by}


@dataclass
class _ItemArms:
    """One item's arms as they are served: live's first request fixes stage 1 and the prefix; each method adds the
    arms of one capability of the engine (`arms`) and the constructions live is compared with (`fresh`)."""

    lm: LM
    engine: ServingEngine
    job: Job[ServingMatchedParams]
    first: Live
    stage1: list[int]
    arms: list[Arm]
    fresh: list[str]

    @property
    def prompt(self) -> list[int]:
        return list(self.job.item.prompt_ids)

    @property
    def prefix(self) -> list[int]:
        return [*self.prompt, *self.stage1]

    @property
    def max_new(self) -> int:
        return self.job.settings.decode.max_new_tokens

    def served(self, name: str, construction: str, g: Generation, start: int = 0, live: Live | None = None,
               **more: Any) -> None:
        """The arm `name` from the engine's output `g` (from `start`), with `more` of its fields; a live arm with
        what its request asked for and the fingerprint of the boundary state it saved (an engine that saves one)."""
        if live is not None:
            more["request"] = LiveRequest(**live.request)
            if live.state is not None:
                more["cache_fp"] = live.state.fingerprint
        self.arms.append(served_arm(self.lm, self.engine.name, name, construction, g, start, self.max_new,
                                    self.stage1, self.job.item, self.job.settings.scorer, len(self.prompt), **more))

    def quiet(self, replica: Callable[[], Live]) -> tuple[Live, bool]:
        """live, prefix-cache (right after live: the blocks live filled) and oneshot, each with its replica (live's
        asked again by `replica`); live's replica, and whether its stage 1 is live's."""
        engine, prefix, max_new = self.engine, self.prefix, self.max_new
        self.served("live", "live", self.first.generation, len(self.stage1), self.first)
        self.served("prefix-cache", "prefix-cache", engine.generate(prefix, max_new, reuse=True))
        again = replica()
        replica_prefix_equal = again.end is not None and list(again.generation.tokens[: again.end + 1]) == self.stage1
        if again.end is not None:
            self.served("live#replica", "live", again.generation, again.end + 1, again)
            self.served("prefix-cache#replica", "prefix-cache",
                        engine.generate([*self.prompt, *again.generation.tokens[: again.end + 1]], max_new,
                                        reuse=True))
        for name in ("oneshot", "oneshot#replica"):
            self.served(name, "oneshot", engine.generate(prefix, max_new, reuse=False))
        return again, replica_prefix_equal

    def restored(self, again: Live, replica_prefix_equal: bool) -> None:
        """An engine that saves states: its saved boundary states restored and continued (`serving.restore`)."""
        from stagereplay.serving.restore import restore_arms

        engine = self.engine
        if not isinstance(engine, SavesState):
            return
        s = self.job.settings

        def arm(name: str, g: Generation, cache_fp: str, restored_positions: int) -> Arm:
            return engine_arm(self.lm, name, name.split("#")[0], engine.name, g.tokens[: self.max_new],
                              g.top[: self.max_new], self.stage1, self.job.item, s.scorer, cache_fp,
                              restored_positions=restored_positions)

        states = [self.first.state, again.state] if replica_prefix_equal else [self.first.state]
        self.arms += restore_arms(engine, self.prefix, states, self.max_new, arm)
        self.fresh += SavesState.ARMS

    def slots(self) -> None:
        """A server that restores slots, when asked for: live's slot saved and restored into another."""
        engine, first = self.engine, self.first
        if not (isinstance(engine, RestoresSlot) and engine.restores_slots):
            return
        for name in ("slot-restore", "slot-restore#replica"):
            again_live, g, how = engine.slot_restore(self.prompt, first.max_tokens, self.prefix, self.max_new)
            self.served(name, "slot-restore", g, slot=SlotRestore(
                **how, live_equal=list(again_live.tokens) == list(first.generation.tokens),
                live_max_tokens=first.max_tokens))
        self.fresh += RestoresSlot.ARMS

    def loaded(self, rule: Any, size: int) -> None:
        """A server under load, when asked for: live's request and oneshot's with other items' in flight."""
        engine, traffic = self.engine, self.job.params.traffic
        if not (traffic and isinstance(engine, ServesUnderLoad)):
            return
        loaded, seen = engine.generate_loaded(self.prompt, self.first.max_tokens, traffic)
        loaded_end = stage1_end(loaded.tokens, rule.watch(), self.lm.eos, size)
        if loaded_end is not None:
            self.served("live@load", "live", loaded, loaded_end + 1, request=LiveRequest(**self.first.request),
                        load=Load(**seen, prefix_equal=list(loaded.tokens[: loaded_end + 1]) == self.stage1))
        loaded, seen = engine.generate_loaded(self.prefix, self.max_new, traffic)
        self.served("oneshot@load", "oneshot", loaded, load=Load(**seen))
        self.fresh += list(LOADED)

    def crossed(self) -> None:
        """--cross: our engine prefills the engine's prefix in one forward and continues it."""
        from stagereplay.experiments.protocol.matched_stage import fixed_state

        cross, lm, s = self.job.params.arms.cross, self.lm, self.job.settings
        if not cross:
            return
        state = fixed_state(self.job.item, self.prefix, s, lm)
        for name in (f"{cross}-oneshot", f"{cross}-oneshot#replica"):
            built = lm.construct(state, "oneshot")
            cont = lm.continue_from(built, s.decode)
            self.arms.append(engine_arm(lm, name, "oneshot", cross, cont.suffix,
                                        hf_top_logprobs(cont.record, TOP_LOGPROBS), self.stage1, self.job.item,
                                        s.scorer, built.fingerprint()))
            del built, cont
        self.fresh.append(f"{cross}-oneshot")

    def payload(self, replica_prefix_equal: bool) -> MatchedPayload:
        """The item's record: every arm, whether each was built as named (`serving.evidence`), the pairs compared
        and their diagnostics."""
        item, prompt, prefix, traffic = self.job.item, self.prompt, self.prefix, self.job.params.traffic
        arms = with_took_place(self.arms, len(prompt), len(prefix))
        pairs = [("live", f) for f in self.fresh] + [(f, f"{f}#replica") for f in ("live", *self.fresh)]
        pairs += [("oneshot", "oneshot@load")] if traffic else []
        comparisons = _compared(item.id, arms, pairs)
        end = len(self.stage1) - 1
        more: dict[str, Any] = dict(self.first.match or {})  # a marker matched on text: whether it ended inside
        if traffic:                                          # the boundary token
            more["load_finding"] = load_finding(comparisons)
        payload = MatchedPayload(
            status="ok", prompt_ids=prompt, prefix_ids=prefix, boundary=len(prefix), answer=item.answer,
            replica_prefix_equal=replica_prefix_equal, arms=arms, comparisons=list(comparisons.values()),
            diagnostics=top_k_diagnostics({a.name: a for a in arms}, [("live", f) for f in self.fresh], comparisons),
            **more, stage1_top=[[(int(t), float(v)) for t, v in step[:STAGE1_TOP]]
                        for step in self.first.generation.top[: end + 1]])
        return with_token_texts(self.lm, payload)


def serving_matched_item(lm: LM, job: Job[ServingMatchedParams]) -> MatchedPayload | NoBoundaryPayload:
    """One item's arms on the serving engine (and ours with --cross hf); `lm` is our engine at the same
    precision: its tokenizer scores and finds the boundary, and it runs the cross arm."""
    item, s = job.item, job.settings
    engine = cached_engine(job.params.arms.engine, lm)
    budget, max_new = s.decode.max_stage1_tokens, s.decode.max_new_tokens
    if budget is None:
        raise StageReplayError("a serving engine's live request needs a resolved stage-1 budget",
                               "run through `stagereplay matched`, which resolves it")
    rule = s.rule().bind(lm.tokenizer)
    prompt = list(item.prompt_ids)
    saves = isinstance(engine, SavesState)

    def send(max_tokens: int, saver: Callable[[int], bool] | None) -> tuple[Generation, Any]:
        if saver is None or not isinstance(engine, SavesState):
            return engine.generate(prompt, max_tokens, reuse=False), None
        return engine.run(prompt, max_tokens, save=saver)  # the boundary state saved as it goes

    first = request_live(send, rule, lm.eos, budget, max_new, saves=saves)
    if first.end is None:
        return no_boundary(item, first.generation.tokens[:budget])
    size = first.max_tokens - max_new  # live's replicas ask for what live asked
    item_arms = _ItemArms(lm, engine, job, first, list(first.generation.tokens[: first.end + 1]), [],
                          ["oneshot", "prefix-cache"])
    again, replica_prefix_equal = item_arms.quiet(
        lambda: request_live(send, rule, lm.eos, budget, max_new, saves=saves, sizes=[size]))
    item_arms.restored(again, replica_prefix_equal)
    item_arms.slots()
    item_arms.loaded(rule, size)
    item_arms.crossed()
    return item_arms.payload(replica_prefix_equal)


def load_finding(comparisons: Mapping[tuple[str, str], Comparison]) -> dict[str, LoadFinding]:
    """What the replicas under load say about the server, apart from construction effects, for live's request and
    oneshot's: `batch-variant` when the quiet replica is exact and the one under load is not (other requests in
    the batch changed the bits), `not self-consistent` when even the quiet replica differs, `invariant` when both
    are exact, `unknown` when a replica did not reach the boundary."""
    out: dict[str, LoadFinding] = {}
    for arm in ("live", "oneshot"):
        quiet, loaded = comparisons.get((arm, f"{arm}#replica")), comparisons.get((arm, f"{arm}@load"))
        if quiet is None or loaded is None:
            out[arm] = "unknown"
        elif not quiet.suffix_equal:
            out[arm] = "not self-consistent"
        else:
            out[arm] = "invariant" if loaded.suffix_equal else "batch-variant"
    return out


class ServedMatched(Served):
    """Matched in the engine (`experiments.protocol.served_matched.serving_matched_item`)."""

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
