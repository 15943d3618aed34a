"""Inputs that moved: a run audited or extended where its model or data are not at the recorded paths.

A manifest records where its models and data were (locations, not bound by the chain) and what they were
(their hashes, bound). A run copied to another machine finds its inputs elsewhere: `--model`,
`--later-model` and `--data` say where, and each is checked against the bound hashes before anything runs.
The embedded toy's checkpoints are found without being named: a run of the toy made in another checkout
records that checkout's path, and the packaged checkpoint with the bound hashes is the same model.

The relocated manifest lives in memory only: the run's manifest keeps the paths it was made with, and the
audit records what moved in its result (`relocated`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from stagereplay.engine.gguf import is_gguf
from stagereplay.engine.model import check_model_dir
from stagereplay.errors import StageReplayError
from stagereplay.records.ledger import diff_fields
from stagereplay.records.manifest import Manifest
from stagereplay.records.provenance import model_hashes
from stagereplay.tasks.item_sources import source
from stagereplay.tasks.sources import HF_PREFIX

FLAGS = {"primary": "--model", "later": "--later-model"}


@dataclass(frozen=True)
class Relocation:
    """Where the run's inputs are now (None: where the manifest says, or the embedded toy's)."""

    panel: ClassVar[str] = "Inputs that moved"

    model: str | None = field(default=None, metadata={"flag": "--model", "help": (
        "where the run's primary model is now, if it moved (checked against the run's hashes)")})
    later_model: str | None = field(default=None, metadata={"flag": "--later-model", "help": (
        "where the run's later model is now, if it moved (checked against the run's hashes)")})
    data: str | None = field(default=None, metadata={"flag": "--data", "help": (
        "where the run's data file is now, if it moved (checked against the run's dataset hash)")})
    server: str | None = field(default=None, metadata={"flag": "--url", "help": (
        "where the run's server is now, if it moved (--engine http runs; its build and model are compared with the "
        "recorded ones): the chain binds the recorded address, so this one replaces it only where the audit "
        "re-executes (`serving.replay.at_server`)")})

    def given(self, checkpoint: str) -> str | None:
        return {"primary": self.model, "later": self.later_model}.get(checkpoint)


def _short(value: Any) -> str:
    return str(value)[:12] if value else "none"


def _get(d: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        d = d.get(key) if isinstance(d, dict) else None
    return d


def check_model(path: str, bound: dict[str, Any], checkpoint: str) -> None:
    """Refuse a model (a directory, or a GGUF file: its hashes say which the run used) whose hashes are not the
    run's, naming the first hash that differs and what to pass instead."""
    flag = FLAGS.get(checkpoint, "--model")
    gguf_run = "gguf" in bound  # a GGUF file's identity is its bytes alone (engine.gguf.file_hashes)
    fix = ("pass the .gguf file the run was made with" if gguf_run
           else "pass the directory of the model the run was made with")
    if gguf_run and not is_gguf(path):
        raise StageReplayError(f"{flag} {path} is not a .gguf file, and the run's {checkpoint} model was one", fix)
    check_model_dir(path)
    found = model_hashes(path)
    differ = diff_fields(bound, found)
    if differ:
        field = differ[0]
        raise StageReplayError(
            f"{flag} {path} is not the run's {checkpoint} model: its {field} hash "
            f"differs ({_short(_get(bound, field))} recorded, {_short(_get(found, field))} here)", fix)


def _toy_match(checkpoint: str, bound: dict[str, Any]) -> str | None:
    """The packaged toy checkpoint of this name, if its hashes are the bound ones."""
    from stagereplay.toy import TOY_CHECKPOINTS, toy_checkpoint

    if checkpoint not in TOY_CHECKPOINTS:
        return None
    path = toy_checkpoint(checkpoint)
    return str(path) if path.is_dir() and not diff_fields(bound, model_hashes(path)) else None


def _model_paths(manifest: Manifest) -> dict[str, str]:
    """Each checkpoint's recorded location: the configuration's, else its first stage's."""
    config = manifest.config
    paths: dict[str, str | None] = {"primary": config.model.path}
    if config.later_model:
        paths["later"] = config.later_model
    for name, stage in manifest.stages.items():
        paths.setdefault(name.partition("/")[2], stage.model.path)
    return {k: v for k, v in paths.items() if v}


def relocate(manifest: Manifest, where: Relocation, need_inputs: bool = True
             ) -> tuple[Manifest, list[dict[str, str]]]:
    """The manifest with its inputs' locations replaced by where they are now, and what moved.

    Every given location is checked against the bound hashes first, and refused with one line naming the
    hash that differs. An input missing from its recorded path and not given is refused when
    `need_inputs` (the full audit, an experiment that extends the run); `--verify-only` needs none."""
    out = manifest
    config = manifest.config
    bound = config.model_hashes
    moved: list[dict[str, str]] = []
    for checkpoint, recorded in _model_paths(manifest).items():
        given = where.given(checkpoint)
        if given is not None:
            here, how = str(Path(given).resolve()), f"{FLAGS[checkpoint]}, hashes match"
            if checkpoint in bound:
                check_model(here, bound[checkpoint], checkpoint)
        elif Path(recorded).exists():  # a folder, or a GGUF file
            continue
        else:
            toy = _toy_match(checkpoint, bound[checkpoint]) if checkpoint in bound else None
            if toy is None:
                if need_inputs:
                    raise StageReplayError(f"the run's {checkpoint} model is not at {recorded}",
                                           f"pass {FLAGS.get(checkpoint, '--model')} PATH where it is now "
                                           "(checked against the run's hashes)")
                continue
            here, how = toy, "the embedded toy checkpoint, hashes match"
        out = _with_model_path(out, checkpoint, recorded, here)
        moved.append({"input": f"{checkpoint} model", "recorded": recorded, "here": here, "how": how})
    data = config.data
    recorded_data = data.path
    if where.data is not None:
        here = where.data if where.data.startswith(HF_PREFIX) else str(Path(where.data).resolve())
        found = source(data.source_name()).at(here, data.columns)
        if found is None:
            raise StageReplayError(f"--data {here} not found", "pass the data the run was made with")
        if found[1] != config.dataset_hash:
            raise StageReplayError(f"--data {here} is not the run's dataset: its dataset_hash differs "
                                   f"({_short(config.dataset_hash)} recorded, {_short(found[1])} here)",
                                   "pass the data the run was made with")
        out = out.updated(config=out.config.updated(data=data.updated(path=here)))
        moved.append({"input": "data", "recorded": recorded_data or "the toy task", "here": here,
                      "how": "--data, dataset hash matches"})
    elif recorded_data and need_inputs and source(data.source_name()).at(recorded_data, data.columns) is None:
        raise StageReplayError(f"the run's data is not at {recorded_data}",
                               "pass --data PATH where it is now (checked against the run's dataset_hash)")
    return out, moved


def _with_model_path(manifest: Manifest, checkpoint: str, recorded: str, here: str) -> Manifest:
    """`manifest` with the model of `checkpoint` at `here` wherever it was recorded at `recorded`."""
    config = manifest.config
    if checkpoint == "primary" and config.model.path == recorded:
        config = config.updated(model=config.model.updated(path=here))
    if checkpoint == "later" and config.later_model == recorded:
        config = config.updated(later_model=here)
    stages = {name: stage.updated(model=stage.model.updated(path=here)) if name.partition("/")[2] == checkpoint
              else stage for name, stage in manifest.stages.items()}
    return manifest.updated(config=config, stages=stages)
