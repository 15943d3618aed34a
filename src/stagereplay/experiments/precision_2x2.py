"""Fixed-prefix 2x2: the matched run's token IDs held fixed, construction crossed with precision."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from stagereplay.engine.decode import derive_seed
from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards
from stagereplay.engine.lm import LM, BoundaryState, Continuation, check_construction
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.common import Job, ReplaySettings, arm_record, comparison, execute, token_texts
from stagereplay.experiments.diagnose import diagnose
from stagereplay.records.ledger import Run
from stagereplay.report.stats import first_divergence
from stagereplay.tasks.base import Item

EXPERIMENT = "precision_2x2"


def fixed_state(item: Item, prefix: list[int], settings: ReplaySettings, lm: LM) -> BoundaryState:
    """A boundary state with no cache yet: what `lm.construct` needs to rebuild one from fixed token IDs (a static
    cache is allocated for the positions the item's live run had, `LM.cache_len`)."""
    return BoundaryState(prefix=tuple(prefix), prompt_len=len(item.prompt_ids), construction="fixed", cache=None,
                         seed=derive_seed(settings.decode.seed, item.id, "suffix"),
                         cache_len=lm.cache_len(len(item.prompt_ids), settings.decode))


def grid_item(lm: LM, job: Job) -> dict[str, Any]:
    """Every construction at this process's precision on one fixed prefix, and their pairwise comparison.

    With `reuse` (see `reused_arm`), the construction that the matched run already continued from this prefix
    on this model is not continued again: its arm is the matched record's, marked `same_as`. Its cache is still
    built (one prefill, for the cache differences) and continued only as far as the diagnostics read its logits
    (the first step and the first divergent one, `diagnostic_steps`); those steps must repeat the recorded
    tokens, or the arm is decoded in full and recorded as its own.
    """
    item, s = job.item, job.settings
    state = fixed_state(item, job.get("prefix"), s, lm)
    reuse = job.get("reuse")
    reused = reuse[0].rpartition(":")[2] if reuse else None
    built = {f"{c}@{lm.config.precision}": (c, lm.construct(state, c)) for c in job.get("constructions")}
    conts: dict[str, Continuation] = {}
    for name, (c, b) in built.items():
        if c != reused:
            # Each arm watches the earlier ones' suffixes: its logits at their first divergent step are kept as
            # it runs; the earlier arm's are replayed from its cache, which every arm here keeps for
            # `cache_difference`.
            conts[name] = lm.continue_from(b, s.decode, watch=[cont.suffix for cont in conts.values()])
    carried: dict[str, tuple[dict[str, Any], list[Any]]] = {}  # arm name -> (its arm, its step margins)
    for name, (c, b) in built.items():
        if c != reused:
            continue
        source, recorded, margins = reuse
        others = [cont.suffix for cont in conts.values()]
        steps = diagnostic_steps(recorded["suffix_ids"], others)
        look = lm.continue_from(b, replace(s.decode, max_new_tokens=steps), watch=others)
        if list(look.suffix) == recorded["suffix_ids"][: len(look.suffix)]:
            conts[name] = look
            carried[name] = ({**recorded, "name": name, "same_as": source}, margins)
        else:  # not the computation the matched run recorded: this arm is its own
            conts[name] = lm.continue_from(b, s.decode, watch=others)
    runs: dict[str, tuple[BoundaryState, Continuation]] = {name: (b, conts[name]) for name, (_, b) in built.items()}
    arms = [carried[name][0] if name in carried else arm_record(lm, name, b, cont, state.stage1, item, s.scorer)
            for name, (b, cont) in runs.items()]
    comparisons = [comparison(item.id, a, b) for i, a in enumerate(arms) for b in arms[i + 1 :]]
    pairs = [(c["a"], c["b"]) for c in comparisons]
    diagnostics = diagnose(runs, pairs, cache_pairs=pairs)
    for name, (_, margins) in carried.items():  # every step's margin, as the matched run computed them
        diagnostics["margins"][name] = margins
    payload = {"status": "ok", "precision": lm.config.precision, "prompt_ids": list(item.prompt_ids),
               "prefix_ids": list(state.prefix), "boundary": len(state.prefix), "answer": item.answer,
               "arms": arms, "comparisons": comparisons, "diagnostics": diagnostics}
    return {**payload, "token_texts": token_texts(lm, payload)}


def forwards(n: Lengths, constructions: tuple[str, ...], precision: str, reused: str | None = None) -> list[int]:
    """The forwards `grid_item` makes at `precision` on a prefix of lengths `n`: each construction and its
    continuation; the `reused` one (carried over from matched) continued only `n.look` steps."""
    out: list[int] = []
    for c in constructions:
        steps = n.look if c == reused and n.look is not None else n.of(f"{c}@{precision}")
        out += construct_forwards(c, n.prompt, n.prefix) + continuation_forwards(steps)
    return out


def diagnostic_steps(recorded: list[int], others: list[tuple[int, ...]]) -> int:
    """How many steps of an arm whose suffix is `recorded` the diagnostics read against arms `others`: through
    the latest first divergence from any of them (the first step when none diverges), at most all of them."""
    last = max((first_divergence(recorded, list(o)) or 0 for o in others), default=0)
    return max(1, min(last + 1, len(recorded)))


def reused_arm(grid_stage: dict[str, Any], matched_stage: dict[str, Any] | None, matched: dict[str, Any],
               checkpoint: str, precision: str) -> tuple[str, dict[str, Any], list[Any]] | None:
    """(`matched/<checkpoint>:<construction>`, its arm, its step margins) when the 2x2 at `precision` would
    repeat that arm: the same model at the same precision, the same settings, the same construction from the
    same prefix (the 2x2's prefixes are the matched run's). None when anything differs or the matched record
    has no diagnostics to carry over."""
    if matched_stage is None or matched.get("status") != "ok":
        return None
    c = matched_stage["construction"]
    same_model = dict(matched_stage["model"]) == {**grid_stage["model"], "precision": precision}
    if c not in grid_stage["constructions"] or not same_model or matched_stage["settings"] != grid_stage["settings"]:
        return None
    arm = next((a for a in matched.get("arms", []) if a.get("name") == c), None)
    margins = (matched.get("diagnostics") or {}).get("margins", {}).get(c)
    if arm is None or margins is None:
        return None
    return f"matched/{checkpoint}:{c}", arm, margins


def fixed_prefixes(run: Run, checkpoint: str) -> list[tuple[Item, list[int]]]:
    """The items of the matched run that reached their boundary, with their prefixes."""
    out = []
    for r in run.find("matched", checkpoint):
        p = r.payload
        if p["status"] == "ok":
            out.append((Item(r.item_id, tuple(p["prompt_ids"]), p["answer"]), p["prefix_ids"]))
    return out


def check_fixed_constructions(constructions: tuple[str, ...]) -> None:
    """Constructions that rebuild a state from fixed token IDs (all but live, which only generation makes)."""
    for c in constructions:
        check_construction(c)
    if "live" in constructions:
        raise StageReplayError("live is not a fixed-prefix construction", "use incremental, oneshot, chunked:<n> "
                                                                          "or retokenized")


def run_2x2(run: Run, model: ModelConfig, settings: ReplaySettings, checkpoint: str,
            constructions: tuple[str, ...], precisions: tuple[str, ...], ex: ExecConfig, quiet: bool = False) -> None:
    check_fixed_constructions(constructions)
    run.begin_stage(f"{EXPERIMENT}/{checkpoint}", {"model": asdict(model), "settings": settings.as_dict(),
                                                  "constructions": list(constructions),
                                                  "precisions": list(precisions)})
    stage = run.manifest["stages"][f"{EXPERIMENT}/{checkpoint}"]  # as JSON gives it back, as the audit reads it
    fixed = fixed_prefixes(run, checkpoint)
    matched_stage = run.manifest.get("stages", {}).get(f"matched/{checkpoint}")
    matched = {r.item_id: r.payload for r in run.find("matched", checkpoint)}
    for precision in precisions:
        jobs = [Job(item, settings, part=precision, extra=(
                    ("prefix", prefix), ("constructions", constructions),
                    ("reuse", reused_arm(stage, matched_stage, matched[item.id], checkpoint, precision))))
                for item, prefix in fixed]
        execute(run, EXPERIMENT, checkpoint, model.with_precision(precision), grid_item, jobs, ex, None, quiet)
