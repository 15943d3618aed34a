"""Library entry points that extend a run directory made by `matched` (or `paper`): the 2x2, the bridge, the
transplants, resample, the audit, and the merge of shards. Each finds the run's matched stage (and its model
where it is now), refuses what the run cannot give (a serving engine's run has no boundary caches of ours),
then runs into the same ledger and writes the report again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagereplay.audit.reexecute import AuditConfig
from stagereplay.audit.relocate import Relocation
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.kernels import follow_run
from stagereplay.experiments.jobs import ReplaySettings
from stagereplay.experiments.resample import ResampleConfig
from stagereplay.experiments.transplant import TransplantConfig
from stagereplay.records.ledger import open_run, read_ledger, read_manifest
from stagereplay.records.shards import merge_runs
from stagereplay.runs.make import check_serving_precision, finish


@dataclass(frozen=True)
class Extension:
    """Where a later stage runs on a run directory: which of its models, in which processes, with the run's inputs
    where they are now (each checked against the run's hashes before anything runs)."""

    checkpoint: str = field(default="primary", metadata={"help": "which model of the run"})
    ex: ExecConfig = field(default_factory=ExecConfig, metadata={"help": "processes and backend"})
    where: Relocation = field(default_factory=Relocation, metadata={"help": "inputs that moved since the run"})


def existing_run(run_dir: str | Path, check_ledger: bool = True) -> tuple[Path, dict[str, Any]]:
    path = Path(run_dir)
    if not (path / "manifest.json").exists():
        raise StageReplayError(f"no run in {path} (manifest.json missing)", "run `stagereplay matched --out` first")
    manifest = read_manifest(path)
    follow_run(manifest)  # the kernels the run was made with, where this process can still choose them
    if check_ledger:
        read_ledger(path)  # a newer schema or a broken chain stops here, before anything runs
    return path, manifest


def matched_stage(manifest: dict[str, Any], checkpoint: str, where: Relocation | None = None
                  ) -> tuple[ModelConfig, ReplaySettings]:
    """The matched stage's model and settings, its model where `where` says it is now."""
    from stagereplay.audit.relocate import FLAGS, relocate

    stage = relocate(manifest, where or Relocation(), need_inputs=False)[0].get("stages", {}).get(
        f"matched/{checkpoint}")
    if stage is None:
        raise StageReplayError(f"the run has no matched experiment at checkpoint {checkpoint!r}",
                               "run `stagereplay matched` into it first")
    if not Path(stage["model"]["path"]).exists():  # a folder, or a GGUF file
        raise StageReplayError(f"the run's {checkpoint} model is not at {stage['model']['path']}",
                               f"pass {FLAGS.get(checkpoint, '--model')} PATH where it is now (checked against the "
                               "run's hashes)")
    return ModelConfig(**stage["model"]), ReplaySettings.from_dict(stage["settings"])


def refuse_serving(manifest: dict[str, Any], checkpoint: str, what: str) -> None:
    """Bridge, transplant and resample need boundary caches our engine made; a serving engine's run has none."""
    from stagereplay.serving.seam import refuse_cache_access

    engine = manifest.get("stages", {}).get(f"matched/{checkpoint}", {}).get("engine")
    if engine is not None:
        raise refuse_cache_access(engine["name"], what)


def precision_2x2(run_dir: str | Path, constructions: tuple[str, ...] = (),
                  precisions: tuple[str, ...] = ("bf16", "fp32"), on: Extension | None = None,
                  quiet: bool = False) -> dict[str, Any]:
    """Hold the matched run's prefixes fixed; cross construction with precision. No constructions given:
    incremental and oneshot, or on a serving engine's run its arms (oneshot, prefix-cache, hf-oneshot)."""
    from stagereplay.experiments.precision_2x2 import check_fixed_constructions, run_2x2

    on = on or Extension()
    path, manifest = existing_run(run_dir)
    model, settings = matched_stage(manifest, on.checkpoint, on.where)
    stage = manifest["stages"][f"matched/{on.checkpoint}"]
    if "engine" in stage:  # a serving engine's run: its arms crossed with precision, in that engine
        from stagereplay.serving.matched import arms_of
        from stagereplay.serving.precision_2x2 import check_serving_constructions, run_serving_2x2

        arms = arms_of(stage)
        constructions = constructions or arms.grid
        check_serving_constructions(constructions, arms)
        for p in precisions:
            check_serving_precision(arms, p)
        if on.ex.workers != 1 or on.ex.executor != "local":
            raise StageReplayError(f"--engine {arms.engine.name} runs in this process",
                                   "pass --workers 1 --executor local")
        arms.kind.require()
        with open_run(path, manifest) as run:
            run_serving_2x2(run, model, settings, on.checkpoint, arms, constructions, precisions, quiet)
            return finish(run, quiet)
    constructions = constructions or ("incremental", "oneshot")
    check_fixed_constructions(constructions)
    for p in precisions:
        model.with_precision(p)  # validates the name before anything runs
    with open_run(path, manifest) as run:
        run_2x2(run, model, settings, on.checkpoint, constructions, precisions, on.ex, quiet)
        return finish(run, quiet)


def bridge(run_dir: str | Path, rows: int = 12, on: Extension | None = None, quiet: bool = False) -> dict[str, Any]:
    """Incremental vs live boundary caches, bitwise, on the first `rows` items that reached the boundary."""
    from stagereplay.experiments.bridge import run_bridge

    on = on or Extension()
    if rows < 1:
        raise StageReplayError(f"--rows must be at least 1, got {rows}", "pass a positive --rows")
    path, manifest = existing_run(run_dir)
    refuse_serving(manifest, on.checkpoint, "the bridge")
    model, settings = matched_stage(manifest, on.checkpoint, on.where)
    with open_run(path, manifest) as run:
        run_bridge(run, model, settings, on.checkpoint, rows, on.ex, quiet)
        return finish(run, quiet)


def transplant(run_dir: str | Path, config: TransplantConfig | None = None, on: Extension | None = None,
               quiet: bool = False) -> dict[str, Any]:
    """Swap K/V between live and fresh boundary states of the selected divergent items, both directions (the
    fresh construction defaults to the matched run's)."""
    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.experiments.transplant import run_transplant

    on = on or Extension()
    path, manifest = existing_run(run_dir)
    refuse_serving(manifest, on.checkpoint, "a transplant")
    model, settings = matched_stage(manifest, on.checkpoint, on.where)
    cfg = config or TransplantConfig(construction=manifest["stages"][f"matched/{on.checkpoint}"]["construction"])
    hf_config, _ = load_config_and_tokenizer(model.path)
    cfg.check_layers(hf_config.get_text_config().num_hidden_layers)
    with open_run(path, manifest) as run:
        run_transplant(run, model, settings, on.checkpoint, cfg, on.ex, quiet)
        return finish(run, quiet)


def resample(run_dir: str | Path, config: ResampleConfig | None = None, on: Extension | None = None,
             quiet: bool = False) -> dict[str, Any]:
    """K seeded draws from the live, live-replica and fresh boundary states of each item: coupled and
    independent designs (`experiments/resample.py`)."""
    from stagereplay.experiments.resample import run_resample

    on = on or Extension()
    path, manifest = existing_run(run_dir)
    refuse_serving(manifest, on.checkpoint, "resample (boundary states in our engine)")
    model, settings = matched_stage(manifest, on.checkpoint, on.where)
    with open_run(path, manifest) as run:
        run_resample(run, model, settings, on.checkpoint, config or ResampleConfig(), on.ex, quiet)
        return finish(run, quiet)


def audit(run_dir: str | Path, config: AuditConfig | None = None, verify_only: bool = False,
          on: Extension | None = None, quiet: bool = False) -> dict[str, Any]:
    """Check what needs no model (chain, binding to the manifest, completeness, derivable claims), then
    (unless `verify_only`) re-execute the ledger, or a seeded sample of it (`config`), and compare every field;
    `reproduced` says if all held. `on.where` says where inputs that moved are now: each is checked against the
    run's hashes before anything runs."""
    import json

    from stagereplay.audit.reexecute import audit_run
    from stagereplay.audit.relocate import relocate
    from stagereplay.audit.verify import verify_run
    from stagereplay.records.ledger import atomic_write
    from stagereplay.report.results import AUDIT_FILE

    on = on or Extension()
    path, manifest = existing_run(run_dir, check_ledger=False)  # the audit reports damage instead of refusing
    here, moved = relocate(manifest, on.where, need_inputs=not verify_only)
    checked = verify_run(path, here)
    if verify_only or checked["broken_records"]:
        return {**checked, "integrity_ok": checked["reproduced"], **({"relocated": moved} if moved else {})}
    with open_run(path, manifest, extend=False) as run:
        summary = audit_run(path, here, run.records, on.ex, quiet, config=config, relocated=moved,
                            server=on.where.server)
        atomic_write(path / AUDIT_FILE, json.dumps(summary, indent=2) + "\n")
        finish(run, quiet)
        return summary


def merge(shards: list[Path], out: Path, quiet: bool = True) -> Path:
    """Join the shards of one `--shard I/N` command into the run one process would have made, with its report.
    Shards computed in different environments merge (each record keeps its own); `shard_environments`
    of the merged manifest names them."""
    merge_runs(shards, out)
    with open_run(out, read_manifest(out)) as run:
        finish(run, quiet)
    return out
