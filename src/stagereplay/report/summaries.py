"""Each experiment's table, computed from its ledger records: what `results.json` holds per stage.

Experiments write records; these functions only read them, so a resumed, merged or audited run reports the
same. The field-by-field format is `docs/results-schema.md`.
"""

from __future__ import annotations

import zlib
from typing import Any

from stagereplay.records.ledger import Record
from stagereplay.report.diagnostics import summarize_pair
from stagereplay.report.stats import (
    MONTE_CARLO_TABLES,
    TWO_SAMPLE_TEST,
    benjamini_hochberg,
    mcnemar_exact,
    paired_bootstrap_ci,
    total_variation,
    two_sample_answer_test,
    wilson_interval,
)


def _cmp(record: Record, a: str, b: str) -> dict[str, Any] | None:
    for c in record.payload["comparisons"]:
        if c["a"] == a and c["b"] == b:
            return dict(c)
    return None


def summarize_matched(records: list[Record], construction: str, checkpoint: str, precision: str,
                      seed: int = 0, n_resamples: int = 10_000) -> dict[str, Any]:
    """The matched table: replica exactness, disagreements, accuracies, paired CI, McNemar, divergence indices.

    A serving engine's arm whose construction did not take place (`took_place` false: its engine reported a fresh
    prefill where a restore was asked for, say; `serving.evidence`) is not that construction: such items are
    counted apart (`not_built`) and left out of this column's statistics."""
    reached = [r for r in records if r.payload["status"] == "ok"]
    built = [_built(r, construction) for r in reached]
    ok = [r for r, b in zip(reached, built, strict=True) if b is not False]
    rep_live = rep_other = 0
    replicated = False  # whether the construction has replicas (a server's under-load arms are replicas themselves)
    suffix_k = label_k = live_only = other_only = 0
    live_acc, other_acc, divergence = [], [], []
    for r in ok:
        arms = {a["name"]: a for a in r.payload["arms"]}
        lr, orr = _cmp(r, "live", "live#replica"), _cmp(r, construction, f"{construction}#replica")
        # cache_equal is None where an engine records no cache fingerprint: the tokens then decide alone.
        rep_live += bool(lr and lr["suffix_equal"] and lr["cache_equal"] is not False
                         and r.payload["replica_prefix_equal"])
        rep_other += bool(orr and orr["suffix_equal"] and orr["cache_equal"] is not False)
        replicated = replicated or orr is not None
        main = _cmp(r, "live", construction)
        assert main is not None
        if not main["suffix_equal"]:
            suffix_k += 1
            divergence.append(main["first_divergence"])
        a, b = arms["live"]["correct"], arms[construction]["correct"]
        label_k += a != b
        live_only += a and not b
        other_only += b and not a
        live_acc.append(int(a))
        other_acc.append(int(b))
    n = len(ok)
    summary: dict[str, Any] = {
        "checkpoint": checkpoint, "construction": construction, "precision": precision,
        "n": len(records), "n_boundary": len(reached), "n_no_boundary": len(records) - len(reached),
        "replica_exact": {"live": {"k": rep_live, "n": n},
                          construction: {"k": rep_other, "n": n} if replicated or not n else None},
        "suffix_disagreements": {"k": suffix_k, "n": n},
        "label_disagreements": {"k": label_k, "n": n},
        "accuracy": {"live": None, construction: None},
        "accuracy_diff": None,
        "discordant": {"live_only": live_only, "other_only": other_only},
        "mcnemar_p": None,
        "first_divergence": divergence,
        **summarize_pair(ok, "live", construction),
    }
    if any(b is not None for b in built):  # a serving engine's counts say whether each arm was built as named
        summary["built"] = {"k": built.count(True), "n": len(reached), "not_built": built.count(False),
                            "unknown": built.count(None),
                            "not_built_cached": [_arm(r, construction).get("num_cached_tokens")
                                                 for r, b in zip(reached, built, strict=True) if b is False]}
    cached = [a for r in reached for a in r.payload["arms"] if a["name"] == construction
              and a.get("num_cached_tokens") is not None]
    if cached:  # a serving engine's arm: how much of the prefix its cache supplied, and how much decoding wrote
        summary["prefix_cache"] = {
            "n": len(cached), "hits": sum(a["num_cached_tokens"] > 0 for a in cached),
            "num_cached_tokens": sum(a["num_cached_tokens"] for a in cached),
            "cached_from_decode": sum(a.get("cached_from_decode", 0) for a in cached),
            "hits_with_decode_blocks": sum(a.get("cached_from_decode", 0) > 0 for a in cached)}
    findings = [r.payload["load_finding"] for r in records if "load_finding" in r.payload]
    if findings and construction == "live@load":  # a server's replicas under load (serving.matched.load_finding)
        summary["load"] = {arm: {f: [x.get(arm) for x in findings].count(f)
                                 for f in ("invariant", "batch-variant", "not self-consistent", "unknown")}
                           for arm in ("live", "oneshot")}
    if any("marker_inside_token" in r.payload for r in ok):  # a marker matched on text (engine.boundary)
        summary["n_marker_inside_token"] = sum(bool(r.payload.get("marker_inside_token")) for r in ok)
    if n:
        la, oa = sum(live_acc) / n, sum(other_acc) / n
        lo, hi = paired_bootstrap_ci(live_acc, other_acc, n_resamples=n_resamples, seed=seed)
        summary["accuracy"] = {"live": la, construction: oa}
        summary["accuracy_diff"] = {"estimate": la - oa, "ci": [lo, hi], "confidence": 0.95,
                                    "n_resamples": n_resamples, "seed": seed}
        summary["mcnemar_p"] = mcnemar_exact(live_only, other_only)
    return summary


