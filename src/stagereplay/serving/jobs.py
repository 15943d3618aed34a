"""What the audit needs to re-execute a serving engine's records in that engine: the work and the job extras of
each experiment, from the manifest stage that declares the engine."""

from __future__ import annotations

from typing import Any

from stagereplay.execution.config import Work
from stagereplay.serving.matched import arms_of, serving_matched_item
from stagereplay.serving.precision_2x2 import job_extra, serving_grid_item


def serving_work(experiment: str) -> Work:
    return {"matched": serving_matched_item, "precision_2x2": serving_grid_item}[experiment]


def serving_job_extra(experiment: str, stage: dict[str, Any], prefix: Any) -> tuple[tuple[str, Any], ...]:
    arms = arms_of(stage)
    if experiment == "matched":
        return arms.extra()
    return job_extra(arms, tuple(stage["constructions"]), prefix)


def engine_build_here(stages: dict[str, Any]) -> dict[str, Any] | None:
    """The build of the serving engine a run's stages name, as installed here (llama.cpp records its build; the
    audit compares it as it compares torch's kernels), or None where no stage names such an engine."""
    for stage in stages.values():
        if stage.get("engine", {}).get("name") == "llama.cpp":
            from stagereplay.serving.llamacpp import build_info, require

            require()
            return build_info()
    return None
