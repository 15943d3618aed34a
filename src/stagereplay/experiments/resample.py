"""Resample: does a re-prefilled boundary state give the same distribution of sampled continuations as the
live one?

Stage-replay methods mostly sample (Thought Anchors-style importance draws ~100 continuations per prefix at
temperature 0.6, top-p 0.95). Per item this takes K seeded draws from each of three boundary states of the
matched run's prefix: the live state, a live replica, and a fresh construction (oneshot by default). Every
draw starts from a clone of its state's cache: K decodes per state, never K prefills.

Seed streams (each draw's seed is `derive_seed(seed, item_id, "resample", stream, j)`, j = 0..K-1):

    A  live, fresh and live replica: coupled, draw j shares its seed on all three sides, so a differing
       draw is the cache's doing (live vs live replica must show none: the negative control)
    B  fresh, independent of A: live(A) vs fresh(B) compares answer distributions as two samples
    C  live, independent of A: live(A) vs live(C) is the null for that comparison

At the matched run's own precision the live state is regenerated from the prompt and must reproduce the
recorded prefix; at another precision the prefix is held fixed and `incremental` (the same operations as
live generation, bit-exact with it as the bridge shows) stands in for live. Each draw is an arm of the
record, so the audit re-executes and checks every one, and the export gives one row per draw.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter

from stagereplay.engine.decode import DecodeConfig, derive_seed
from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards, live_forwards
from stagereplay.engine.lm import LM, BoundaryState, NoBoundary, check_construction
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.jobs import Job, ReplaySettings, execute
from stagereplay.experiments.precision_2x2 import fixed_prefixes, fixed_state
from stagereplay.records.ledger import Run
from stagereplay.records.payloads import Draw, ResamplePayload
from stagereplay.tasks.scoring import answer_extractor, scorer_by_name

EXPERIMENT = "resample"
PAYLOAD: TypeAdapter[ResamplePayload] = TypeAdapter(ResamplePayload)
"""A resample record's payload (`records.payloads`)."""
STREAMS = {
    "A": "coupled: live, fresh and live replica draw j share this seed",
    "B": "independent: fresh draws, set against live(A)",
    "C": "null: live draws, set against live(A)",
}
SEED_RULE = "derive_seed(seed, item_id, 'resample', stream, str(j))"


