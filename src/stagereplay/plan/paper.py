"""`stagereplay plan`: what a `paper` run costs, before it runs, from the model's config alone.

Per stage (each step of `paper`, `experiments.protocol.paper.paper_steps`): the items, the forwards (prefill forwards and
their tokens, single-token decode steps) counted by its experiment's own `forwards(...)` (the list its item function
makes, built from engine.forwards, which `LM.construct` also runs from; `Experiment.planned_forwards`), the most K/V
caches alive at once and their size at the longest sequence, the weights resident, and with rates (given, or measured
by `rates.calibrate` on the real model) the wall time.

Before a run the lengths are assumptions: every prompt as tokenized (or `prompt_tokens`), stage 1 of
`stage1_tokens` (default: the stage-1 budget), every suffix of `suffix_tokens` (default: `max_new_tokens`),
and `divergent` items whose live and fresh suffixes differ (default: all; it sizes the transplant selections
and the carried-over 2x2 arm's diagnostic decode). After a run (`plan_recorded.plan_run`) every length is the
measured one.

A dynamic cache holds what was fed so far, so its size is that of the longest sequence. A static cache
(`--cache static`) is allocated whole before the first token, for prompt + stage-1 budget + max new tokens - 1
positions (`LM.cache_len`), and is priced at that length whatever the suffixes turn out to be.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stagereplay.engine.forwards import Lengths
from stagereplay.errors import StageReplayError
from stagereplay.execution.kernels import check_kernels, choose, follow_run, pin
from stagereplay.experiments.core.experiment import Assumed
from stagereplay.experiments.protocol.paper import PRECISION, paper_steps
from stagereplay.plan.rates import Rates, calibrate
from stagereplay.plan.recorded import plan_run, run_cache
from stagereplay.plan.stages import PlanConfig, Shape, StagePlan, allocate, model_shape
from stagereplay.records.ledger import read_manifest


def plan_paper(cfg: PlanConfig, shape: Shape, prompts: Sequence[int], budget: int) -> list[StagePlan]:
    """The stages of `paper` with assumed lengths: `prompts` are the items' prompt lengths (`cfg.n` of them). Each
    step of `paper` (`experiments.protocol.paper.paper_steps`) is priced by its experiment (`Experiment.planned_forwards`),
    one row per part of its units (a precision); then the audit's re-executions and the proofs of the captured step."""
    s1, n = cfg.stage1_tokens or budget, cfg.suffix
    assumed = Assumed(tuple(Lengths(p, s1, n) for p in prompts), cfg.n if cfg.divergent is None else cfg.divergent,
                      cfg.dedup, shape.layers, PRECISION)
    end = max(prompts) + s1 + n
    stages: list[StagePlan] = []
    settings: set[tuple[str, str]] = set()  # (checkpoint, precision): the model settings the run loads
    for step in paper_steps(cfg.protocol, cfg.later):
        e = step.experiment
        caches = e.peak_caches(e.planned_stage(step.options))
        for part, units in e.planned_forwards(assumed, step.options).items():
            st = StagePlan(f"{e.name}/{step.checkpoint}" + (f"@{part}" if part else ""), part or assumed.precision,
                           caches=caches)
            for lengths, forwards in units:
                st.add(forwards, lengths.prefix + lengths.suffix)
            stages.append(st)
            settings.add((step.checkpoint, st.precision))
    stages += audit_stages(stages, cfg.audit_sample or None)
    stages += proof_stages(cfg, min(prompts), end, shape.context, settings)
    for st in stages:
        st.positions = min(st.positions, end)
    return stages


