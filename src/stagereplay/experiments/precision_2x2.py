"""Fixed-prefix 2x2: the matched run's token IDs held fixed, construction crossed with precision."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from stagereplay.engine.decode import derive_seed
from stagereplay.engine.lm import LM, BoundaryState, Continuation, check_construction
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.common import Job, ReplaySettings, arm_record, comparison, execute, token_texts
from stagereplay.experiments.diagnose import diagnose
from stagereplay.records.ledger import Run
from stagereplay.tasks.base import Item

EXPERIMENT = "precision_2x2"


def fixed_state(item: Item, prefix: list[int], settings: ReplaySettings) -> BoundaryState:
    """A boundary state with no cache yet: what `lm.construct` needs to rebuild one from fixed token IDs."""
    return BoundaryState(prefix=tuple(prefix), prompt_len=len(item.prompt_ids), construction="fixed", cache=None,
                         seed=derive_seed(settings.decode.seed, item.id, "suffix"))


def grid_item(lm: LM, job: Job) -> dict[str, Any]:
    """Every construction at this process's precision on one fixed prefix, and their pairwise comparison."""
    item, s = job.item, job.settings
    state = fixed_state(item, job.get("prefix"), s)
    runs: dict[str, tuple[BoundaryState, Continuation]] = {}
    for construction in job.get("constructions"):
        built = lm.construct(state, construction)
        # Each arm watches the earlier ones' suffixes: its logits at their first divergent step are kept as it
        # runs; the earlier arm's are replayed from its cache, which every arm here keeps for `cache_difference`.
        watch = [cont.suffix for _, cont in runs.values()]
        runs[f"{construction}@{lm.config.precision}"] = (built, lm.continue_from(built, s.decode, watch=watch))
    arms = [arm_record(lm, name, built, cont, state.stage1, item, s.scorer) for name, (built, cont) in runs.items()]
    comparisons = [comparison(item.id, a, b) for i, a in enumerate(arms) for b in arms[i + 1 :]]
    pairs = [(c["a"], c["b"]) for c in comparisons]
    payload = {"status": "ok", "precision": lm.config.precision, "prompt_ids": list(item.prompt_ids),
               "prefix_ids": list(state.prefix), "boundary": len(state.prefix), "answer": item.answer,
               "arms": arms, "comparisons": comparisons, "diagnostics": diagnose(runs, pairs, cache_pairs=pairs)}
    return {**payload, "token_texts": token_texts(lm, payload)}


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
    fixed = fixed_prefixes(run, checkpoint)
    for precision in precisions:
        jobs = [Job(item, settings, part=precision, extra=(("prefix", prefix), ("constructions", constructions)))
                for item, prefix in fixed]
        execute(run, EXPERIMENT, checkpoint, model.with_precision(precision), grid_item, jobs, ex, None, quiet)
