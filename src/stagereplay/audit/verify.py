"""The audit's model-free half (`stagereplay audit --verify-only`): what holds without running a model.

    chain         every line parses; every hash and link holds, from the manifest's identity hash
    binding       the manifest's configuration, item ids and stages are the ones the chain was made under
    completeness  each unit a declared stage names has exactly one record, and no record is outside them
    claims        every field that follows from other recorded fields follows: comparisons from their arms,
                  labels from the scorer, fingerprints from token IDs, transplant outcomes from the arms,
                  a transplant selection from its rule, results.json from the ledger
    summary       each stage's records summarize as its experiment summarizes them (what results.json and the
                  report are made of): a record its summary cannot read (a score array one short of its tokens)
                  is named

What needs the model (token IDs and cache fingerprints themselves) is the re-executing audit's part.
A finding (`records.findings.Finding`) names the item, the stage and the field; a chain break (`Break`) the line.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stagereplay.audit.versions import claimed, derived_comparison
from stagereplay.engine.lm import ids_fingerprint
from stagereplay.experiments.core import registry
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.records.audit_summary import AuditSummary
from stagereplay.records.findings import Break, Finding
from stagereplay.records.ledger import Record, chain_problems, diff_fields, items, parse_record
from stagereplay.records.manifest import (
    Manifest,
    RunConfig,
    StageSection,
    binding_problems,
    binds,
    bound_config,
    bound_stage,
    chain_start,
    stage_name,
)
from stagereplay.records.payload_readers import ItemHead
from stagereplay.records.payloads import Arm, first_error, read_arm
from stagereplay.records.shards import parse_shard, shard_items
from stagereplay.report.results import build_results, comparable_results
from stagereplay.tasks.item_sources import source
from stagereplay.tasks.scoring import scorer_by_name

STATUSES = ("ok", "no_boundary", "prefix_not_reproduced", "not_reproduced")
SCHEMA_1_NOTE = ("ledger schema 1: its manifest is not bound into the hash chain, so an edit of the manifest "
                 "alone goes unseen; re-run the experiments to get a bound run")


def read_chain(run_dir: Path) -> tuple[list[Record], list[Break]]:
    """The records that parse, and the damage: a torn last line, a line that does not parse."""
    path = run_dir / "ledger.jsonl"
    if not path.exists():
        return [], [Break(seq=0, reason=f"no ledger.jsonl in {run_dir}")]
    data = path.read_bytes()
    problems: list[Break] = []
    if data and not data.endswith(b"\n"):
        problems.append(Break(seq=data.count(b"\n"), reason="incomplete last record (torn write)"))
    records: list[Record] = []
    for i, line in enumerate(data.split(b"\n")[:-1]):  # after the last newline: empty, or torn (reported above)
        try:
            records.append(parse_record(line.decode("utf-8"), i + 1, path))
        except Exception as exc:  # a damaged line is a finding, not a crash
            problems.append(Break(seq=i, reason=str(exc).split(";")[0]))
            break
    return records, problems


def verify_run(run_dir: Path, manifest: Manifest, stored_results: bool = True) -> AuditSummary:
    """Chain, binding, completeness and every derivable claim; `reproduced` is False on any finding.
    `stored_results=False` leaves out results.json (a run about to rewrite it)."""
    chain, broken = read_chain(run_dir)
    broken += chain_problems(chain, chain_start(manifest)) + binding_problems(manifest, chain)
    records = items(chain)
    findings: list[Finding] = []
    if not broken:  # a broken chain is the finding; what it says is not to be trusted or derived from
        findings += _guarded("", "the manifest", lambda: dataset_findings(manifest) + stage_model_findings(manifest))
        findings += _guarded("", "the ledger", lambda: completeness(manifest, records))
        stages = manifest.stages
        matched = {(r.checkpoint, r.item_id): r for r in records if registry.starts_run(r.experiment)
                   and not r.part}
        for r in records:
            stage = stages.get(stage_name(r))
            if stage is not None:
                findings += _guarded(r.item_id, stage_name(r), partial(
                    claim_findings, r, stage, matched.get((r.checkpoint, r.item_id)), binds(manifest)))
        unsummarized = summary_findings(manifest, records)
        findings += unsummarized
        if stored_results and not unsummarized:
            findings += _guarded("", "results.json", lambda: results_findings(run_dir, manifest, records))
    return AuditSummary(items=len({r.item_id for r in records}), records=len(records), chain_ok=not broken,
                        broken_records=broken, findings=findings, notes=[] if binds(manifest) else [SCHEMA_1_NOTE],
                        reproduced=not broken and not findings, verify_only=True)


MALFORMED = (KeyError, TypeError, AttributeError, ValueError, IndexError, StopIteration)
"""What reading a record too malformed to check raises (a field missing, of another type, arrays of other lengths):
a finding, never a crash of the audit. Anything else a check raises is a bug, and the command's failure."""


