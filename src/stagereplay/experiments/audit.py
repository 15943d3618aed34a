"""Audit: re-execute a saved run from its manifest and ledger and re-derive every claim its records make.

This runs the model again: a ledger whose hash chain was recomputed after an edit still fails here, because
the edited tokens, fingerprints or labels are not what the model produces. Every field of every item record
is compared with its re-execution (token IDs and their fingerprints, every arm's cache fingerprint and
label, every comparison field, transplant outcomes, statuses), and results.json is rebuilt from the
re-executed records. The model-free checks (chain, binding, completeness, derivable claims) are
`stagereplay.experiments.verify`, which runs first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.common import Job, ReplaySettings, comparison_fp_schema_1
from stagereplay.records.ledger import Record, diff_fields, items
from stagereplay.records.manifest import binds
from stagereplay.records.provenance import model_hashes
from stagereplay.records.shards import parse_shard, shard_items
from stagereplay.report.results import build_results, comparable_results
from stagereplay.tasks import DataConfig, Item, load_items

__all__ = ["audit_run", "compare_payloads", "verify_ledger"]

PER_PRECISION = ("precision_2x2", "resample")
"""Experiments whose records' `part` is the precision they ran at."""


def verify_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """Integrity only, no model: every line parses, every hash and link of the chain holds (from the
    manifest's identity when there is one), and the chain is bound to the manifest."""
    from stagereplay.experiments.verify import read_chain
    from stagereplay.records.ledger import chain_problems, read_manifest
    from stagereplay.records.manifest import binding_problems, chain_start

    manifest = read_manifest(run_dir) if (run_dir / "manifest.json").exists() else {}
    chain, problems = read_chain(run_dir)
    return problems + chain_problems(chain, chain_start(manifest)) + binding_problems(manifest, chain)


def _keyed(entries: list[dict[str, Any]], key: Callable[[dict[str, Any]], str]) -> dict[str, dict[str, Any]]:
    return {key(e): e for e in entries}


def compare_payloads(item_id: str, recorded: dict[str, Any], again: dict[str, Any]
                     ) -> tuple[int, int, int, int, list[str]]:
    """(trajectories reproduced, of, comparisons reproduced, of, mismatch descriptions naming each field).

    Arms are matched by name and comparisons by their pair; every other field is compared as it stands."""
    mismatches: list[str] = []
    rec_arms, new_arms = (_keyed(p.get("arms", []), lambda a: str(a.get("name"))) for p in (recorded, again))
    t_ok = 0
    for name, arm in rec_arms.items():
        fields = diff_fields(arm, new_arms[name]) if name in new_arms else ["(the arm)"]
        t_ok += not fields
        mismatches += [f"{item_id}: arm {name}: {f} not reproduced" for f in fields]
    mismatches += [f"{item_id}: arm {name} produced but not recorded" for name in new_arms if name not in rec_arms]

    def pair(c: dict[str, Any]) -> str:
        return f"{c.get('a')} vs {c.get('b')}"

    rec_c, new_c = (_keyed(p.get("comparisons", []), pair) for p in (recorded, again))
    c_ok = 0
    for name, c in rec_c.items():
        fields = diff_fields(c, new_c[name]) if name in new_c else ["(the comparison)"]
        c_ok += not fields
        mismatches += [f"{item_id}: comparison {name}: {f} not reproduced" for f in fields]
    mismatches += [f"{item_id}: comparison {name} produced but not recorded" for name in new_c if name not in rec_c]
    rec_rest, new_rest = ({k: v for k, v in p.items() if k not in ("arms", "comparisons")} for p in (recorded, again))
    mismatches += [f"{item_id}: {f} not reproduced" for f in diff_fields(rec_rest, new_rest, lists=True)]
    return t_ok, len(rec_arms), c_ok, len(rec_c), mismatches


def _work(experiment: str) -> Callable[..., dict[str, Any]]:
    from stagereplay.experiments.bridge import bridge_item
    from stagereplay.experiments.matched import matched_item
    from stagereplay.experiments.precision_2x2 import grid_item
    from stagereplay.experiments.resample import resample_item
    from stagereplay.experiments.transplant import transplant_item

    return {"matched": matched_item, "precision_2x2": grid_item, "bridge": bridge_item,
            "transplant": transplant_item, "resample": resample_item}[experiment]


