"""Mismatch's section of results.json and its tables: the attribution of the gap, the RL metrics of each pair of
sides, the position bands, the transplant's outcomes, and a sample of per-token ratios for the figure.

The attribution's rows, each a pair (a, b) of sides on the same tokens, log_ratio = log pi_b - log pi_a:

    total          rollout vs trainer@<run precision>        what an RL trainer sees
    construction   rollout vs prefill                        decode vs prefill inside the rollout engine
    engine         prefill vs trainer@<run precision>        two implementations' one-shot prefills (ours: the same)
    precision      trainer@<run precision> vs trainer@<p>    for each other trainer precision
    bridge         rollout vs incremental                    ours: the live loop's operations teacher-forced
    replicas       rollout vs rollout#replica, prefill vs prefill#replica, trainer@<p> vs its replica
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stagereplay.experiments.format import NA, Table, as_rows, k_of_n
from stagereplay.experiments.mismatch_stats import Pair, summarize_pairs
from stagereplay.experiments.stats import wilson_interval
from stagereplay.records import arrays
from stagereplay.records.ledger import Record

FIGURE_POINTS = 4000
"""Per-token ratios results.json keeps for the figure (evenly spaced over the run's tokens)."""


def sides(records: Sequence[Record]) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray | None]]]:
    """Per item, per arm name: its log-probabilities and argmaxes, decoded (every part of the item together)."""
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray | None]]] = {}
    for r in records:
        if r.payload.get("status") != "ok":
            continue
        held = out.setdefault(r.item_id, {})
        for arm in r.payload.get("arms", []):
            held[arm["name"]] = (arrays.decode(arm["logprobs"]),
                                 None if arm.get("argmax") is None else arrays.decode(arm["argmax"]))
    return out


def attribution(run_precision: str, precisions: Sequence[str]) -> list[tuple[str, str, str]]:
    """(row, side a, side b) of the attribution, in the report's order."""
    trainer = f"trainer@{run_precision}" if run_precision in precisions else f"trainer@{precisions[0]}"
    rows = [("total", "rollout", trainer), ("construction", "rollout", "prefill"), ("engine", "prefill", trainer)]
    rows += [(f"precision {trainer.partition('@')[2]} -> {p}", trainer, f"trainer@{p}")
             for p in precisions if f"trainer@{p}" != trainer]
    rows += [("bridge", "rollout", "incremental"), ("replica: rollout", "rollout", "rollout#replica"),
             ("replica: prefill", "prefill", "prefill#replica")]
    rows += [(f"replica: trainer@{p}", f"trainer@{p}", f"trainer@{p}#replica") for p in precisions]
    rows += [(f"batch composition @ {p}", f"trainer@{p}", f"trainer@{p}#batch") for p in precisions]
    rows += [(f"total @ {p}", "rollout", f"trainer@{p}") for p in precisions if f"trainer@{p}" != trainer]
    return rows


def _pairs(held: dict[str, dict[str, tuple[np.ndarray, np.ndarray | None]]], a: str, b: str) -> list[Pair]:
    return [Pair(arms[a][0], arms[b][0], arms[a][1], arms[b][1]) for arms in held.values() if a in arms and b in arms]


def _figure_points(pairs: list[Pair]) -> dict[str, list[float]]:
    """Up to FIGURE_POINTS (position in the response, log_ratio) of the total row, evenly spaced."""
    positions = np.concatenate([np.arange(p.a.size) for p in pairs]) if pairs else np.zeros(0)
    ratios = np.concatenate([p.log_ratio() for p in pairs]) if pairs else np.zeros(0)
    keep = np.unique(np.linspace(0, ratios.size - 1, min(FIGURE_POINTS, ratios.size)).astype(int)) if ratios.size \
        else np.zeros(0, dtype=int)
    return {"position": positions[keep].astype(int).tolist(),
            "log_ratio": [float(np.clip(x, -20, 20)) for x in ratios[keep]]}


def _transplants(records: Sequence[Record]) -> dict[str, Any] | None:
    moved = [r.payload["transplant"] for r in records if r.payload.get("transplant")]
    if not moved:
        return None
    out: dict[str, Any] = {"n": len(moved), "directions": [], "control": []}
    for key in ("directions", "control"):
        for direction in sorted(moved[0][key]):
            outcomes = [m[key][direction]["outcome"] for m in moved]
            k, n = outcomes.count("donor"), len(outcomes)
            out[key].append({"direction": direction, "n": n, "follows_donor": k,
                             "follows_recipient": outcomes.count("recipient"), "neither": outcomes.count("neither"),
                             "donor_wilson": list(wilson_interval(k, n))})
    return out


