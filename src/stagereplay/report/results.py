"""results.json: every table of the report, rebuilt from the ledger (so a resumed run reports the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagereplay.experiments.registry import all_experiments, of_stage
from stagereplay.records.ledger import Record
from stagereplay.records.manifest import Manifest
from stagereplay.records.provenance import now

RESULTS_VERSION = 1
AUDIT_FILE = "audit.json"


def build_results(run_dir: Path, manifest: Manifest, records: list[Record]) -> dict[str, Any]:
    """Each declared stage's sections, as its experiment summarises its records (an experiment of a list of sections
    gets one per stage, arm or precision; one of a single section the last stage's), and the last audit."""
    config = manifest.config
    results: dict[str, Any] = {
        "schema_version": RESULTS_VERSION,
        "run": {
            "model": config.model.path,
            "later_model": config.later_model,
            "precision": config.model.precision,
            "n_items": len(config.item_ids),
            "created": now(),
            "tool_version": manifest.tool_version,
        },
        **{e.name: [] if e.many else None for e in all_experiments()},
        "audit": None,
    }
    for name, stage in manifest.stages.items():
        experiment = of_stage(name)
        checkpoint = name.partition("/")[2]
        mine = [r for r in records if r.experiment == experiment.name and r.checkpoint == checkpoint]
        entry = experiment.entry_of(experiment.summarize(mine, stage, checkpoint))
        if experiment.many:
            results[experiment.name].extend(entry)
        else:
            results[experiment.name] = entry
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
