"""Library entry points that extend a run directory made by `matched` (or `paper`): the 2x2, the bridge, the
transplants, resample, the audit, and the merge of shards. Each finds the run's matched stage (and its model
where it is now), refuses what the run cannot give (a serving engine's run has no boundary caches of ours),
then runs into the same ledger and writes the report again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagereplay.engine.decode import DecodeConfig
from stagereplay.engine.model import ModelConfig
from stagereplay.errors import StageReplayError
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.kernels import follow_run
from stagereplay.experiments.jobs import ReplaySettings
from stagereplay.records.ledger import open_run, read_ledger, read_manifest
from stagereplay.records.shards import merge_runs
from stagereplay.runs.make import finish, serving_arms


def existing_run(run_dir: str | Path, check_ledger: bool = True) -> tuple[Path, dict[str, Any]]:
    path = Path(run_dir)
    if not (path / "manifest.json").exists():
        raise StageReplayError(f"no run in {path} (manifest.json missing)", "run `stagereplay matched --out` first")
    manifest = read_manifest(path)
    follow_run(manifest)  # the kernels the run was made with, where this process can still choose them
    if check_ledger:
        read_ledger(path)  # a newer schema or a broken chain stops here, before anything runs
    return path, manifest


def matched_stage(manifest: dict[str, Any], checkpoint: str, where: Any = None) -> tuple[ModelConfig, ReplaySettings]:
    """The matched stage's model and settings, its model where `where` (a `Relocation`) says it is now."""
    from stagereplay.audit.relocate import FLAGS, Relocation, relocate

    stage = relocate(manifest, where or Relocation(), need_inputs=False)[0].get("stages", {}).get(
        f"matched/{checkpoint}")
    if stage is None:
        raise StageReplayError(f"the run has no matched experiment at checkpoint {checkpoint!r}",
                               "run `stagereplay matched` into it first")
    if not Path(stage["model"]["path"]).exists():  # a folder, or a GGUF file
        raise StageReplayError(f"the run's {checkpoint} model is not at {stage['model']['path']}",
                               f"pass {FLAGS.get(checkpoint, '--model')} PATH where it is now (checked against the "
                               "run's hashes)")
    s = stage["settings"]
    return ModelConfig(**stage["model"]), ReplaySettings(s["boundary"], DecodeConfig(**s["decode"]), s["scorer"])


def refuse_serving(manifest: dict[str, Any], checkpoint: str, what: str) -> None:
    """Bridge, transplant and resample need boundary caches our engine made; a serving engine's run has none."""
    from stagereplay.serving.seam import refuse_cache_access

    engine = manifest.get("stages", {}).get(f"matched/{checkpoint}", {}).get("engine")
    if engine is not None:
        raise refuse_cache_access(engine["name"], what)


def precision_2x2(run_dir: str | Path, constructions: tuple[str, ...] = (),
                  precisions: tuple[str, ...] = ("bf16", "fp32"), checkpoint: str = "primary", workers: int = 1,
                  executor: str = "local", quiet: bool = False, where: Any = None) -> dict[str, Any]:
    """Hold the matched run's prefixes fixed; cross construction with precision. No constructions given:
    incremental and oneshot, or on a serving engine's run its arms (oneshot, prefix-cache, hf-oneshot)."""
    from stagereplay.experiments.precision_2x2 import check_fixed_constructions, run_2x2

    path, manifest = existing_run(run_dir)
    model, settings = matched_stage(manifest, checkpoint, where)
    served = manifest["stages"][f"matched/{checkpoint}"].get("engine")
    if served is not None:  # a serving engine's run: its arms crossed with precision, in that engine
        from stagereplay.serving.matched import arms_of
        from stagereplay.serving.precision_2x2 import check_serving_constructions, run_serving_2x2

        arms = arms_of(manifest["stages"][f"matched/{checkpoint}"])
        constructions = constructions or arms.grid
        check_serving_constructions(constructions, arms)
        for p in precisions:
            serving_arms(served["name"], arms.cross or None, served.get("block_size", 32), "oneshot",
                         ExecConfig(workers, executor), DecodeConfig(), p,
                         {k: v for k, v in served.items() if k not in ("name", "block_size")})
        with open_run(path, manifest) as run:
            run_serving_2x2(run, model, settings, checkpoint, arms, constructions, precisions, quiet)
            return finish(run, quiet)
    constructions = constructions or ("incremental", "oneshot")
    check_fixed_constructions(constructions)
    for p in precisions:
        model.with_precision(p)  # validates the name before anything runs
    with open_run(path, manifest) as run:
        run_2x2(run, model, settings, checkpoint, constructions, precisions, ExecConfig(workers, executor), quiet)
        return finish(run, quiet)


