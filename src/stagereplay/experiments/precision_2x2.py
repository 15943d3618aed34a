"""Fixed-prefix 2x2: the matched run's token IDs held fixed, construction crossed with precision."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import TypeAdapter

from stagereplay.engine.decode import derive_seed
from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards
from stagereplay.engine.lm import LM, BoundaryState, Continuation, check_construction
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.arms import arm_record, carried_arm, compare, matched_arms, with_token_texts
from stagereplay.experiments.diagnose import diagnose
from stagereplay.experiments.jobs import Job, ReplaySettings, execute
from stagereplay.records.ledger import Run
from stagereplay.records.payloads import Arm, Diagnostics, GridPayload
from stagereplay.report.stats import first_divergence
from stagereplay.tasks.base import Item

EXPERIMENT = "precision_2x2"
PAYLOAD: TypeAdapter[GridPayload] = TypeAdapter(GridPayload)
"""A 2x2 record's payload (`records.payloads`), a serving run's too."""


def fixed_state(item: Item, prefix: list[int], settings: ReplaySettings, lm: LM) -> BoundaryState:
    """A boundary state with no cache yet: what `lm.construct` needs to rebuild one from fixed token IDs (a static
    cache is allocated for the positions the item's live run had, `LM.cache_len`)."""
    return BoundaryState(prefix=tuple(prefix), prompt_len=len(item.prompt_ids), construction="fixed", cache=None,
                         seed=derive_seed(settings.decode.seed, item.id, "suffix"),
                         cache_len=lm.cache_len(len(item.prompt_ids), settings.decode))


def grid_item(lm: LM, job: Job) -> dict[str, Any]:
    """Every construction at this process's precision on one fixed prefix, and their pairwise comparison.

    With `reuse` (see `reused_arms`), a construction whose arm the matched run already computed on this model
    (its own construction, and `incremental`, which makes live generation's calls: the prompt, then one token
    per forward) is not continued again: its cache is built (for the cache differences) and must be the
    recorded arm's bit for bit (its fingerprint); it is then continued only as far as the diagnostics read its
    logits (the first step and the latest first divergent one, `diagnostic_steps`), and those steps must repeat
    the recorded tokens. Its arm is then the matched record's, marked `same_as`; otherwise it is decoded in
    full and recorded as its own.
    """
    item, s = job.item, job.settings
    state = fixed_state(item, job.get("prefix"), s, lm)
    reuse = {c: (source, arm, margins) for c, source, arm, margins in job.get("reuse") or ()}
    built = {f"{c}@{lm.config.precision}": (c, lm.construct(state, c)) for c in job.get("constructions")}
    conts: dict[str, Continuation] = {}
    for name, (c, b) in built.items():
        if c not in reuse:
            # Each arm watches the earlier ones' suffixes: its logits at their first divergent step are kept as
            # it runs; the earlier arm's are replayed from its cache, which every arm here keeps for
            # `cache_difference`.
            conts[name] = lm.continue_from(b, s.decode, watch=[cont.suffix for cont in conts.values()])
    suffixes = {name: conts[name].suffix if c not in reuse else tuple(reuse[c][1]["suffix_ids"])
                for name, (c, _) in built.items()}
    carried: dict[str, tuple[Arm, list[Any]]] = {}  # arm name -> (its arm, its step margins)
    for name, (c, b) in built.items():
        if c not in reuse:
            continue
        source, recorded, margins = reuse[c]
        others = [suffix for other, suffix in suffixes.items() if other != name]  # it watches every other arm
        fp = b.fingerprint()
        if fp == recorded["cache_fp"]:
            steps = diagnostic_steps(recorded["suffix_ids"], others)
            look = lm.continue_from(b, replace(s.decode, max_new_tokens=steps), watch=others)
            if list(look.suffix) == recorded["suffix_ids"][: len(look.suffix)]:
                conts[name] = look
                carried[name] = (carried_arm(recorded, name, c, source), margins)
                continue
        # not the computation the matched run recorded: this arm is its own
        conts[name] = lm.continue_from(b, s.decode, watch=others)
    runs: dict[str, tuple[BoundaryState, Continuation]] = {name: (b, conts[name]) for name, (_, b) in built.items()}
    arms = [carried[name][0] if name in carried else arm_record(lm, name, b, cont, state.stage1, item, s.scorer)
            for name, (b, cont) in runs.items()]
    comparisons = [compare(item.id, a, b) for i, a in enumerate(arms) for b in arms[i + 1 :]]
    pairs = [(c.a, c.b) for c in comparisons]
    diagnosed = diagnose(runs, pairs, cache_pairs=pairs)
    # A carried arm's margins are every step's, as the matched run computed them.
    diagnostics = Diagnostics(margins={**diagnosed.margins, **{name: m for name, (_, m) in carried.items()}},
                              pairs=diagnosed.pairs)
    payload = GridPayload(status="ok", precision=lm.config.precision, prompt_ids=list(item.prompt_ids),
                          prefix_ids=list(state.prefix), boundary=len(state.prefix), answer=item.answer, arms=arms,
                          comparisons=comparisons, diagnostics=diagnostics)
    return with_token_texts(lm, payload).as_payload()


def forwards(n: Lengths, constructions: tuple[str, ...], precision: str) -> list[int]:
    """The forwards `grid_item` makes at `precision` on a prefix of lengths `n`: each construction and its
    continuation; one carried over from matched (`n.looks`) continued only as many steps as its diagnostics read."""
    out: list[int] = []
    looks = dict(n.looks)
    for c in constructions:
        steps = looks[c] if c in looks else n.of(f"{c}@{precision}")
        out += construct_forwards(c, n.prompt, n.prefix) + continuation_forwards(steps)
    return out


def diagnostic_steps(recorded: list[int], others: list[tuple[int, ...]]) -> int:
    """How many steps of an arm whose suffix is `recorded` the diagnostics read against arms `others`: through
    the latest first divergence from any of them (the first step when none diverges), at most all of them."""
    last = max((first_divergence(recorded, list(o)) or 0 for o in others), default=0)
    return max(1, min(last + 1, len(recorded)))


CARRIED_FROM = {"incremental": "live"}
"""A fixed-prefix construction that makes the same forwards as a matched arm of another name: `incremental`
feeds the prompt in one forward, then one token per forward, as live generation did (the bridge's claim, which
the carried arm's cache fingerprint checks item by item)."""


def reused_arms(grid_stage: dict[str, Any], matched_stage: dict[str, Any] | None, matched: dict[str, Any],
                checkpoint: str, precision: str) -> tuple[tuple[str, str, dict[str, Any], list[Any]], ...]:
    """(construction, `matched/<checkpoint>:<arm>`, that arm, its step margins) for each construction of the 2x2
    at `precision` that would repeat an arm of the matched record: the same model at the same precision, the
    same settings, from the same prefix (the 2x2's prefixes are the matched run's), and the same forwards (the
    matched run's own construction, and `incremental` for `live`: `CARRIED_FROM`). Empty when anything differs
    or the matched record has no diagnostics to carry over."""
    arms = matched_arms(grid_stage, matched_stage, matched, precision)
    if not arms:
        return ()
    assert matched_stage is not None
    sources = {matched_stage["construction"]: matched_stage["construction"], **CARRIED_FROM}
    margins = (matched.get("diagnostics") or {}).get("margins", {})
    return tuple((c, f"matched/{checkpoint}:{sources[c]}", arms[sources[c]], margins[sources[c]])
                 for c in grid_stage["constructions"] if c in sources and sources[c] in arms
                 and sources[c] in margins)


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
    run.begin_stage(f"{EXPERIMENT}/{checkpoint}", {"model": model.as_dict(), "settings": settings.as_dict(),
                                                  "constructions": list(constructions),
                                                  "precisions": list(precisions)})
    stage = run.manifest["stages"][f"{EXPERIMENT}/{checkpoint}"]  # as JSON gives it back, as the audit reads it
    fixed = fixed_prefixes(run, checkpoint)
    matched_stage = run.manifest.get("stages", {}).get(f"matched/{checkpoint}")
    matched = {r.item_id: r.payload for r in run.find("matched", checkpoint)}
    for precision in precisions:
        jobs = [Job(item, settings, part=precision, extra=(
                    ("prefix", prefix), ("constructions", constructions),
                    ("reuse", reused_arms(stage, matched_stage, matched[item.id], checkpoint, precision))))
                for item, prefix in fixed]
        execute(run, EXPERIMENT, checkpoint, model.with_precision(precision), grid_item, jobs, ex, None, quiet)
