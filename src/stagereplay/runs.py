"""Library entry points that make or extend a run directory: validate inputs, freeze the manifest, run, report.

Every check that can fail on bad input runs before the run directory is created, so a bad input never leaves
a half-written run behind.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stagereplay.boundary import BoundaryRule
from stagereplay.decode import DecodeConfig
from stagereplay.errors import StageReplayError
from stagereplay.executors import ExecConfig
from stagereplay.experiments.common import ReplaySettings
from stagereplay.ledger import SCHEMA_VERSION, Run, open_run, read_ledger, read_manifest
from stagereplay.lm import LM, load
from stagereplay.model import ModelConfig, check_model_dir
from stagereplay.provenance import environment, model_hashes, now, package_versions
from stagereplay.tasks import DataConfig, Item, load_items


@dataclass(frozen=True)
class Source:
    """A model and the items, boundary rule and scorer to run it on; the toy task fills what is not given."""

    model: ModelConfig
    data: DataConfig
    settings: ReplaySettings


def resolve_source(model: str | None, data: str | None, n: int | None, boundary: BoundaryRule | None,
                   scorer: str | None, decode: DecodeConfig, precision: str, device: str, threads: int,
                   attn_impl: str, checkpoint: str = "primary") -> Source:
    """Fill in the embedded toy defaults: its checkpoint, held-out items, marker and scorer."""
    if model is None:
        from stagereplay.toy import toy_checkpoint

        model = str(toy_checkpoint(checkpoint))
    if data is None and boundary is None:
        from stagereplay.tasks.toy import TOY_MARKER

        rule = f"marker:{TOY_MARKER}"
    elif boundary is None:
        raise StageReplayError("no boundary rule given for --data",
                               "pass --boundary-marker, --boundary-regex or --boundary-after")
    else:
        rule = boundary.describe()
    if scorer is None:
        scorer = "toy" if data is None else "last-number"
    config = ModelConfig(path=str(Path(model).resolve()), precision=precision, device=device, threads=threads,
                         attn_impl=attn_impl)
    check_model_dir(config.path)
    return Source(config, DataConfig(path=str(Path(data).resolve()) if data else None, n=n),
                  ReplaySettings(boundary=rule, decode=decode, scorer=scorer))


def prepare(source: Source, ex: ExecConfig) -> tuple[LM | None, list[Item], str]:
    """Load the model (when running in this process) and the items, before any run directory exists."""
    from stagereplay.model import _quiet_transformers, set_determinism

    lm: LM | None = None
    if ex.workers == 1 and ex.executor == "local":
        m = source.model
        lm = load(m.path, m.precision, m.device, m.threads, m.attn_impl)
        tokenizer = lm.tokenizer
    else:
        from transformers import AutoTokenizer

        set_determinism(source.model.threads, source.model.device)
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source.model.path)
    items, data_hash = load_items(source.data, tokenizer)
    if lm is not None:
        for item in items:
            lm._prompt(item)  # raises on a prompt that does not fit the context
    return lm, items, data_hash


def new_manifest(command: str, config: dict[str, Any], source: Source, items: list[Item], data_hash: str,
                 determinism: dict[str, Any], extra_models: dict[str, str] | None = None) -> dict[str, Any]:
    """The frozen record of what this run is. `config` is its identity: resuming requires it unchanged."""
    models = {"primary": source.model.path, **(extra_models or {})}
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "stagereplay",
        "tool_version": package_versions()["stagereplay"],
        "created": now(),
        "command": command,
        "config": {
            **config,
            "model": asdict(source.model),
            "data": asdict(source.data),
            "settings": source.settings.as_dict(),
            "dataset_hash": data_hash,
            "item_ids": [i.id for i in items],
            "model_hashes": {name: model_hashes(path) for name, path in models.items()},
        },
        "environment": environment(source.model.device, determinism),
        "stages": {},
    }


def open_existing(run_dir: Path) -> tuple[dict[str, Any], list[Any]]:
    if not Path(run_dir).is_dir():
        raise StageReplayError(f"run directory not found: {run_dir}", "pass the --out of an earlier run")
    return read_manifest(Path(run_dir)), read_ledger(Path(run_dir))


def finish(run: Run, quiet: bool = False) -> dict[str, Any]:
    """Rebuild results.json from the whole ledger, write the report, print the tables."""
    from stagereplay.results import build_results

    results = build_results(run.path, run.manifest, run.records)
    run.write_results(results)
    write_and_print_report(run.path, results, quiet)
    return results


def write_and_print_report(run_dir: Path, results: dict[str, Any], quiet: bool) -> None:
    from stagereplay.report import print_tables, write_report

    write_report(run_dir)
    if not quiet:
        from rich.console import Console

        print_tables(results, Console())


def matched(
    out: str | Path,
    model: str | None = None,
    data: str | None = None,
    n: int | None = None,
    construction: str = "oneshot",
    boundary: BoundaryRule | None = None,
    scorer: str | None = None,
    decode: DecodeConfig | None = None,
    precision: str = "bf16",
    device: str = "cpu",
    threads: int = 1,
    attn_impl: str = "sdpa",
    workers: int = 1,
    executor: str = "local",
    quiet: bool = False,
) -> dict[str, Any]:
    """Run (or resume) the matched experiment into `out`; return results.json's content."""
    from stagereplay.experiments.matched import MatchedConfig, run_matched

    ex = ExecConfig(workers, executor)
    source = resolve_source(model, data, n, boundary, scorer, decode or DecodeConfig(), precision, device,
                            threads, attn_impl)
    config = MatchedConfig(source.model, source.settings, source.data, construction)
    lm, items, data_hash = prepare(source, ex)
    manifest = new_manifest("matched", {"construction": construction}, source, items, data_hash,
                            lm.determinism if lm else {"threads": threads})
    with open_run(Path(out), manifest) as run:
        run_matched(run, config, items, ex, lm, quiet)
        return finish(run, quiet)