def summarize_mismatch(records: Sequence[Record], stage: Any, checkpoint: str, seed: int = 0,
                       n_resamples: int = 10_000) -> dict[str, Any]:
    """The section (module docstring)."""
    main = [r for r in records if not r.part and r.payload.get("status") == "ok"]
    held = sides(records)
    rows = []
    total: list[Pair] = []
    for label, a, b in attribution(stage.model.precision, stage.precisions):
        pairs = _pairs(held, a, b)
        if not pairs:
            continue
        if label == "total":
            total = pairs
        rows.append({"row": label, "a": a, "b": b, **summarize_pairs(pairs, seed, n_resamples)})
    replicas = [r.payload.get("replica_tokens_equal") for r in main if r.payload.get("replica_tokens_equal")
                is not None]
    return {"checkpoint": checkpoint, "source": stage.source, "mode": stage.mode,
            "engine": stage.engine.name if stage.engine is not None else "hf", "precision": stage.model.precision,
            "precisions": list(stage.precisions), "n": len(main),
            "tokens": int(sum(len(r.payload.get("response_ids") or []) for r in main)),
            "replica_tokens_equal": {"k": sum(bool(x) for x in replicas), "n": len(replicas)} if replicas else None,
            "pairs": rows, "transplant": _transplants(main), "figure": _figure_points(total)}


# -- the report's tables -----------------------------------------------------------------------------------------


def _num(x: Any, digits: int = 3) -> str:
    if x is None:
        return NA
    x = float(x)
    return "0" if x == 0 else f"{x:.{digits}g}"


def _ci(ci: list[float] | None) -> str:
    return NA if ci is None else f"[{_num(ci[0])}, {_num(ci[1])}]"


def mismatch_tables(section: dict[str, Any]) -> list[Table]:
    """The attribution, the weights of each pair, the bands of the total row, the transplant."""
    where = f"{section['checkpoint']} ({section['engine']} rollouts, {section['source']}, {section['mode']} logprobs)"
    headers = ("pair (a vs b)", "tokens", "bitwise equal", "mean |log-ratio| [95% CI over items]", "max |log-ratio|",
               "k3 KL [95% CI]", "chi2", "outside [1/2,2]", "outside [1/5,5]", "argmax agree")
    rows = [[f"{p['row']}: {p['a']} vs {p['b']}", str(p["tokens"]), _num(p["bitwise_equal"], 4),
             f"{_num(p['abs_mean'])} {_ci(p['ci']['abs_mean'])}", _num(p["abs_max"]),
             f"{_num(p['k3'])} {_ci(p['ci']['k3'])}", _num(p["chi2"]), _num(p["outside_2"]), _num(p["outside_5"]),
             _num(p["argmax_agree"], 4)] for p in section["pairs"]]
    tables = [Table(f"table-mismatch-{section['checkpoint']}", f"Mismatch, {where}: where the gap comes from",
                    headers, as_rows(rows),
                    "log-ratio = log pi_b - log pi_a per response token, on the same token IDs; k3 = mean(w - 1 - "
                    "log-ratio), w = exp(log-ratio) clamped at exp(+-20); intervals: percentile bootstrap over items "
                    "(10,000 resamples, seed 0).")]
    wrows = []
    for p in section["pairs"]:
        for level, w in p["weights"].items():
            if w["n"]:
                wrows.append([f"{p['row']}", level, str(w["n"]), _num(w["mean"]), _num(w["min"]), _num(w["max"]),
                              _num(w["std"]), _num(w["ess"]), _num(w["outside_2"]), _num(w["outside_5"])])
    tables.append(Table(f"table-mismatch-weights-{section['checkpoint']}", "Importance weights pi_b / pi_a",
                        ("pair", "level", "n", "mean", "min", "max", "std", "ESS (fraction)", "outside [1/2,2]",
                         "outside [1/5,5]"), as_rows(wrows),
                        "token: every token; sequence: exp of a sequence's summed log-ratio; geometric: exp of its "
                        "mean (verl's three levels)."))
    total = next((p for p in section["pairs"] if p["row"] == "total"), None)
    if total is not None and total["bands"]:
        brows = [[b["band"], str(b["tokens"]), _num(b["bitwise_equal"], 4), _num(b["abs_mean"]), _num(b["abs_max"]),
                  _num(b["k3"]), _num(b["outside_2"])] for b in total["bands"]]
        tables.append(Table(f"table-mismatch-bands-{section['checkpoint']}", "Total gap by response position",
                            ("positions", "tokens", "bitwise equal", "mean |log-ratio|", "max |log-ratio|", "k3",
                             "outside [1/2,2]"), as_rows(brows)))
    moved = section.get("transplant")
    if moved:
        trows = [[("control (no layer): " if key == "control" else "") + d["direction"], k_of_n(d["follows_donor"], d["n"]),
                  str(d["follows_recipient"]), str(d["neither"])]
                 for key in ("directions", "control") for d in moved[key]]
        tables.append(Table(f"table-mismatch-transplant-{section['checkpoint']}",
                            "K/V transplant at mid-response: do the log-probabilities after it follow the cache donor?",
                            ("direction (donor->recipient)", "follows donor", "follows recipient", "neither"),
                            as_rows(trows), "A continuation follows a side when its log-probabilities are that side's "
                                            "own continuation's, bit for bit."))
    return tables


