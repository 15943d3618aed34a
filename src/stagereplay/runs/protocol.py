"""`paper`: the whole protocol in one run directory, as the reference paper runs it.

matched (bf16) -> bridge -> transplant -> fixed-prefix 2x2 -> matched and an outcome-blind transplant at a
later checkpoint -> audit -> report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from stagereplay.audit.reexecute import AuditConfig, audit_run
from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import check_model_dir
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.experiments.bridge import Bridge, BridgeOptions
from stagereplay.experiments.matched import Matched, MatchedOptions
from stagereplay.experiments.precision_2x2 import GridOptions, PrecisionGrid
from stagereplay.experiments.prepared import OURS
from stagereplay.experiments.resample import Resample, ResampleConfig
from stagereplay.experiments.transplant import Transplant, TransplantConfig
from stagereplay.records.findings import audit_json
from stagereplay.records.ledger import atomic_write, open_run
from stagereplay.report.results import AUDIT_FILE
from stagereplay.runs.inputs import Inputs
from stagereplay.runs.make import finish, new_manifest
from stagereplay.runs.prepare import prepare

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
    caches any stage holds (`Experiment.peak_caches`) in fp32 (the 2x2's fp32 stage is the largest) at the longest
    sequence the budgets allow, within 90% of the memory free before the fp32 weights load."""
    import torch

    from stagereplay.engine.limits import STAGE1_BUDGET
    from stagereplay.experiments.registry import all_experiments
    from stagereplay.plan.stages import model_shape, planned_stage

    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint("primary"))
    shape = model_shape(model)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    positions = min(shape.context, (decode.max_stage1_tokens or STAGE1_BUDGET) + decode.max_new_tokens + 1024)
    grid = {"constructions": ["incremental", "oneshot"], "construction": "oneshot"}  # the 2x2 `paper` runs
    per_item = max(e.peak_caches(planned_stage(e.name, **grid)) for e in all_experiments()) \
        * shape.cache_bytes(positions, "fp32")
    room = 0.9 * free - shape.weight_bytes("fp32")
    return max(1, min(MAX_GPU_BATCH, int(room // per_item)))


@dataclass(frozen=True)
class PaperConfig:
    """What `paper` runs besides matched: the later checkpoint, the transplant selection, the bridge rows, the layer
    sweep, resample, and the closing audit's sample."""

    panel: ClassVar[str] = "Protocol"

    later_model: str | None = field(default=None, metadata={
        "help": "the second checkpoint (default: the embedded toy's later one when the model is the toy, else none)"})
    select_primary: str = field(default="first:24", metadata={
        "flag": "--select", "help": "transplant selection at the primary checkpoint"})
    bridge_rows: int = field(default=12, metadata={"flag": "--rows", "help": "bridge rows"})
    sweep: bool = field(default=False, metadata={"flag": "--sweep/--no-sweep",
                                                 "help": "layer sweep at the primary checkpoint"})
    resample: int = field(default=0, metadata={"help": "K sampled draws per state (0: no resample stage)"})
    resample_items: int = field(default=50, metadata={"help": "items the resample stage draws on"})
    audit_sample: int | None = field(default=AUDIT_SAMPLE, metadata={
        "help": "units per stage the closing audit re-executes, after verifying every record (0 or None: every unit)"})

    def __post_init__(self) -> None:
        if self.audit_sample == 0:  # the command line's "every unit"
            object.__setattr__(self, "audit_sample", None)
        if self.bridge_rows < 1:
            raise StageReplayError(f"--rows must be at least 1, got {self.bridge_rows}", "pass a positive --rows")
        TransplantConfig(select=self.select_primary)  # a bad selection rule fails here, before any run directory


def paper(out: str | Path, inputs: Inputs | None = None, protocol: PaperConfig | None = None,
          workers: int = 0, executor: str = "local", quiet: bool = False) -> dict[str, Any]:
    """The whole protocol: matched (bf16), 2x2, bridge, transplant, outcome-blind replication at a later
    checkpoint, audit, report. With `protocol.resample` = K > 0, also K sampled draws per boundary state on the first
    `resample_items` items, at bf16 and fp32 (the primary checkpoint). The audit verifies every record and
    re-executes a seeded sample of `audit_sample` units per stage (None: every unit). The CPU kernels
    (`inputs.numerics.kernels`, `execution.kernels`; by default portable ones for the embedded toy) are chosen before
    torch loads. `inputs.numerics.batch`: up to this many items step together (engine.batched_step), at every stage
    and in the audit; 0 (auto): `TOY_BATCH` for the embedded toy on a CPU, 1 for a model of the user's on a CPU, on a
    GPU what its free memory holds (`gpu_batch`). `workers` 0: one single-threaded process per core on a CPU (at most
    2), one process on a GPU. `inputs.input.n` None: 200 items."""
    inputs, protocol = inputs or Inputs(), protocol or PaperConfig()
    model, device, decode = inputs.input.model, inputs.numerics.device, inputs.decode
    audit = AuditConfig(protocol.audit_sample, seed=0)
    if workers == 0:  # auto: one single-threaded process per core on a CPU (capped), one process per GPU run
        workers = min(2, os.cpu_count() or 1) if device == "cpu" else 1
    ex = ExecConfig(workers, executor)
    batch = inputs.numerics.batch
    if batch == 0:
        batch = TOY_BATCH if model is None and device == "cpu" else 1
        if device.startswith("cuda"):
            from stagereplay.execution.kernels import choose, pin

            pin(choose(inputs.numerics.kernels, toy=model is None, device=device))  # before torch loads
            batch = gpu_batch(model, device, decode)
    inputs = replace(inputs, input=replace(inputs.input, n=200 if inputs.input.n is None else inputs.input.n),
                     numerics=replace(inputs.numerics, precision="bf16", batch=batch))
    later_model = protocol.later_model
    if later_model is None and model is None:
        from stagereplay.toy import toy_checkpoint

        later_model = str(toy_checkpoint("later"))
    if later_model is not None:
        check_model_dir(str(Path(later_model).resolve()))
    matched = Matched()
    prepared = prepare("paper", inputs, matched, MatchedOptions(), OURS, ex, quiet)
    # The later checkpoint runs as the primary does, on the same static length where one is shared.
    later = replace(prepared.model, path=str(Path(later_model).resolve())) if later_model else None
    identity = {"later_model": later.path if later else None, "select_primary": protocol.select_primary,
                "bridge_rows": protocol.bridge_rows, "sweep": protocol.sweep, "resample": protocol.resample,
                "resample_items": protocol.resample_items}
    manifest = new_manifest(prepared, identity, {"later": later.path} if later else None)
    with open_run(Path(out), manifest) as run:
        matched.run(run, prepared, MatchedOptions())
        matched.check_outcome({Matched.name: matched.summarize(run.find(Matched.name, "primary"),
                                                                run.manifest.stages[f"{Matched.name}/primary"],
                                                                "primary")}, prepared)
        # Everything on the primary bf16 model first, so worker processes are started once for it.
        Bridge().run(run, prepared, BridgeOptions(protocol.bridge_rows))
        Transplant().run(run, prepared, TransplantConfig(select=protocol.select_primary, sweep=protocol.sweep))
        PrecisionGrid().run(run, prepared, GridOptions(("incremental", "oneshot"), ("bf16", "fp32")))
        if protocol.resample:
            Resample().run(run, prepared, ResampleConfig(k=protocol.resample, n=protocol.resample_items,
                                                         precisions=("bf16", "fp32")))
        if later is not None:
            at_later = prepared.at("later", later)
            matched.run(run, at_later, MatchedOptions())
            Transplant().run(run, at_later, TransplantConfig(select="all-divergent"))
        summary = audit_run(run.path, run.manifest, run.records, ex, quiet, stored_results=False, config=audit)
        atomic_write(run.path / AUDIT_FILE, audit_json(summary))
        return finish(run, quiet)