def _guarded(item: str, where: str, check: Callable[[], list[Finding]]) -> list[Finding]:
    """A check's findings; a record or manifest too malformed to check is itself the finding."""
    try:
        return check()
    except MALFORMED as exc:
        return [Finding(item_id=item, what=f"{where}: malformed ({one_line(exc)})")]


def one_line(exc: BaseException) -> str:
    """`<type>: <the message's first line>`, as a finding quotes what a check raised."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def summary_findings(manifest: Manifest, records: list[Record]) -> list[Finding]:
    """Each declared stage's records summarized as its experiment summarizes them (`Experiment.summarize`, what
    results.json and the report are made of). A stage whose summary fails names the records that fail it: those
    whose summary alone fails as the stage's does, set aside until the rest summarize; failing with none of them
    named, the stage is the finding."""
    findings: list[Finding] = []
    for name, stage in manifest.stages.items():
        experiment = registry.of_stage(name)
        checkpoint = name.partition("/")[2]
        left = [r for r in records if r.experiment == experiment.name and r.checkpoint == checkpoint]
        alone: dict[int, str | None] = {}
        while (said := _summary_fails(experiment, left, stage, checkpoint)) is not None:
            bad = [r for r in left if alone.setdefault(r.seq, _summary_fails(experiment, [r], stage, checkpoint))
                   == said]
            if not bad:
                findings.append(Finding(what=f"{name}: its records cannot be summarized ({said})"))
                break
            findings += [Finding(item_id=r.item_id, what=f"{name}{'@' + r.part if r.part else ''}: its summary "
                                                         f"fails on this record ({said})") for r in bad]
            set_aside = {r.seq for r in bad}
            left = [r for r in left if r.seq not in set_aside]
    return findings


def _summary_fails(experiment: Experiment, records: list[Record], stage: StageSection, checkpoint: str) -> str | None:
    """Why `experiment` cannot summarize `records` (None: it can)."""
    try:
        experiment.summarize(records, stage, checkpoint)
    except MALFORMED as exc:
        return one_line(exc)
    return None


def dataset_findings(manifest: Manifest) -> list[Finding]:
    """The item ids are what the dataset gives, and the dataset is the run's (its hash), read without a model:
    the data's ids (first `n`, this shard's) when it is at its location, in any format (`tasks.sources`); the
    toy task's rows, which are generated and hashed (`tasks.toy.toy_data_hash`) as a file's bytes are."""
    config = manifest.config
    data, ids = config.data, list(config.item_ids)
    shard = parse_shard(config.shard)
    findings = []
    if data.path is None:
        from stagereplay.tasks.toy import HELDOUT_SEED, toy_data_hash, toy_rows

        n = data.n or 200
        if toy_data_hash(n, HELDOUT_SEED) != config.dataset_hash:
            findings.append(Finding(what="the toy task's items are not the run's dataset (dataset_hash differs)"))
        want = shard_items([row["id"] for row in toy_rows(n, HELDOUT_SEED)], shard)
    else:
        path = data.path
        found = source(data.source_name()).at(path, data.columns)  # its source reads it; None: not at hand here
        if found is None:
            return []  # a location only; the full audit reads the data where it is given
        if found[1] != config.dataset_hash:
            findings.append(Finding(what=f"the data at {path} is not the run's dataset (dataset_hash differs)"))
        rows = [r.id for r in found[0]]
        want = shard_items(rows[: data.n or len(rows)], shard)
    findings += [Finding(item_id=i, what="config.item_ids lacks an item of the dataset") for i in want if i not in ids]
    findings += [Finding(item_id=i, what="config.item_ids holds an item the dataset lacks") for i in ids if i not in want]
    return findings


def stage_model_findings(manifest: Manifest) -> list[Finding]:
    """Every stage runs the run's model settings (precision, device, threads, attention); only the path (the
    checkpoint) may differ, and a 2x2 stage's precisions are its parts."""
    model = bound_config(manifest.config).get("model", {})
    findings = []
    for name, stage in manifest.stages.items():
        differ = diff_fields(model, bound_stage(stage).get("model", {}))
        if differ:
            findings.append(Finding(what=f"stage {name}: model {', '.join(differ)} differs from the run's "
                                         "configuration"))
    return findings


