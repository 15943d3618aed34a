"""`compare`: two runs of the same items under two settings, item by item, from their matched records at one
checkpoint (the model, the tokenizer and the items must be the runs' own and equal: `compare_manifests`).

Per item, the live trajectory (stage 1 = `prefix_ids[len(prompt_ids):]`, then the live arm's suffix) of run A
against run B: equal or not; the first position where they differ, in stage 1 or in the suffix (or where the two
runs' boundaries differ); each side's token there, its margin (top-1 minus top-2: a logit or a logprob, the same
difference) and its top candidates, as far as the records reach. Where they come from:

    stage 1            the record's `stage1_top` (per stage-1 step, the top-2), on the payload or the live arm
    suffix, a server   the live arm's `top_logprobs` (per step, the top-5)
    suffix, our engine `diagnostics.margins["live"]` (per step); the top-5 only at a step where live diverged
                       from an arm of its own record (`diagnostics.pairs`)

Elsewhere (an older record) the margin is not recorded, and says so (null). When stage 1 differs, the two runs'
suffixes continue different prefixes: they are compared all the same, and counted apart.

Then per arm the two runs share by name (live, the fresh construction, a server's prefix-cache ...): suffix and
correctness-label disagreements, each side's accuracy, the paired 95% CI of the accuracy difference (A - B) and
McNemar's exact p, as the matched table computes them (`experiments.matched.summarize_matched`). A difference
between the runs means something only where each run is self-consistent, so each run's replicas are counted too
(an arm and its `#replica` equal in tokens and cache, live's replica reaching live's stage 1).

`build_comparison` returns compare.json's content (`COMPARE_VERSION`); `report.compare_render` draws it.
"""

from __future__ import annotations

from typing import Any

from stagereplay.experiments.matched import EXPERIMENT as MATCHED
from stagereplay.experiments.stats import first_divergence, mcnemar_exact, paired_bootstrap_ci
from stagereplay.report.compare_manifests import RunSide, check_comparable, manifest_differences

COMPARE_VERSION = 1
"""compare.json's schema version: a reader refuses another."""
N_RESAMPLES, SEED = 10_000, 0
"""The paired bootstrap's resamples and seed: the matched table's (`experiments.matched.MatchedConfig`)."""
REPLICA = "#replica"
STAGE1, SUFFIX, BOUNDARY = "stage 1", "suffix", "boundary"
"""Where a first divergence falls: in both runs' stage 1, in both runs' suffix, or where one run's stage 1 has
ended and the other's has not (their boundaries differ)."""


def build_comparison(a: RunSide, b: RunSide, checkpoint: str = "primary") -> dict[str, Any]:
    """compare.json: the two runs, what differs between their manifests, each item, and the aggregates. Refuses
    (`StageReplayError`) runs of different models, tokenizers or items."""
    check_comparable(a, b, checkpoint)
    ra = {r.item_id: r.payload for r in a.matched(checkpoint)}
    rb = {r.item_id: r.payload for r in b.matched(checkpoint)}
    ids = [i for i in a.manifest.config.item_ids if i in ra and i in rb]
    items = [compare_item(i, ra[i], rb[i]) for i in ids]
    names_a = list(dict.fromkeys(n for p in ra.values() for n in _arm_names(p)))
    names_b = list(dict.fromkeys(n for p in rb.values() for n in _arm_names(p)))
    shared = [n for n in names_a if n in names_b]
    return {
        "schema_version": COMPARE_VERSION,
        "checkpoint": checkpoint,
        "runs": {"a": _run(a, checkpoint), "b": _run(b, checkpoint)},
        "differences": manifest_differences(a, b, checkpoint),
        "trajectories": trajectory_summary(items),
        "replicas": {side: replica_counts(items, side) for side in ("a", "b")},
        "arms": [arm_summary(name, items) for name in shared],
        "arms_only_in": {"a": [n for n in names_a if n not in names_b], "b": [n for n in names_b if n not in names_a]},
        "items": items,
    }


def _run(side: RunSide, checkpoint: str) -> dict[str, Any]:
    """What names a run in the report: its folder, the command and when, and the matched stage's model settings."""
    m = side.manifest
    stage = m.stage(f"{MATCHED}/{checkpoint}")
    model = stage.model if stage is not None else m.config.model
    return {"path": str(side.path), "command": m.command, "created": m.created, "tool_version": m.tool_version,
            "precision": model.precision,
            "engine": stage.engine.name if stage is not None and stage.engine is not None else "ours",
            "construction": stage.extras().get("construction") if stage is not None else None}


