"""The `stagereplay` command: a thin typer layer over the library (torch is imported only inside commands)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperGroup

try:  # typer vendors click (0.2x on): its parser raises the vendored exceptions
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # an older typer on the real click
    from click.exceptions import NoArgsIsHelpError, UsageError  # type: ignore[assignment]  # same names, older home

from stagereplay.errors import StageReplayError


class OneLineErrors(TyperGroup):
    """Click's usage errors (a value of the wrong type, a missing or unknown option or command) as the one
    `error: <problem>; <fix>` line and exit code 2 of every other bad input, not a usage box."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except NoArgsIsHelpError:
            raise
        except UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else ctx.command_path
            problem = " ".join(exc.format_message().split())
            typer.echo(f"error: {problem.rstrip('.')}; see `{where} --help`", err=True)
            raise typer.Exit(2) from None


app = typer.Typer(cls=OneLineErrors, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Audit stage replay: live cache vs fresh prefill of identical token IDs.")
toy_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The embedded toy reasoning model.")
app.add_typer(toy_app, name="toy")

T = TypeVar("T")


def _run(fn: Callable[[], T]) -> T:
    """Bad input -> one line on stderr naming the problem and the fix, exit code 2."""
    import warnings

    warnings.filterwarnings("ignore", message=".*TypedStorage.*")
    try:
        return fn()
    except StageReplayError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None


# Options shared by commands that load a model.
Model = Annotated[str | None, typer.Option("--model", help=(
    "local model directory, or a .gguf file (default: the embedded toy)"))]
Data = Annotated[str | None, typer.Option("--data", help=(
    "items: a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk folder, or hf:NAME[:CONFIG][:SPLIT] "
    "(default: the toy task's held-out items)"))]
Columns = Annotated[str | None, typer.Option("--columns", help=(
    "map the data's fields: TARGET=COLUMN,... with TARGET prompt, messages, user (a one-message chat), answer or "
    "id (GSM8K and MATH-style problem/answer/unique_id rows need none)"))]
N = Annotated[int | None, typer.Option("--n", help="run the first N items")]
Out = Annotated[Path, typer.Option("--out", help="run directory (created, or resumed)")]
Precision = Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32 | fp32-compute")]
Device = Annotated[str, typer.Option("--device", help="cpu | cuda | cuda:<i>")]
Threads = Annotated[int, typer.Option("--threads", help="torch threads per process (fixed, recorded)")]
AttnImpl = Annotated[str, typer.Option("--attn-impl", help="auto (what transformers picks for the model: sdpa where "
                                                            "it has it, else eager; recorded) | eager | sdpa")]
Cache = Annotated[str, typer.Option("--cache", help=(
    "dynamic (the default: grows per step, equals generate()) | static (preallocated, equals "
    "generate(cache_implementation='static'); CUDA-graph captured on a GPU)"))]
Marker = Annotated[str | None, typer.Option("--boundary-marker", help=(
    "stage 1 ends at the first token whose text completes this (default for a reasoning model: </think>)"))]
Regex = Annotated[str | None, typer.Option("--boundary-regex", help=(
    "stage 1 ends when its text matches (searched in the last 1024 characters and the new token's text)"))]
After = Annotated[int | None, typer.Option("--boundary-after", help="stage 1 is the first N generated tokens")]
Scorer = Annotated[str | None, typer.Option("--scorer", help=(
    "last-number | exact | math (LaTeX answers: the last \\boxed{}, through math-verify) | regex:PATTERN"))]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="suffix length limit")]
MaxStage1 = Annotated[int | None, typer.Option("--max-stage1-tokens", help=(
    "tokens allowed to reach the boundary (default: 8192 or what the context leaves)"))]
Sample = Annotated[bool, typer.Option("--sample/--greedy", help="seeded sampling instead of greedy")]
Temperature = Annotated[float, typer.Option("--temperature")]
TopK = Annotated[int, typer.Option("--top-k", help="sample from the top k tokens only (0 = all)")]
TopP = Annotated[float, typer.Option("--top-p", help="sample from the smallest set of this mass (1 = all)")]
Seed = Annotated[int, typer.Option("--seed", help="base seed for sampling")]
Workers = Annotated[int, typer.Option("--workers", help="local worker processes")]
Executor = Annotated[str, typer.Option("--executor", help="local | ray")]
Quiet = Annotated[bool, typer.Option("--quiet", help="no progress bar or tables")]
Batch = Annotated[int, typer.Option("--batch", help=(
    "items stepping together: up to C items' decode steps share one forward of C rows, each row batch-invariant "
    "(its attention per item; recorded, and later stages and the audit follow it); 1 = one item at a time"))]