def expected_units(name: str, stage: StageSection, config: RunConfig, records: list[Record]
                   ) -> list[tuple[str, str]]:
    """The (item id, part) units a declared stage names, as its experiment says (`Experiment.units`)."""
    experiment, _, checkpoint = name.partition("/")
    return registry.experiment(experiment).units(checkpoint, stage, config, records)


def completeness(manifest: Manifest, records: list[Record]) -> list[Finding]:
    """A missing, extra or duplicated record, per declared stage; a record of a stage the manifest lacks."""
    stages, config = manifest.stages, manifest.config
    findings: list[Finding] = []
    counts = Counter((stage_name(r), r.item_id, r.part) for r in records)
    for name, item, _ in counts:
        if name not in stages:
            findings.append(Finding(item_id=item, what=f"{name}: a record for a stage the manifest does not declare"))
    for name, stage in stages.items():
        expected = expected_units(name, stage, config, records)
        where = name
        for item, part in expected:
            k = counts.get((name, item, part), 0)
            at = f"{where}{'@' + part if part else ''}"
            if k == 0:
                findings.append(Finding(item_id=item, what=f"{at}: no record, but the manifest declares one"))
            elif k > 1:
                findings.append(Finding(item_id=item, what=f"{at}: {k} records, one expected"))
        wanted = set(expected)
        for n, item, part in counts:
            if n == name and (item, part) not in wanted:
                at = f"{where}{'@' + part if part else ''}"
                findings.append(Finding(item_id=item, what=f"{at}: a record the manifest does not declare"))
        findings += registry.of_stage(name).stage_findings(name, stage, records)
    return findings


def claim_findings(record: Record, stage: StageSection, matched: Record | None, schema_2: bool = True
                   ) -> list[Finding]:
    """Every field of one item record that follows from its other fields (and its matched record), checked.
    Schema 1 fingerprinted fewer comparison fields (`schema_2=False`). A record of the protocol's arms is read as every
    such record is (`records.payload_readers.ItemHead`: its arms and comparisons as their models), one of an experiment
    whose records are its own as its model (`Experiment.read`); its experiment checks the rest (`Experiment.claims`)."""
    where = f"{stage_name(record)}{'@' + record.part if record.part else ''}"
    kind = registry.experiment(record.experiment)
    if not kind.shape.continuations:  # its records are its own: its model and its claims are all there is to check
        try:
            kind.read(record)
        except ValidationError as e:
            return [Finding(item_id=record.item_id, what=f"{where} not a {record.experiment} payload "
                                                         f"({first_error(e)})")]
        return [Finding(item_id=record.item_id, what=f"{where} {b}") for b in kind.claims(record, stage, matched)]
    try:
        payload = ItemHead.model_validate(record.payload)
    except ValidationError as e:  # a field missing, of another type, or one no arm has: nothing to derive from
        bad = _unread(record.payload, e)
    else:
        bad = _payload_claims(record, payload, stage, matched, schema_2)
    bad += registry.experiment(record.experiment).claims(record, stage, matched)
    return [Finding(item_id=record.item_id, what=f"{where} {b}") for b in bad]


