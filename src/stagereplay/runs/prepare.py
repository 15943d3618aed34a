"""`prepare`: what the user asked for, turned into one frozen `PreparedRun` before any run directory exists.

In this order, each step refusing bad input in one line before the next costs anything:

    kernels       the CPU kernels chosen before torch loads (execution.kernels)
    model         the model's folder found, its attention resolved, as the engine loads it
    refusals      what the engine and the experiment cannot run (serving options, sampling on a server, ...)
    engine bound  the positions a request may hold, asked of a serving engine (a server: whether it answers and
                  speaks an API read here)
    items         the tokenizer and config only (no weights): the items loaded and each prompt checked
    stage 1       the boundary rule and the stage-1 budget resolved for this model and these items (`fit_stage1`)
    static length one allocation for every item where the steps are CUDA graphs (`shared_static_len`)
    the model     loaded in this process where the run steps here, and its fast step proven (engine.proof)
    the engine    a serving engine's version and settings, read once it is loaded
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.limits import model_context, static_cache_len
from stagereplay.engine.lm import Determinism
from stagereplay.engine.model import DeterminismSettings, ModelConfig, check_model_dir, resolve_attn_impl
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.kernels import choose, pin
from stagereplay.execution.local import check_worker_devices
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.core.jobs import ReplaySettings
from stagereplay.experiments.core.prepared import OURS, PreparedRun, RunEngine, frozen
from stagereplay.records.manifest import RopeFacts, Stage1Facts
from stagereplay.records.shards import parse_shard, shard_items
from stagereplay.runs.inputs import Inputs
from stagereplay.tasks import DataConfig, Item, load_items
from stagereplay.tasks.sources import HF_PREFIX

log = logging.getLogger(__name__)


def resolve_model(inputs: Inputs, checkpoint: str = "primary") -> ModelConfig:
    """The model as this run loads it: the embedded toy's checkpoint where none is given, its folder (or GGUF file)
    checked, its attention as transformers picks it where `auto`."""
    path = inputs.input.model
    if path is None:
        from stagereplay.toy import toy_checkpoint

        path = str(toy_checkpoint(checkpoint))
    path = str(Path(path).resolve())
    check_model_dir(path)
    n = inputs.numerics
    return ModelConfig(path=path, precision=n.precision, device=n.device, threads=n.threads,
                       attn_impl=resolve_attn_impl(path, n.attn_impl), cache=n.cache, batch=n.batch,
                       static_len=n.static_len)


def data_config(inputs: Inputs, experiment: Experiment | None = None, options: Any = None) -> DataConfig:
    """Where the items come from: the input group's data, as the experiment reads it (a rollout file)."""
    data = inputs.input.data
    if data and not data.startswith(HF_PREFIX):
        data = str(Path(data).resolve())  # a file or folder; an hf: name stays as given
    if experiment is not None:
        return experiment.data(data or None, inputs.input.n, inputs.input.columns, options)
    return DataConfig(path=data or None, n=inputs.input.n, columns=inputs.input.columns)