# -- the figure --------------------------------------------------------------------------------------------------


def ratio_figure(section: dict[str, Any]) -> Any:
    """The total row's per-token ratio pi_trainer / pi_rollout on a log axis against the position in the response,
    with the 2x and 5x bands RL frameworks clip at (left), and its distribution (right). matplotlib through the Agg
    canvas only (never pyplot), imported here so that nothing else pays for it."""
    from matplotlib.figure import Figure

    points = section["figure"]
    ratio = np.exp(np.asarray(points["log_ratio"], dtype=np.float64))
    fig = Figure(figsize=(9.0, 3.2), layout="constrained")
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    left.scatter(points["position"], ratio, s=4, alpha=0.5, color="#2b6cb0", linewidths=0)
    for band, style in ((2.0, "--"), (5.0, ":")):
        for y in (band, 1 / band):
            left.axhline(y, color="#718096", linestyle=style, linewidth=0.8)
    left.axhline(1.0, color="#1a202c", linewidth=0.6)
    left.set_yscale("log")
    left.set_xlabel("position in the response")
    left.set_ylabel("pi_trainer / pi_rollout")
    trainer = next((p["b"] for p in section["pairs"] if p["row"] == "total"), "trainer")
    left.set_title(f"{section['checkpoint']}: rollout vs {trainer}", fontsize=9)
    nonzero = np.abs(np.log10(ratio[ratio != 1.0])) if ratio.size else np.zeros(0)
    right.hist(np.log10(ratio) if ratio.size else [], bins=60, color="#2b6cb0")
    right.set_xlabel("log10 ratio")
    right.set_ylabel("tokens")
    right.set_title(f"{int((ratio == 1.0).sum())} of {ratio.size} sampled tokens at exactly 1"
                    + (f"; max |log10| {nonzero.max():.2g}" if nonzero.size else ""), fontsize=9)
    return fig


# -- the verdict -------------------------------------------------------------------------------------------------


def _seen(facts: Sequence[Any]) -> str:
    head = "yes" if all(f.holds for f in facts) else "no"
    return f"{head}: " + "; ".join(f.phrase for f in facts) + "."


def mismatch_verdict(section: dict[str, Any]) -> list[Any]:
    """Its facts: to the replicas question, to the cache question (the transplant), and to its own question."""
    from stagereplay.experiments.verdict import CARRIES, REPLICAS, Fact, Question

    seen = Question("trainer sees rollout", "Does the trainer see the probabilities the rollout was sampled from?",
                    _seen)
    ckpt, rows = section["checkpoint"], {p["row"]: p for p in section["pairs"]}
    facts = []
    replicas = [p for label, p in rows.items() if label.startswith("replica")]
    if replicas:
        exact = sum(p["bitwise_equal"] == 1.0 for p in replicas)
        facts.append(Fact(REPLICAS, f"{ckpt} mismatch: {exact}/{len(replicas)} sides' log-probabilities",
                          holds=exact == len(replicas), caveat="and log-probabilities"))
    total = rows.get("total")
    if total is not None:
        parts = [f"{label} {_num(rows[label]['abs_mean'])}" for label in rows
                 if label in ("construction", "engine") or label.startswith("precision")]
        facts.append(Fact(seen, (
            f"{ckpt}, {total['a']} vs {total['b']}: {100 * total['bitwise_equal']:.1f}% of {total['tokens']} token "
            f"log-probabilities are the same bits, mean |log-ratio| {_num(total['abs_mean'])} (max "
            f"{_num(total['abs_max'])}), k3 {_num(total['k3'])}, {100 * (total['outside_2'] or 0):.1f}% of token "
            f"weights outside [1/2, 2]; mean |log-ratio| by part: {', '.join(parts)}"),
            holds=total["bitwise_equal"] == 1.0))
    moved = section.get("transplant") or {}
    for d in moved.get("directions", []):
        facts.append(Fact(CARRIES, f"{ckpt} mismatch at mid-response {d['direction']}", holds=d["follows_donor"] == d["n"],
                          k=d["follows_donor"], n=d["n"]))
    for d in moved.get("control", []):
        facts.append(Fact(CARRIES, "", k=d["follows_recipient"], n=d["n"], control=True))
    return facts