def _unread(raw: dict[str, Any], exc: ValidationError) -> list[str]:
    """Why a payload does not read: each arm that is not an arm, else its first error."""
    bad = []
    for arm in raw.get("arms") or []:
        try:
            read_arm(arm)
        except ValidationError as e:
            bad.append(f"arm {arm.get('name')}: not an arm ({first_error(e)})")
    return bad or [f"not an item record's payload ({first_error(exc)})"]


def _payload_claims(record: Record, payload: ItemHead, stage: StageSection, matched: Record | None,
                    schema_2: bool) -> list[str]:
    bad = []
    if payload.status not in STATUSES:
        bad.append(f"status {payload.status!r} is not one of {', '.join(STATUSES)}")
    if payload.status == "ok":
        if payload.boundary != len(payload.prefix_ids or []):
            bad.append("boundary is not the prefix's length")
        fixed = registry.experiment(record.experiment).shape.fixed_prefix
        if fixed and matched is not None and payload.prefix_ids != ItemHead.model_validate(matched.payload).prefix_ids:
            bad.append("prefix_ids are not the matched run's")
    bad += _arm_claims(record, payload, stage)
    arms = {a.name: a for a in payload.arms if isinstance(a, Arm)}
    for c in payload.comparisons:
        a, b = arms.get(c.a), arms.get(c.b)
        if a is None or b is None:
            bad.append(f"comparison {c.a} vs {c.b}: an arm is missing")
            continue
        derived = derived_comparison(record.item_id, a, b, schema_2)
        for f in diff_fields(c.as_payload(), derived.as_payload()):
            bad.append(f"comparison {c.a} vs {c.b}: {f} does not follow from its arms")
    bad += _same_as_claims(payload, matched)
    return bad


def _arm_claims(record: Record, payload: ItemHead, stage: StageSection) -> list[str]:
    scorer = scorer_by_name(stage.settings.scorer)
    precision = record.part or stage.model.precision
    bad = []
    for a in payload.arms:
        if a.suffix_fp != ids_fingerprint(a.suffix_ids):
            bad.append(f"arm {a.name}: suffix_fp is not the fingerprint of its suffix_ids")
        if isinstance(a, Arm) and a.correct != bool(scorer(a.text, payload.answer)):  # a draw keeps no text
            bad.append(f"arm {a.name}: correct is not what scorer {stage.settings.scorer} gives its text")
        if a.precision != precision:
            bad.append(f"arm {a.name}: precision {a.precision} is not the stage's {precision}")
    return bad


def _same_as_claims(payload: ItemHead, matched: Record | None) -> list[str]:
    """An arm marked `same_as: "<stage>:<arm>"` was not computed again: every field but its name and its
    construction must be that recorded arm's, its cache fingerprint included (the re-executing audit then checks
    that the matched run still computes it, and that the construction still builds that cache)."""
    bad = []
    for a in payload.arms:
        if not isinstance(a, Arm) or a.same_as is None:
            continue
        where, _, name = a.same_as.rpartition(":")
        source = ItemHead.model_validate(matched.payload).arms if matched is not None and stage_name(matched) == where \
            else []
        arm = next((x for x in source if x.name == name), None)
        if arm is None:
            bad.append(f"arm {a.name}: same_as {a.same_as} names no recorded arm")
            continue
        own = {k: v for k, v in a.as_payload().items() if k not in ("name", "construction", "same_as")}
        for f in diff_fields({k: v for k, v in arm.as_payload().items() if k not in ("name", "construction")}, own):
            bad.append(f"arm {a.name}: {f} is not the one of {a.same_as}, which it says it is")
    return bad


def results_findings(run_dir: Path, manifest: Manifest, records: list[Record]) -> list[Finding]:
    """Every field of results.json must be what the ledger gives (less its time stamp, the last audit and the
    models' locations)."""
    path = run_dir / "results.json"
    if not path.exists():
        return []
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return [Finding(what="results.json is not valid JSON")]
    rebuilt = claimed(comparable_results(build_results(run_dir, manifest, records).as_json()), stored)
    differ = diff_fields(comparable_results(stored), rebuilt, lists=True)
    return [Finding(what=f"results.json {f} is not what the ledger gives") for f in differ]