Kernels = Annotated[str, typer.Option("--kernels", help=(
    "CPU kernels: native (this machine's own) | portable (ATen and oneDNN on AVX2, MKL on its branch for every "
    "vendor: the same bits on every x86-64 CPU with AVX2) | auto (portable for the embedded toy on a CPU, else native)"))]


def _decode(max_new: int, max_stage1: int | None, sample: bool, temperature: float, top_k: int, seed: int,
            top_p: float = 1.0) -> Any:
    from stagereplay.engine.decode import DecodeConfig

    return DecodeConfig(max_new, max_stage1, sample, temperature, top_k, seed, top_p)


@app.command()
def matched(
    out: Out,
    model: Model = None,
    data: Data = None,
    n: N = None,
    construction: Annotated[str, typer.Option(help="oneshot | incremental | chunked:<n> | retokenized")] = "oneshot",
    boundary_marker: Marker = None,
    boundary_regex: Regex = None,
    boundary_after: After = None,
    scorer: Scorer = None,
    precision: Precision = "bf16",
    device: Device = "cpu",
    threads: Threads = 1,
    attn_impl: AttnImpl = "auto",
    max_new_tokens: MaxNew = 128,
    max_stage1_tokens: MaxStage1 = None,
    sample: Sample = False,
    temperature: Temperature = 1.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    workers: Workers = 1,
    executor: Executor = "local",
    shard: Annotated[str | None, typer.Option("--shard", help="I/N: run every N-th item from the I-th")] = None,
    quiet: Quiet = False,
    columns: Columns = None,
    engine: Annotated[str, typer.Option("--engine", help=(
        "hf (ours) | vllm: live, oneshot and prefix-cache arms in vLLM | llama.cpp: those and the state-restore "
        "arms, on a --model .gguf (docs/engines.md)"))] = "hf",
    cross: Annotated[str | None, typer.Option("--cross", help=(
        "hf: also continue the serving engine's prefixes in ours (the hf-oneshot arm)"))] = None,
    block_size: Annotated[int, typer.Option("--block-size", help=(
        "the serving engine's K/V block size (its prefix cache reuses whole blocks)"))] = 32,
    n_ctx: Annotated[int, typer.Option("--n-ctx", help="llama.cpp: context positions")] = 4096,
    n_batch: Annotated[int, typer.Option("--n-batch", help="llama.cpp: prompt tokens per batch (-b)")] = 512,
    n_ubatch: Annotated[int, typer.Option("--n-ubatch", help="llama.cpp: micro-batch size (-ub)")] = 512,
    flash_attn: Annotated[bool, typer.Option("--flash-attn", help="llama.cpp: flash attention (-fa)")] = False,
    cache: Cache = "dynamic",
    kernels: Kernels = "auto",
    batch: Batch = 1,
) -> None:
    """Live continuation vs a fresh construction of the same token IDs, each with an exact replica."""

    def go() -> None:
        from stagereplay.engine.boundary import boundary_from_options
        from stagereplay.engine.lm import check_construction
        from stagereplay.runs import matched as run

        check_construction(construction)
        rule = boundary_from_options(boundary_marker, boundary_regex, boundary_after)
        dc = _decode(max_new_tokens, max_stage1_tokens, sample, temperature, top_k, seed, top_p)
        run(out, model, data, n, construction, rule, scorer, dc, precision, device, threads, attn_impl,
            workers, executor, shard, quiet, columns, engine, cross, block_size, cache=cache, kernels=kernels,
            engine_options=_engine_options(engine, n_ctx, n_batch, n_ubatch, flash_attn), batch=batch)

    _run(go)