def proof_stages(cfg: PlanConfig, prompt: int, reach: int, context: int, settings: Iterable[tuple[str, str]]
                 ) -> list[StagePlan]:
    """Before a captured step runs at a position, that position is proven equal to the eager step (engine.proof):
    per proof one prefill of the shortest prompt, then two single-token steps per position up to its reach. With a
    marker boundary the first proof is short and each later one doubles it as the items get further
    (`engine.proof.schedule`, to the longest sequence assumed); once per model setting (checkpoint, precision) and
    machine, whatever the workers (they share the store, records.proofs). One row per precision. A static cache's
    steps on CUDA are graphs, proven on a cache of the run's one static length (runs.make.prepare), so no reach
    passes the run's longest sequence; on a CPU they are eager, as are fp32-compute's: nothing to prove. Batched
    steps are not captured (their check, `LM.prove_batch`, costs a few dozen forwards, not counted). `settings`:
    the (checkpoint, precision) of every stage."""
    from stagereplay.engine.decode import graphs_steps
    from stagereplay.engine.proof import schedule

    graphs = graphs_steps("bf16", cfg.cache, cfg.device)  # per precision below: fp32-compute's steps stay eager
    if (cfg.cache != "dynamic" and not graphs) or cfg.batch > 1:
        return []
    if graphs:
        context = min(context, reach)
    out: dict[str, StagePlan] = {}
    for _, precision in sorted(set(settings)):
        if precision == "fp32-compute":
            continue
        row = out.setdefault(precision, StagePlan(f"proof@{precision}", precision, caches=2))
        for target in schedule(prompt + 1, reach, context):
            row.add([prompt, *[1] * (2 * (target - prompt))], target)
    return list(out.values())


def audit_stages(stages: list[StagePlan], sample: int | None) -> list[StagePlan]:
    """Before a run: the audit re-executes every unit of every stage, or `sample` units per stage and part (each row
    here: a 2x2's precisions are sampled apart, `audit.reexecute.sample_units`), scaled from the row's mean unit; one
    row per precision."""
    out: dict[str, StagePlan] = {}
    for s in stages:
        audit = out.setdefault(s.precision, StagePlan(f"audit@{s.precision}", s.precision))
        total = s.units
        share = 1.0 if sample is None or total == 0 else min(sample, total) / total
        audit.units += round(s.units * share)
        for k, v in s.sizes.items():
            audit.sizes[k] += round(v * share)
        audit.positions = max(audit.positions, s.positions)
        audit.caches = max(audit.caches, s.caches)
    return list(out.values())


def render(stages: list[StagePlan], shape: Shape, rates: Rates | None, workers: int = 1) -> str:
    """A table, one row per stage, then the totals."""
    w = max([28, *(len(s.name) for s in stages)])
    head = (f"{'stage':{w}} {'prec':>5} {'items':>6} {'forwards':>10} {'prefill tok':>12} {'steps':>10} "
            f"{'caches':>7} {'cache MiB':>10} {'weights MiB':>12}" + (f" {'hours':>8}" if rates else ""))
    lines = [head]
    total = 0.0
    for s in stages:  # caches: the most alive at once (per item, times the items stepping together); cache MiB:
        # one of them at the stage's longest sequence
        size = shape.cache_bytes(s.positions, s.precision) / 2**20
        row = (f"{s.name:{w}} {s.precision:>5} {s.units:>6} {s.forwards:>10} {s.prefill_tokens:>12} {s.steps:>10} "
               f"{s.caches * s.rows:>7} {size:>10.1f} {shape.weight_bytes(s.precision) / 2**20:>12.1f}")
        if rates:
            hours = rates.wall(s, workers) / 3600
            total += hours
            row += f" {hours:>8.3f}"
        lines.append(row)
    forwards = sum(s.forwards for s in stages)
    lines.append(f"total: {forwards} forwards, {sum(s.prefill_tokens for s in stages)} prefill tokens, "
                 f"{sum(s.steps for s in stages)} decode steps"
                 + (f", {total:.3f} hours ({total * 3600:.0f} s; rates {rates.source})" if rates else ""))
    return "\n".join(lines)


