"""Audit: re-execute a saved run from its manifest and ledger and check every fingerprint is reproduced.

This runs the model again: a ledger whose hash chain was recomputed after an edit still fails here, because
the edited tokens are not what the model produces.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from stagereplay.engine.lm import ids_fingerprint
from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.common import Job, ReplaySettings
from stagereplay.records.ledger import Record, chain_problems, diff_fields, parse_record
from stagereplay.tasks import DataConfig, Item, load_items

PER_PRECISION = ("precision_2x2", "resample")
"""Experiments whose records' `part` is the precision they ran at."""


def verify_ledger(run_dir: Path) -> list[dict[str, Any]]:
    """Integrity only, no model: every line parses, every hash and link of the chain holds."""
    path = run_dir / "ledger.jsonl"
    if not path.exists():
        return [{"seq": 0, "reason": f"no ledger.jsonl in {run_dir}"}]
    data = path.read_bytes()
    problems: list[dict[str, Any]] = []
    if data and not data.endswith(b"\n"):
        problems.append({"seq": data.count(b"\n"), "reason": "incomplete last record (torn write)"})
    records: list[Record] = []
    for i, line in enumerate(data.split(b"\n")[:-1]):  # after the last newline: empty, or torn (reported above)
        try:
            records.append(parse_record(line.decode("utf-8"), i + 1, path))
        except Exception as exc:  # a damaged line is a finding, not a crash
            problems.append({"seq": i, "reason": str(exc).split(";")[0]})
            return problems + chain_problems(records)
    return problems + chain_problems(records)


def _trajectories(payload: dict[str, Any]) -> dict[str, list[int] | None]:
    """Every decoded sequence in a payload (transplanted continuations are arms too), by arm name."""
    return {f"arm {a['name']}": a["suffix_ids"] for a in payload.get("arms", [])}


def compare_payloads(item_id: str, recorded: dict[str, Any], again: dict[str, Any]
                     ) -> tuple[int, int, int, int, list[str]]:
    """(trajectories reproduced, of, comparisons reproduced, of, mismatch descriptions)."""
    mismatches = []
    rec_t, new_t = _trajectories(recorded), _trajectories(again)
    t_ok = 0
    for name, ids in rec_t.items():
        arm = next((a for a in recorded.get("arms", []) if f"arm {a['name']}" == name), None)
        consistent = arm is None or arm["suffix_fp"] == ids_fingerprint(ids or [])
        if consistent and new_t.get(name) == ids:
            t_ok += 1
        else:
            mismatches.append(f"{item_id}: {name} not reproduced")
    new_c = {(c["a"], c["b"]): c["fp"] for c in again.get("comparisons", [])}
    c_ok = 0
    for c in recorded.get("comparisons", []):
        if new_c.get((c["a"], c["b"])) == c["fp"]:
            c_ok += 1
        else:
            mismatches.append(f"{item_id}: comparison {c['a']} vs {c['b']} not reproduced")
    others = [f for f in diff_fields(recorded, again) if not f.startswith(("arms", "comparisons"))]
    mismatches += [f"{item_id}: {f} differs" for f in others]
    return t_ok, len(rec_t), c_ok, len(recorded.get("comparisons", [])), mismatches


def _work(experiment: str) -> Callable[..., dict[str, Any]]:
    from stagereplay.experiments.bridge import bridge_item
    from stagereplay.experiments.matched import matched_item
    from stagereplay.experiments.precision_2x2 import grid_item
    from stagereplay.experiments.resample import resample_item
    from stagereplay.experiments.transplant import transplant_item

    return {"matched": matched_item, "precision_2x2": grid_item, "bridge": bridge_item,
            "transplant": transplant_item, "resample": resample_item}[experiment]


def _job(record: Record, stage: dict[str, Any], item: Item, prefixes: dict[tuple[str, str], Any]) -> Job:
    s = stage["settings"]
    from stagereplay.engine.decode import DecodeConfig

    settings = ReplaySettings(s["boundary"], DecodeConfig(**s["decode"]), s["scorer"])
    prefix = prefixes.get((record.checkpoint, record.item_id))
    extra: tuple[tuple[str, Any], ...]
    if record.experiment == "matched":
        extra = (("construction", stage["construction"]),)
    elif record.experiment == "precision_2x2":
        extra = (("prefix", prefix), ("constructions", tuple(stage["constructions"])))
    elif record.experiment == "bridge":
        extra = (("prefix", prefix),)
    elif record.experiment == "resample":
        from stagereplay.experiments.resample import job_extra

        extra = job_extra(stage, record.part, prefix)
    else:
        extra = (("prefix", prefix), ("config", tuple(stage["config"].items())))
    return Job(item, settings, record.part, extra)


def _model_key(stages: dict[str, Any], group: tuple[str, str, str]) -> tuple[str, str]:
    experiment, checkpoint, part = group
    model = stages[f"{experiment}/{checkpoint}"]["model"]
    return model["path"], part or model["precision"]


def audit_run(run_dir: Path, manifest: dict[str, Any], records: list[Record], ex: ExecConfig,
              quiet: bool = False) -> dict[str, Any]:
    """Re-execute every record; return the audit summary (also what results.json shows)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.execution.jobs import run_jobs

    config = manifest["config"]
    stages = manifest.get("stages", {})
    _, tokenizer = load_config_and_tokenizer(config["model"]["path"])  # the weights load where jobs run
    items = {i.id: i for i in load_items(DataConfig(**config["data"]), tokenizer)[0]}
    # Prefixes of the matched records: the fixed token states the other experiments start from.
    prefixes = {(r.checkpoint, r.item_id): r.payload.get("prefix_ids") for r in records if r.experiment == "matched"}
    groups: dict[tuple[str, str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.experiment, r.checkpoint, r.part if r.experiment in PER_PRECISION else ""), []).append(r)
    t_ok = t_n = c_ok = c_n = 0
    mismatches: list[dict[str, str]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), disable=quiet) as bar:
        task = bar.add_task("audit", total=len(records))
        # Grouped by model settings, so that worker processes load each model once.
        for (experiment, checkpoint, part), group in sorted(groups.items(), key=lambda g: _model_key(stages, g[0])):
            stage = stages[f"{experiment}/{checkpoint}"]
            model = ModelConfig(**stage["model"])
            if part:
                model = model.with_precision(part)
            missing = [r.item_id for r in group if r.item_id not in items]
            mismatches += [{"item_id": i, "what": "item is not in the manifest's dataset"} for i in missing]
            todo = [r for r in group if r.item_id in items]
            jobs = [_job(r, stage, items[r.item_id], prefixes) for r in todo]
            for record, again in zip(todo, run_jobs(model, _work(experiment), jobs, ex), strict=True):
                a, b, c, d, bad = compare_payloads(record.item_id, record.payload, again)
                t_ok, t_n, c_ok, c_n = t_ok + a, t_n + b, c_ok + c, c_n + d
                where = f"{experiment}/{checkpoint}{'@' + part if part else ''}"
                mismatches += [{"item_id": record.item_id, "what": f"{where} {m}"} for m in bad]
                bar.advance(task)
    chain = chain_problems(records)
    return {"items": len({r.item_id for r in records}), "records": len(records),
            "trajectories": {"k": t_ok, "n": t_n}, "comparisons": {"k": c_ok, "n": c_n},
            "chain_ok": not chain, "broken_records": chain, "mismatches": mismatches,
            "reproduced": not mismatches and not chain}