def _engine_options(engine: str, n_ctx: int, n_batch: int, n_ubatch: int, flash_attn: bool) -> dict[str, Any]:
    """llama.cpp's own settings (engine.serving.EngineConfig), given only for it."""
    options = {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "flash_attn": flash_attn}
    return options if engine == "llama.cpp" else {}


RunDir = Annotated[Path, typer.Argument(help="a run directory made by `stagereplay matched` or `paper`")]
Checkpoint = Annotated[str, typer.Option("--checkpoint", help="which model of the run")]
# Inputs that moved since the run was made: each is checked against the run's hashes before anything runs.
MovedModel = Annotated[str | None, typer.Option("--model", help=(
    "where the run's primary model is now, if it moved (checked against the run's hashes)"))]
MovedLater = Annotated[str | None, typer.Option("--later-model", help=(
    "where the run's later model is now, if it moved (checked against the run's hashes)"))]
MovedData = Annotated[str | None, typer.Option("--data", help=(
    "where the run's data file is now, if it moved (checked against the run's dataset hash)"))]


def _where(model: str | None, later_model: str | None, data: str | None = None) -> Any:
    from stagereplay.experiments.relocate import Relocation

    return Relocation(model, later_model, data)


@app.command("precision-2x2")
def precision_2x2(
    run_dir: RunDir,
    constructions: Annotated[str | None, typer.Option(help=(
        "comma list (default: incremental,oneshot; on a vLLM run its arms oneshot,prefix-cache[,hf-oneshot])"))] = None,
    precisions: Annotated[str, typer.Option(help="comma list of bf16, fp16, fp32, fp32-compute")] = "bf16,fp32",
    checkpoint: Checkpoint = "primary",
    workers: Workers = 1,
    executor: Executor = "local",
    model: MovedModel = None,
    later_model: MovedLater = None,
    quiet: Quiet = False,
) -> None:
    """Hold the run's prefixes fixed; cross construction with precision."""

    def go() -> None:
        from stagereplay.runs import precision_2x2 as run

        run(run_dir, tuple(constructions.split(",")) if constructions is not None else (), tuple(precisions.split(",")),
            checkpoint, workers, executor, quiet, _where(model, later_model))

    _run(go)


@app.command()
def bridge(
    run_dir: RunDir,
    rows: Annotated[int, typer.Option("--rows", help="items to compare")] = 12,
    checkpoint: Checkpoint = "primary",
    workers: Workers = 1,
    executor: Executor = "local",
    model: MovedModel = None,
    later_model: MovedLater = None,
    quiet: Quiet = False,
) -> None:
    """Incremental vs live boundary caches, bitwise, layer by layer, K and V, and their suffixes."""

    def go() -> None:
        from stagereplay.runs import bridge as run

        res = run(run_dir, rows, checkpoint, workers, executor, quiet, _where(model, later_model))
        if res["bridge"]["cache_bit_exact"] != res["bridge"]["rows"]:
            raise typer.Exit(1)

    _run(go)


@app.command()
def transplant(
    run_dir: RunDir,
    layers: Annotated[str, typer.Option(help="all | none | A-B,C,...")] = "all",
    kv: Annotated[str, typer.Option(help="k | v | kv")] = "kv",
    positions: Annotated[str | None, typer.Option(help="A:B sequence positions")] = None,
    select: Annotated[str, typer.Option(help="all-divergent | first:K | random:K:SEED")] = "all-divergent",
    sweep: Annotated[str | None, typer.Option(help="layers: also every single layer and band")] = None,
    checkpoint: Checkpoint = "primary",
    workers: Workers = 1,
    executor: Executor = "local",
    model: MovedModel = None,
    later_model: MovedLater = None,
    quiet: Quiet = False,
) -> None:
    """Swap K/V between live and fresh boundary states of divergent items, both directions, and continue."""

    def go() -> None:
        from stagereplay.experiments.transplant import TransplantConfig
        from stagereplay.records.ledger import read_manifest
        from stagereplay.runs import transplant as run

        if sweep not in (None, "layers"):
            raise StageReplayError(f"unknown --sweep {sweep!r}", "use --sweep layers")
        stage = read_manifest(run_dir).get("stages", {}).get(f"matched/{checkpoint}", {}) if (
            run_dir / "manifest.json").exists() else {}
        cfg = TransplantConfig(stage.get("construction", "oneshot"), layers, kv, positions, select, sweep == "layers")
        run(run_dir, cfg, checkpoint, workers, executor, quiet, _where(model, later_model))

    _run(go)


