"""A serving engine's arms as a run holds them (`ServingArms`: the engine's config and the cross arm), the engine
loaded for them (one per process, `cached_engine`), and what a served arm's record adds: whether its engine's counts
say it was built as named, and a resumed run's note of a server that restarted."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stagereplay.engine.lm import LM
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.records.ledger import Run
from stagereplay.records.manifest import StageSection
from stagereplay.records.payloads import Arm
from stagereplay.serving.engines import ENGINES, OURS, config_from_dict, engine_config, kind_of
from stagereplay.serving.evidence import took_place
from stagereplay.serving.seam import (
    ChecksFirst,
    EngineConfig,
    EngineKind,
    Restarts,
    ServesUnderLoad,
    ServingEngine,
)
from stagereplay.tasks.base import Item

log = logging.getLogger(__name__)


CROSS = (OURS,)
"""Engines that may replay a serving engine's prefixes: ours."""
GRID_ARMS = ("oneshot", "prefix-cache")
"""The arms every engine's precision 2x2 builds on a fixed prefix, besides those of its capabilities
(`EngineKind.grid_arms`)."""
LOADED = ServesUnderLoad.ARMS


@dataclass(frozen=True)
class ServingArms:
    """Which arms a serving matched run has, besides live."""

    engine: EngineConfig
    cross: str = ""

    def __post_init__(self) -> None:
        if self.cross and self.cross not in CROSS:
            raise StageReplayError(f"unknown --cross {self.cross!r}", f"use one of {', '.join(CROSS)}")

    def our_model(self, model: ModelConfig) -> ModelConfig:
        """Our engine's model for these arms: without its weights unless --cross steps it (otherwise it only
        tokenizes and scores), for the run and its audit alike."""
        return model if self.cross else replace(model, weights=False)

    @property
    def kind(self) -> EngineKind:
        return kind_of(self.engine.name)

    @property
    def fresh(self) -> tuple[str, ...]:
        """The arms set against live, in the order of the report's columns: oneshot and prefix-cache, those the
        engine's capabilities add (`EngineKind.arms`), and the cross arm."""
        return ("oneshot", "prefix-cache", *self.kind.arms(self.engine),
                *((f"{self.cross}-oneshot",) if self.cross else ()))

    @property
    def loaded(self) -> tuple[str, ...]:
        """The under-load arms (a server's, with --concurrency): live's replica with other requests in flight."""
        return tuple(a for a in self.fresh if a in LOADED)

    @property
    def grid(self) -> tuple[str, ...]:
        """The arms `precision-2x2` crosses with precision by default: those of `fresh` it builds on a fixed
        prefix (`GRID_ARMS`, the engine's `grid_arms` and the cross arm). Not state-restore or slot-restore, which
        need live's state at each precision, nor the under-load arms (`chunked:<n>` may be added where the engine
        prefills in chunks)."""
        own = (*GRID_ARMS, *self.kind.grid_arms(), f"{self.cross}-oneshot")
        return tuple(a for a in self.fresh if a in own)

    def traffic(self, items: Sequence[Item], index: int) -> tuple[tuple[int, ...], ...]:
        """The prompts an item's under-load arms run beside: the next --concurrency items' (its own, alone)."""
        if not self.loaded:
            return ()
        others = [items[(index + 1 + i) % len(items)] for i in range(self.kind.concurrency(self.engine))]
        return tuple(tuple(o.prompt_ids) for o in others)


def serving_arms(engine: str, cross: str | None = None, options: Mapping[str, Any] | None = None
                 ) -> ServingArms | None:
    """The arms of a matched run on `engine` with the options given for it, or None on ours; an option the engine
    does not take, or a cross arm on our own engine, is refused in one line."""
    if engine == OURS:
        if cross is not None:
            raise StageReplayError("--cross replays a serving engine's prefixes in ours",
                                   f"pass it with --engine {' or --engine '.join(ENGINES)}")
        if options:
            flag = "--" + sorted(options)[0].replace("_", "-")
            raise StageReplayError(f"{flag} is an option of a serving engine, and --engine {OURS} is ours",
                                   f"pass --engine {' or --engine '.join(ENGINES)}, or drop {flag}")
        return None
    return ServingArms(engine_config(engine, options), cross or "")


def check_serving_precision(arms: ServingArms, precision: str) -> None:
    """A serving engine runs the precisions it has a dtype for: not our fp32-compute."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise StageReplayError(f"--engine {arms.engine.name} does not run precision {precision}",
                               "use bf16, fp16 or fp32")


def arms_of(stage: StageSection) -> ServingArms:
    """The arms a manifest stage that names an engine declares."""
    assert stage.engine is not None
    return ServingArms(config_from_dict(stage.engine.as_json()), stage.cross or "")


_ENGINES: dict[tuple[Any, ...], ServingEngine] = {}


@atexit.register
def _close_engines() -> None:
    """Engines closed at exit, before the interpreter tears down what their own finalizers need."""
    for key in list(_ENGINES):
        _ENGINES.pop(key).close()


def cached_engine(config: EngineConfig, lm: LM) -> ServingEngine:
    key = (config, lm.config.path, lm.config.precision, lm.config.threads, lm.config.device)
    if key not in _ENGINES:
        for old in list(_ENGINES):
            _ENGINES.pop(old).close()
        engine = kind_of(config.name).load(config, lm.config.path, lm.config.precision, lm.config.threads,
                                           lm.config.device)
        if isinstance(engine, ChecksFirst):  # a server is checked against the run's tokenizer before any item
            engine.check(lm.tokenizer)
        _ENGINES[key] = engine
    return _ENGINES[key]


def hf_top_logprobs(record: Any, k: int) -> list[list[tuple[int, float]]]:
    """Our engine's per-step top-k (engine.steps) as the serving engine reports them: (id, logprob), ties by id."""
    return [] if record is None else [[(int(t), float(v)) for t, v in step] for step in record.top_logprobs(k)]


def with_took_place(arms: Sequence[Arm], prompt_len: int, boundary: int) -> list[Arm]:
    """Each served arm with `took_place`: whether its engine's counts say it was built as named
    (`serving.evidence`); an arm of ours (no `num_cached_tokens`) as it is."""
    return [arm.model_copy(update={"took_place": took_place(arm, prompt_len, boundary)})
            if "num_cached_tokens" in arm.model_fields_set else arm for arm in arms]


REQUESTS_PER_ITEM = 6
"""Completions a server's matched item sends at least (live, prefix-cache and oneshot, each with its replica)."""


def note_resume(run: Run, done: Sequence[Any], engine: Restarts) -> None:
    """Tell an engine that restarts (a server) how the process that made the last record saw it, and how many items
    that process recorded since; say so when it restarted (its prefix cache is then cold, which the records from
    here on also say, in their environment's `engine.resumed`)."""
    last = done[-1]
    env = next((r.payload for r in run.chain if r.kind == "environment" and r.env == last.env), {})
    before = ((env.get("engine") or {}).get("checked") or {}).get("instance")
    if before is None:
        return
    made = sum(r.env == last.env for r in done)
    restarted = engine.note_resume(before, REQUESTS_PER_ITEM * made, last.item_id)
    if restarted:
        log.info(f"note: the server at {engine.address} restarted since item {last.item_id} was recorded: its "
                 "caches are cold (the records from here on say so)")
