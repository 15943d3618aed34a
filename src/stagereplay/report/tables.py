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

from stagereplay.records.kernels import describe
from stagereplay.report.figures import slug
from stagereplay.report.format import (
    NA,
    Table,
    as_rows,
    bound,
    count_of,
    interval,
    k_of_n,
    p_value,
    pct,
    points,
    wilson_or_given,
    yes_no,
)
from stagereplay.report.resample_tables import resample_tables

SCHEMA_VERSION = 1
"""The `results.json` schema this renderer reads."""
_TRANSPLANT_HEADERS = (
    "direction",
    "layers",
    "K/V",
    "follows donor",
    "Wilson 95% lower",
    "follows recipient",
    "neither",
)


# --- results -> tables ---------------------------------------------------------------------------


def load_results(path: Path) -> dict[str, Any]:
    """Read `results.json` (or `<run_dir>/results.json`) and refuse a schema version we cannot render."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    results = json.loads(path.read_text(encoding="utf-8"))
    version = results.get("schema_version") if isinstance(results, dict) else None
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: results schema_version {version!r} is not supported (this stagereplay reads "
            f"{SCHEMA_VERSION}); rebuild results.json from the ledger with a matching stagereplay"
        )
    return results


def build_tables(results: dict[str, Any]) -> list[Table]:
    """All of the paper's tables the results contain, in the paper's order."""
    tables: list[Table] = []
    if results.get("matched"):
        tables.append(matched_table(results["matched"]))
    if results.get("precision_2x2"):
        tables.extend(precision_2x2_tables(results["precision_2x2"]))
    diagnostics = diagnostics_table(results)
    if diagnostics:
        tables.append(diagnostics)
    if results.get("bridge"):
        tables.extend(bridge_tables(results["bridge"]))
    for t in results.get("transplant") or []:
        tables.extend(transplant_tables(t))
    if results.get("resample"):
        tables.extend(resample_tables(results["resample"]))
    if results.get("audit"):
        tables.extend(audit_tables(results["audit"]))
    return tables


def matched_table(matched: list[dict[str, Any]]) -> Table:
    """Rows are quantities, columns checkpoints, so two checkpoints read side by side."""
    fresh = {m["construction"] for m in matched}
    other = fresh.pop() if len(fresh) == 1 else "rebuilt"
    labels = [
        "items (boundary / no boundary)",
        "replica exact, live",
        f"replica exact, {other}",
        "suffix disagreements",
        "correctness-label disagreements",
        "accuracy, live",
        f"accuracy, {other}",
        f"accuracy difference, live - {other} (points) [95% CI]",
        f"discordant labels: live only / {other} only",
        "McNemar exact p",
    ]
    columns = []
    for m in matched:
        c, diff = m["construction"], m.get("accuracy_diff")
        accuracy, discordant = m.get("accuracy") or {}, m["discordant"]
        ci = f"{points(diff['estimate'])} [{points(diff['ci'][0])}, {points(diff['ci'][1])}]" if diff else NA
        columns.append(
            [
                f"{m['n']} ({m['n_boundary']} / {m['n_no_boundary']})",
                count_of(m["replica_exact"].get("live")),
                count_of(m["replica_exact"].get(c)),
                count_of(m["suffix_disagreements"]),
                count_of(m["label_disagreements"]),
                pct(accuracy.get("live")),
                pct(accuracy.get(c)),
                ci,
                f"{discordant['live_only']} / {discordant['other_only']}",
                p_value(m.get("mcnemar_p")),
            ]
        )
    if any("n_marker_inside_token" in m for m in matched):  # a marker matched on text (engine.boundary)
        labels.insert(1, "boundary marker ended inside a token")
        for m, col in zip(matched, columns, strict=True):
            inside = m.get("n_marker_inside_token")
            col.insert(1, NA if inside is None else k_of_n(inside, m["n_boundary"]))
    if any(m.get("built") for m in matched):  # a serving engine's counts: was each arm built as its name says?
        labels.insert(1, "built as named, by the engine's counts (the rest left out below)")
        for m, col in zip(matched, columns, strict=True):
            b = m.get("built")
            col.insert(1, NA if not b or b["k"] + b["not_built"] == 0 else k_of_n(b["k"], b["k"] + b["not_built"]))
    rows = [[label, *(col[i] for col in columns)] for i, label in enumerate(labels)]
    headers = ("", *(f"{m['engine'] + ' ' if m.get('engine') else ''}{m['checkpoint']}: live vs {m['construction']} "
                     f"@ {m['precision']}" for m in matched))
    note = "Disagreements and accuracies are over items that reached the stage boundary."
    for m in matched:
        b = m.get("built")
        if b and b["not_built"]:
            why = NOT_BUILT.get(m["construction"].split("@")[0], "by the engine's counts")
            note += (f" {m['construction']} @ {m['precision']} was not built as named on {b['not_built']} of "
                     f"{b['n']} items ({why}; "
                     f"cached positions reported: {_spread(b['not_built_cached'])}): those items are counted apart "
                     "and left out of its column.")
    for m in matched:
        pc = m.get("prefix_cache")
        if pc and pc["hits"]:
            note += (f" {m['construction']} @ {m['precision']}: {pc['hits']}/{pc['n']} requests hit the prefix cache, "
                     f"{pc['hits_with_decode_blocks']} of them on blocks live's decoding wrote "
                     f"({pc['cached_from_decode']} of {pc['num_cached_tokens']} cached positions).")
        load = m.get("load")
        if load:
            note += f" Under load (@ {m['precision']}, the server's replicas with other requests in flight), per item:"
            for arm, n in load.items():
                note += (f" {arm}: {n['invariant']} invariant, {n['batch-variant']} batch-variant (exact alone, "
                         f"different under load), {n['not self-consistent']} not self-consistent (different even "
                         f"alone), {n['unknown']} unknown;")
    d = next((m["accuracy_diff"] for m in matched if m.get("accuracy_diff")), None)
    if d:
        note += (
            f" CI: paired percentile bootstrap over items, {d.get('n_resamples')} resamples, "
            f"seed {d.get('seed')}, confidence {d.get('confidence')}."
        )
    return Table("table-matched", "Matched: live cache vs fresh prefill", headers, as_rows(rows), note)


NOT_BUILT = {
    "live": "the engine took positions from a cache",
    "oneshot": "the engine took positions from a cache: not a fresh prefill",
    "prefix-cache": "no position written by live's decoding came from the cache",
    "slot-restore": "the server did not continue from the restored slot but prefilled afresh",
}
"""Per arm, what it means that the engine did not build it as named (`serving.evidence.took_place`)."""


def _spread(values: list[Any]) -> str:
    """A list of counts as `a` or `a-b`."""
    known = sorted(int(v) for v in values if v is not None)
    if not known:
        return NA
    return str(known[0]) if known[0] == known[-1] else f"{known[0]}-{known[-1]}"


def precision_2x2_tables(grid: dict[str, Any]) -> list[Table]:
    """Accuracy per cell (construction x precision), then disagreements per precision with Wilson 95%."""
    precisions = list(grid["precisions"])
    cells = {(c["construction"], c["precision"]): c for c in grid["cells"]}
    accuracy = []
    for construction in grid["constructions"]:
        row = [construction]
        for p in precisions:
            cell = cells.get((construction, p))
            row.append(f"{pct(cell.get('accuracy'))} (n={cell['n']})" if cell else NA)
        accuracy.append(row)
    a, b = [*grid["constructions"], "?", "?"][:2]
    disagreements = []
    for d in grid["disagreements"]:
        k, n = int(d["k"]), int(d["n"])
        label = k_of_n(int(d["label_k"]), n) if d.get("label_k") is not None else NA
        disagreements.append([d["precision"], k_of_n(k, n), interval(wilson_or_given(k, n, d.get("wilson"))), label])
        for pair in d.get("pairs") or []:  # a serving engine's run crosses three arms: every other pair too
            pk, pn = int(pair["k"]), int(pair["n"])
            names = f"{pair['a'].split('@')[0]} vs {pair['b'].split('@')[0]}"
            disagreements.append([f"{d['precision']}: {names}", k_of_n(pk, pn),
                                  interval(wilson_or_given(pk, pn, pair.get("wilson"))), k_of_n(int(pair["label_k"]), pn)])
    ckpt = grid["checkpoint"]
    return [
        Table(
            "table-2x2",
            f"Fixed-prefix 2x2 ({ckpt}): accuracy",
            ("construction", *precisions),
            as_rows(accuracy),
            f"All {grid['n']} prefixes held fixed; only construction and precision change.",
        ),
        Table(
            "table-2x2-disagreements",
            f"Fixed-prefix 2x2 ({ckpt}): {a} vs {b} disagreements",
            ("precision", "suffix disagreements", "Wilson 95%", "label disagreements"),
            as_rows(disagreements),
            "0/n is reported with its Wilson upper bound.",
        ),
    ]


def _logit(x: float | None) -> str:
    """A logit-scale number: 3 significant digits, 0 as 0."""
    return NA if x is None else "0" if x == 0 else f"{x:.3g}"


def _median(values: Any) -> float | None:
    from statistics import median

    xs = [v for v in (values.values() if isinstance(values, dict) else values or []) if v is not None]
    return float(median(xs)) if xs else None


def diagnostics_table(results: dict[str, Any]) -> Table | None:
    """Why pairs diverged, one row per compared pair: margins, first-step logit difference, cache difference."""
    rows = []
    pairs = [(f"{m['checkpoint']} live vs {m['construction']} @{m['precision']}", m, m["suffix_disagreements"])
             for m in results.get("matched") or []]
    grid = results.get("precision_2x2") or {}
    pairs += [(f"{grid['checkpoint']} 2x2 @{d['precision']}", d, d) for d in grid.get("disagreements") or []]
    for label, s, kn in pairs:
        if s.get("margins") is None:
            continue
        steps, at = s["margins"].get("steps") or {}, s["margins"]["at_divergence"]
        layers = s.get("cache_diff") or []
        k = _median([r["k_rel_l2"] for r in layers])
        v = _median([r["v_rel_l2"] for r in layers])
        rows.append([label, f"{kn['k']}/{kn['n']}", f"{_logit(at['median'])} / {_logit(steps.get('median'))}",
                     _logit(_median(s.get("first_step_logit_maxabs"))), f"{_logit(k)} / {_logit(v)}"])
    if not rows:
        return None
    headers = ("pair", "diverged", "margin: div / all", "step-1 logit diff", "cache K / V")
    note = ("Medians over items. Margin: top-1 minus top-2 fp32 logit, at the first divergent token against all "
            "steps of the reference arm. Step-1 logit diff: max-abs difference of the two arms' logits at the first "
            "suffix step. Cache: relative L2 ||a-b||/||a|| of the boundary caches, median over layers of the "
            "per-layer medians.")
    return Table("table-diagnostics", "Why pairs diverged: margins, logits, caches", headers, as_rows(rows), note)


def bridge_tables(bridge: dict[str, Any]) -> list[Table]:
    n = int(bridge["rows"])
    summary = [[str(n), k_of_n(int(bridge["cache_bit_exact"]), n), k_of_n(int(bridge["suffix_equal"]), n)]]
    tables = [
        Table(
            "table-bridge",
            f"Bridge ({bridge['checkpoint']}): incremental vs live cache",
            ("rows", "caches bit-exact", "suffixes equal"),
            as_rows(summary),
        )
    ]
    rows = []
    for i in bridge.get("items") or []:
        if i["cache_equal"] and i["suffix_equal"]:
            continue
        fd = i.get("first_difference")
        where = f"layer {fd['layer']}, {fd['tensor']}, position {fd['position']}" if fd else NA
        rows.append([i["item_id"], yes_no(i["cache_equal"]), where, yes_no(i["suffix_equal"])])
    if rows:
        headers = ("item", "cache equal", "first difference", "suffix equal")
        tables.append(Table("table-bridge-differences", "Bridge rows that differ", headers, as_rows(rows)))
    return tables


def transplant_tables(t: dict[str, Any]) -> list[Table]:
    ckpt = str(t["checkpoint"])
    rows = [_direction_row(d, str(t.get("layers", "all")), str(t.get("kv", "kv"))) for d in t["directions"]]
    control = t.get("control")
    if control:
        rows += [_direction_row(d, f"{control['layers']} (control)", NA) for d in control["directions"]]
    note = (
        f"Selection {t['selection']} ({t['n_items']} items), frozen before outcomes were seen; positions "
        f"{t.get('positions') or 'all'}. Direction is donor->recipient; 'Wilson 95% lower' bounds the "
        "donor-following rate."
    )
    tables = [
        Table(
            f"table-transplant-{slug(ckpt)}", f"Transplant ({ckpt})", _TRANSPLANT_HEADERS, as_rows(rows), note
        )
    ]
    if t.get("sweep") and t["sweep"].get("rows"):
        tables.extend(_sweep_tables(t["sweep"], ckpt))
    return tables


def _direction_row(d: dict[str, Any], layers: str, kv: str) -> list[str]:
    n, donor = int(d["n"]), int(d["follows_donor"])
    ci = wilson_or_given(donor, n, d.get("donor_wilson"))
    return [
        d["direction"],
        layers,
        kv,
        k_of_n(donor, n),
        bound(ci[0]) if ci else NA,
        k_of_n(int(d["follows_recipient"]), n),
        k_of_n(int(d["neither"]), n),
    ]


def _sweep_tables(sweep: dict[str, Any], ckpt: str) -> list[Table]:
    directions = list(dict.fromkeys(r["direction"] for r in sweep["rows"]))
    bands: dict[tuple[str, str], dict[str, str]] = {}
    for r in sweep["rows"]:
        bands.setdefault((r["kind"], r["band"]), {})[r["direction"]] = f"{r['follows_donor']}/{r['n']}"
    smallest = sweep.get("smallest_band") or {}
    summary = [[d, _layers(smallest.get(d), sweep.get("n_layers"))] for d in directions]
    detail = [[kind, band, *(cells.get(d, NA) for d in directions)] for (kind, band), cells in bands.items()]
    return [
        Table(
            f"table-sweep-summary-{slug(ckpt)}",
            f"Layer sweep ({ckpt}): smallest band whose K/V makes every continuation follow the donor",
            ("direction", "smallest band"),
            as_rows(summary),
        ),
        Table(
            f"table-sweep-{slug(ckpt)}",
            f"Layer sweep ({ckpt}): follows donor per band",
            ("kind", "layers", *directions),
            as_rows(detail),
            terminal=False,
        ),
    ]


def _layers(layers: list[int] | None, n_layers: Any) -> str:
    if not layers:
        return "none found"
    span = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
    return f"layers {span} ({len(layers)} of {n_layers})"


def audit_tables(audit: dict[str, Any]) -> list[Table]:
    broken = audit.get("broken_records") or []
    mismatches = audit.get("mismatches") or []
    sample = audit.get("sample")
    rows = [
        ["items audited", str(audit["items"])],
        ["records re-executed", f"a seeded sample of {sample['re_executed']} of {sample['of']} ({sample['per_stage']} "
                                f"per stage, seed {sample['seed']}); every record verified" if sample else "every record"],
        ["trajectory fingerprints reproduced", count_of(audit["trajectories"])],
        ["comparison fingerprints reproduced", count_of(audit["comparisons"])],
        ["ledger hash chain intact", yes_no(audit["chain_ok"])],
        ["broken ledger records", ", ".join(_record(b) for b in broken) if broken else "none"],
        *_environment_rows(audit),
        ["mismatches", str(len(mismatches))],
    ]
    tables = [Table("table-audit", "Audit: re-executed from the saved ledger", ("", "result"), as_rows(rows))]
    if mismatches:
        shown = [[m["item_id"], m["what"]] for m in mismatches[:MISMATCH_ROWS]]
        if len(mismatches) > MISMATCH_ROWS:
            shown.append(["", f"... and {len(mismatches) - MISMATCH_ROWS} more (all in audit.json)"])
        tables.append(Table("table-audit-mismatches", "Audit mismatches", ("item", "what"), as_rows(shown)))
    return tables


MISMATCH_ROWS = 50


def _environment_rows(audit: dict[str, Any]) -> list[list[str]]:
    """The kernels the audit ran under against the run's, and the findings split by kind (audits since the
    split; an older audit.json has neither)."""
    env = audit.get("environment")
    if env is None:
        return []
    differ = env.get("differences") or []
    kernels = "the run's" if not differ else "other for {} of {} records: {}".format(
        env["records_other_kernels"], env["records"],
        describe([(d["field"], d["recorded"], d["here"]) for d in differ]))
    here = audit.get("not_reproduced_here") or {}
    by = ", ".join(f"{n} {p}" for p, n in sorted((here.get("by_precision") or {}).items()))
    rows = [["kernels", kernels], ["integrity", "holds" if audit.get("integrity_ok") else "findings"],
            ["not reproduced under other kernels", f"{here.get('units', 0)}" + (f" ({by})" if by else "")]]
    if here.get("fp32_token_differences"):
        rows.append(["fp32 units with other tokens (suspicious)", ", ".join(here["fp32_token_differences"])])
    for moved in audit.get("relocated") or []:
        rows.append([f"{moved['input']} relocated", f"{moved['here']} ({moved['how']})"])
    return rows


def _record(b: Any) -> str:
    """A broken record as `seq N`, whether stored as a bare seq or as an object carrying one."""
    if isinstance(b, dict) and "seq" in b:
        return f"seq {b['seq']}" + (f" ({b['reason']})" if b.get("reason") else "")
    return f"seq {b}" if isinstance(b, int) else json.dumps(b)


def run_summary(results: dict[str, Any]) -> list[tuple[str, str]]:
    run = results.get("run") or {}
    keys = ("model", "later_model", "precision", "n_items", "created", "tool_version")
    return [(k.replace("_", " "), str(run[k])) for k in keys if run.get(k) is not None]
