"""`paper`: the whole protocol in one run directory, as the reference paper runs it: its steps
(`experiments.protocol.paper.paper_steps`: matched (bf16) -> bridge -> transplant -> fixed-prefix 2x2 -> matched and an
outcome-blind transplant at a later checkpoint), then the audit and the report.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from stagereplay.audit.reexecute import AuditConfig, audit_run
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import check_model_dir
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.core.prepared import OURS, PreparedRun
from stagereplay.experiments.protocol.paper import AUDIT_SAMPLE, PRECISION, PaperConfig, Step, paper_steps
from stagereplay.records.audit_summary import audit_json
from stagereplay.records.ledger import Run, atomic_write, open_run
from stagereplay.report.results import AUDIT_FILE, Results
from stagereplay.runs.inputs import Inputs
from stagereplay.runs.make import finish, new_manifest
from stagereplay.runs.prepare import prepare

__all__ = ["AUDIT_SAMPLE", "MAX_GPU_BATCH", "TOY_BATCH", "PaperConfig", "auto_workers", "gpu_batch", "paper"]


TOY_BATCH = 16
"""`paper`'s batch on the embedded toy on a CPU: its steps are mostly per-forward overhead, which 16 rows share."""
MAX_GPU_BATCH = 32


def gpu_batch(model: str | None, device: str, decode: DecodeConfig, protocol: PaperConfig | None = None) -> int:
    """The most items whose caches fit beside the weights on `device`, at most `MAX_GPU_BATCH`: per item, the most
    caches any step of `paper` holds (`Experiment.peak_caches`) in fp32 (the widest precision it runs) at the longest
    sequence the budgets allow, within 90% of the memory free before the fp32 weights load."""
    import torch

    from stagereplay.engine.limits import STAGE1_BUDGET
    from stagereplay.plan.stages import model_shape

    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    shape = model_shape(model)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    positions = min(shape.context, (decode.max_stage1_tokens or STAGE1_BUDGET) + decode.max_new_tokens + 1024)
    per_item = max(s.experiment.peak_caches(s.experiment.planned_stage(s.options))
                   for s in paper_steps(protocol or PaperConfig(), later=False)) * shape.cache_bytes(positions, "fp32")
    room = 0.9 * free - shape.weight_bytes("fp32")
    return max(1, min(MAX_GPU_BATCH, int(room // per_item)))


def auto_workers(device: str) -> int:
    """`--workers 0`: one single-threaded process per core on a CPU (at most 2), one process on a GPU."""
    return min(2, os.cpu_count() or 1) if device == "cpu" else 1


def paper(out: str | Path, inputs: Inputs | None = None, protocol: PaperConfig | None = None,
          workers: int = 0, executor: str = "local", quiet: bool = False) -> Results:
    """The whole protocol (`experiments.protocol.paper.paper_steps`): matched (bf16), bridge, transplant, 2x2, outcome-blind
    replication at a later checkpoint, audit, report. With `protocol.resample` = K > 0, also K sampled draws per
    boundary state on the first `resample_items` items, at bf16 and fp32 (the primary checkpoint). The audit verifies
    every record and re-executes a seeded sample of `audit_sample` units per stage (None: every unit). The CPU kernels
    (`inputs.numerics.kernels`, `execution.kernels`; by default portable ones for the embedded toy) are chosen before
    torch loads. `inputs.numerics.batch`: up to this many items step together (engine.batched_step), at every stage
    and in the audit; 0 (auto): `TOY_BATCH` for the embedded toy on a CPU, 1 for a model of the user's on a CPU, on a
    GPU what its free memory holds (`gpu_batch`). `workers` 0: one single-threaded process per core on a CPU (at most
    2), one process on a GPU. `inputs.input.n` None: 200 items."""
    inputs, protocol = inputs or Inputs(), protocol or PaperConfig()
    model, device, decode = inputs.input.model, inputs.numerics.device, inputs.decode
    audit = AuditConfig(protocol.audit_sample, seed=0)
    ex = ExecConfig(workers or auto_workers(device), executor)
    batch = inputs.numerics.batch
    if batch == 0:
        batch = TOY_BATCH if model is None and device == "cpu" else 1
        if device.startswith("cuda"):
            from stagereplay.execution.kernels import choose, pin

            pin(choose(inputs.numerics.kernels, toy=model is None, device=device))  # before torch loads
            batch = gpu_batch(model, device, decode, protocol)
    inputs = replace(inputs, input=replace(inputs.input, n=200 if inputs.input.n is None else inputs.input.n),
                     numerics=replace(inputs.numerics, precision=PRECISION, batch=batch))
    later_model = protocol.later_checkpoint(model)
    if later_model is not None:
        check_model_dir(str(Path(later_model).resolve()))
    steps = paper_steps(protocol, later=later_model is not None)
    first = steps[0]
    prepared = prepare("paper", inputs, first.experiment, first.options, OURS, ex, quiet)
    # The later checkpoint runs as the primary does, on the same static length where one is shared.
    later = replace(prepared.model, path=str(Path(later_model).resolve())) if later_model else None
    at = {"primary": prepared, **({"later": prepared.at("later", later)} if later else {})}
    manifest = new_manifest(prepared, protocol.identity(later.path if later else None),
                            {"later": later.path} if later else None)
    with open_run(Path(out), manifest) as run:
        for step in steps:
            step.experiment.run(run, at[step.checkpoint], step.options)
            if step is first:
                check_outcome(run, step, prepared)
        summary = audit_run(run.path, run.manifest, run.records, ex, quiet, stored_results=False, config=audit)
        atomic_write(run.path / AUDIT_FILE, audit_json(summary))
        return finish(run, quiet)


def check_outcome(run: Run, step: Step, prepared: PreparedRun) -> None:
    """The stage that starts the run, checked as its own command checks it (`Experiment.check_outcome`) as soon as
    it is made: a boundary rule no item reaches fails here, its records kept, not after the whole protocol."""
    e, checkpoint = step.experiment, step.checkpoint
    sections = e.summarize(run.find(e.name, checkpoint), run.manifest.stages[f"{e.name}/{checkpoint}"], checkpoint)
    e.check_outcome(sections if e.shape.many else sections[0], prepared)
