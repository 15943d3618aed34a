"""The paper's tables from `results.json`, as renderer-neutral `Table`s (rendered by `stagereplay.report.render`).

`build_tables` turns results into neutral `Table`s once; Markdown, HTML (`stagereplay.report.html`) and rich
all render those, so the three views cannot disagree. A section that is null (or an empty list) is left
out; a value that is null (an accuracy over zero boundary items) prints as `-`. The field-by-field
format is `docs/results-schema.md`.

Number format, one rule everywhere: a proportion prints as `k/n (p%)` with one decimal; an interval
bound prints in percent with two decimals below 10% and one decimal otherwise, so a Wilson upper bound
for 0/200 reads `1.88%` and a lower bound for 24/24 `86.2%`; an accuracy difference and its CI print in
signed points with one decimal, e.g. `+1.0 [-3.5, +5.5]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagereplay.experiments.core.diagnostics_summary import Diagnosed
from stagereplay.experiments.core.format import NA, Table, as_rows, count_of, yes_no
from stagereplay.experiments.core.registry import all_experiments
from stagereplay.records.audit_summary import AuditSummary
from stagereplay.records.findings import Break
from stagereplay.records.kernels import describe
from stagereplay.records.summary import Count
from stagereplay.report.results import RESULTS_VERSION, Results

# --- results -> tables ---------------------------------------------------------------------------


def load_results(path: Path) -> Results:
    """Read `results.json` (or `<run_dir>/results.json`) and refuse a schema version we cannot render."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    version = results.get("schema_version") if isinstance(results, dict) else None
    if version != RESULTS_VERSION:
        raise ValueError(
            f"{path}: results schema_version {version!r} is not supported (this stagereplay reads "
            f"{RESULTS_VERSION}); rebuild results.json from the ledger with a matching stagereplay"
        )
    return Results.model_validate(results)


def build_tables(results: Results) -> list[Table]:
    """Every experiment's tables that the results contain, in the registry's order; the diagnostics of the compared
    pairs after those of the last experiment whose sections carry them; the audit's last."""
    per_experiment = [(e.tables(own), bool(e.diagnosed(own)))
                      for e in all_experiments() for own in [results.of(e)]]
    last = max((i for i, (_, diagnosed) in enumerate(per_experiment) if diagnosed), default=None)
    tables: list[Table] = []
    for i, (own, _) in enumerate(per_experiment):
        tables.extend(own)
        diagnostics = diagnostics_table(results) if i == last else None
        if diagnostics is not None:
            tables.append(diagnostics)
    if results.audit:
        tables.extend(audit_tables(results.audit))
    return tables


def _logit(x: float | None) -> str:
    """A logit-scale number: 3 significant digits, 0 as 0."""
    return NA if x is None else "0" if x == 0 else f"{x:.3g}"


def _median(values: Any) -> float | None:
    from statistics import median

    xs = [v for v in (values.values() if isinstance(values, dict) else values or []) if v is not None]
    return float(median(xs)) if xs else None


def diagnosed_pairs(results: Results) -> list[tuple[str, Diagnosed, Count]]:
    """(label, summary, its disagreement counts) of every compared pair whose summary carries diagnostics,
    experiment by experiment."""
    return [pair for e in all_experiments() for pair in e.diagnosed(results.of(e))]


def diagnostics_table(results: Results) -> Table | None:
    """Why pairs diverged, one row per compared pair: margins, first-step logit difference, cache difference."""
    rows = []
    for label, s, kn in diagnosed_pairs(results):
        assert s.margins is not None  # a diagnosed pair's summary carries its margins
        steps, at = s.margins.steps, s.margins.at_divergence
        layers = s.cache_diff or []
        k = _median([r.k_rel_l2 for r in layers])
        v = _median([r.v_rel_l2 for r in layers])
        rows.append([label, f"{kn.k}/{kn.n}", f"{_logit(at.median)} / {_logit(steps.median if steps else None)}",
                     _logit(_median(s.first_step_logit_maxabs)), f"{_logit(k)} / {_logit(v)}"])
    if not rows:
        return None
    headers = ("pair", "diverged", "margin: div / all", "step-1 logit diff", "cache K / V")
    note = ("Medians over items. Margin: top-1 minus top-2 fp32 logit, at the first divergent token against all "
            "steps of the reference arm. Step-1 logit diff: max-abs difference of the two arms' logits at the first "
            "suffix step. Cache: relative L2 ||a-b||/||a|| of the boundary caches, median over layers of the "
            "per-layer medians.")
    return Table("table-diagnostics", "Why pairs diverged: margins, logits, caches", headers, as_rows(rows), note)


def audit_tables(audit: AuditSummary) -> list[Table]:
    """The audit's summary as results.json holds it (audit.json's)."""
    broken = audit.broken_records
    mismatches = audit.findings
    sample = audit.sample
    rows = [
        ["items audited", str(audit.items)],
        ["records re-executed", f"a seeded sample of {sample.re_executed} of {sample.of} ({sample.per_stage} per "
                                f"stage and part, seed {sample.seed}); every record verified" if sample
         else "every record"],
        ["trajectory fingerprints reproduced", count_of(audit.trajectories)],
        ["comparison fingerprints reproduced", count_of(audit.comparisons)],
        ["ledger hash chain intact", yes_no(audit.chain_ok)],
        ["broken ledger records", ", ".join(_record(b) for b in broken) if broken else "none"],
        *_environment_rows(audit),
        ["mismatches", str(len(mismatches))],
    ]
    tables = [Table("table-audit", "Audit: re-executed from the saved ledger", ("", "result"), as_rows(rows))]
    if mismatches:
        shown = [[m.item_id, m.what] for m in mismatches[:MISMATCH_ROWS]]
        if len(mismatches) > MISMATCH_ROWS:
            shown.append(["", f"... and {len(mismatches) - MISMATCH_ROWS} more (all in audit.json)"])
        tables.append(Table("table-audit-mismatches", "Audit mismatches", ("item", "what"), as_rows(shown)))
    return tables


MISMATCH_ROWS = 50


def _environment_rows(audit: AuditSummary) -> list[list[str]]:
    """The kernels the audit ran under against the run's, and the findings split by kind (audits since the
    split; an older audit.json has neither)."""
    env = audit.environment
    if env is None:
        return []
    differ = env.differences
    kernels = "the run's" if not differ else f"other for {env.records_other_kernels} of {env.records} records: {describe([(d.field, d.recorded, d.here) for d in differ])}"
    here = audit.not_reproduced_here
    by = ", ".join(f"{n} {p}" for p, n in sorted(here.by_precision.items())) if here else ""
    rows = [["kernels", kernels], ["integrity", "holds" if audit.integrity_ok else "findings"],
            ["not reproduced under other kernels", f"{here.units if here else 0}" + (f" ({by})" if by else "")]]
    if here and here.fp32_token_differences:
        rows.append(["fp32 units with other tokens (suspicious)", ", ".join(here.fp32_token_differences)])
    for moved in audit.relocated or []:
        rows.append([f"{moved['input']} relocated", f"{moved['here']} ({moved['how']})"])
    return rows


def _record(b: Break | int) -> str:
    """A broken record as `seq N (reason)`, or `seq N` where an older audit.json stored the bare seq."""
    if isinstance(b, Break):
        return f"seq {b.seq}" + (f" ({b.reason})" if b.reason else "")
    return f"seq {b}"


def run_summary(results: Results) -> list[tuple[str, str]]:
    run = results.run.as_json()
    return [(k.replace("_", " "), str(v)) for k, v in run.items() if v is not None]
