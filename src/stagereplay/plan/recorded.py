"""The work a recorded run did, from its ledger: every unit's forwards from its record's measured lengths (each
experiment's own `forwards(...)`), and the audit's re-executions of the units it samples (`plan_run`).
"""

from __future__ import annotations

from pathlib import Path

from stagereplay.experiments.core.registry import of_stage
from stagereplay.plan.stages import StagePlan, allocate, new_stage
from stagereplay.records.audit_summary import AuditSummary
from stagereplay.records.ledger import Record, items, read_ledger, read_manifest
from stagereplay.records.manifest import Manifest, StageSection
from stagereplay.records.payload_readers import ItemHead


def plan_run(run_dir: Path, audit_sample: int | None = None, audited: bool = True) -> list[StagePlan]:
    """The stages of a run as it ran: every unit's forwards from its record's measured lengths; then its audit,
    re-executing the units the audit picks (`audit.sample_units`: the run's own sample, from its audit.json,
    unless `audit_sample` is given; 0 or none recorded: every unit)."""
    from stagereplay.audit.reexecute import AuditConfig, sample_units

    manifest = read_manifest(run_dir)
    stages_cfg = manifest.stages
    plans: dict[str, StagePlan] = {}
    units: dict[str, list[Record]] = {}  # per stage, as the audit groups them, in ledger order
    made: dict[int, tuple[str, list[int], int]] = {}  # record seq -> (row, forwards, longest sequence)
    prompts: list[int] = []
    for r in items(read_ledger(run_dir)):
        prompts.append(len(r.payload.get("prompt_ids") or []))
        name = f"{r.experiment}/{r.checkpoint}"
        stage = stages_cfg.get(name)
        if stage is None:
            continue  # not a declared stage: the audit re-executes none of it, and verify names it
        counted = unit_forwards(r, stage)
        if counted is None:
            continue
        row, fw, longest = counted
        precision = of_stage(name).unit_model(stage.model.config(), r.part).precision
        plan = plans.setdefault(row, new_stage(row, precision, stage))
        plan.add(fw, longest)
        units.setdefault(name, []).append(r)
        made[r.seq] = counted
    out = list(plans.values())
    config = manifest.config
    if run_cache(manifest) == "static":  # every cache is allocated whole: priced at the longest allocation
        from stagereplay.engine.limits import model_context
        from stagereplay.engine.model import load_checked_config

        decode = config.settings.decode
        allocate(out, prompts, decode.max_stage1_tokens, decode.max_new_tokens,
                 model_context(load_checked_config(Path(config.model.path))), config.model.static_len)
    if not audited:
        return out
    if audit_sample is None:
        path = run_dir / "audit.json"
        recorded = AuditSummary.model_validate_json(path.read_text()).sample if path.exists() else None
        audit_sample, seed = (recorded.per_stage, recorded.seed) if recorded else (None, 0)
    else:
        seed = 0
    chosen = sample_units(units, AuditConfig(audit_sample or None, seed))
    audits: dict[str, StagePlan] = {}
    for r in (r for rs in chosen.values() for r in rs):
        row, fw, longest = made[r.seq]
        st = plans[row]
        audit = audits.setdefault(st.precision, StagePlan(f"audit@{st.precision}", st.precision))
        audit.add(fw, longest)
        audit.caches = max(audit.caches, st.caches)
    return out + list(audits.values())


def run_cache(manifest: Manifest) -> str:
    """The cache kind a run ran on (a run from before `--cache` ran on a dynamic cache)."""
    return manifest.config.model.cache


def unit_forwards(r: Record, stage: StageSection) -> tuple[str, list[int], int] | None:
    """(its plan row, the forwards its item function made, its longest sequence) for one item record, from its
    measured lengths, as its experiment counts them (`Experiment.unit_forwards`); None for a unit whose lengths
    are not recorded, or whose forwards are not our engine's."""
    from stagereplay.experiments.core.serving_run import stage_engine

    name = f"{r.experiment}/{r.checkpoint}"
    experiment = of_stage(name)
    fw = stage_engine(stage).unit_forwards(experiment, r, stage)
    if fw is None:
        return None
    if r.part:
        name = f"{name}@{r.part}"
    if experiment.shape.replays_diagnostics and (p := ItemHead.model_validate(r.payload)).status == "ok":
        fw = fw + replay_forwards(p)
    return name, fw, experiment.unit_positions(r)


def replay_forwards(p: ItemHead) -> list[int]:
    """The single-token forwards the diagnostics make replaying an arm to its pair's first divergent step d
    (experiments.protocol.diagnose, engine.steps.replay_logits): d + 1 for each (arm, d) with d >= 1 inside both arms'
    steps, for the arm of the pair that ran first (the other watched its suffix and kept its own logits there).
    Arms run in the record's order, except the arms carried over from matched (`same_as`), which run last,
    decode only as far as their diagnostics read and watch every other arm's suffix (never replayed)."""
    arms = p.arms
    carried = {a.name for a in arms if "same_as" in a.model_fields_set}
    order = [a.name for a in arms if a.name not in carried] + [a.name for a in arms if a.name in carried]
    steps = {a.name: len(a.suffix_ids) for a in arms}
    out: list[int] = []
    seen: set[tuple[str, int]] = set()
    for c in p.comparisons:
        a, b, d = c.a, c.b, c.first_divergence
        if a not in steps or b not in steps or not d or d >= steps[a] or d >= steps[b]:
            continue
        first = a if order.index(a) < order.index(b) else b
        if first not in carried and (first, d) not in seen:
            seen.add((first, d))
            out += [1] * (d + 1)
    return out
