"""Matched: per item, the retained live continuation and a fresh construction of the same token IDs, each
with an exact replica from scratch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from stagereplay.executors import ExecConfig
from stagereplay.experiments.common import (
    Job,
    ReplaySettings,
    arm_record,
    comparison,
    execute,
    no_boundary_payload,
)
from stagereplay.ledger import Record, Run
from stagereplay.lm import LM, NoBoundary, check_construction
from stagereplay.model import ModelConfig
from stagereplay.stats import mcnemar_exact, paired_bootstrap_ci
from stagereplay.tasks import DataConfig

EXPERIMENT = "matched"


@dataclass(frozen=True)
class MatchedConfig:
    """One matched experiment at one checkpoint."""

    model: ModelConfig
    settings: ReplaySettings
    data: DataConfig = field(default_factory=DataConfig)
    construction: str = field(default="oneshot", metadata={"help": "the fresh construction set against live"})
    checkpoint: str = field(default="primary", metadata={"help": "name of this model in the run"})
    bootstrap_seed: int = field(default=0, metadata={"help": "seed of the paired bootstrap"})
    n_resamples: int = field(default=10_000, metadata={"help": "bootstrap resamples"})

    def __post_init__(self) -> None:
        check_construction(self.construction)

    def stage(self) -> dict[str, Any]:
        return {"model": asdict(self.model), "settings": self.settings.as_dict(), "construction": self.construction}


def matched_item(lm: LM, job: Job) -> dict[str, Any]:
    """Live + replica, construction + replica; the comparisons between them. Pure in (model, item, settings)."""
    item, s = job.item, job.settings
    construction = job.get("construction", "oneshot")
    rule = s.rule()
    try:
        live = lm.live(item, rule, s.decode)
    except NoBoundary as nb:
        return no_boundary_payload(item, nb.generated)
    try:
        replica = lm.live(item, rule, s.decode)  # from scratch: the same construction run again
    except NoBoundary:
        replica = None
    fresh = lm.construct(live, construction)
    fresh_again = lm.construct(live, construction)
    stage1 = live.stage1
    assert live.live_suffix is not None
    arms = [arm_record(lm, "live", live, live.live_suffix, stage1, item, s.scorer)]
    if replica is not None and replica.live_suffix is not None:
        arms.append(arm_record(lm, "live#replica", replica, replica.live_suffix, stage1, item, s.scorer))
    arms.append(arm_record(lm, construction, fresh, lm.continue_from(fresh, s.decode), stage1, item, s.scorer))
    arms.append(arm_record(lm, f"{construction}#replica", fresh_again, lm.continue_from(fresh_again, s.decode),
                           stage1, item, s.scorer))
    by = {a["name"]: a for a in arms}
    pairs = [("live", construction), ("live", "live#replica"), (construction, f"{construction}#replica")]
    return {
        "status": "ok",
        "prompt_ids": list(item.prompt_ids),
        "prefix_ids": list(live.prefix),
        "boundary": len(live.prefix),
        "answer": item.answer,
        "replica_prefix_equal": replica is not None and replica.prefix == live.prefix,
        "arms": arms,
        "comparisons": [comparison(item.id, by[a], by[b]) for a, b in pairs if a in by and b in by],
    }


def run_matched(run: Run, config: MatchedConfig, items: list[Any], ex: ExecConfig, lm: LM | None = None,
                quiet: bool = False) -> None:
    """Append a matched record for every item not yet in the ledger."""
    stage = f"{EXPERIMENT}/{config.checkpoint}"
    run.begin_stage(stage, config.stage())
    jobs = [Job(item, config.settings, extra=(("construction", config.construction),)) for item in items]
    execute(run, EXPERIMENT, config.checkpoint, config.model, matched_item, jobs, ex, lm, quiet)


def _cmp(record: Record, a: str, b: str) -> dict[str, Any] | None:
    for c in record.payload["comparisons"]:
        if c["a"] == a and c["b"] == b:
            return dict(c)
    return None


def summarize_matched(records: list[Record], construction: str, checkpoint: str, precision: str,
                      seed: int = 0, n_resamples: int = 10_000) -> dict[str, Any]:
    """The matched table: replica exactness, disagreements, accuracies, paired CI, McNemar, divergence indices."""
    ok = [r for r in records if r.payload["status"] == "ok"]
    rep_live = rep_other = 0
    suffix_k = label_k = live_only = other_only = 0
    live_acc, other_acc, divergence = [], [], []
    for r in ok:
        arms = {a["name"]: a for a in r.payload["arms"]}
        lr, orr = _cmp(r, "live", "live#replica"), _cmp(r, construction, f"{construction}#replica")
        rep_live += bool(lr and lr["suffix_equal"] and lr["cache_equal"] and r.payload["replica_prefix_equal"])
        rep_other += bool(orr and orr["suffix_equal"] and orr["cache_equal"])
        main = _cmp(r, "live", construction)
        assert main is not None
        if not main["suffix_equal"]:
            suffix_k += 1
            divergence.append(main["first_divergence"])
        a, b = arms["live"]["correct"], arms[construction]["correct"]
        label_k += a != b
        live_only += a and not b
        other_only += b and not a
        live_acc.append(int(a))
        other_acc.append(int(b))
    n = len(ok)
    summary: dict[str, Any] = {
        "checkpoint": checkpoint, "construction": construction, "precision": precision,
        "n": len(records), "n_boundary": n, "n_no_boundary": len(records) - n,
        "replica_exact": {"live": {"k": rep_live, "n": n}, construction: {"k": rep_other, "n": n}},
        "suffix_disagreements": {"k": suffix_k, "n": n},
        "label_disagreements": {"k": label_k, "n": n},
        "accuracy": {"live": None, construction: None},
        "accuracy_diff": None,
        "discordant": {"live_only": live_only, "other_only": other_only},
        "mcnemar_p": None,
        "first_divergence": divergence,
    }
    if n:
        la, oa = sum(live_acc) / n, sum(other_acc) / n
        lo, hi = paired_bootstrap_ci(live_acc, other_acc, n_resamples=n_resamples, seed=seed)
        summary["accuracy"] = {"live": la, construction: oa}
        summary["accuracy_diff"] = {"estimate": la - oa, "ci": [lo, hi], "confidence": 0.95,
                                    "n_resamples": n_resamples, "seed": seed}
        summary["mcnemar_p"] = mcnemar_exact(live_only, other_only)
    return summary