def prepare(command: str, inputs: Inputs, experiment: Experiment, options: Any, engine: RunEngine = OURS,
            ex: ExecConfig | None = None, quiet: bool = False) -> PreparedRun:
    """The prepared run of `experiment` with `options` on `engine` (module docstring). Nothing here writes a run
    directory; everything that can fail on bad input fails here."""
    ex = ex or ExecConfig()
    n = inputs.numerics
    pin(choose(n.kernels, toy=inputs.input.model is None and engine is OURS, device=n.device))
    model = engine.model(resolve_model(inputs))
    experiment.check_inputs(inputs, options)
    engine.check_run(experiment, ex, inputs.decode)
    engine.check(experiment, model, options)
    engine.check_source(inputs.input.model)
    check_worker_devices(model.device, ex.workers, ex.executor)  # one GPU per local worker, before anything loads
    # The engine's own bound on a request's positions, asked of it before anything loads: a server that does not
    # answer, or speaks no API read here, is refused in seconds, not once a model has loaded (minutes for a GGUF).
    engine_context = engine.context()
    # The inputs are checked against the config and tokenizer before any weights load (minutes at 14B, or for a
    # GGUF file to dequantize): a bad item fails in seconds.
    from stagereplay.engine.lm import check_prompt
    from stagereplay.engine.model import load_config_and_tokenizer, set_determinism

    determinism = set_determinism(model.threads, model.device)
    config, tokenizer = load_config_and_tokenizer(model.path)
    context = model_context(config)
    data = data_config(inputs, experiment, options)
    items, data_hash = load_items(data, tokenizer, context)
    for item in items:
        check_prompt(item, context)  # a prompt that does not fit fails here, not in a worker
    rule = inputs.boundary.rule()
    settings = ReplaySettings(boundary="" if rule is None else rule.describe(), decode=inputs.decode,
                              scorer=inputs.input.scorer or "last-number")
    stage1: Stage1Facts | None = None
    if experiment.shape.uses_boundary:
        settings, stage1 = fit_stage1(settings, config, tokenizer, items, engine_context)
        reach = prove_reach(settings, items) if items else None
    else:  # the whole response is the sequence: how far each item's reaches is the experiment's to say
        longest = max(experiment.sequence_end(i, settings.decode) for i in items)
        limit, where = context, "the model's context"
        if engine_context is not None and engine_context[0] < context:
            limit, where = engine_context
        if longest > limit:
            raise StageReplayError(f"a prompt and its response reach {longest} tokens, past {where} of {limit}",
                                   "lower --max-new-tokens or shorten the prompts")
        reach = (min((i.prompt_ids for i in items), key=len), longest) if items else None
    model = shared_static_len(model, settings.decode, items, context)
    recorded = warm(model, items, settings, determinism, quiet, reach, here=ex.workers == 1 and ex.executor == "local")
    prepared = PreparedRun(command=command, model=model, data=data, settings=settings, stage1=stage1,
                           items=tuple(shard_items(items, parse_shard(inputs.input.shard))), data_hash=data_hash,
                           engine=engine, determinism=frozen(recorded), ex=ex, quiet=quiet)
    if not quiet and stage1 is not None:
        log.info(stage1.line())
    identity = engine.identity(model)
    return prepared if identity is None else replace(prepared, engine_identity=frozen(identity))


class RunDeterminism(Determinism, total=False):
    """The determinism a manifest records (`warm`): the process's, whether single-token steps are captured, and
    whether they are CUDA graphs (only when they are)."""

    captured_steps: bool
    cuda_graph_steps: bool


def warm(model: ModelConfig, items: list[Item], settings: ReplaySettings, determinism: DeterminismSettings,
         quiet: bool, reach: tuple[tuple[int, ...], int] | None, here: bool) -> RunDeterminism:
    """Where the run steps in this process (`here`; else workers load their own replicas): load the model into this
    process's cache and prove its fast step as far as the run is sure to go (`prove_reach`), with a progress bar
    unless `quiet`, or show the batched step batch-invariant where items share it. A model loaded without its
    weights (a serving engine's run without --cross) proves nothing. Returns the determinism the manifest records:
    the process's (`determinism`, or the loaded model's with its proofs' outcome), whether steps are captured and
    whether they are CUDA graphs."""
    from stagereplay.engine.decode import captures_steps, graphs_steps
    from stagereplay.execution.models import cached_lm
    from stagereplay.records.proofs import machine_store

    captured = captures_steps(model.precision, model.cache) and model.batch == 1 and model.weights
    out: RunDeterminism = {}
    if here:
        lm = cached_lm(model, machine_store=machine_store)
        if items and model.weights and model.batch > 1:  # the batched step shown batch-invariant before items share it
            lm.prove_batch([i.prompt_ids for i in items[:3]])
        elif reach is not None and model.weights:  # the fast step proven before any item uses it (engine.proof)
            lm.prover.show = not quiet
            prompt, furthest = reach
            lm.prove(prompt, furthest, lm.cache_len(max(len(i.prompt_ids) for i in items), settings.decode))
            captured = lm.stepper.capture
        out.update(lm.determinism)
    else:
        out.update(determinism)
    # Captured steps are the eager ones, bit for bit, where proven (once per machine and model setting: workers
    # reuse what the first to need it proved, records.proofs), and each record's environment says the outcome
    # (`fast_steps`); the manifest says whether they were on.
    out["captured_steps"] = captured
    if graphs_steps(model.precision, model.cache, model.device):  # CUDA graphs replay the eager kernels
        out["cuda_graph_steps"] = True
    return out


