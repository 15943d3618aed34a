"""The verdict at the top of the report: the four questions a reader of a stage-replay audit asks, each
answered with its number from `results.json`.

1. Are replicas exact? (if not, nothing below is attributable to the construction)
2. Is replay faithful at the run's precision (bf16 in the paper)?
3. Is it faithful in fp32?
4. Does the cache carry the divergence (transplant)?

and, where the run recorded diagnostics, how close the decisions were where the arms diverged (LayerCast's
margins) and how far apart the two states' first-step logits are per precision. A question the run did not
measure says so, with the command that would.
"""

from __future__ import annotations

from statistics import median
from typing import Any

from stagereplay.experiments.stats import wilson_interval


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.1f}%)" if n else f"{k}/{n}"


def _upper(k: int, n: int) -> str:
    return f"{100 * wilson_interval(k, n)[1]:.2f}%" if n else "-"


def _lower(k: int, n: int) -> str:
    return f"{100 * wilson_interval(k, n)[0]:.1f}%" if n else "-"


def _items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _num(x: float | None) -> str:
    """A logit-scale number: 3 significant digits, 0 as 0."""
    return "-" if x is None else "0" if x == 0 else f"{x:.3g}"


def _median(values: Any) -> float | None:
    xs = [v for v in (values.values() if isinstance(values, dict) else values or []) if v is not None]
    return float(median(xs)) if xs else None


def replicas(matched: list[dict[str, Any]]) -> str:
    parts, exact = [], True
    for m in matched:
        arms = []
        for arm, kn in m["replica_exact"].items():
            if kn is None:  # an arm without replicas (a server's under-load arms)
                continue
            exact &= kn["k"] == kn["n"]
            arms.append(f"{arm} {kn['k']}/{kn['n']}")
        parts.append(f"{m['checkpoint']} " + ", ".join(arms))
    head = "yes" if exact else "no"
    what = "tokens (caches where the engine exposes them)" if any(m.get("engine") for m in matched) \
        else "tokens and caches"
    return f"{head}: runs repeated from scratch were bit-identical in {what} ({'; '.join(parts)})."


def faithful(matched: list[dict[str, Any]], grid: dict[str, Any] | None, precision: str) -> str:
    """Faithful = no suffix changes. From the matched run at that precision, else the 2x2 row for it."""
    facts: list[tuple[int, int, str]] = []
    for m in matched:
        if m["precision"] == precision:
            d = m["suffix_disagreements"]
            facts.append((d["k"], d["n"], f"live vs {m['construction']} ({m['checkpoint']})"))
    for d in (grid or {}).get("disagreements") or []:
        if d["precision"] == precision:
            a, b = [*grid["constructions"], "?", "?"][:2]  # type: ignore[index]  # grid is set when rows exist
            facts.append((d["k"], d["n"], f"fixed-prefix {a} vs {b}"))
    if not facts:
        return f"not measured at {precision} (run `stagereplay precision-2x2 RUN --precisions bf16,fp32`)."
    ok = all(k == 0 for k, _, _ in facts)
    said = "; ".join(
        f"{_pct(k, n)} suffixes differ, {label}" + (f" (Wilson 95% upper bound {_upper(k, n)})" if k == 0 else "")
        for k, n, label in facts
    )
    return ("yes" if ok else "no") + f": {said}."


def carried(transplants: list[dict[str, Any]]) -> str:
    rows = [(t["checkpoint"], d) for t in transplants for d in t.get("directions") or [] if d["n"]]
    if not rows:
        return "not tested (no divergent item was transplanted; run `stagereplay transplant RUN`)."
    donor = all(d["follows_donor"] == d["n"] for _, d in rows)
    head = "yes" if donor else "partly" if any(d["follows_donor"] for _, d in rows) else "no"
    said = "; ".join(
        f"{ckpt} {d['direction']}: {d['follows_donor']}/{d['n']} follow the donor "
        f"(Wilson 95% lower bound {_lower(d['follows_donor'], d['n'])})"
        for ckpt, d in rows
    )
    controls = [d for t in transplants for d in (t.get("control") or {}).get("directions") or [] if d["n"]]
    if controls:
        k, n = sum(d["follows_recipient"] for d in controls), sum(d["n"] for d in controls)
        said += f"; with no layers moved, {k}/{n} follow the recipient"
    return f"{head}: swapping the K/V of all layers moves the continuation with the cache: {said}."


def margins(matched: list[dict[str, Any]]) -> str | None:
    """LayerCast's observation: margins at the first divergent token against margins over all steps."""
    said = []
    for m in matched:
        mg = m.get("margins")
        if not mg or not mg.get("steps") or not mg["at_divergence"]["n"]:
            continue
        said.append(
            f"{m['checkpoint']} @ {m['precision']}: median top-1/top-2 logit margin {_num(mg['at_divergence']['median'])} "
            f"at the first divergent token ({_items(mg['at_divergence']['n'])}, {mg['arm']} arm) against "
            f"{_num(mg['steps']['median'])} over all {mg['steps']['n']} steps"
        )
    return "; ".join(said) + "." if said else None


def first_step(matched: list[dict[str, Any]], grid: dict[str, Any] | None) -> str | None:
    """How far apart the two states are before any token differs, per precision."""
    said = []
    for m in matched:
        value = _median(m.get("first_step_logit_maxabs"))
        if value is not None:
            said.append(f"{_num(value)} live vs {m['construction']} @ {m['precision']} ({m['checkpoint']})")
    for d in (grid or {}).get("disagreements") or []:
        value = _median(d.get("first_step_logit_maxabs"))
        if value is not None:
            said.append(f"{_num(value)} fixed-prefix @ {d['precision']}")
    return "median max-abs logit difference at the first suffix step: " + "; ".join(said) + "." if said else None


def verdict(results: dict[str, Any]) -> list[tuple[str, str]]:
    """(question, answer) pairs, in the order the report prints them; empty when the run has no matched part."""
    matched = results.get("matched") or []
    if not matched:
        return []
    grid = results.get("precision_2x2")
    precision = matched[0]["precision"]
    out = [
        ("Are replicas exact?", replicas(matched)),
        (f"Is replay faithful in {precision}?", faithful(matched, grid, precision)),
    ]
    if precision != "fp32":
        out.append(("Is replay faithful in fp32?", faithful(matched, grid, "fp32")))
    out.append(("Does the cache carry the divergence?", carried(results.get("transplant") or [])))
    close = margins(matched)
    if close:
        out.append(("How close were the decisions where the arms diverged?", close))
    apart = first_step(matched, grid)
    if apart:
        out.append(("How far apart are the two states before any token differs?", apart))
    return out


def verdict_text(results: dict[str, Any]) -> str:
    """The verdict as one paragraph of plain text."""
    return " ".join(f"{q} {a[0].upper()}{a[1:]}" for q, a in verdict(results))