@app.command()
def resample(
    run_dir: RunDir,
    k: Annotated[int, typer.Option("--k", help="draws per boundary state and seed stream")] = 32,
    temperature: Annotated[float, typer.Option("--temperature", help="sampling temperature")] = 0.6,
    top_p: TopP = 0.95,
    top_k: TopK = 0,
    construction: Annotated[str, typer.Option(help="the fresh side: oneshot | incremental | chunked:<n> | "
                                                   "retokenized")] = "oneshot",
    n: Annotated[int | None, typer.Option("--n", help="first N items that reached the boundary")] = None,
    precisions: Annotated[str | None, typer.Option(help="comma list (default: the run's precision)")] = None,
    seed: Seed = 0,
    checkpoint: Checkpoint = "primary",
    workers: Workers = 1,
    executor: Executor = "local",
    model: MovedModel = None,
    later_model: MovedLater = None,
    quiet: Quiet = False,
) -> None:
    """K seeded draws from live and fresh boundary states: coupled (shared seeds) and independent designs."""

    def go() -> None:
        from stagereplay.experiments.resample import ResampleConfig
        from stagereplay.runs import resample as run

        chosen = tuple(p for p in (precisions or "").split(",") if p)
        cfg = ResampleConfig(k, temperature, top_p, top_k, construction, n, chosen, seed)
        run(run_dir, cfg, checkpoint, workers, executor, quiet, _where(model, later_model))

    _run(go)


@app.command()
def audit(
    run_dir: RunDir,
    verify_only: Annotated[bool, typer.Option("--verify-only", help="check the ledger's integrity only")] = False,
    sample: Annotated[int | None, typer.Option("--sample", help=(
        "re-execute a seeded sample of N units per stage (every record is still verified)"))] = None,
    seed: Annotated[int, typer.Option("--seed", help="seed of the --sample")] = 0,
    model: MovedModel = None,
    later_model: MovedLater = None,
    data: MovedData = None,
    workers: Workers = 1,
    executor: Executor = "local",
    quiet: Quiet = False,
) -> None:
    """Re-execute a run from its manifest and ledger. Exit 0: every record reproduced; 1: an integrity finding
    (tampering or a broken run, whatever the machine); 3: integrity holds, but units were not reproduced
    under this machine's other kernels (the first line names the fields that differ)."""

    def go() -> None:
        from stagereplay.experiments.audit import AuditConfig, exit_code
        from stagereplay.report.audit_lines import finding_lines, verdict_line
        from stagereplay.runs import audit as run

        res = run(run_dir, verify_only, workers, executor, quiet, AuditConfig(sample, seed),
                  _where(model, later_model, data))
        for moved in res.get("relocated", []):
            typer.echo(f"note: {moved['input']} found at {moved['here']} ({moved['how']}), recorded at "
                       f"{moved['recorded']}", err=True)
        for note in res.get("notes", []):
            typer.echo(f"note: {note}", err=True)
        for b in res.get("broken_records", []):
            typer.echo(f"  ledger record {b['seq']}: {b['reason']}", err=True)
        for line in finding_lines(res):
            typer.echo(line, err=True)
        if res.get("verify_only"):
            typer.echo("ledger intact, bound and complete" if res["reproduced"] else "ledger damaged" if not
                       res["chain_ok"] else "ledger intact, but its claims or completeness fail")
        else:
            t, c = res["trajectories"], res["comparisons"]
            sampled = res.get("sample")
            of = f" (a sample of {sampled['re_executed']} of {sampled['of']} records, seed {sampled['seed']})" \
                if sampled else ""
            typer.echo(f"trajectories reproduced {t['k']}/{t['n']}, comparisons reproduced {c['k']}/{c['n']}{of}")
            typer.echo(verdict_line(res))
        code = exit_code(res)
        if code:
            raise typer.Exit(code)

    _run(go)