@dataclass(frozen=True)
class ResampleConfig:
    """K sampled continuations per boundary state, drawn the way users sample."""

    k: int = field(default=32, metadata={"help": "draws per state and seed stream"})
    temperature: float = field(default=0.6, metadata={"help": "sampling temperature"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus mass (1 = off)"})
    top_k: int = field(default=0, metadata={"help": "top-k cut (0 = off)"})
    construction: str = field(default="oneshot", metadata={"help": "the fresh construction set against live"})
    n: int | None = field(default=None, metadata={"help": "first n items that reached the boundary (all: None)"})
    precisions: tuple[str, ...] = field(default=(), metadata={"help": "precisions to draw at (the run's: empty)"})
    seed: int = field(default=0, metadata={"help": "base seed of the three seed streams"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "precisions", tuple(self.precisions))
        if self.k < 1:
            raise StageReplayError(f"--k must be at least 1, got {self.k}", "pass e.g. --k 32")
        if self.n is not None and self.n < 1:
            raise StageReplayError(f"--n must be at least 1, got {self.n}", "pass a positive --n")
        if check_construction(self.construction) == "live":
            raise StageReplayError("the fresh side of resample cannot be live", "use e.g. --construction oneshot")
        self.sampling(1)  # temperature, top-p and top-k are checked where every sampler checks them

    def sampling(self, max_new_tokens: int) -> DecodeConfig:
        return DecodeConfig(max_new_tokens=max_new_tokens, sample=True, temperature=self.temperature,
                            top_k=self.top_k, top_p=self.top_p)


def draw_names(construction: str, k: int) -> list[str]:
    """The arms `resample_item` draws, in order: K per (state, stream)."""
    return [f"{name}:{stream}{j}" for name, stream in (("live", "A"), (construction, "A"), ("live#replica", "A"),
                                                        (construction, "B"), ("live", "C")) for j in range(k)]


def forwards(n: Lengths, k: int, construction: str, live_source: str) -> list[int]:
    """The forwards `resample_item` makes on a prefix of lengths `n`: the live state and its replica (live
    generation to the boundary, or `incremental` at another precision), the fresh construction, then 5K draws."""
    if live_source == "incremental":
        states = construct_forwards("incremental", n.prompt, n.prefix) * 2
    else:
        states = live_forwards(n.prompt, n.stage1 or 0, None) * 2
    out = states + construct_forwards(construction, n.prompt, n.prefix)
    for name in draw_names(construction, k):
        out += continuation_forwards(n.of(name))
    return out


def draw_seed(seed: int, item_id: str, stream: str, j: int) -> int:
    return derive_seed(seed, item_id, EXPERIMENT, stream, str(j))


def _states(lm: LM, job: Job) -> tuple[BoundaryState, BoundaryState] | None:
    """(live, live replica) for the job's prefix, or None when live generation no longer reaches it."""
    item, s, prefix = job.item, job.settings, tuple(job.get("prefix"))
    if job.get("live_source") == "incremental":
        fixed = fixed_state(item, list(prefix), s, lm)
        return lm.construct(fixed, "incremental"), lm.construct(fixed, "incremental")
    try:
        live = lm.live(item, s.rule(), s.decode, keep_going=False)
        replica = lm.live(item, s.rule(), s.decode, keep_going=False)
    except NoBoundary:
        return None
    return (live, replica) if live.prefix == prefix == replica.prefix else None


def resample_item(lm: LM, job: Job) -> dict[str, Any]:
    """5K draws for one item: live(A), fresh(A), live replica(A), fresh(B), live(C). Pure in (model, job)."""
    item, s = job.item, job.settings
    cfg = ResampleConfig(**dict(job.get("config")))
    states = _states(lm, job)

    def payload(status: Literal["ok", "not_reproduced"], boundary: int | None, draws: list[Draw]) -> ResamplePayload:
        return ResamplePayload(status=status, prompt_ids=list(item.prompt_ids), prefix_ids=list(job.get("prefix")),
                               boundary=boundary, answer=item.answer, live_source=job.get("live_source"),
                               arms=draws, comparisons=[])

    if states is None:
        return payload("not_reproduced", None, []).as_payload()
    live, replica = states
    fresh = lm.construct(live, cfg.construction)
    dc = cfg.sampling(s.decode.max_new_tokens)
    answer_of, score = answer_extractor(s.scorer), scorer_by_name(s.scorer)
    draws = []
    for name, state, stream in (("live", live, "A"), (cfg.construction, fresh, "A"), ("live#replica", replica, "A"),
                                (cfg.construction, fresh, "B"), ("live", live, "C")):  # the order of draw_names
        cache_fp = state.fingerprint()
        for j in range(cfg.k):
            seed = draw_seed(cfg.seed, item.id, stream, j)
            cont = lm.continue_from(state, dc, seed, keep_steps=False)
            text = lm.text([*live.stage1, *cont.suffix])
            draws.append(Draw(
                name=f"{name}:{stream}{j}", state=name, stream=stream, draw=j, seed=seed,
                construction=state.construction, precision=lm.config.precision,
                suffix_ids=list(cont.suffix), suffix_fp=cont.fingerprint, cache_fp=cache_fp,
                stop=cont.stop, answer=answer_of(text), correct=bool(score(text, item.answer)),
            ))
    return payload("ok", len(live.prefix), draws).as_payload()


def job_extra(stage: dict[str, Any], part: str, prefix: list[int] | None) -> tuple[tuple[str, Any], ...]:
    """What a resample job needs besides the item, from its frozen stage: shared by the run and its audit."""
    live_source = "live" if part == stage["model"]["precision"] else "incremental"
    return ("prefix", prefix), ("config", tuple(stage["config"].items())), ("live_source", live_source)


def run_resample(run: Run, model: ModelConfig, settings: ReplaySettings, checkpoint: str, cfg: ResampleConfig,
                 ex: ExecConfig, quiet: bool = False) -> None:
    """Append a resample record per selected item and precision not yet in the ledger."""
    precisions = cfg.precisions or (model.precision,)
    for p in precisions:
        model.with_precision(p)  # validates the name before anything runs
    fixed = fixed_prefixes(run, checkpoint)[: cfg.n]
    # Frozen before the first draw: the sampling settings, the seed rule and the items.
    stage = {"model": model.as_dict(), "settings": settings.as_dict(), "config": asdict(cfg),
             "precisions": list(precisions), "items": [item.id for item, _ in fixed],
             "seeds": {"base": cfg.seed, "rule": SEED_RULE, "streams": STREAMS}}
    run.begin_stage(f"{EXPERIMENT}/{checkpoint}", stage)
    stage = run.manifest["stages"][f"{EXPERIMENT}/{checkpoint}"]
    for p in precisions:
        jobs = [Job(item, settings, part=p, extra=job_extra(stage, p, prefix)) for item, prefix in fixed]
        execute(run, EXPERIMENT, checkpoint, model.with_precision(p), resample_item, jobs, ex, None, quiet)
