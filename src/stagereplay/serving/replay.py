"""What the audit needs of a serving engine's run besides its experiments' own forms: the engine's build as installed
here, the server of a run that moved, and the arms one request at a time cannot re-execute (under load)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.records.manifest import EngineSection, StageSection
from stagereplay.serving.arms import LOADED
from stagereplay.serving.engines import config_from_dict, kind_of
from stagereplay.serving.http import public_url


def engine_build_here(stages: Mapping[str, StageSection]) -> Mapping[str, object] | None:
    """The build of the serving engine a run's stages name, as it is here (llama.cpp's installed build, the
    server's at its address; the audit compares it as it compares torch's kernels), or None where no stage names an
    engine that records one."""
    for stage in stages.values():
        if stage.engine is not None:
            config = config_from_dict(stage.engine.as_json())
            build = kind_of(config.name).build(config)
            if build is not None:
                return build
    return None


def at_server(stages: Mapping[str, StageSection], url: str
              ) -> tuple[dict[str, StageSection], list[dict[str, str]]]:
    """The stages with the engine of each stage that has an address (a server) at `url` instead of its recorded one
    (in memory: the chain binds the recorded one), and what moved, for the audit's notes."""
    out, moved = dict(stages), []
    for name, stage in stages.items():
        if stage.engine is None:
            continue
        config = config_from_dict(stage.engine.as_json())
        there = kind_of(config.name).at_address(config, url)
        if there is not None:
            out[name] = stage.updated(engine=EngineSection.model_validate(there.as_dict()))
            moved.append({"input": f"{name} server", "recorded": stage.engine.extras().get("url", ""),
                          "here": public_url(url), "how": "--url; its build and model are compared with the "
                                                          "recorded ones"})
    if not moved:
        raise StageReplayError("--url names a server, and no stage of this run ran on one",
                               "drop --url (a run of an engine in process is audited in that engine)")
    return out, moved


def _under_load(*names: str) -> bool:
    """Whether any of the arm names is an under-load arm (`serving.arms.LOADED`)."""
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
