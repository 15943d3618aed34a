"""results.json: every table of the report, rebuilt from the ledger (so a resumed run reports the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagereplay.records.ledger import Record
from stagereplay.records.provenance import now
from stagereplay.report.summaries import (
    summarize_2x2,
    summarize_bridge,
    summarize_matched,
    summarize_resample,
    summarize_transplant,
)

RESULTS_VERSION = 1
AUDIT_FILE = "audit.json"


def build_results(run_dir: Path, manifest: dict[str, Any], records: list[Record]) -> dict[str, Any]:
    stages: dict[str, dict[str, Any]] = manifest.get("stages", {})
    config = manifest.get("config", {})
    results: dict[str, Any] = {
        "schema_version": RESULTS_VERSION,
        "run": {
            "model": config.get("model", {}).get("path"),
            "later_model": config.get("later_model"),
            "precision": config.get("model", {}).get("precision"),
            "n_items": len(config.get("item_ids", [])),
            "created": now(),
            "tool_version": manifest.get("tool_version"),
        },
        "matched": [],
        "precision_2x2": None,
        "bridge": None,
        "transplant": [],
        "resample": [],
        "audit": None,
    }
    for name, stage in stages.items():
        experiment, _, checkpoint = name.partition("/")
        mine = [r for r in records if r.experiment == experiment and r.checkpoint == checkpoint]
        if experiment == "matched":
            # A serving engine's run sets several arms against live (oneshot, prefix-cache, hf-oneshot): one
            # summary each, as one column each of the matched table.
            for construction in stage.get("arms", [stage["construction"]]):
                summary = summarize_matched(mine, construction, checkpoint, stage["model"]["precision"])
                if "engine" in stage:
                    summary = {"engine": stage["engine"]["name"], **summary}
                results["matched"].append(summary)
        elif experiment == "precision_2x2":
            results["precision_2x2"] = summarize_2x2(mine, stage, checkpoint)
        elif experiment == "bridge":
            results["bridge"] = summarize_bridge(mine, checkpoint)
        elif experiment == "transplant":
            results["transplant"].append(summarize_transplant(mine, stage, checkpoint))
        elif experiment == "resample":
            results["resample"].extend(summarize_resample(mine, stage, checkpoint))
    audit = run_dir / AUDIT_FILE
    if audit.exists():
        results["audit"] = json.loads(audit.read_text())
    return results


def comparable_results(results: dict[str, Any]) -> dict[str, Any]:
    """results.json less what the ledger does not decide: its time stamp, the last audit's findings and the
    models' locations (the chain binds their hashes, not where they lie)."""
    out = json.loads(json.dumps(results))
    for key in ("created", "model", "later_model"):
        out.get("run", {}).pop(key, None)
    out.pop("audit", None)
    return out
