"""Pieces every experiment shares: arm and comparison records, the item loop with its progress bar."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from stagereplay.engine.boundary import BoundaryRule, parse_boundary
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.lm import LM, BoundaryState, Continuation
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig, Work
from stagereplay.execution.jobs import run_jobs
from stagereplay.records.ledger import Run, sha256_json
from stagereplay.report.stats import first_divergence
from stagereplay.tasks.base import Item
from stagereplay.tasks.scoring import scorer_by_name


@dataclass(frozen=True)
class ReplaySettings:
    """What every item job needs besides the item: how to find the boundary, decode and score."""

    boundary: str = field(metadata={"help": "marker:TEXT | regex:PATTERN | after:N"})
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    scorer: str = field(default="last-number", metadata={"help": "last-number | exact | regex:PATTERN"})

    def rule(self) -> BoundaryRule:
        return parse_boundary(self.boundary)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Job:
    """One item's work for one experiment; picklable so that worker processes and Ray actors can take it."""

    item: Item
    settings: ReplaySettings
    part: str = ""
    extra: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.extra).get(key, default)


def arm_record(lm: LM, name: str, state: BoundaryState, cont: Continuation, stage1: Sequence[int], item: Item,
               scorer: str) -> dict[str, Any]:
    """One arm: its suffix, fingerprints and correctness label. Text is scored as stage 1 + suffix."""
    text = lm.text([*stage1, *cont.suffix])
    arm = {
        "name": name,
        "construction": state.construction,
        "precision": lm.config.precision,
        "suffix_ids": list(cont.suffix),
        "suffix_fp": cont.fingerprint,
        "cache_fp": state.fingerprint(),
        "stop": cont.stop,
        "text": text,
        "correct": bool(scorer_by_name(scorer)(text, item.answer)),
    }
    if state.roundtrip is not None:
        arm["roundtrip"] = state.roundtrip
    return arm


def comparison(item_id: str, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two arms side by side, with a fingerprint over item, arm names, suffix fingerprints and labels."""
    return {
        "a": a["name"],
        "b": b["name"],
        "suffix_equal": a["suffix_fp"] == b["suffix_fp"],
        "cache_equal": a["cache_fp"] == b["cache_fp"],
        "label_equal": a["correct"] == b["correct"],
        "first_divergence": first_divergence(a["suffix_ids"], b["suffix_ids"]),
        "fp": sha256_json([item_id, a["name"], b["name"], a["suffix_fp"], b["suffix_fp"], a["correct"], b["correct"]]),
    }


def no_boundary_payload(item: Item, generated: Sequence[int]) -> dict[str, Any]:
    return {"status": "no_boundary", "prompt_ids": list(item.prompt_ids), "prefix_ids": None, "boundary": None,
            "generated_ids": list(generated), "answer": item.answer, "arms": [], "comparisons": []}


def execute(run: Run, experiment: str, checkpoint: str, model: ModelConfig, work: Work, jobs: Sequence[Job],
            ex: ExecConfig, lm: LM | None = None, quiet: bool = False) -> None:
    """Run every job not yet in the ledger, appending records in job order, with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    pending = [j for j in jobs if not run.done(experiment, checkpoint, j.item.id, j.part)]
    label = f"{experiment} [{checkpoint}]" + (f" {model.precision}" if model.precision else "")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=quiet, transient=False) as bar:
        task = bar.add_task(label, total=len(jobs), completed=len(jobs) - len(pending))
        for job, payload in zip(pending, run_jobs(model, work, pending, ex, lm), strict=False):
            run.append(experiment, checkpoint, job.item.id, payload, job.part)
            bar.advance(task)