def prompt_lengths(model: str, data: str | None, n: int, prompt_tokens: int | None) -> list[int]:
    """The prompt lengths of the first `n` items as the model's tokenizer makes them (the toy task's without
    `data`), or `prompt_tokens` for each when given (a directory holding only config.json has no tokenizer; a GGUF
    file holds its own)."""
    if prompt_tokens is not None:
        return [prompt_tokens] * n
    from stagereplay.engine.gguf import is_gguf
    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.tasks import DataConfig, load_items

    if not is_gguf(model) and not any((Path(model) / f).is_file()
                                      for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise StageReplayError(f"no tokenizer in {model} to measure the prompts with", "pass --prompt-tokens N")
    _, tokenizer = load_config_and_tokenizer(model)
    found = load_items(DataConfig(path=str(Path(data).resolve()) if data else None, n=n), tokenizer)[0]
    return [len(i.prompt_ids) for i in found]


def plan(cfg: PlanConfig, model: str | None = None, data: str | None = None, run: Path | None = None,
         max_stage1_tokens: int | None = None, rates: Rates | None = None, calibrate_on: dict[str, Any] | None = None,
         kernels: str = "auto") -> str:
    """The plan's table: of `run` as it ran (its measured lengths), else of `paper` on `model` with `cfg`'s
    lengths. `calibrate_on` (device, threads) measures the rates on the real model instead of `rates`, on the
    kernels the run would use (`kernels`, chosen before torch loads) or those `run` recorded."""
    from stagereplay.engine.limits import STAGE1_BUDGET, check_budgets

    check_kernels(kernels)
    if run is not None:
        if not (run / "manifest.json").exists():
            raise StageReplayError(f"no run in {run} (manifest.json missing)", "pass a run directory, or no RUN")
        manifest = read_manifest(run)
        if calibrate_on is not None:
            follow_run(manifest.environment)
        model = manifest.config.model.path
    elif calibrate_on is not None:
        pin(choose(kernels, toy=model is None, device=calibrate_on["device"]))
    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    shape = model_shape(model)
    if run is not None:
        stages = plan_run(run, cfg.audit_sample)
        cache = run_cache(manifest)
    else:
        prompts = prompt_lengths(model, data, cfg.n, cfg.prompt_tokens)
        budget = check_budgets(max(prompts), max_stage1_tokens, cfg.suffix, shape.context, STAGE1_BUDGET)
        stages = plan_paper(cfg, shape, prompts, budget)
        cache = cfg.cache
        if cache == "static":
            max_new = max(cfg.max_new_tokens, cfg.suffix)  # no suffix outgrows its budget
            allocate(stages, prompts, max_stage1_tokens, max_new, shape.context)
    batch = cfg.batch if run is None else manifest.config.model.batch
    for st in stages:
        st.rows = 1 if st.name.startswith("proof@") else batch  # a proof steps one item at a time
    if calibrate_on is not None:
        together = cfg.workers if calibrate_on["device"] == "cpu" else 1  # workers on a CPU share it
        rates = calibrate(model, sorted({s.precision for s in stages}), **calibrate_on, cache=cache,
                          together=together, batch=batch)
    header = (f"model {Path(model).name}: {shape.layers} layers, {shape.kv_heads} KV heads of {shape.head_dim}, "
              f"{shape.params / 1e9:.3f}B parameters; a cache holds "
              f"{shape.cache_bytes(1, 'bf16') / 1024:.0f} KiB per position in bf16")
    if run is None:
        s1 = cfg.stage1_tokens or budget
        header += (f"\nassumed: {cfg.n} items, prompts {min(prompts)}-{max(prompts)} tokens, stage 1 {s1}, suffix "
                   f"{cfg.suffix}, divergent {cfg.n if cfg.divergent is None else cfg.divergent}; "
                   f"2x2 and transplants {'carry the matched arms over' if cfg.dedup else 'recompute every arm'}; audit "
                   + (f"of {cfg.audit_sample} units per stage and part" if cfg.audit_sample else "of every unit"))
    else:
        header += f"\nmeasured: the lengths recorded in {run}"
    if batch > 1:
        header += (f"\n--batch {batch}: single-token steps {batch} to a forward (rows kept full), each prefill alone; "
                   f"caches alive: {batch} items' at once")
    if cache == "static":
        header += ("\nstatic caches: each allocated for prompt + stage-1 budget + max new tokens - 1 positions, "
                   f"{stages[0].positions if stages else 0} at the longest prompt")
    return header + "\n" + render(stages, shape, rates, cfg.workers)