@app.command()
def paper(
    out: Annotated[Path, typer.Option("--out", help="run directory")] = Path("stagereplay-paper"),
    model: Model = None,
    later_model: Annotated[str | None, typer.Option("--later-model", help="second checkpoint")] = None,
    data: Data = None,
    columns: Columns = None,
    n: Annotated[int, typer.Option("--n")] = 200,
    boundary_marker: Marker = None,
    boundary_regex: Regex = None,
    boundary_after: After = None,
    scorer: Scorer = None,
    max_new_tokens: MaxNew = 128,
    max_stage1_tokens: MaxStage1 = None,
    select: Annotated[str, typer.Option("--select", help="transplant selection at the primary checkpoint")] = "first:24",
    rows: Annotated[int, typer.Option("--rows", help="bridge rows")] = 12,
    sweep: Annotated[bool, typer.Option("--sweep/--no-sweep", help="layer sweep at the primary checkpoint")] = False,
    resample: Annotated[int, typer.Option("--resample", help="K sampled draws per state (0: no resample stage)")] = 0,
    resample_items: Annotated[int, typer.Option("--resample-items", help="items the resample stage draws on")] = 50,
    audit_sample: Annotated[int, typer.Option("--audit-sample", help=(
        "units per stage the closing audit re-executes, after verifying every record (0: every unit)"))] = 10,
    device: Device = "cpu",
    threads: Threads = 1,
    attn_impl: AttnImpl = "auto",
    workers: Annotated[int, typer.Option("--workers", help="processes; 0 = one per core on CPU (at most 2)")] = 0,
    executor: Executor = "local",
    quiet: Quiet = False,
    cache: Cache = "dynamic",
    kernels: Kernels = "auto",
    batch: Annotated[int, typer.Option("--batch", help=(
        "items stepping together (as matched's --batch); 0 = auto: 16 for the embedded toy on a CPU, 1 for your "
        "model on a CPU, on a GPU what its memory holds beside the weights (at most 32)"))] = 0,
) -> None:
    """The whole protocol in one command, then the report (defaults: the embedded toy model)."""

    def go() -> None:
        from stagereplay.engine.boundary import boundary_from_options
        from stagereplay.runs import paper as run

        rule = boundary_from_options(boundary_marker, boundary_regex, boundary_after)
        dc = _decode(max_new_tokens, max_stage1_tokens, False, 1.0, 0, 0)
        res = run(out, model, later_model, data, n, rule, scorer, dc, select, rows, sweep, device=device,
                  threads=threads, attn_impl=attn_impl, workers=workers, executor=executor, quiet=quiet,
                  resample=resample, resample_items=resample_items, audit_sample=audit_sample or None, columns=columns,
                  cache=cache, kernels=kernels, batch=batch)
        from stagereplay.experiments.audit import exit_code

        typer.echo(f"report: {out / 'report.html'}")
        if exit_code(res["audit"]):
            raise typer.Exit(exit_code(res["audit"]))

    _run(go)


