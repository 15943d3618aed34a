"""The protocol's stages as commands: `matched` starts a run, the others extend it, `paper` runs them all."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stagereplay.cli.app import app, guarded
from stagereplay.cli.options import (
    After,
    Api,
    ApiKeyEnv,
    AttnImpl,
    Batch,
    BlockSize,
    BridgeRows,
    Cache,
    Checkpoint,
    Columns,
    Concurrency,
    Data,
    Device,
    Executor,
    FlashAttn,
    Items,
    Kernels,
    KvCacheDtype,
    LaterModel,
    Marker,
    MaxNew,
    MaxNumBatchedTokens,
    MaxStage1,
    Model,
    MovedLater,
    MovedModel,
    N,
    NBatch,
    NCtx,
    NUbatch,
    Out,
    Precision,
    Processes,
    Quiet,
    Regex,
    Repack,
    Resample,
    ResampleItems,
    Retries,
    RunDir,
    Sample,
    Scorer,
    Seed,
    Select,
    ServerArgs,
    SlotRestore,
    SpeculativeConfig,
    Sweep,
    Temperature,
    Threads,
    Timeout,
    TopK,
    TopP,
    Url,
    Workers,
    decode_config,
    given,
    relocation,
)
from stagereplay.errors import StageReplayError


@app.command()
def matched(
    out: Out,
    model: Model = None,
    data: Data = None,
    n: N = None,
    construction: Annotated[str, typer.Option(help=(
        "oneshot | incremental | chunked:<n> | retokenized | roundtrip:fp8-e4m3|fp8-e5m2|int8 (live's K/V through that "
        "format and back), or several, comma-separated: each is set against live"))] = "oneshot",
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
        "arms, on a --model .gguf | http: those arms on a running server (--url; docs/engines.md)"))] = "hf",
    cross: Annotated[str | None, typer.Option("--cross", help=(
        "hf: also continue the serving engine's prefixes in ours (the hf-oneshot arm)"))] = None,
    block_size: BlockSize = None,
    n_ctx: NCtx = None,
    n_batch: NBatch = None,
    n_ubatch: NUbatch = None,
    flash_attn: FlashAttn = False,
    repack: Repack = False,
    url: Url = None,
    api: Api = None,
    api_key_env: ApiKeyEnv = None,
    slot_restore: SlotRestore = False,
    concurrency: Concurrency = None,
    timeout: Timeout = None,
    retries: Retries = None,
    server_args: ServerArgs = None,
    kv_cache_dtype: KvCacheDtype = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    speculative_config: SpeculativeConfig = None,
    static_len: Annotated[int | None, typer.Option("--static-len", help=(
        "with --cache static: positions each cache is allocated, where more than an item needs (the padded keys "
        "change the attention's blocking: a setting to compare). On CUDA the default is the longest item's, one "
        "length for all, so one proof covers the run's graphs"))] = None,
    speculate: Annotated[str | None, typer.Option("--speculate", help=(
        "live built by transformers' assisted generation: prompt-lookup:N | draft:PATH | self (the model as its own "
        "draft); the tokens each step added are recorded"))] = None,
    quantized_cache: Annotated[str | None, typer.Option("--quantized-cache", help=(
        "live built with transformers' quantized K/V cache: quanto:2|4 | hqq:1|2|3|4|8 | fp8"))] = None,
    cache: Cache = "dynamic",
    kernels: Kernels = "auto",
    batch: Batch = 1,
) -> None:
    """Live continuation vs a fresh construction of the same token IDs, each with an exact replica."""

    def go() -> None:
        from stagereplay.engine.boundary import boundary_from_options
        from stagereplay.experiments.matched import constructions
        from stagereplay.runs import ExecConfig, Inputs, serving_arms
        from stagereplay.runs import matched as run

        constructions(construction)
        serving = serving_arms(engine, cross, given(
            block_size=block_size, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, flash_attn=flash_attn,
            repack=repack, url=url, api=api, api_key_env=api_key_env, slot_restore=slot_restore,
            concurrency=concurrency, timeout=timeout, retries=retries, server_args=server_args,
            kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=max_num_batched_tokens,
            speculative_config=speculative_config))
        inputs = Inputs(model=model, data=data, n=n, columns=columns,
                        boundary=boundary_from_options(boundary_marker, boundary_regex, boundary_after), scorer=scorer,
                        decode=decode_config(max_new_tokens, max_stage1_tokens, sample, temperature, top_k, seed, top_p),
                        precision=precision, device=device, threads=threads, attn_impl=attn_impl, cache=cache,
                        static_len=static_len, batch=batch, kernels=kernels)
        from stagereplay.engine.generated import Generated

        generated = Generated(speculate or "", quantized_cache or "")
        run(out, inputs, construction, ExecConfig(workers, executor), shard, serving, quiet, generated)

    guarded(go)


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
        from stagereplay.runs import ExecConfig, Extension
        from stagereplay.runs import precision_2x2 as run

        on = Extension(checkpoint, ExecConfig(workers, executor), relocation(model, later_model))
        run(run_dir, tuple(constructions.split(",")) if constructions is not None else (), tuple(precisions.split(",")),
            on, quiet)

    guarded(go)


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
        from stagereplay.runs import ExecConfig, Extension
        from stagereplay.runs import bridge as run

        res = run(run_dir, rows, Extension(checkpoint, ExecConfig(workers, executor), relocation(model, later_model)),
                  quiet)
        if res["bridge"]["cache_bit_exact"] != res["bridge"]["rows"]:
            raise typer.Exit(1)

    guarded(go)


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
        from stagereplay.records.ledger import read_manifest
        from stagereplay.runs import ExecConfig, Extension, TransplantConfig
        from stagereplay.runs import transplant as run

        if sweep not in (None, "layers"):
            raise StageReplayError(f"unknown --sweep {sweep!r}", "use --sweep layers")
        stage = read_manifest(run_dir).get("stages", {}).get(f"matched/{checkpoint}", {}) if (
            run_dir / "manifest.json").exists() else {}
        cfg = TransplantConfig(stage.get("construction", "oneshot"), layers, kv, positions, select, sweep == "layers")
        run(run_dir, cfg, Extension(checkpoint, ExecConfig(workers, executor), relocation(model, later_model)), quiet)

    guarded(go)


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
        from stagereplay.runs import ExecConfig, Extension, ResampleConfig
        from stagereplay.runs import resample as run

        chosen = tuple(p for p in (precisions or "").split(",") if p)
        cfg = ResampleConfig(k, temperature, top_p, top_k, construction, n, chosen, seed)
        run(run_dir, cfg, Extension(checkpoint, ExecConfig(workers, executor), relocation(model, later_model)), quiet)

    guarded(go)



@app.command()
def paper(
    out: Annotated[Path, typer.Option("--out", help="run directory")] = Path("stagereplay-paper"),
    model: Model = None,
    later_model: LaterModel = None,
    data: Data = None,
    columns: Columns = None,
    n: Items = 200,
    boundary_marker: Marker = None,
    boundary_regex: Regex = None,
    boundary_after: After = None,
    scorer: Scorer = None,
    max_new_tokens: MaxNew = 128,
    max_stage1_tokens: MaxStage1 = None,
    select: Select = "first:24",
    rows: BridgeRows = 12,
    sweep: Sweep = False,
    resample: Resample = 0,
    resample_items: ResampleItems = 50,
    audit_sample: Annotated[int, typer.Option("--audit-sample", help=(
        "units per stage the closing audit re-executes, after verifying every record (0: every unit)"))] = 10,
    device: Device = "cpu",
    threads: Threads = 1,
    attn_impl: AttnImpl = "auto",
    workers: Processes = 0,
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
        from stagereplay.runs import Inputs, PaperConfig
        from stagereplay.runs import paper as run

        rule = boundary_from_options(boundary_marker, boundary_regex, boundary_after)
        dc = decode_config(max_new_tokens, max_stage1_tokens, False, 1.0, 0, 0)
        inputs = Inputs(model=model, data=data, n=n, columns=columns, boundary=rule, scorer=scorer, decode=dc,
                        precision="bf16", device=device, threads=threads, attn_impl=attn_impl, cache=cache, batch=batch,
                        kernels=kernels)
        protocol = PaperConfig(later_model, select, rows, sweep, resample, resample_items, audit_sample or None)
        res = run(out, inputs, protocol, workers, executor, quiet)
        from stagereplay.audit.reexecute import exit_code

        typer.echo(f"report: {out / 'report.html'}")
        if exit_code(res["audit"]):
            raise typer.Exit(exit_code(res["audit"]))

    guarded(go)