def _arm(payload: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((x for x in payload.get("arms", []) if x.get("name") == name), None)


def _arm_names(payload: dict[str, Any]) -> list[str]:
    """The arms compared across runs: every arm but the replicas (which say whether a run is self-consistent)."""
    return [x["name"] for x in payload.get("arms", []) if REPLICA not in x["name"]]


# -- one item ------------------------------------------------------------------------------------------------------


def compare_item(item_id: str, pa: dict[str, Any], pb: dict[str, Any]) -> dict[str, Any]:
    """One item of both runs: its live trajectories, their first divergence, the replicas, each shared arm."""
    status = {"a": pa.get("status"), "b": pb.get("status")}
    if status["a"] != "ok" or status["b"] != "ok":  # no boundary: nothing to set side by side
        return {"item_id": item_id, "compared": False, "status": status}
    s1a, s1b = _stage1(pa), _stage1(pb)
    la, lb = _arm(pa, "live"), _arm(pb, "live")
    assert la is not None and lb is not None  # every matched record that reached its boundary has live
    ta, tb = [*s1a, *la["suffix_ids"]], [*s1b, *lb["suffix_ids"]]
    pos = first_divergence(ta, tb)
    divergence = None
    if pos is not None:
        sa, sb = _side(pa, ta, len(s1a), pos), _side(pb, tb, len(s1b), pos)
        where = sa["stage"] if sa["stage"] == sb["stage"] else BOUNDARY
        divergence = {"position": pos, "in": where, "a": sa, "b": sb}
    names = [n for n in _arm_names(pa) if n in _arm_names(pb)]
    return {
        "item_id": item_id,
        "compared": True,
        "trajectory_equal": pos is None,
        "stage1_equal": s1a == s1b,
        "stage1_len": {"a": len(s1a), "b": len(s1b)},
        "first_divergence": divergence,
        "replicas": {"a": replicas_exact(pa), "b": replicas_exact(pb)},
        "arms": {n: _arm_pair(_arm(pa, n), _arm(pb, n)) for n in names},
        "token_texts": _texts(pa, pb, divergence),
    }


def _stage1(payload: dict[str, Any]) -> list[int]:
    return list(payload["prefix_ids"][len(payload["prompt_ids"]):])


def _side(payload: dict[str, Any], trajectory: list[int], stage1_len: int, pos: int) -> dict[str, Any]:
    """One run at the trajectory's position `pos`: its token there (None: its trajectory ended before), whether
    that step is in its stage 1 or its suffix, and the margin and top candidates its record holds for that step."""
    token = trajectory[pos] if pos < len(trajectory) else None
    if pos < stage1_len:
        stage, step = STAGE1, pos
        top, source = _nth(_stage1_top(payload), step), "stage1_top"
        margin = _margin(top)
    else:
        stage, step = SUFFIX, pos - stage1_len
        live = _arm(payload, "live") or {}
        top, source = _nth(live.get("top_logprobs"), step), "top_logprobs"
        margin = _margin(top)
        if top is None:  # our engine: the margin at every step, the candidates where live diverged in its record
            margins = ((payload.get("diagnostics") or {}).get("margins") or {}).get("live")
            margin, source = _nth(margins, step), "margins"
            top = _divergence_top(payload, step)
    recorded = top is not None or margin is not None
    return {"stage": stage, "step": step, "token": token, "margin": margin,
            "top": [list(t) for t in top] if top is not None else None, "recorded": source if recorded else None}


def _stage1_top(payload: dict[str, Any]) -> list[Any] | None:
    """Per stage-1 step of live, the top-2 [token id, value]: on the payload, or on the live arm."""
    return payload.get("stage1_top") or (_arm(payload, "live") or {}).get("stage1_top")


def _nth(values: list[Any] | None, i: int) -> Any:
    return values[i] if values is not None and i < len(values) else None


def _margin(top: list[Any] | None) -> float | None:
    """Top-1 minus top-2 of a step's candidates, best first (None: fewer than two, or a value not recorded)."""
    if top is None or len(top) < 2 or top[0][1] is None or top[1][1] is None:
        return None
    return float(top[0][1]) - float(top[1][1])


def _divergence_top(payload: dict[str, Any], step: int) -> list[Any] | None:
    """live's top candidates at suffix `step`, where a pair of its record with live in it first diverged there."""
    for key, pair in ((payload.get("diagnostics") or {}).get("pairs") or {}).items():
        d = (pair or {}).get("divergence")
        first, _, second = key.partition(" vs ")
        if d and d.get("step") == step and "live" in (first, second):
            return list(d["a" if first == "live" else "b"]["top"])
    return None


def replicas_exact(payload: dict[str, Any]) -> dict[str, bool]:
    """Per arm with a replica in the record: whether the two are exact (the matched table's `replica exact`:
    suffixes equal, caches not different, and for live, its replica reaching live's stage 1)."""
    out = {}
    for c in payload.get("comparisons", []):
        if c.get("b") == f"{c.get('a')}{REPLICA}":
            exact = bool(c["suffix_equal"]) and c.get("cache_equal") is not False
            if c["a"] == "live":
                exact = exact and bool(payload.get("replica_prefix_equal", True))
            out[c["a"]] = exact
    return out


def _arm_pair(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any]:
    """One arm of one item in both runs: suffixes, labels, and whether each was built as named (a server's)."""
    assert a is not None and b is not None
    out = {"suffix_equal": a["suffix_ids"] == b["suffix_ids"],
           "first_divergence": first_divergence(a["suffix_ids"], b["suffix_ids"]),
           "label_equal": a["correct"] == b["correct"], "correct": {"a": a["correct"], "b": b["correct"]}}
    if a.get("took_place") is not None or b.get("took_place") is not None:
        out["built"] = {"a": a.get("took_place"), "b": b.get("took_place")}
    return out


def _texts(pa: dict[str, Any], pb: dict[str, Any], divergence: dict[str, Any] | None) -> dict[str, str]:
    """The decoded text of each token shown at the divergence, from the records' `token_texts`."""
    if divergence is None:
        return {}
    known = {**(pb.get("token_texts") or {}), **(pa.get("token_texts") or {})}
    shown = {divergence[s]["token"] for s in ("a", "b")}
    shown |= {t[0] for s in ("a", "b") for t in divergence[s]["top"] or []}
    return {str(t): known[str(t)] for t in sorted(x for x in shown if x is not None) if str(t) in known}


# -- the aggregates ------------------------------------------------------------------------------------------------


def trajectory_summary(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Live trajectories over the items both runs took to their boundary: equal, and where the others first
    diverge; the same over the items where both runs' live replicas are exact."""
    compared = [i for i in items if i["compared"]]
    consistent = [i for i in compared if i["replicas"]["a"].get("live") and i["replicas"]["b"].get("live")]
    where = [i["first_divergence"]["in"] for i in compared if i["first_divergence"]]
    return {
        "n": len(items),
        "not_compared": [{"item_id": i["item_id"], "status": i["status"]} for i in items if not i["compared"]],
        "equal": {"k": sum(i["trajectory_equal"] for i in compared), "n": len(compared)},
        "first_divergence_in": {w: where.count(w) for w in (STAGE1, SUFFIX, BOUNDARY)},
        "self_consistent": {"k": sum(i["trajectory_equal"] for i in consistent), "n": len(consistent)},
    }


def replica_counts(items: list[dict[str, Any]], side: str) -> dict[str, Any]:
    """One run's replicas per arm (exact k of n items), and the items whose live replica was not exact."""
    compared = [i for i in items if i["compared"]]
    arms = dict.fromkeys(a for i in compared for a in i["replicas"][side])
    return {"exact": {a: {"k": sum(bool(i["replicas"][side].get(a)) for i in compared),
                          "n": sum(a in i["replicas"][side] for i in compared)} for a in arms},
            "live_inexact": [i["item_id"] for i in compared if i["replicas"][side].get("live") is False]}


def arm_summary(name: str, items: list[dict[str, Any]], n_resamples: int = N_RESAMPLES, seed: int = SEED
                ) -> dict[str, Any]:
    """One arm, A against B, over the items where both runs have it built as named: the matched table's numbers
    with A and B in place of live and the construction."""
    both = [i for i in items if i["compared"] and name in i["arms"]]
    built = [i for i in both if False not in (i["arms"][name].get("built") or {}).values()]
    pairs = [(i, i["arms"][name]) for i in built]
    same = [(i, p) for i, p in pairs if i["stage1_equal"]]
    acc_a = [int(p["correct"]["a"]) for _, p in pairs]
    acc_b = [int(p["correct"]["b"]) for _, p in pairs]
    a_only = sum(x and not y for x, y in zip(acc_a, acc_b, strict=True))
    b_only = sum(y and not x for x, y in zip(acc_a, acc_b, strict=True))
    n = len(pairs)
    out: dict[str, Any] = {
        "arm": name, "n": n, "not_built": len(both) - len(built),
        "suffix_disagreements": {"k": sum(not p["suffix_equal"] for _, p in pairs), "n": n},
        "suffix_disagreements_same_stage1": {"k": sum(not p["suffix_equal"] for _, p in same), "n": len(same)},
        "label_disagreements": {"k": sum(not p["label_equal"] for _, p in pairs), "n": n},
        "accuracy": {"a": None, "b": None}, "accuracy_diff": None,
        "discordant": {"a_only": a_only, "b_only": b_only}, "mcnemar_p": None,
        "first_divergence": [p["first_divergence"] for _, p in same if not p["suffix_equal"]],
        "replica_exact": {s: _replica_of(name, [i for i, _ in pairs], s) for s in ("a", "b")},
    }
    if n:
        lo, hi = paired_bootstrap_ci(acc_a, acc_b, n_resamples=n_resamples, seed=seed)
        out["accuracy"] = {"a": sum(acc_a) / n, "b": sum(acc_b) / n}
        out["accuracy_diff"] = {"estimate": (sum(acc_a) - sum(acc_b)) / n, "ci": [lo, hi], "confidence": 0.95,
                                "n_resamples": n_resamples, "seed": seed}
        out["mcnemar_p"] = mcnemar_exact(a_only, b_only)
    return out


def _replica_of(name: str, items: list[dict[str, Any]], side: str) -> dict[str, int] | None:
    has = [i["replicas"][side][name] for i in items if name in i["replicas"][side]]
    return {"k": sum(has), "n": len(has)} if has else None