def shared_static_len(model: ModelConfig, decode: DecodeConfig, items: list[Item], context: int) -> ModelConfig:
    """`model` with one static length for every item where its steps are CUDA graphs and `--static-len` is not
    given: the longest item's allocation (`engine.limits.static_cache_len`), frozen in the manifest.

    A graph, and the proof that lets it run (engine.proof), hold for the static length they ran at: with each item
    allocated its own length, every item would be proven afresh, two steps per position. One length makes one proof
    cover the run. Each item's tokens stay generate()'s with the same static cache: generate(cache_implementation=
    "static") with max_new_tokens = L - prompt + 1 (a static forward's bits follow L, so the length is recorded)."""
    from stagereplay.engine.decode import graphs_steps

    if not items or not model.weights or model.static_len is not None or not graphs_steps(model.precision,
                                                                                           model.cache, model.device):
        return model
    longest = max(len(i.prompt_ids) for i in items)
    return replace(model, static_len=static_cache_len(longest, decode.max_stage1_tokens, decode.max_new_tokens,
                                                      context))


def prove_reach(settings: ReplaySettings, items: list[Item]) -> tuple[tuple[int, ...], int]:
    """What to prove before the first item: from the shortest prompt (every item steps from its own prompt on, so
    from there every step is covered) to where the items are sure to go. A count boundary fixes stage 1, so that
    is the longest prompt + stage 1 + the suffix budget; a marker ends it where nobody knows yet, so the proof
    starts short and is extended as the items get further (`engine.prover.Prover.guard`)."""
    from stagereplay.engine.boundary import After

    dc = settings.decode
    shortest = min((i.prompt_ids for i in items), key=len)
    rule = settings.rule()
    if isinstance(rule, After):
        longest = max(len(i.prompt_ids) for i in items)
        return shortest, longest + min(rule.n, dc.max_stage1_tokens or rule.n) + dc.max_new_tokens
    return shortest, len(shortest) + 1


def fit_stage1(settings: ReplaySettings, config: Any, tokenizer: Any, items: list[Item],
               engine_context: tuple[int, str] | None = None) -> tuple[ReplaySettings, Stage1Facts]:
    """The boundary rule and the stage-1 budget for this model and these items, and what was found; what cannot fit
    is refused.

    The rule defaults to `</think>` for a reasoning model (engine.boundary.default_rule). The budget defaults to 8192
    or what the context leaves after the longest prompt and the suffix budget; a budget given that does not fit is
    refused (engine.limits). The context is the model's, or a serving engine's where that is smaller
    (`engine_context`: a llama.cpp context, a server's per-slot context). A length-dependent RoPE that a sequence may
    push past its original context is warned about once and recorded.
    """
    from stagereplay.engine.boundary import default_rule, parse_boundary
    from stagereplay.engine.limits import STAGE1_BUDGET, check_budgets, rope_scaling

    defaulted = not settings.boundary
    if defaulted:
        rule = default_rule(tokenizer)
        if rule is None:
            raise StageReplayError("no boundary rule given for --data, and none follows from the model (that takes "
                                   "a </think> token and a chat template opening a think block)",
                                   'pass --boundary-marker "</think>", --boundary-regex or --boundary-after')
        settings = replace(settings, boundary=rule.describe())
    match = parse_boundary(settings.boundary).bind(tokenizer).match_kind()
    context, where = model_context(config), "the model's context"
    if engine_context is not None and engine_context[0] < context:
        context, where = engine_context
    longest = max(len(i.prompt_ids) for i in items)
    dc = settings.decode
    budget = check_budgets(longest, dc.max_stage1_tokens, dc.max_new_tokens, context, STAGE1_BUDGET, where)
    rope = rope_scaling(config)
    sequence = longest + budget + dc.max_new_tokens
    if rope.may_change(sequence):
        warnings.warn(f"RoPE scaling {rope.type!r} changes its frequencies past {rope.original_context} positions "
                      f"and a sequence here may reach {sequence}: live and one-shot can then differ by algorithm, "
                      "not rounding (recorded in the manifest)", stacklevel=2)
    facts = Stage1Facts(rule=settings.boundary, rule_source="default" if defaulted else "given", match=match,
                        budget=budget, budget_source="given" if dc.max_stage1_tokens is not None else "default",
                        suffix_budget=dc.max_new_tokens, longest_prompt=longest, context=context,
                        rope=RopeFacts.model_validate(rope.as_dict(sequence)),
                        **({"context_of": where} if engine_context is not None else {}))
    return replace(settings, decode=replace(dc, max_stage1_tokens=budget)), facts
