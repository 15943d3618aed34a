"""The library entry point that makes a run directory (`matched`), and what every run shares: resolve the
source, validate inputs, freeze the manifest, run, report (`runs.extend` extends a run).

Every check that can fail on bad input runs before the run directory is created, so a bad input never leaves
a half-written run behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stagereplay.engine.boundary import BoundaryRule
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.generated import Generated
from stagereplay.engine.limits import model_context, static_cache_len
from stagereplay.engine.lm import LM
from stagereplay.engine.model import ModelConfig, check_model_dir, resolve_attn_impl
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.kernels import choose, pin
from stagereplay.execution.local import cached_lm, check_worker_devices
from stagereplay.experiments.jobs import ReplaySettings
from stagereplay.records.ledger import SCHEMA_VERSION, Run, open_run
from stagereplay.records.proofs import machine_store
from stagereplay.records.provenance import environment, model_hashes, now, package_versions
from stagereplay.records.shards import parse_shard, shard_items
from stagereplay.serving.matched import ServingArms
from stagereplay.tasks import DataConfig, Item, load_items
from stagereplay.tasks.sources import HF_PREFIX


@dataclass(frozen=True)
class Inputs:
    """What a run is made of, as given: the model, the items and how to read them, how to find the boundary, decode
    and score, and the numerics. What is not given follows from the model (a reasoning model's `</think>`), or is the
    embedded toy's (its checkpoint, its held-out items)."""

    model: str | None = field(default=None, metadata={"help": "local model folder or .gguf file (None: the toy)"})
    data: str | None = field(default=None, metadata={"help": "items: a file, a folder or hf:NAME (None: the toy's)"})
    n: int | None = field(default=None, metadata={"help": "the first n items (None: all)"})
    columns: str | None = field(default=None, metadata={"help": "TARGET=COLUMN,... mapping the data's fields"})
    boundary: BoundaryRule | None = field(default=None, metadata={"help": "None: the model's default rule"})
    scorer: str | None = field(default=None, metadata={"help": "None: last-number"})
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    precision: str = field(default="bf16", metadata={"help": "bf16 | fp16 | fp32 | fp32-compute"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda | cuda:<i>"})
    threads: int = field(default=1, metadata={"help": "torch threads per process (fixed, recorded)"})
    attn_impl: str = field(default="auto", metadata={"help": "auto | eager | sdpa"})
    cache: str = field(default="dynamic", metadata={"help": "dynamic | static"})
    static_len: int | None = field(default=None, metadata={"help": "static cache positions (None: what is needed)"})
    batch: int = field(default=1, metadata={"help": "items stepping together"})
    kernels: str = field(default="auto", metadata={"help": "CPU kernels: native | portable | auto"})


@dataclass(frozen=True)
class Source:
    """A model and the items, boundary rule and scorer to run it on; the toy task fills what is not given."""

    model: ModelConfig
    data: DataConfig
    settings: ReplaySettings
    stage1: dict[str, Any] = field(default_factory=dict)  # what `prepare` resolved: rule, budgets, RoPE


def resolve_source(inputs: Inputs, checkpoint: str = "primary") -> Source:
    """Fill in the embedded toy's checkpoint and held-out items when no model or data is given.

    Nothing else is special to the toy: with no boundary rule the rule is left empty for `prepare` to default
    from the tokenizer (`</think>` for a reasoning model's, the toy's included), and the scorer defaults to
    `last-number`, so the toy takes the path a user's reasoning model takes.
    """
    i = inputs
    model = i.model
    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint(checkpoint))
    rule = "" if i.boundary is None else i.boundary.describe()
    path = str(Path(model).resolve())
    check_model_dir(path)
    config = ModelConfig(path=path, precision=i.precision, device=i.device, threads=i.threads,
                         attn_impl=resolve_attn_impl(path, i.attn_impl), cache=i.cache, batch=i.batch,
                         static_len=i.static_len)
    data = i.data
    if data and not data.startswith(HF_PREFIX):
        data = str(Path(data).resolve())  # a file or folder; an hf: name stays as given
    return Source(config, DataConfig(path=data or None, n=i.n, columns=i.columns),
                  ReplaySettings(boundary=rule, decode=i.decode, scorer=i.scorer or "last-number"))


def prepare(source: Source, ex: ExecConfig, quiet: bool = True, engine_context: tuple[int, str] | None = None
            ) -> tuple[Source, LM | None, list[Item], str, dict[str, Any]]:
    """Load the model (when running in this process) and the items, before any run directory exists, and prove
    the fast step as far as the run is sure to go (`prove_reach`), with a progress bar unless `quiet`. A model
    loaded without its weights (`ModelConfig.weights` False: a serving engine's run without --cross, where our
    engine steps nothing) proves nothing.

    Returns the source with its boundary rule and stage-1 budget resolved (`fit_stage1`, within a serving engine's
    `engine_context` too: positions per request and its name), the model (None when workers load their own), the
    items, the data hash and the determinism settings.
    """
    from stagereplay.engine.decode import captures_steps, graphs_steps
    from stagereplay.engine.lm import check_prompt
    from stagereplay.engine.model import load_config_and_tokenizer, set_determinism

    m = source.model
    check_worker_devices(m.device, ex.workers, ex.executor)  # one GPU per local worker, before anything loads
    lm: LM | None = None
    # The inputs are checked against the config and tokenizer before any weights load (minutes at 14B, or for a
    # GGUF file to dequantize): a bad item fails in seconds.
    determinism = set_determinism(m.threads, m.device)
    config, tokenizer = load_config_and_tokenizer(m.path)
    context = model_context(config)
    items, data_hash = load_items(source.data, tokenizer)
    for item in items:
        check_prompt(item, context)  # a prompt that does not fit fails here, not in a worker
    source = fit_stage1(source, config, tokenizer, items, engine_context)
    source = shared_static_len(source, items, context)
    m = source.model
    if ex.workers == 1 and ex.executor == "local":  # else workers load their own replicas
        lm = cached_lm(m, machine_store=machine_store)
        determinism = lm.determinism
    captured = captures_steps(m.precision, m.cache) and m.batch == 1 and m.weights
    steps = lm is not None and bool(items) and m.weights  # our engine steps this run's items here
    if lm is not None and steps and m.batch > 1:  # the batched step shown batch-invariant before items share it
        lm.prove_batch([i.prompt_ids for i in items[:3]])
        determinism = {**determinism, "batch_check": lm.determinism["batch_check"]}
    elif lm is not None and steps:  # the fast step proven before any item uses it (engine.proof)
        lm.prover.show = not quiet
        prompt, reach = prove_reach(source, items)
        lm.prove(prompt, reach, lm.cache_len(max(len(i.prompt_ids) for i in items), source.settings.decode))
        captured, determinism = lm.stepper.capture, lm.determinism  # with the proof's outcome (fast_steps)
    # Captured steps are the eager ones, bit for bit, where proven (once per machine and model setting: workers
    # reuse what the first to need it proved, records.proofs), and each record's environment says the outcome
    # (`fast_steps`); the manifest says whether they were on.
    determinism = {**determinism, "captured_steps": captured}
    if graphs_steps(m.precision, m.cache, m.device):  # CUDA graphs replay the eager kernels (engine.graphs)
        determinism["cuda_graph_steps"] = True
    return source, lm, items, data_hash, determinism


def shared_static_len(source: Source, items: list[Item], context: int) -> Source:
    """`source` with one static length for every item where its steps are CUDA graphs and `--static-len` is not
    given: the longest item's allocation (`engine.limits.static_cache_len`), frozen in the manifest.

    A graph, and the proof that lets it run (engine.proof), hold for the static length they ran at: with each item
    allocated its own length, every item would be proven afresh, two steps per position. One length makes one proof
    cover the run. Each item's tokens stay generate()'s with the same static cache: generate(cache_implementation=
    "static") with max_new_tokens = L - prompt + 1 (a static forward's bits follow L, so the length is recorded)."""
    from stagereplay.engine.decode import graphs_steps

    m, dc = source.model, source.settings.decode
    if not items or not m.weights or m.static_len is not None or not graphs_steps(m.precision, m.cache, m.device):
        return source
    longest = max(len(i.prompt_ids) for i in items)
    length = static_cache_len(longest, dc.max_stage1_tokens, dc.max_new_tokens, context)
    return replace(source, model=replace(m, static_len=length))


def prove_reach(source: Source, items: list[Item]) -> tuple[tuple[int, ...], int]:
    """What to prove before the first item: from the shortest prompt (every item steps from its own prompt on, so
    from there every step is covered) to where the items are sure to go. A count boundary fixes stage 1, so that
    is the longest prompt + stage 1 + the suffix budget; a marker ends it where nobody knows yet, so the proof
    starts short and is extended as the items get further (`Prover.guard`)."""
    from stagereplay.engine.boundary import After, parse_boundary

    dc = source.settings.decode
    shortest = min((i.prompt_ids for i in items), key=len)
    rule = parse_boundary(source.settings.boundary)
    if isinstance(rule, After):
        longest = max(len(i.prompt_ids) for i in items)
        return shortest, longest + min(rule.n, dc.max_stage1_tokens or rule.n) + dc.max_new_tokens
    return shortest, len(shortest) + 1


def fit_stage1(source: Source, config: Any, tokenizer: Any, items: list[Item],
               engine_context: tuple[int, str] | None = None) -> Source:
    """Resolve the boundary rule and the stage-1 budget for this model and these items; refuse what cannot fit.

    The rule defaults to `</think>` for a reasoning model (engine.boundary.default_rule). The budget defaults
    to 8192 or what the context leaves after the longest prompt and the suffix budget; a budget given that
    does not fit is refused (engine.limits). The context is the model's, or a serving engine's where that is
    smaller (`engine_context`: a llama.cpp context, a server's per-slot context). A length-dependent RoPE that a
    sequence may push past its original context is warned about once and recorded.
    """
    import warnings

    from stagereplay.engine.boundary import default_rule, parse_boundary
    from stagereplay.engine.limits import STAGE1_BUDGET, check_budgets, rope_scaling

    settings = source.settings
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
    given = dc.max_stage1_tokens is not None
    budget = check_budgets(longest, dc.max_stage1_tokens, dc.max_new_tokens, context, STAGE1_BUDGET, where)
    settings = replace(settings, decode=replace(dc, max_stage1_tokens=budget))
    rope = rope_scaling(config)
    sequence = longest + budget + dc.max_new_tokens
    if rope.may_change(sequence):
        warnings.warn(f"RoPE scaling {rope.type!r} changes its frequencies past {rope.original_context} positions "
                      f"and a sequence here may reach {sequence}: live and one-shot can then differ by algorithm, "
                      "not rounding (recorded in the manifest)", stacklevel=2)
    budget_source = "given" if given else "default"
    stage1 = {**source.stage1, "rule": settings.boundary, "rule_source": "default" if defaulted else "given",
              "match": match, "budget": budget, "budget_source": budget_source, "suffix_budget": dc.max_new_tokens,
              "longest_prompt": longest, "context": context, "rope": rope.as_dict(sequence),
              **({"context_of": where} if engine_context is not None else {})}
    return replace(source, settings=settings, stage1=stage1)


def stage1_header(source: Source) -> str:
    """One line for the top of a run: the boundary rule, how it matches, and the budgets in use."""
    s = source.stage1
    return (f"stage 1: {s['rule']} ({s['rule_source']}, matched on {s['match']}), budget {s['budget']} tokens "
            f"({s['budget_source']}), suffix budget {s['suffix_budget']}, longest prompt {s['longest_prompt']}, "
            f"context {s['context']}, RoPE {s['rope']['type']}")


def print_header(source: Source, quiet: bool) -> None:
    if not quiet:
        import sys

        print(stage1_header(source), file=sys.stderr)


def new_manifest(command: str, config: dict[str, Any], source: Source, items: list[Item], data_hash: str,
                 determinism: dict[str, Any], extra_models: dict[str, str] | None = None) -> dict[str, Any]:
    """The frozen record of what this run is. `config` is its identity: resuming requires it unchanged."""
    from stagereplay.tasks.scoring import scorer_versions

    models = {"primary": source.model.path, **(extra_models or {})}
    scorer_packages = scorer_versions(source.settings.scorer)  # math-verify's version decides `math` labels
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "stagereplay",
        "tool_version": package_versions()["stagereplay"],
        "created": now(),
        "command": command,
        "config": {
            **config,
            "model": source.model.as_dict(),
            "data": source.data.as_dict(),
            "settings": source.settings.as_dict(),
            "dataset_hash": data_hash,
            "item_ids": [i.id for i in items],
            "model_hashes": {name: model_hashes(path) for name, path in models.items()},
            "stage1": source.stage1,
            **({"scorer_packages": scorer_packages} if scorer_packages else {}),
        },
        "environment": environment(source.model.device, determinism),
        "stages": {},
    }


def finish(run: Run, quiet: bool = False) -> dict[str, Any]:
    """Rebuild results.json from the whole ledger, write the report, print the tables."""
    from stagereplay.execution.local import shutdown_workers
    from stagereplay.report.results import build_results

    shutdown_workers()
    results = build_results(run.path, run.manifest, run.records)
    run.write_results(results)
    write_and_print_report(run.path, results, quiet)
    return results


def write_and_print_report(run_dir: Path, results: dict[str, Any], quiet: bool) -> None:
    from stagereplay.report.render import print_tables, write_report

    write_report(run_dir)
    if not quiet:
        from rich.console import Console

        print_tables(results, Console())


def matched(out: str | Path, inputs: Inputs | None = None, construction: str = "oneshot",
            ex: ExecConfig | None = None, shard: str | None = None, serving: ServingArms | None = None,
            quiet: bool = False, generated: Generated | None = None) -> dict[str, Any]:
    """Run (or resume) the matched experiment into `out`; return results.json's content.

    With `shard="I/N"` only every N-th item from the I-th runs; `stagereplay merge` joins the shards. With `serving`
    the arms are a serving engine's (`serving.matched`); its `cross` adds our engine's replay of its prefixes. With
    `generated`, live is built by transformers' generate() with speculation or a quantized cache
    (`engine.generated`). The CPU kernels (`inputs.kernels`, `execution.kernels`) are chosen here, before torch
    loads.
    """
    from stagereplay.experiments.matched import MatchedConfig, run_matched

    inputs, ex, generated = inputs or Inputs(), ex or ExecConfig(), generated or Generated()
    if generated:
        if serving is not None:
            raise StageReplayError(f"{generated.describe()} builds live in our engine, through transformers",
                                   "a serving engine's own option is its own: drop --speculate/--quantized-cache")
        generated.check(inputs.cache, inputs.batch)
    pin(choose(inputs.kernels, toy=inputs.model is None and serving is None, device=inputs.device))
    part = parse_shard(shard)
    context = None
    if serving is not None:
        check_serving(serving, construction, ex, inputs)
        serving.kind.check_model(inputs.model)
        context = serving.kind.context(serving.engine)  # a request must fit the engine's context too
    source = resolve_source(inputs)
    if serving is not None:  # without --cross our engine steps nothing: its model gives the tokenizer alone
        source = replace(source, model=serving.our_model(source.model))
    source, lm, items, data_hash, determinism = prepare(source, ex, quiet, context)
    print_header(source, quiet)
    config = MatchedConfig(source.model, source.settings, source.data, construction, generated=generated)
    items = shard_items(items, part)
    identity: dict[str, Any] = {"construction": construction, **({"generate": generated.as_dict()} if generated else {})}
    if shard is not None:
        identity["shard"] = shard
    if serving is not None:
        identity.update(engine=serving.engine.as_dict(), cross=serving.cross)
    manifest = new_manifest("matched", identity, source, items, data_hash, determinism)
    if serving is not None:  # the engine's version and settings, frozen with the rest before the first item
        from stagereplay.serving.matched import cached_engine

        assert lm is not None  # a serving engine runs in this process (check_serving)
        manifest["environment"]["engine"] = cached_engine(serving.engine, lm).settings()
    with open_run(Path(out), manifest) as run:
        if serving is None:
            run_matched(run, config, items, ex, lm, quiet)
        else:
            from stagereplay.serving.matched import run_serving_matched

            run_serving_matched(run, source.model, source.settings, source.data, serving, items, lm, quiet=quiet)
        results = finish(run, quiet)
    require_boundary(results["matched"][0], source.settings)
    return results


def check_serving(serving: ServingArms, construction: str, ex: ExecConfig, inputs: Inputs) -> None:
    """Refuse, before anything loads, what a serving engine's matched run cannot do."""
    engine = serving.engine.name
    if construction != "oneshot":
        raise StageReplayError(f"--construction {construction} is our engine's; --engine {engine} runs oneshot and "
                               "prefix-cache", "drop --construction")
    if ex.workers != 1 or ex.executor != "local":
        raise StageReplayError(f"--engine {engine} runs in this process", "pass --workers 1 --executor local")
    if inputs.decode.sample:
        raise StageReplayError(f"--engine {engine} runs greedy: its sampler is not ours, so draws would not "
                               "compare across engines", "drop --sample")
    check_serving_precision(serving, inputs.precision)
    serving.kind.require()


def check_serving_precision(serving: ServingArms, precision: str) -> None:
    if precision not in ("bf16", "fp16", "fp32"):
        raise StageReplayError(f"--engine {serving.engine.name} does not run precision {precision}",
                               "use bf16, fp16 or fp32")


def require_boundary(summary: dict[str, Any], settings: ReplaySettings) -> None:
    """Every item missing its boundary means the rule is wrong: the records are kept, but the command fails."""
    if summary["n"] and not summary["n_boundary"]:
        raise StageReplayError(
            f"no item reached the boundary {settings.boundary} within {settings.decode.max_stage1_tokens} "
            f"stage-1 tokens ({summary['n']} recorded as no_boundary)",
            "check the boundary rule against the model's output, or raise --max-stage1-tokens",
        )
