"""Audit: re-execute a saved run from its manifest and ledger and re-derive every claim its records make.

This runs the model again: a ledger whose hash chain was recomputed after an edit still fails here, because
the edited tokens, fingerprints or labels are not what the model produces. Every field of every item record
is compared with its re-execution (token IDs and their fingerprints, every arm's cache fingerprint and
label, every comparison field, transplant outcomes, statuses), and results.json is rebuilt from the
re-executed records. The model-free checks (chain, binding, completeness, derivable claims) are
`stagereplay.audit.verify`, which runs first.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict

from stagereplay.audit.versions import as_recorded
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import FLAGGED, INCONCLUSIVE, OK, StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.core.experiment import Replay
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.registry import experiment, of_stage, starts_run
from stagereplay.experiments.core.serving_run import stage_engine
from stagereplay.records.audit_summary import (
    AuditSummary,
    Elsewhere,
    EnvironmentSummary,
    KernelDifference,
    Sample,
)
from stagereplay.records.findings import Break, Finding, FindingKind
from stagereplay.records.kernels import NOT_RECORDED, describe, kernel_differences
from stagereplay.records.ledger import Record, diff_fields, items
from stagereplay.records.manifest import Manifest, RunConfig, StageSection, binds, stage_name
from stagereplay.records.payloads import PayloadModel
from stagereplay.records.provenance import environment, model_hashes
from stagereplay.records.shards import parse_shard, shard_items
from stagereplay.records.summary import Count
from stagereplay.report.audit_lines import re_executed
from stagereplay.report.results import build_results, comparable_results
from stagereplay.tasks import DataConfig, Item, load_items

__all__ = ["AuditConfig", "audit_run", "compare_payloads", "exit_code", "verify_ledger"]

def verify_ledger(run_dir: Path) -> list[Break]:
    """Integrity only, no model: every line parses, every hash and link of the chain holds (from the
    manifest's identity when there is one), and the chain is bound to the manifest."""
    from stagereplay.audit.verify import read_chain
    from stagereplay.records.ledger import chain_problems, read_manifest
    from stagereplay.records.manifest import binding_problems, chain_start

    manifest = read_manifest(run_dir) if (run_dir / "manifest.json").exists() else None
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


def _replay(record: Record, stages: Mapping[str, StageSection], item: Item,
            first: dict[tuple[str, str], tuple[str, dict[str, Any]]]) -> Replay:
    """What re-executing `record` needs: its stage, and the item's record of the stage that made the run at its
    checkpoint (`first`: by checkpoint and item, that stage's name and the payload)."""
    origin, payload = first.get((record.checkpoint, record.item_id), ("", None))
    return Replay(record, stages[stage_name(record)], item, stages.get(origin), payload)


def _unit_work(lm: Any, job: Job) -> PayloadModel:
    """A unit of any of our engine's experiments, by the experiment its parameters name (`Unit`)."""
    return experiment(job.params.experiment).work(lm, replace(job, params=job.params.params))


@dataclass(frozen=True)
class Unit(Params):
    """A re-executed unit's parameters with its experiment's name: units of several stages run as one batch of
    jobs, each by its own experiment's item function."""

    experiment: str
    params: Params

    @property
    def part(self) -> str:
        return self.params.part


def _unit_model(record: Record, stage: StageSection) -> ModelConfig:
    """The model settings a unit re-executes under: its stage's as its engine loads ours, at the unit's precision
    where it has one."""
    model = stage_engine(stage).model(stage.model.config())
    return experiment(record.experiment).unit_model(model, record.part)


def input_findings(manifest: Manifest, data_hash: str, item_ids: list[str],
                   checked: frozenset[str] = frozenset()) -> list[Finding]:
    """The files at the manifest's paths must be the ones the run bound by hash: each stage's model
    (config, weights, tokenizer, generation config) and the dataset, whose items (this shard's) must be the
    manifest's item ids. A path is only where to look. `checked`: checkpoints a relocation already checked."""
    config = manifest.config
    bound = config.model_hashes
    want = shard_items(item_ids, parse_shard(config.shard))
    have = config.item_ids
    findings = [Finding(item_id=i, what="config.item_ids lacks an item of the dataset") for i in want if i not in have]
    findings += [Finding(item_id=i, what="config.item_ids holds an item the dataset lacks") for i in have
                 if i not in want]
    if data_hash != config.dataset_hash:
        findings.append(Finding(what=f"the data at {config.data.path} is not the run's dataset (dataset_hash "
                                     "differs)"))
    seen: dict[str, str] = {}
    for name, stage in manifest.stages.items():
        checkpoint, path = name.partition("/")[2], stage.model.path
        if seen.get(checkpoint) == path or checkpoint not in bound or checkpoint in checked:
            continue
        seen[checkpoint] = path
        differ = diff_fields(bound[checkpoint], model_hashes(path))
        if differ and binds(manifest):
            findings.append(Finding(what=f"the model at {path} is not the run's {checkpoint} model "
                                         f"({', '.join(differ)} differ)"))
    return findings


@dataclass(frozen=True)
class AuditConfig:
    """What the audit re-executes: every unit, or a seeded sample of `sample` units per stage and part (after the
    model-free checks have covered every record). A stage's parts (a 2x2's precisions, attest's served run, honest
    variants and reference) are sampled apart, as `plan` rows them: a sample of 1 re-executes one unit of each."""

    sample: int | None = field(default=None, metadata={
        "help": "units re-executed per stage and part (a precision, an honest variant: each a row of `plan`); "
                "default: every unit"})
    seed: int = field(default=0, metadata={"help": "seed of the sample"})

    def __post_init__(self) -> None:
        if self.sample is not None and self.sample < 1:
            raise StageReplayError(f"--sample must be at least 1, got {self.sample}",
                                   "pass a positive --sample, or leave it out to re-execute every unit")


def sample_units(groups: dict[str, list[Record]], config: AuditConfig) -> dict[str, list[Record]]:
    """Per stage, a seeded sample of `config.sample` of its records of each part, drawn from the part's records in
    ledger order (one `random.Random` per stage and part, seeded by their names, so adding a stage or a part moves
    no other's sample), kept in ledger order."""
    if config.sample is None:
        return groups
    out = {}
    for name, records in groups.items():
        picked: set[int] = set()
        for part in dict.fromkeys(r.part for r in records):
            mine = [k for k, r in enumerate(records) if r.part == part]
            rng = random.Random(f"{config.seed}:{name}" + (f"@{part}" if part else ""))
            picked |= {mine[k] for k in rng.sample(range(len(mine)), min(config.sample, len(mine)))}
        out[name] = [r for k, r in enumerate(records) if k in picked]
    return out


TOKEN_FIELDS = ("suffix_ids", "suffix_fp", "prefix_ids", "prompt_ids", "text", "correct", "status", "boundary",
                "first_divergence", "suffix_equal", "label_equal", "stop", "directions", "control",
                "baseline_diverges", "(the arm)")
"""Fields whose difference is a difference of tokens or labels, not only of bits (caches, logits)."""


@dataclass
class _Tally:
    """What the re-execution found so far: counts, findings, the re-executed records and the units not
    reproduced under this machine's other kernels (unit, precision, whether tokens differ)."""

    mismatches: list[Finding] = field(default_factory=list)
    trajectories: list[int] = field(default_factory=lambda: [0, 0])
    comparisons: list[int] = field(default_factory=lambda: [0, 0])
    again: dict[int, Record] = field(default_factory=dict)
    elsewhere: list[tuple[Record, str, bool]] = field(default_factory=list)


def audit_run(run_dir: Path, manifest: Manifest, records: list[Record], ex: ExecConfig,
              quiet: bool = False, stored_results: bool = True, config: AuditConfig | None = None,
              relocated: list[dict[str, str]] | None = None, server: str | None = None) -> AuditSummary:
    """Check what needs no model (`verify.verify_run`), then compare the environment each record was computed
    in with this one, re-execute every item record (or a sample, `config`) and compare every field; rebuild
    the results from the re-executed records. Returns the audit summary (results.json's `audit`).

    Findings are of two kinds (`kind`): `integrity` (the chain, completeness, derivable claims, the inputs'
    hashes, and a unit re-executed under the kernels it was recorded with that differs: tampering or a
    broken run, whatever the machine) and `not_reproduced_here` (a unit that differs when re-executed under
    other kernels, which other kernels alone can cause). `stored_results=False` skips the comparison with a
    results.json not yet rewritten (a paper run). `relocated`: inputs found elsewhere than recorded; `server`: where
    the run's server is now, if it moved (its build and model are still compared)."""
    from stagereplay.audit.verify import verify_run

    config = config or AuditConfig()
    checked = verify_run(run_dir, manifest, stored_results)
    tally = _Tally([m.of_kind("integrity") for m in checked.findings])
    stages: Mapping[str, StageSection] = manifest.stages
    if server is not None:  # the run's server, moved (--url)
        from stagereplay.serving.replay import at_server

        stages, moved_server = at_server(stages, server)
        relocated = [*(relocated or []), *moved_server]
    records = items(records)
    other, env_summary = _other_kernels(run_dir, manifest, stages, records)
    by_id = _items(manifest, relocated, tally)
    chosen = sample_units(_declared(stages, manifest.config, records), config)
    _reexecute(chosen, stages, records, by_id, ex, quiet, binds(manifest), other, tally)
    again_records = [tally.again.get(r.seq, r) for r in records]  # a sample: the rest as recorded
    tally.mismatches += _results_findings(run_dir, manifest, records, again_records, tally)
    return _summary(records, checked, tally, env_summary, chosen, config, relocated)


def _results_findings(run_dir: Path, manifest: Manifest, records: list[Record], again: list[Record],
                      tally: _Tally) -> list[Finding]:
    """The results the re-executed records give against those the recorded ones give. Records their experiment
    cannot summarize are verify's finding (`verify.summary_findings`), so no results are compared from them; results
    the re-executed records cannot make are this one's."""
    from stagereplay.audit.verify import MALFORMED, one_line

    try:
        recorded = comparable_results(build_results(run_dir, manifest, records).as_json())
    except MALFORMED:
        return []
    kind: FindingKind = "not_reproduced_here" if tally.elsewhere else "integrity"
    try:
        rebuilt = comparable_results(build_results(run_dir, manifest, again).as_json())
    except MALFORMED as exc:
        return [Finding(what=f"the re-executed records cannot be summarized ({one_line(exc)})", kind=kind)]
    return [Finding(what=f"results {f} is not what the re-executed records give", kind=kind)
            for f in diff_fields(recorded, rebuilt, lists=True)]


def _other_kernels(run_dir: Path, manifest: Manifest, stages: Mapping[str, StageSection], records: list[Record]
                   ) -> tuple[set[int], EnvironmentSummary]:
    """The records computed under other kernels than this machine's (their seqs), and the summary of the
    differences (said on stderr): a difference there is "not reproduced here", not an integrity finding."""
    from stagereplay.audit.verify import read_chain
    from stagereplay.engine.model import set_determinism
    from stagereplay.serving.replay import engine_build_here

    chain, _ = read_chain(run_dir)
    environments = {r.env: r.payload for r in chain if r.kind == "environment"}
    model = manifest.config.model
    here = environment(model.device, set_determinism(model.threads, model.device))
    build = engine_build_here(stages)  # a serving engine that records its build: this machine's, to compare
    if build is not None:
        here = {**here, "engine": {"build": build}}
    differences = {env: kernel_differences(recorded, here) for env, recorded in environments.items()}
    other = [r for r in records if differences.get(r.env, [("environment", NOT_RECORDED, "this machine's")])]
    env_summary, first = _environment_summary(records, other, differences)
    if env_summary.differences:  # the line the CLI says first (`stagereplay audit`)
        env_summary = env_summary.model_copy(update={
            "line": f"environment: this machine's kernels differ from the run's for {len(other)} of "
                    f"{len(records)} records: {describe(first)}"})
    return {r.seq for r in other}, env_summary


def _items(manifest: Manifest, relocated: list[dict[str, str]] | None, tally: _Tally) -> dict[str, Item]:
    """The run's items from its data as it is here, by id; what differs from what the run bound is a finding."""
    from stagereplay.engine.model import load_config_and_tokenizer

    run_config = manifest.config
    _, tokenizer = load_config_and_tokenizer(run_config.model.path)  # the weights load where jobs run
    loaded, data_hash = load_items(DataConfig(**run_config.data.as_config()), tokenizer)
    moved = frozenset(m["input"].split()[0] for m in relocated or [] if m["input"].endswith("model"))
    tally.mismatches += [m.of_kind("integrity")
                         for m in input_findings(manifest, data_hash, [i.id for i in loaded], moved)]
    return {i.id: i for i in loaded}


def _declared(stages: Mapping[str, StageSection], config: RunConfig, records: list[Record]
              ) -> dict[str, list[Record]]:
    """Per stage, its records of the units the manifest declares, once each (a missing, extra or duplicated record
    is verify's finding)."""
    from stagereplay.audit.verify import expected_units

    declared = {(name, item, part) for name, stage in stages.items()
                for item, part in expected_units(name, stage, config, records)}
    by_stage: dict[str, list[Record]] = {}
    for r in records:
        unit = (stage_name(r), r.item_id, r.part)
        if unit in declared:
            declared.discard(unit)
            by_stage.setdefault(unit[0], []).append(r)
    return by_stage


def _reexecute(chosen: dict[str, list[Record]], stages: Mapping[str, StageSection], records: list[Record],
               by_id: dict[str, Item], ex: ExecConfig, quiet: bool, bound: bool, other: set[int],
               tally: _Tally) -> None:
    """Re-execute the chosen units, grouped by the model settings that run them, whatever their stage: one batch of
    jobs per model, so that worker processes load each model once and its units step together (a row's bits do
    not depend on its batch-mates, engine.batched_step). A serving engine's stage runs alone, in its engine."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from stagereplay.execution.executors import run_jobs
    from stagereplay.records.proofs import machine_store

    first = {(r.checkpoint, r.item_id): (stage_name(r), r.payload) for r in records
             if starts_run(r.experiment) and not r.part}
    groups: dict[tuple[ModelConfig, str], list[Record]] = {}
    for r in (r for rs in chosen.values() for r in rs):
        stage = stages[stage_name(r)]
        served = stage.engine is not None  # a serving engine's stage runs alone, in its engine
        groups.setdefault((_unit_model(r, stage), stage_name(r) if served else ""), []).append(r)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), disable=quiet) as bar:
        task = bar.add_task("audit", total=sum(len(g) for g in groups.values()))
        for (model, engine), group in sorted(groups.items(), key=lambda g: (g[0][0].path, g[0][0].precision, g[0][1])):
            tally.mismatches += [Finding(item_id=r.item_id, what=f"{experiment(r.experiment).where(r)}: item is not in "
                                         "the manifest's dataset", kind="integrity") for r in group if r.item_id not in by_id]
            todo = [r for r in group if r.item_id in by_id]
            jobs = [stage_engine(stages[stage_name(r)]).replay_job(experiment(r.experiment),
                                                                   _replay(r, stages, by_id[r.item_id], first))
                    for r in todo]
            if engine:
                work = stage_engine(stages[engine]).work(of_stage(engine))
            else:
                work = _unit_work
                jobs = [replace(job, params=Unit(r.experiment, job.params)) for job, r in zip(jobs, todo, strict=True)]
            # Each model's fast step proven once per machine (records.proofs), in whichever process runs its units.
            for record, again in zip(todo, run_jobs(model, work, jobs, ex, machine_store=machine_store), strict=True):
                _compare(record, again.as_payload(), bool(engine), bound, record.seq in other, model.precision, tally)
                bar.advance(task)


def _compare(record: Record, again: dict[str, Any], served: bool, bound: bool, elsewhere: bool, precision: str,
             tally: _Tally) -> None:
    """One re-executed unit against its record: every field, as the record's version claims them."""
    again = as_recorded(experiment(record.experiment), record.item_id, again, record.payload, bound)
    recorded = record.payload
    if served:  # what a serving engine re-executes one request at a time (serving.replay.replayable)
        from stagereplay.serving.replay import replayable, with_unreplayed

        recorded = replayable(recorded)
    a, b, c, d, bad = compare_payloads(record.item_id, recorded, again)
    if served:
        again = with_unreplayed(again, record.payload)
    tally.trajectories = [tally.trajectories[0] + a, tally.trajectories[1] + b]
    tally.comparisons = [tally.comparisons[0] + c, tally.comparisons[1] + d]
    kind: FindingKind = "not_reproduced_here" if elsewhere else "integrity"
    if elsewhere:
        bad = _collapse_diagnostics(record.item_id, bad)
    where = experiment(record.experiment).where(record)
    tally.mismatches += [Finding(item_id=record.item_id, what=f"{where} {m}", kind=kind) for m in bad]
    if bad and elsewhere:
        tally.elsewhere.append((record, precision, any(f in m for m in bad for f in TOKEN_FIELDS)))
    tally.again[record.seq] = record.model_copy(update={"payload": again})


class SummaryExtras(TypedDict, total=False):
    """The audit summary's fields only some audits have: the inputs found elsewhere, the units sampled."""

    relocated: list[dict[str, str]]
    sample: Sample


def _summary(records: list[Record], checked: AuditSummary, tally: _Tally, env_summary: EnvironmentSummary,
             chosen: dict[str, list[Record]], config: AuditConfig, relocated: list[dict[str, str]] | None
             ) -> AuditSummary:
    broken = checked.broken_records
    findings = tally.mismatches
    optional: SummaryExtras = {"relocated": relocated} if relocated else {}
    if config.sample is not None:
        optional["sample"] = Sample(
            per_stage=config.sample, seed=config.seed,
            units={name: [[r.item_id, r.part] for r in rs] for name, rs in sorted(chosen.items())},
            re_executed=sum(len(rs) for rs in chosen.values()), of=len(records))
    return AuditSummary(
        items=len({r.item_id for r in records}), records=len(records),
        trajectories=Count(k=tally.trajectories[0], n=tally.trajectories[1]),
        comparisons=Count(k=tally.comparisons[0], n=tally.comparisons[1]),
        chain_ok=not broken, broken_records=broken, findings=findings, notes=checked.notes,
        integrity_ok=not broken and not any(m.integrity for m in findings),
        environment=env_summary, not_reproduced_here=_elsewhere_summary(tally.elsewhere),
        reproduced=not findings and not broken, **optional)


def exit_code(summary: AuditSummary) -> int:
    """`stagereplay audit`'s exit: OK when every record re-executed (and verified) reproduced; FLAGGED on any
    integrity finding (tampering or a broken run, whatever the machine); INCONCLUSIVE when integrity holds but some
    units were not reproduced under this machine's other kernels, or when it checked nothing (no record verified,
    none re-executed): a check of nothing is not a pass."""
    if not summary.reproduced:
        integrity = summary.integrity_ok or False  # an older audit.json, or verify-only: no split
        return INCONCLUSIVE if integrity else FLAGGED
    checked = summary.records if summary.verify_only else re_executed(summary)
    return INCONCLUSIVE if checked == 0 else OK


def _collapse_diagnostics(item_id: str, bad: list[str]) -> list[str]:
    """Under other kernels every margin and cache statistic of a unit moves with its bits: one line for them."""
    diagnostics = [m for m in bad if m.startswith(f"{item_id}: diagnostics.")]
    if len(diagnostics) <= 1:
        return bad
    rest = [m for m in bad if m not in diagnostics]
    return [*rest, f"{item_id}: diagnostics ({len(diagnostics)} fields) not reproduced"]


def _environment_summary(records: list[Record], other: list[Record],
                         differences: dict[str, list[tuple[str, Any, Any]]]
                         ) -> tuple[EnvironmentSummary, list[tuple[str, Any, Any]]]:
    """The kernel-choosing fields that differ from this machine's, with how many records each covers; and the
    first record's differences (what the command names)."""
    counts: dict[str, int] = {}
    found: dict[str, tuple[str, Any, Any]] = {}
    first: list[tuple[str, Any, Any]] = []
    for r in other:
        diff = differences.get(r.env, [("environment", NOT_RECORDED, "this machine's")])
        first = first or diff
        for name, a, b in diff:
            key = f"{name}\0{a!r}"
            found.setdefault(key, (name, a, b))
            counts[key] = counts.get(key, 0) + 1
    fields = [KernelDifference(field=name, recorded=a, here=b, records=counts[key])
              for key, (name, a, b) in found.items()]
    return EnvironmentSummary(records=len(records), records_other_kernels=len(other), differences=fields), first


def _elsewhere_summary(units: list[tuple[Record, str, bool]]) -> Elsewhere:
    """How many units were not reproduced under other kernels, by precision; fp32 units whose tokens or
    labels differ are suspicious (other kernels move fp32 bits, rarely its tokens)."""
    by_precision: dict[str, int] = {}
    for _, precision, _ in units:
        by_precision[precision] = by_precision.get(precision, 0) + 1
    suspicious = [f"{r.experiment}/{r.checkpoint} {r.item_id}{'@' + r.part if r.part else ''}"
                  for r, precision, tokens in units if tokens and precision.startswith("fp32")]
    return Elsewhere(units=len(units), by_precision=by_precision,
                     reduced_precision_only=all(p in ("bf16", "fp16") for p in by_precision),
                     fp32_token_differences=suspicious)
