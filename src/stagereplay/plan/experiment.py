"""What one experiment's run costs before it runs (`stagereplay <command> ... --plan`): its own items read as the run
would read them (a rollout file's included: each response's own length), each priced by the experiment
(`Experiment.planned_forwards`), one row per part of its units (a precision), then the audit's re-execution of every
unit. Runs nothing and writes nothing.

The lengths are the items' prompts as tokenized; a stage boundary (where the experiment finds one) is assumed at the
stage-1 budget, and every suffix or response at `max_new_tokens` (a rollout file's, its own). No item is assumed to
diverge: the diagnostics' replays are the matched run's to add once it has run (`plan RUN`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagereplay.engine.forwards import Lengths
from stagereplay.experiments.core.experiment import Assumed, Experiment
from stagereplay.plan.paper import audit_stages, render
from stagereplay.plan.rates import Rates, calibrate
from stagereplay.plan.stages import StagePlan, model_shape


def plan_experiment(experiment: Experiment, options: Any, model: str | None, data: Any, decode: Any,
                    precision: str, served_by: str | None = None, rates: Rates | None = None,
                    calibrate_on: dict[str, Any] | None = None) -> str:
    """The plan's table of a run of `experiment` with `options` on `model` (the embedded toy's when None) and the
    items `data` gives (`tasks.DataConfig`, as the experiment reads its inputs), decoding with `decode`; `served_by`:
    the serving engine the run uses (`--engine`): an experiment that asks it for what it serves leaves those
    forwards out (`Experiment.planned_forwards`). With `rates` (given), or `calibrate_on` (device, threads: measured
    on the real model, `plan.rates.calibrate`), each stage's time too: our engine's forwards at those rates (what a
    serving engine does is not ours to price)."""
    from stagereplay.engine.limits import STAGE1_BUDGET, check_budgets
    from stagereplay.engine.model import ModelConfig, load_config_and_tokenizer
    from stagereplay.tasks import load_items

    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    shape = model_shape(model)
    _, tokenizer = load_config_and_tokenizer(model)
    found = load_items(data, tokenizer, shape.context)[0]
    stage1: int | None = 0
    if experiment.shape.uses_boundary:
        stage1 = check_budgets(max(len(i.prompt_ids) for i in found), decode.max_stage1_tokens,
                               decode.max_new_tokens, shape.context, STAGE1_BUDGET)
    lengths = tuple(Lengths(len(i.prompt_ids), stage1, experiment.sequence_end(i, decode) - len(i.prompt_ids))
                    for i in found)
    assumed = Assumed(lengths, 0, False, shape.layers, precision, served_by=served_by)
    base = ModelConfig(path=model, precision=precision)
    caches = experiment.peak_caches(experiment.planned_stage(options))
    stages: list[StagePlan] = []
    for part, units in experiment.planned_forwards(assumed, options).items():
        st = StagePlan(f"{experiment.name}/primary" + (f"@{part}" if part else ""),
                       experiment.unit_model(base, part).precision, caches=caches)
        for unit, forwards in units:
            st.add(forwards, unit.prefix + unit.suffix)
        stages.append(st)
    stages += audit_stages(stages, None)
    if calibrate_on is not None:
        rates = calibrate(model, sorted({st.precision for st in stages}), **calibrate_on)
    header = (f"model {Path(model).name}: {shape.layers} layers, {shape.kv_heads} KV heads of {shape.head_dim}, "
              f"{shape.params / 1e9:.3f}B parameters\nassumed: {len(found)} items, prompts "
              f"{min(u.prompt for u in lengths)}-{max(u.prompt for u in lengths)} tokens"
              + (f", stage 1 {stage1}" if experiment.shape.uses_boundary else "")
              + f", {'suffix' if experiment.shape.uses_boundary else 'response'} "
              f"{min(u.suffix for u in lengths)}-{max(u.suffix for u in lengths)} tokens; audit of every unit")
    notes = "".join(f"\n{line}" for line in experiment.plan_notes(options, len(found)))
    return header + "\n" + render(stages, shape, rates) + notes