def bridge(run_dir: str | Path, rows: int = 12, checkpoint: str = "primary", workers: int = 1,
           executor: str = "local", quiet: bool = False, where: Any = None) -> dict[str, Any]:
    """Incremental vs live boundary caches, bitwise, on the first `rows` items that reached the boundary."""
    from stagereplay.experiments.bridge import run_bridge

    if rows < 1:
        raise StageReplayError(f"--rows must be at least 1, got {rows}", "pass a positive --rows")
    path, manifest = existing_run(run_dir)
    refuse_serving(manifest, checkpoint, "the bridge")
    model, settings = matched_stage(manifest, checkpoint, where)
    with open_run(path, manifest) as run:
        run_bridge(run, model, settings, checkpoint, rows, ExecConfig(workers, executor), quiet)
        return finish(run, quiet)


def transplant(run_dir: str | Path, config: Any = None, checkpoint: str = "primary", workers: int = 1,
               executor: str = "local", quiet: bool = False, where: Any = None) -> dict[str, Any]:
    """Swap K/V between live and fresh boundary states of the selected divergent items, both directions."""
    from stagereplay.engine.model import load_config_and_tokenizer
    from stagereplay.experiments.transplant import TransplantConfig, run_transplant

    path, manifest = existing_run(run_dir)
    refuse_serving(manifest, checkpoint, "a transplant")
    model, settings = matched_stage(manifest, checkpoint, where)
    cfg = config or TransplantConfig(construction=manifest["stages"][f"matched/{checkpoint}"]["construction"])
    hf_config, _ = load_config_and_tokenizer(model.path)
    cfg.check_layers(hf_config.get_text_config().num_hidden_layers)
    with open_run(path, manifest) as run:
        run_transplant(run, model, settings, checkpoint, cfg, ExecConfig(workers, executor), quiet)
        return finish(run, quiet)


def resample(run_dir: str | Path, config: Any = None, checkpoint: str = "primary", workers: int = 1,
             executor: str = "local", quiet: bool = False, where: Any = None) -> dict[str, Any]:
    """K seeded draws from the live, live-replica and fresh boundary states of each item: coupled and
    independent designs (`experiments/resample.py`)."""
    from stagereplay.experiments.resample import ResampleConfig, run_resample

    path, manifest = existing_run(run_dir)
    refuse_serving(manifest, checkpoint, "resample (boundary states in our engine)")
    model, settings = matched_stage(manifest, checkpoint, where)
    cfg = config or ResampleConfig()
    with open_run(path, manifest) as run:
        run_resample(run, model, settings, checkpoint, cfg, ExecConfig(workers, executor), quiet)
        return finish(run, quiet)


def audit(run_dir: str | Path, verify_only: bool = False, workers: int = 1, executor: str = "local",
          quiet: bool = False, config: Any = None, where: Any = None) -> dict[str, Any]:
    """Check what needs no model (chain, binding to the manifest, completeness, derivable claims), then
    (unless `verify_only`) re-execute the ledger, or a seeded sample of it (`config`, an `AuditConfig`), and
    compare every field; `reproduced` says if all held. `where` (a `Relocation`) says where inputs that
    moved are now: each is checked against the run's hashes before anything runs."""
    import json

    from stagereplay.audit.reexecute import audit_run
    from stagereplay.audit.relocate import Relocation, relocate
    from stagereplay.audit.verify import verify_run
    from stagereplay.records.ledger import atomic_write
    from stagereplay.report.results import AUDIT_FILE

    path, manifest = existing_run(run_dir, check_ledger=False)  # the audit reports damage instead of refusing
    here, moved = relocate(manifest, where or Relocation(), need_inputs=not verify_only)
    checked = verify_run(path, here)
    if verify_only or checked["broken_records"]:
        return {**checked, "integrity_ok": checked["reproduced"], **({"relocated": moved} if moved else {})}
    with open_run(path, manifest, extend=False) as run:
        summary = audit_run(path, here, run.records, ExecConfig(workers, executor), quiet, config=config,
                            relocated=moved, server=(where or Relocation()).server)
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
