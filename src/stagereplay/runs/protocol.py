"""`paper`: the whole protocol in one run directory, as the reference paper runs it.

matched (bf16) -> bridge -> transplant -> fixed-prefix 2x2 -> matched and an outcome-blind transplant at a
later checkpoint -> audit -> report.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stagereplay.audit.reexecute import AuditConfig, audit_run
from stagereplay.engine.boundary import BoundaryRule
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import ModelConfig, check_model_dir
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.kernels import choose, pin
from stagereplay.experiments.bridge import run_bridge
from stagereplay.experiments.matched import MatchedConfig, run_matched
from stagereplay.experiments.precision_2x2 import run_2x2
from stagereplay.experiments.resample import ResampleConfig, run_resample
from stagereplay.experiments.transplant import TransplantConfig, run_transplant
from stagereplay.records.ledger import atomic_write, open_run
from stagereplay.report.results import AUDIT_FILE
from stagereplay.report.summaries import summarize_matched
from stagereplay.runs.make import (
    finish,
    new_manifest,
    prepare,
    print_header,
    require_boundary,
    resolve_source,
)

AUDIT_SAMPLE = 10
"""Units per stage the audit of `paper` re-executes by default: with every record verified without a model,
a seeded sample keeps the audit a fraction of the run (`stagereplay audit RUN` re-executes all of it). Ten
keep `paper` on the embedded toy within about ten minutes on two cores (docs/reference/performance.md); at
scale pick it for the detection wanted, 1 - (1 - f)^N for a fraction f of units that do not reproduce
(docs/how-to/plan.md)."""


TOY_BATCH = 16
"""`paper`'s batch on the embedded toy on a CPU: its steps are mostly per-forward overhead, which 16 rows share."""
MAX_GPU_BATCH = 32


def gpu_batch(model: str | None, device: str, decode: DecodeConfig) -> int:
    """The most items whose caches fit beside the weights on `device`, at most `MAX_GPU_BATCH`: per item, the most
    caches any stage holds (`stage_plan.PEAK_CACHES`) in fp32 (the 2x2's fp32 stage is the largest) at the longest
    sequence the budgets allow, within 90% of the memory free before the fp32 weights load."""
    import torch

    from stagereplay.engine.limits import STAGE1_BUDGET
    from stagereplay.plan.stages import PEAK_CACHES, model_shape

    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    shape = model_shape(model)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    positions = min(shape.context, (decode.max_stage1_tokens or STAGE1_BUDGET) + decode.max_new_tokens + 1024)
    per_item = max(PEAK_CACHES.values()) * shape.cache_bytes(positions, "fp32")
    room = 0.9 * free - shape.weight_bytes("fp32")
    return max(1, min(MAX_GPU_BATCH, int(room // per_item)))


def paper(
    out: str | Path,
    model: str | None = None,
    later_model: str | None = None,
    data: str | None = None,
    n: int | None = 200,
    boundary: BoundaryRule | None = None,
    scorer: str | None = None,
    decode: DecodeConfig | None = None,
    select_primary: str = "first:24",
    bridge_rows: int = 12,
    sweep: bool = False,
    resample: int = 0,
    resample_items: int = 50,
    audit_sample: int | None = AUDIT_SAMPLE,
    columns: str | None = None,
    device: str = "cpu",
    threads: int = 1,
    attn_impl: str = "auto",
    workers: int = 0,
    executor: str = "local",
    quiet: bool = False,
    cache: str = "dynamic",
    kernels: str = "auto",
    batch: int = 0,
) -> dict[str, Any]:
    """The whole protocol: matched (bf16), 2x2, bridge, transplant, outcome-blind replication at a later
    checkpoint, audit, report. With `resample` = K > 0, also K sampled draws per boundary state on the first
    `resample_items` items, at bf16 and fp32 (the primary checkpoint). The audit verifies every record and
    re-executes a seeded sample of `audit_sample` units per stage (None: every unit). `kernels`: the CPU kernels
    (`execution.kernels`; by default portable ones for the embedded toy), chosen here, before torch loads.
    `batch`: up to this many items step together (engine.batch), at every stage and in the audit; 0 (auto):
    `TOY_BATCH` for the embedded toy on a CPU, 1 for a model of the user's on a CPU, on a GPU what its free memory
    holds (`gpu_batch`)."""
    pin(choose(kernels, toy=model is None, device=device))
    if bridge_rows < 1:
        raise StageReplayError(f"--rows must be at least 1, got {bridge_rows}", "pass a positive --rows")
    TransplantConfig(select=select_primary)  # a bad selection rule fails here, before any run directory exists
    audit = AuditConfig(audit_sample, seed=0)
    if workers == 0:  # auto: one single-threaded process per core on a CPU (capped), one process per GPU run
        workers = min(2, os.cpu_count() or 1) if device == "cpu" else 1
    ex = ExecConfig(workers, executor)
    if batch == 0:
        batch = TOY_BATCH if model is None and device == "cpu" else 1
        if device.startswith("cuda"):
            batch = gpu_batch(model, device, decode or DecodeConfig())
    source = resolve_source(model, data, n, boundary, scorer, decode or DecodeConfig(), "bf16", device, threads,
                            attn_impl, columns=columns, cache=cache, batch=batch)
    if later_model is None and model is None:
        from stagereplay.toy import toy_checkpoint

        later_model = str(toy_checkpoint("later"))
    later = ModelConfig(**{**asdict(source.model), "path": str(Path(later_model).resolve())}) if later_model else None
    if later is not None:
        check_model_dir(later.path)
    source, lm, items, data_hash, determinism = prepare(source, ex, quiet)
    print_header(source, quiet)
    extra = {"later": later.path} if later else {}
    manifest = new_manifest("paper", {"later_model": later.path if later else None, "select_primary": select_primary,
                                      "bridge_rows": bridge_rows, "sweep": sweep, "resample": resample,
                                      "resample_items": resample_items},
                            source, items, data_hash, determinism, extra)
    with open_run(Path(out), manifest) as run:
        settings = source.settings
        run_matched(run, MatchedConfig(source.model, settings, source.data), items, ex, lm, quiet)
        del lm  # held here, it would stay loaded beside the next model (execution.local keeps one at a time)
        require_boundary(summarize_matched(run.find("matched", "primary"), "oneshot", "primary", "bf16"), settings)
        # Everything on the primary bf16 model first, so worker processes are started once for it.
        run_bridge(run, source.model, settings, "primary", bridge_rows, ex, quiet)
        run_transplant(run, source.model, settings, "primary", TransplantConfig(select=select_primary, sweep=sweep),
                       ex, quiet)
        run_2x2(run, source.model, settings, "primary", ("incremental", "oneshot"), ("bf16", "fp32"), ex, quiet)
        if resample:
            cfg = ResampleConfig(k=resample, n=resample_items, precisions=("bf16", "fp32"))
            run_resample(run, source.model, settings, "primary", cfg, ex, quiet)
        if later is not None:
            run_matched(run, MatchedConfig(later, settings, source.data, checkpoint="later"), items, ex, None, quiet)
            run_transplant(run, later, settings, "later", TransplantConfig(select="all-divergent"), ex, quiet)
        summary = audit_run(run.path, run.manifest, run.records, ex, quiet, stored_results=False, config=audit)
        atomic_write(run.path / AUDIT_FILE, json.dumps(summary, indent=2) + "\n")
        return finish(run, quiet)