def _arm(record: Record, name: str) -> dict[str, Any]:
    return next((a for a in record.payload["arms"] if a["name"] == name), {})


def _built(record: Record, construction: str) -> bool | None:
    """Whether the record's arm of `construction` was built as named (None: nothing says; `serving.evidence`)."""
    took = _arm(record, construction).get("took_place")
    return None if took is None else bool(took)


def summarize_2x2(records: list[Record], stage: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    constructions, precisions = stage["constructions"], stage["precisions"]
    cells, disagreements = [], []
    for precision in precisions:
        mine = [r for r in records if r.part == precision]
        for c in constructions:
            name = f"{c}@{precision}"
            correct = [a["correct"] for r in mine for a in r.payload["arms"] if a["name"] == name]
            cells.append({"construction": c, "precision": precision, "n": len(correct),
                          "accuracy": sum(correct) / len(correct) if correct else None})
        first = [r.payload["comparisons"][0] for r in mine if r.payload["comparisons"]]
        k = sum(not c["suffix_equal"] for c in first)
        n = len(first)
        more = _more_pairs(mine)
        disagreements.append({
            **({"pairs": more} if more else {}),
            "precision": precision, "k": k, "n": n,
            "wilson": list(wilson_interval(k, n)) if n else None,
            "label_k": sum(not c["label_equal"] for c in first),
            "first_divergence": [c["first_divergence"] for c in first if not c["suffix_equal"]],
            **(summarize_pair(mine, first[0]["a"], first[0]["b"]) if first else {}),
        })
    return {"checkpoint": checkpoint, "constructions": constructions, "precisions": precisions,
            "n": max((d["n"] for d in disagreements), default=0), "cells": cells, "disagreements": disagreements}


def _more_pairs(records: list[Record]) -> list[dict[str, Any]]:
    """With three or more arms (a serving engine's run), every compared pair past the first: its disagreements."""
    ok = [r for r in records if len(r.payload["comparisons"]) > 1]
    if not ok:
        return []
    out = []
    for j, c in enumerate(ok[0].payload["comparisons"][1:], start=1):
        cs = [r.payload["comparisons"][j] for r in ok]
        k, n = sum(not x["suffix_equal"] for x in cs), len(cs)
        out.append({"a": c["a"], "b": c["b"], "k": k, "n": n, "wilson": list(wilson_interval(k, n)),
                    "label_k": sum(not x["label_equal"] for x in cs)})
    return out


def summarize_bridge(records: list[Record], checkpoint: str) -> dict[str, Any]:
    ok = [r for r in records if r.payload["status"] == "ok"]
    items = [{"item_id": r.item_id, "cache_equal": r.payload["cache_equal"],
              "first_difference": (r.payload["differences"] or [None])[0],
              "suffix_equal": r.payload["comparisons"][0]["suffix_equal"]} for r in ok]
    return {"checkpoint": checkpoint, "rows": len(ok), "cache_bit_exact": sum(i["cache_equal"] for i in items),
            "suffix_equal": sum(i["suffix_equal"] for i in items), "items": items}


def _directions(records: list[Record], key: str) -> list[dict[str, Any]]:
    names = list(records[0].payload[key]) if records else []
    out = []
    for name in names:
        outcomes = [r.payload[key][name]["outcome"] for r in records]
        n, k = len(outcomes), outcomes.count("donor")
        out.append({"direction": name, "n": n, "follows_donor": k, "follows_recipient": outcomes.count("recipient"),
                    "neither": outcomes.count("neither"), "donor_wilson": list(wilson_interval(k, n)) if n else None,
                    "divergence_from_donor": [r.payload[key][name]["divergence_from_donor"] for r in records]})
    return out


def summarize_transplant(records: list[Record], stage: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    cfg = stage["config"]
    ok = [r for r in records if r.payload["status"] == "ok"]
    summary: dict[str, Any] = {
        "checkpoint": checkpoint, "selection": cfg["select"], "layers": cfg["layers"], "kv": cfg["kv"],
        "positions": cfg["positions"], "n_items": len(ok), "n_selected": len(stage["selected"]),
        "n_not_reproduced": len(records) - len(ok),
        "directions": _directions(ok, "directions"),
        "control": {"layers": "none", "directions": _directions(ok, "control")},
        "sweep": None,
    }
    if cfg.get("sweep") and ok:
        bands = ok[0].payload["sweep"]
        n_layers = max(max(b["layers"]) for b in bands) + 1
        rows: list[dict[str, Any]] = []
        smallest: dict[str, list[int]] = {}
        for j, band in enumerate(bands):
            for d in (x["direction"] for x in summary["directions"]):
                k = sum(r.payload["sweep"][j][d] == "donor" for r in ok)
                layers = band["layers"]
                label = str(layers[0]) if len(layers) == 1 else f"{layers[0]}-{layers[-1]}"
                rows.append({"band": label, "kind": band["kind"], "layers": layers, "direction": d,
                             "follows_donor": k, "n": len(ok)})
                best = smallest.get(d)
                if k == len(ok) and (best is None or (len(layers), layers[0]) < (len(best), best[0])):
                    smallest[d] = layers
        summary["sweep"] = {"n_layers": n_layers, "rows": rows, "smallest_band": smallest}
    return summary


FDR = 0.05
"""False-discovery rate of the Benjamini-Hochberg procedure over the items' answer-distribution tests."""


def _draws(record: Record, state: str, stream: str) -> list[dict[str, Any]]:
    return sorted((a for a in record.payload["arms"] if a["state"] == state and a["stream"] == stream),
                  key=lambda a: a["draw"])


def _mean_ci(a: list[float], b: list[float], seed: int = 0) -> dict[str, Any]:
    """mean(a - b) with its paired percentile bootstrap 95% CI over items."""
    if not a:
        return {"estimate": None, "ci": None}
    lo, hi = paired_bootstrap_ci(a, b, seed=seed)
    return {"estimate": sum(a) / len(a) - sum(b) / len(b), "ci": [lo, hi]}


def summarize_resample(records: list[Record], stage: dict[str, Any], checkpoint: str) -> list[dict[str, Any]]:
    """One entry per precision: coupled differences, independent answer distributions, the accuracy bias."""
    cfg = stage["config"]
    fresh = cfg["construction"]
    out = []
    for precision in stage["precisions"]:
        mine = [r for r in records if r.part == precision]
        ok = [r for r in mine if r.payload["status"] == "ok"]
        coupled = {"draws": 0, "replica_differ": 0, "fresh_differ": 0, "answer_differ": 0, "label_differ": 0}
        tv_fresh, tv_null, p_fresh, p_null = [], [], [], []
        acc_live, acc_fresh, acc_null = [], [], []
        for r in ok:
            live, rep, fa = _draws(r, "live", "A"), _draws(r, "live#replica", "A"), _draws(r, fresh, "A")
            fb, lc = _draws(r, fresh, "B"), _draws(r, "live", "C")
            coupled["draws"] += len(live)
            coupled["replica_differ"] += sum(x["suffix_fp"] != y["suffix_fp"] for x, y in zip(live, rep, strict=True))
            coupled["fresh_differ"] += sum(x["suffix_fp"] != y["suffix_fp"] for x, y in zip(live, fa, strict=True))
            coupled["answer_differ"] += sum(x["answer"] != y["answer"] for x, y in zip(live, fa, strict=True))
            coupled["label_differ"] += sum(x["correct"] != y["correct"] for x, y in zip(live, fa, strict=True))
            answers = {name: [d["answer"] for d in draws] for name, draws in (("A", live), ("B", fb), ("C", lc))}
            test_seed = zlib.crc32(r.item_id.encode())  # per item, so a resumed or merged run gets the same p
            tv_fresh.append(total_variation(answers["A"], answers["B"]))
            tv_null.append(total_variation(answers["A"], answers["C"]))
            p_fresh.append(two_sample_answer_test(answers["A"], answers["B"], test_seed))
            p_null.append(two_sample_answer_test(answers["A"], answers["C"], test_seed))
            acc_live.append(sum(d["correct"] for d in live) / len(live))
            acc_fresh.append(sum(d["correct"] for d in fb) / len(fb))
            acc_null.append(sum(d["correct"] for d in lc) / len(lc))
        bias = _mean_ci(acc_live, acc_fresh)
        out.append({
            "checkpoint": checkpoint, "precision": precision, "construction": fresh,
            "k": cfg["k"], "temperature": cfg["temperature"], "top_p": cfg["top_p"], "top_k": cfg["top_k"],
            "seed": cfg["seed"], "n_items": len(ok), "n_not_reproduced": len(mine) - len(ok),
            "live_source": ok[0].payload["live_source"] if ok else None,
            "items": [r.item_id for r in ok],
            "coupled": coupled,
            "independent": {
                "test": TWO_SAMPLE_TEST, "monte_carlo_tables": MONTE_CARLO_TABLES, "fdr": FDR,
                "tv_fresh": tv_fresh, "tv_null": tv_null, "excess_tv": _mean_ci(tv_fresh, tv_null),
                "p_values": p_fresh, "p_values_null": p_null,
                "rejected_bh": sum(benjamini_hochberg(p_fresh, FDR)),
                "rejected_bh_null": sum(benjamini_hochberg(p_null, FDR)),
            },
            "accuracy": {"live": _mean(acc_live), fresh: _mean(acc_fresh)},
            "accuracy_bias": {**bias, "per_item": [a - b for a, b in zip(acc_live, acc_fresh, strict=True)]},
            "accuracy_bias_null": _mean_ci(acc_live, acc_null),
        })
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None
