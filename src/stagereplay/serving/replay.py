"""What the audit needs to re-execute a serving engine's records in that engine: the work and the job extras of
each experiment, from the manifest stage that declares the engine."""

from __future__ import annotations

from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.execution.config import Work
from stagereplay.serving.matched import LOADED, arms_of, serving_matched_item
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
        if stage.get("engine", {}).get("name") == "http":  # the server at the recorded address, as it is now
            from stagereplay.serving import http
            from stagereplay.serving.seam import EngineConfig

            return http.build_info(EngineConfig(**stage["engine"]))
    return None


def at_server(stages: dict[str, Any], url: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The stages with the server of each `--engine http` stage at `url` instead of its recorded address (in memory:
    the chain binds the recorded one), and what moved, for the audit's notes."""
    from stagereplay.serving.http import public_url

    out, moved = dict(stages), []
    for name, stage in stages.items():
        engine = stage.get("engine") or {}
        if engine.get("name") == "http":
            out[name] = {**stage, "engine": {**engine, "url": url}}
            moved.append({"input": f"{name} server", "recorded": engine.get("url", ""), "here": public_url(url),
                          "how": "--url; its build and model are compared with the recorded ones"})
    if not moved:
        raise StageReplayError("--url names a server, and this run has no stage of --engine http",
                               "drop --url (a run of another engine is audited in that engine)")
    return out, moved


def _under_load(*names: str) -> bool:
    """Whether any of the arm names is an under-load arm (`serving.matched.LOADED`)."""
    return not set(LOADED).isdisjoint(names)


def _has_load(payload: dict[str, Any]) -> bool:
    return _under_load(*(str(a.get("name")) for a in payload.get("arms", [])))


def replayable(payload: dict[str, Any]) -> dict[str, Any]:
    """A serving record without what one request at a time cannot re-execute: the under-load arms (other
    requests in flight decide their bits), their comparisons, margins and the item's load finding."""
    if not _has_load(payload):
        return payload
    diagnostics = dict(payload.get("diagnostics") or {})
    if diagnostics:
        diagnostics["margins"] = {k: v for k, v in (diagnostics.get("margins") or {}).items() if not _under_load(k)}
        diagnostics["pairs"] = {k: v for k, v in (diagnostics.get("pairs") or {}).items()
                                if not _under_load(*k.split(" vs "))}
    return {**{k: v for k, v in payload.items() if k != "load_finding"},
            "arms": [a for a in payload["arms"] if not _under_load(a.get("name"))],
            "comparisons": [c for c in payload.get("comparisons", []) if not _under_load(c["a"], c["b"])],
            **({"diagnostics": diagnostics} if diagnostics else {})}


def with_unreplayed(again: dict[str, Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """A re-executed serving record with the parts `replayable` left out taken as recorded, so the run's results
    rebuild from it (the under-load rows are then the run's own, the rest re-executed)."""
    if not _has_load(recorded):
        return again
    out = {**again, "arms": [*again.get("arms", []), *(a for a in recorded["arms"] if _under_load(a.get("name")))],
           "comparisons": [*again.get("comparisons", []),
                           *(c for c in recorded.get("comparisons", []) if _under_load(c["a"], c["b"]))]}
    if "load_finding" in recorded:
        out["load_finding"] = recorded["load_finding"]
    diagnostics, kept = dict(again.get("diagnostics") or {}), recorded.get("diagnostics") or {}
    if diagnostics and kept:
        diagnostics["margins"] = {**diagnostics.get("margins", {}),
                                  **{k: v for k, v in kept.get("margins", {}).items() if _under_load(k)}}
        diagnostics["pairs"] = {**diagnostics.get("pairs", {}),
                                **{k: v for k, v in kept.get("pairs", {}).items() if _under_load(*k.split(" vs "))}}
        out["diagnostics"] = diagnostics
    return out