def _job(record: Record, stage: dict[str, Any], item: Item, prefixes: dict[tuple[str, str], Any],
         reuse: Any = None) -> Job:
    s = stage["settings"]
    from stagereplay.engine.decode import DecodeConfig

    settings = ReplaySettings(s["boundary"], DecodeConfig(**s["decode"]), s["scorer"])
    prefix = prefixes.get((record.checkpoint, record.item_id))
    extra: tuple[tuple[str, Any], ...]
    if record.experiment == "matched":
        extra = (("construction", stage["construction"]),)
    elif record.experiment == "precision_2x2":
        extra = (("prefix", prefix), ("constructions", tuple(stage["constructions"])), ("reuse", reuse))
    elif record.experiment == "bridge":
        extra = (("prefix", prefix),)
    elif record.experiment == "resample":
        from stagereplay.experiments.resample import job_extra

        extra = job_extra(stage, record.part, prefix)
    else:
        extra = (("prefix", prefix), ("config", tuple(stage["config"].items())))
    return Job(item, settings, record.part, extra)


def _reuse(record: Record, stage: dict[str, Any], stages: dict[str, Any],
           matched: dict[tuple[str, str], dict[str, Any]]) -> Any:
    """The matched arm a 2x2 record carries over (`precision_2x2.reused_arm`), as the run found it."""
    from stagereplay.experiments.precision_2x2 import reused_arm

    if record.experiment != "precision_2x2" or (record.checkpoint, record.item_id) not in matched:
        return None
    return reused_arm(stage, stages.get(f"matched/{record.checkpoint}"), matched[(record.checkpoint, record.item_id)],
                      record.checkpoint, record.part)


def _model_key(stages: dict[str, Any], group: tuple[str, str, str]) -> tuple[str, str]:
    experiment, checkpoint, part = group
    model = stages[f"{experiment}/{checkpoint}"]["model"]
    return model["path"], part or model["precision"]


