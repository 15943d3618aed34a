"""Fixed-prefix 2x2: the matched run's token IDs held fixed, construction crossed with precision."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pydantic import TypeAdapter

from stagereplay.engine.constructions import parse_construction
from stagereplay.engine.decode import derive_seed
from stagereplay.engine.forwards import Lengths, construct_forwards, continuation_forwards
from stagereplay.engine.lm import LM, BoundaryState, Continuation
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.arms import (
    arm_record,
    carried_arm,
    compare,
    matched_arms,
    record_lengths,
    with_token_texts,
)
from stagereplay.experiments.diagnose import diagnose
from stagereplay.experiments.diagnostics_summary import summarize_pair
from stagereplay.experiments.experiment import Experiment, Replay, Section, Stage, matched_ok
from stagereplay.experiments.format import NA, Table, as_rows, interval, k_of_n, pct, wilson_or_given
from stagereplay.experiments.jobs import Job, Params, ReplaySettings, execute
from stagereplay.experiments.stats import first_divergence, wilson_interval
from stagereplay.records.ledger import Record, Run
from stagereplay.records.payloads import Arm, Diagnostics, GridPayload, Payload
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


Carried = tuple[tuple[str, str, dict[str, Any], list[Any]], ...]
"""(construction, `matched/<checkpoint>:<arm>`, that arm, its step margins) per carried-over arm (`reused_arms`)."""


@dataclass(frozen=True)
class GridParams(Params):
    """A 2x2 job's parameters: the fixed prefix, the constructions, the precision (the record's part) and the
    matched arms it may carry over."""

    prefix: tuple[int, ...]
    constructions: tuple[str, ...]
    precision: str
    reuse: Carried = ()

    @property
    def part(self) -> str:
        return self.precision


def grid_item(lm: LM, job: Job[GridParams]) -> Payload:
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
    state = fixed_state(item, list(job.params.prefix), s, lm)
    reuse = {c: (source, arm, margins) for c, source, arm, margins in job.params.reuse}
    built = {f"{c}@{lm.config.precision}": (c, lm.construct(state, c)) for c in job.params.constructions}
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


def reused_arms(grid_stage: Stage, matched_stage: Stage | None, matched: dict[str, Any],
                checkpoint: str, precision: str) -> Carried:
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
    made = [parse_construction(c) for c in constructions]  # every name checked before live is refused
    if not all(m.fixed_prefix for m in made):
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
        jobs = [Job(item, settings, GridParams(tuple(prefix), constructions, precision,
                                               reused_arms(stage, matched_stage, matched[item.id], checkpoint, precision)))
                for item, prefix in fixed]
        execute(run, EXPERIMENT, checkpoint, model.with_precision(precision), grid_item, jobs, ex, None, quiet)


# -- results.json and the report ---------------------------------------------------------------------------------


def summarize_2x2(records: list[Record], stage: Stage, checkpoint: str) -> Section:
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


def grid_lengths(payload: dict[str, Any]) -> Lengths:
    """A 2x2 record's lengths, with the steps each arm it carried over from matched was decoded again for its
    diagnostics (`diagnostic_steps`: against every other arm's suffix, as `grid_item` runs it)."""
    n = record_lengths(payload)
    arms = payload.get("arms", [])
    looks = tuple((str(a["construction"]), diagnostic_steps(a["suffix_ids"], [tuple(o["suffix_ids"]) for o in arms
                                                                             if o is not a]))
                  for a in arms if a.get("same_as"))
    return Lengths(n.prompt, n.stage1, 0, n.arms, looks=looks)


class PrecisionGrid(Experiment):
    """The matched run's prefixes held fixed, construction crossed with precision (`grid_item`)."""

    name: ClassVar[str] = EXPERIMENT
    label: ClassVar[str] = "2x2"
    fixed_prefix: ClassVar[bool] = True
    per_precision: ClassVar[bool] = True
    many: ClassVar[bool] = False
    replays_diagnostics: ClassVar[bool] = True

    def work(self, lm: LM, job: Job) -> Payload:
        return grid_item(lm, job)

    def units(self, checkpoint: str, stage: Stage, config: dict[str, Any], records: list[Record]
              ) -> list[tuple[str, str]]:
        """Every prefix of its matched run, at each precision."""
        ok = matched_ok(records, checkpoint)
        return [(i, p) for p in stage.get("precisions", []) for i in ok]

    def replay_job(self, replay: Replay) -> Job:
        checkpoint, part = replay.record.checkpoint, replay.record.part
        reuse = () if replay.matched is None else reused_arms(replay.stage, replay.matched_stage, replay.matched,
                                                              checkpoint, part)
        return Job(replay.item, replay.settings, GridParams(tuple(replay.prefix or ()),
                                                            tuple(replay.stage["constructions"]), part, reuse))

    def unit_forwards(self, record: Record, stage: Stage) -> list[int] | None:
        return forwards(grid_lengths(record.payload), tuple(stage["constructions"]), record.part)

    def peak_caches(self, stage: Stage) -> int:
        return len(stage.get("constructions", ())) + 1  # every construction's state, and one continuation's

    def summarize(self, records: list[Record], stage: Stage, checkpoint: str) -> list[Section]:
        return [summarize_2x2(records, stage, checkpoint)]

    def tables(self, results: Any) -> list[Table]:
        return precision_2x2_tables(results) if results else []

    def diagnosed(self, results: Any) -> list[tuple[str, Section, dict[str, int]]]:
        if not results:
            return []
        a, b = [*results["constructions"], "?", "?"][:2]
        return [(f"2x2 {results['checkpoint']}: {a} vs {b} @ {d['precision']}", d, d)
                for d in results.get("disagreements") or [] if d.get("margins") is not None]