@app.command()
def plan(
    run_dir: Annotated[Path | None, typer.Argument(help="a run: plan it with its measured lengths")] = None,
    model: Model = None,
    later_model: Annotated[str | None, typer.Option("--later-model", help="second checkpoint")] = None,
    data: Data = None,
    n: Annotated[int, typer.Option("--n")] = 200,
    max_new_tokens: MaxNew = 128,
    max_stage1_tokens: MaxStage1 = None,
    select: Annotated[str, typer.Option("--select", help="transplant selection at the primary checkpoint")] = "first:24",
    rows: Annotated[int, typer.Option("--rows", help="bridge rows")] = 12,
    sweep: Annotated[bool, typer.Option("--sweep/--no-sweep", help="layer sweep at the primary checkpoint")] = False,
    device: Device = "cpu",
    threads: Threads = 1,
    workers: Annotated[int, typer.Option("--workers", help="processes; 0 = one per core on CPU (at most 2)")] = 0,
    stage1_tokens: Annotated[int | None, typer.Option("--stage1-tokens", help=(
        "assumed stage-1 length (default: the stage-1 budget)"))] = None,
    suffix_tokens: Annotated[int | None, typer.Option("--suffix-tokens", help=(
        "assumed suffix length (default: --max-new-tokens)"))] = None,
    prompt_tokens: Annotated[int | None, typer.Option("--prompt-tokens", help=(
        "assumed prompt length (default: the items' as tokenized)"))] = None,
    divergent: Annotated[int | None, typer.Option("--divergent", help=(
        "items whose live and fresh suffixes diverge (default: all)"))] = None,
    audit_sample: Annotated[int | None, typer.Option("--audit-sample", help=(
        "units per stage the audit re-executes (0: every unit; default: paper's, or what RUN's audit did)"))] = None,
    no_dedup: Annotated[bool, typer.Option("--no-dedup", help="count the 2x2 and the transplants decoding the matched arms again")] = False,
    resample: Annotated[int, typer.Option("--resample", help="K sampled draws per state (0: no resample stage)")] = 0,
    resample_items: Annotated[int, typer.Option("--resample-items", help="items the resample stage draws on")] = 50,
    tokens_per_second: Annotated[float | None, typer.Option("--tokens-per-second", help=(
        "decode steps per second (any forward costs one)"))] = None,
    prefill_tokens_per_second: Annotated[float | None, typer.Option("--prefill-tokens-per-second", help=(
        "prefill tokens per second, on top of the forward's step"))] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help=(
        "measure the rates on the real model (on a CPU, in as many processes at once as --workers)"))] = False,
    row_ms: Annotated[float | None, typer.Option("--row-ms", help=(
        "with --batch: what each row beyond the first adds to a batched step, in ms (--calibrate measures it)"))] = None,
    cache: Cache = "dynamic",
    kernels: Kernels = "auto",
    batch: Batch = 1,
) -> None:
    """What `paper` (or the run RUN) costs: forwards, caches, weights and time per stage; runs nothing."""

    def go() -> None:
        import os

        from stagereplay.experiments.plan import plan as make_plan
        from stagereplay.experiments.rates import Rates
        from stagereplay.experiments.stage_plan import PlanConfig
        from stagereplay.experiments.transplant import parse_selection

        parse_selection(select)
        for name, rate in (("--tokens-per-second", tokens_per_second),
                           ("--prefill-tokens-per-second", prefill_tokens_per_second)):
            if rate is not None and not 0 < rate < float("inf"):
                raise StageReplayError(f"{name} must be positive, got {rate}", f"pass e.g. {name} 40")
        from stagereplay.experiments.paper import AUDIT_SAMPLE

        w = workers or (min(2, os.cpu_count() or 1) if device == "cpu" else 1)
        sample = AUDIT_SAMPLE if audit_sample is None and run_dir is None else audit_sample
        cfg = PlanConfig(n=n, suffix_tokens=suffix_tokens or max_new_tokens, stage1_tokens=stage1_tokens,
                         prompt_tokens=prompt_tokens, divergent=divergent, bridge_rows=rows, select=select,
                         sweep=sweep, later=later_model is not None or model is None, audit_sample=sample,
                         dedup=not no_dedup, workers=w, resample=resample, resample_items=resample_items,
                         cache=cache, max_new_tokens=max_new_tokens, batch=batch)
        if row_ms is not None and not 0 <= row_ms < float("inf"):
            raise StageReplayError(f"--row-ms must be 0 or more, got {row_ms}", "pass e.g. --row-ms 2")
        rates = None
        if tokens_per_second is not None:
            rates = Rates({"": tokens_per_second},
                          {"": prefill_tokens_per_second} if prefill_tokens_per_second else {},
                          f"{tokens_per_second:g} steps/s"
                          + (f", {prefill_tokens_per_second:g} prefill tokens/s" if prefill_tokens_per_second else "")
                          + (f", {row_ms:g} ms per extra row" if batch > 1 and row_ms is not None else ""),
                          {"": row_ms / 1e3} if row_ms is not None else {})
        elif batch > 1 and row_ms is not None and not calibrate:
            raise StageReplayError("--row-ms prices a batched step on top of --tokens-per-second",
                                   "pass --tokens-per-second too, or --calibrate")
        typer.echo(make_plan(cfg, model, data, run_dir, max_stage1_tokens, rates,
                             {"device": device, "threads": threads} if calibrate else None, kernels))

    _run(go)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Rewrite report.md and report.html from results.json."""

    def go() -> None:
        from stagereplay.report.render import write_report

        if not (run_dir / "results.json").exists():
            raise StageReplayError(f"no results.json in {run_dir}", "run an experiment into it first")
        md, html = write_report(run_dir)
        typer.echo(f"wrote {md} and {html}")

    _run(go)


@app.command()
def show(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    item_id: Annotated[str, typer.Argument(help="the item's id, as in the report's explorer")],
    checkpoint: Annotated[str | None, typer.Option("--checkpoint", help="only this model of the run")] = None,
) -> None:
    """One item's story: prompt, stage 1, both suffixes with the divergence marked, margins, cache per layer."""

    def go() -> None:
        from stagereplay.report.explorer import show_item

        show_item(run_dir, item_id, checkpoint)

    _run(go)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    format: Annotated[str, typer.Option("--format", help="parquet | csv")] = "parquet",
    output: Annotated[Path | None, typer.Option("--output", help="file to write")] = None,
) -> None:
    """One row per item and arm, token IDs included."""

    def go() -> None:
        from stagereplay.report.export import export_ledger

        if format not in ("parquet", "csv"):
            raise StageReplayError(f"unknown export format {format!r}", "use --format parquet or csv")
        if not (run_dir / "ledger.jsonl").exists():
            raise StageReplayError(f"no ledger.jsonl in {run_dir}", "point at a run directory")
        if output is not None and output.is_dir():
            raise StageReplayError(f"--output {output} is a directory", "pass the path of the file to write")
        typer.echo(f"wrote {export_ledger(run_dir, format, output)}")  # type: ignore[arg-type]  # checked above

    _run(go)