def as_schema_1(item_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A re-executed payload with its comparison fingerprints as ledger schema 1 wrote them."""
    arms = {a["name"]: a for a in payload.get("arms", [])}
    comparisons = [{**c, "fp": comparison_fp_schema_1(item_id, arms[c["a"]], arms[c["b"]])}
                   for c in payload.get("comparisons", [])]
    return {**payload, "comparisons": comparisons}


def input_findings(manifest: dict[str, Any], data_hash: str, item_ids: list[str]) -> list[dict[str, str]]:
    """The files at the manifest's paths must be the ones the run bound by hash: each stage's model
    (config, weights, tokenizer, generation config) and the dataset, whose items (this shard's) must be the
    manifest's item ids. A path is only where to look."""
    bound = manifest["config"].get("model_hashes", {})
    want = shard_items(item_ids, parse_shard(manifest["config"].get("shard")))
    have = manifest["config"].get("item_ids", [])
    findings = [{"item_id": i, "what": "config.item_ids lacks an item of the dataset"} for i in want if i not in have]
    findings += [{"item_id": i, "what": "config.item_ids holds an item the dataset lacks"} for i in have if i not in want]
    if data_hash != manifest["config"].get("dataset_hash"):
        findings.append({"item_id": "", "what": f"the data at {manifest['config']['data'].get('path')} is not the "
                                                "run's dataset (dataset_hash differs)"})
    seen: dict[str, str] = {}
    for name, stage in manifest.get("stages", {}).items():
        checkpoint, path = name.partition("/")[2], stage["model"]["path"]
        if seen.get(checkpoint) == path or checkpoint not in bound:
            continue
        seen[checkpoint] = path
        differ = diff_fields(bound[checkpoint], model_hashes(path))
        if differ and binds(manifest):
            findings.append({"item_id": "", "what": f"the model at {path} is not the run's {checkpoint} model "
                                                    f"({', '.join(differ)} differ)"})
    return findings


def audit_run(run_dir: Path, manifest: dict[str, Any], records: list[Record], ex: ExecConfig,
              quiet: bool = False, stored_results: bool = True) -> dict[str, Any]:
    """Check what needs no model (`verify.verify_run`), then re-execute every item record and compare every
    field; rebuild the results from the re-executed records. Returns the audit summary (results.json's
    `audit`). `stored_results=False` skips the comparison with a results.json not yet rewritten (a paper run)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.execution.jobs import run_jobs
    from stagereplay.experiments.verify import claimed, expected_units, verify_run

    checked = verify_run(run_dir, manifest, stored_results)
    mismatches: list[dict[str, str]] = list(checked["mismatches"])
    records = items(records)
    config = manifest["config"]
    stages = manifest.get("stages", {})
    _, tokenizer = load_config_and_tokenizer(config["model"]["path"])  # the weights load where jobs run
    loaded, data_hash = load_items(DataConfig(**config["data"]), tokenizer)
    by_id = {i.id: i for i in loaded}
    mismatches += input_findings(manifest, data_hash, [i.id for i in loaded])
    # Prefixes of the matched records: the fixed token states the other experiments start from.
    prefixes = {(r.checkpoint, r.item_id): r.payload.get("prefix_ids") for r in records if r.experiment == "matched"}
    matched = {(r.checkpoint, r.item_id): r.payload for r in records if r.experiment == "matched"}
    # Only the units the manifest declares, once each: a missing, extra or duplicated record is verify's finding.
    declared = {(name, item, part) for name, stage in stages.items()
                for item, part in expected_units(name, stage, config, records)}
    groups: dict[tuple[str, str, str], list[Record]] = {}
    for r in records:
        unit = (f"{r.experiment}/{r.checkpoint}", r.item_id, r.part)
        if unit in declared:
            declared.discard(unit)
            groups.setdefault((r.experiment, r.checkpoint, r.part if r.experiment in PER_PRECISION else ""),
                              []).append(r)
    t_ok = t_n = c_ok = c_n = 0
    again_records: list[Record] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), disable=quiet) as bar:
        task = bar.add_task("audit", total=len(records))
        # Grouped by model settings, so that worker processes load each model once.
        for (experiment, checkpoint, part), group in sorted(groups.items(), key=lambda g: _model_key(stages, g[0])):
            stage = stages[f"{experiment}/{checkpoint}"]
            model = ModelConfig(**stage["model"])
            if part:
                model = model.with_precision(part)
            where = f"{experiment}/{checkpoint}{'@' + part if part else ''}"
            missing = [r.item_id for r in group if r.item_id not in by_id]
            mismatches += [{"item_id": i, "what": f"{where}: item is not in the manifest's dataset"} for i in missing]
            todo = [r for r in group if r.item_id in by_id]
            jobs = [_job(r, stage, by_id[r.item_id], prefixes, _reuse(r, stage, stages, matched)) for r in todo]
            for record, again in zip(todo, run_jobs(model, _work(experiment), jobs, ex), strict=True):
                if not binds(manifest):  # what a schema 1 record claims, as it fingerprinted it
                    again = claimed(as_schema_1(record.item_id, again), record.payload)
                a, b, c, d, bad = compare_payloads(record.item_id, record.payload, again)
                t_ok, t_n, c_ok, c_n = t_ok + a, t_n + b, c_ok + c, c_n + d
                mismatches += [{"item_id": record.item_id, "what": f"{where} {m}"} for m in bad]
                again_records.append(record.model_copy(update={"payload": again}))
                bar.advance(task)
    order = {r.seq: k for k, r in enumerate(records)}
    again_records.sort(key=lambda r: order[r.seq])
    recorded, rebuilt = (comparable_results(build_results(run_dir, manifest, rs)) for rs in (records, again_records))
    mismatches += [{"item_id": "", "what": f"results {f} is not what the re-executed records give"}
                   for f in diff_fields(recorded, rebuilt, lists=True)]
    broken = checked["broken_records"]
    return {"items": len({r.item_id for r in records}), "records": len(records),
            "trajectories": {"k": t_ok, "n": t_n}, "comparisons": {"k": c_ok, "n": c_n},
            "chain_ok": not broken, "broken_records": broken, "mismatches": mismatches,
            "notes": checked["notes"], "reproduced": not mismatches and not broken}