@app.command()
def merge(
    shards: Annotated[list[Path], typer.Argument(help="the shard run directories")],
    out: Annotated[Path, typer.Option("--out", help="the merged run directory (new)")],
) -> None:
    """Join runs made with --shard I/N into the run one process would have made; refuses mismatched shards."""

    def go() -> None:
        from stagereplay.records.ledger import read_manifest
        from stagereplay.records.shards import environment_notes
        from stagereplay.runs import merge

        typer.echo(f"merged {len(shards)} shards into {merge(shards, out)}")
        for note in environment_notes(read_manifest(out)):
            typer.echo(f"note: {note}", err=True)

    _run(go)


@toy_app.command("train")
def toy_train(
    out: Annotated[Path, typer.Option("--out", help="folder for the primary and later checkpoints")],
    steps: Annotated[int | None, typer.Option("--steps", help="training steps (default: the shipped run's)")] = None,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    threads: Annotated[int | None, typer.Option("--threads")] = None,
) -> None:
    """Train the embedded toy model from scratch (deterministic for a seed and thread count)."""

    def go() -> None:
        from dataclasses import replace

        from stagereplay.toy.train import TrainConfig, train

        for name, value in (("--steps", steps), ("--threads", threads)):
            if value is not None and value < 1:
                raise StageReplayError(f"{name} must be at least 1, got {value}", f"pass a positive {name}")
        changes = {k: v for k, v in {"steps": steps, "seed": seed, "threads": threads}.items() if v is not None}
        train(replace(TrainConfig(out=out), **changes))  # type: ignore[arg-type]  # only int fields are replaced

    _run(go)


@toy_app.command("items")
def toy_items_command(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write (refused if it exists)")],
    n: Annotated[int, typer.Option("--n", help="held-out items")] = 200,
) -> None:
    """Write the toy's held-out items as `messages` JSONL: `--data` of this file runs exactly the default items."""

    def go() -> None:
        from stagereplay.records.ledger import atomic_write
        from stagereplay.tasks.toy import HELDOUT_SEED, toy_jsonl

        if n < 1:
            raise StageReplayError(f"--n must be at least 1, got {n}", "pass a positive --n")
        if out.exists():
            raise StageReplayError(f"{out} already exists", "pass a new --out path")
        atomic_write(out, toy_jsonl(n, HELDOUT_SEED))
        typer.echo(f"wrote {n} toy items to {out}")

    _run(go)


def main() -> None:
    app(prog_name="stagereplay")


if __name__ == "__main__":
    main()
