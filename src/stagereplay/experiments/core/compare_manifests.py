"""What two runs' manifests say of them, side by side: whether they are runs of one model, one tokenizer and one
set of items (else `compare` refuses them in one line), and what differs between them: the settings, the serving
engine's identity and settings, the kernels and the rest of the environment.

A run's settings are its manifest's `config` (less what identifies its model and items, which must be equal) and
the compared experiment's stage's own section where it says more (a serving engine's options, `engine`, flat; `cross`; the arms).
Fields that only say where a file or a server lies (a path, a URL) are not settings: they are listed apart, as
locations. The kernels are those of the process that computed the records (`records.kernels`), read from the
ledger's environment records, the manifest's where the records name none.
"""

from __future__ import annotations

from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core import registry
from stagereplay.experiments.core.run_side import RunSide
from stagereplay.records.differences import Difference, Differences
from stagereplay.records.kernels import kernel_differences
from stagereplay.records.ledger import diff_fields

MODEL_KEYS = ("config", "weights", "gguf")
"""The `config.model_hashes.<checkpoint>` fields that identify a model's weights and architecture
(`records.provenance.model_hashes`; a GGUF file is one hash of all of it)."""
TOKENIZER_KEYS = ("tokenizer", "gguf")
"""...and its tokenizer (inside the GGUF file for a GGUF model)."""
IDENTITY = ("item_ids", "dataset_hash", "model_hashes")
"""Config fields that must be equal for two runs to compare: checked, not listed as settings."""
LOCATIONS = frozenset({"path", "url", "model_path", "root"})
"""Last keys of the fields that say where a file or a server lies."""
VOLATILE = ("checked.instance", "resumed")
"""Server fields that tell one process's life from another's, not its settings (`serving.http.HttpEngine`)."""
KERNELS_OUTSIDE = frozenset({"machine", "packages.torch", "packages.transformers", "determinism.threads",
                             "determinism.deterministic_algorithms", "gpu", "capability", "cuda", "cudnn"})
"""The environment fields outside `kernels` that `records.kernels` reads as kernel fields: listed there, not
twice."""
SERVER_IN_KERNELS = "engine build"
"""The kernel field that repeats the server's build, which the server's section lists."""


def check_comparable(a: RunSide, b: RunSide, checkpoint: str, experiment: str, also: str = "") -> None:
    """Refuse, in one line, two runs that do not hold records of `experiment` at `checkpoint` (`also`: another
    command whose runs hold them, named in the fix), or that ran different models, tokenizers or items (on data of
    another hash, what the experiment says: `Experiment.check_other_data`)."""
    for side in (a, b):
        if not side.matched(checkpoint, experiment):
            held = ", ".join(side.checkpoints(experiment))
            raise StageReplayError(f"{side.path} holds no {experiment} records at checkpoint {checkpoint}",
                                   f"pass --checkpoint one of: {held}" if held else
                                   f"compare runs made by `stagereplay {experiment}`"
                                   + (f" (or `{also}`)" if also else ""))
    ha, hb = (_hashes(side, checkpoint) for side in (a, b))
    if ("gguf" in ha) != ("gguf" in hb):
        gguf, folder = (a, b) if "gguf" in ha else (b, a)
        raise StageReplayError(f"{gguf.path} ran a GGUF file and {folder.path} a model folder at checkpoint "
                               f"{checkpoint}: nothing shows they hold one model",
                               "compare runs of one model file (a setting may differ, the model may not)")
    model = [k for k in MODEL_KEYS if ha.get(k) != hb.get(k)]
    if model:
        raise StageReplayError(f"{a.path} and {b.path} ran different models at checkpoint {checkpoint} "
                               f"({', '.join(model)} hashes differ)",
                               "compare runs of one model (a setting may differ, the model may not)")
    tokenizer = [k for k in TOKENIZER_KEYS if ha.get(k) != hb.get(k)]
    if tokenizer:
        raise StageReplayError(f"{a.path} and {b.path} ran different tokenizers at checkpoint {checkpoint}",
                               "compare runs of one model and tokenizer: token IDs of two tokenizers do not compare")
    ca, cb = a.manifest.config, b.manifest.config
    ia, ib = list(ca.item_ids), list(cb.item_ids)
    if ia != ib:
        common = len(set(ia) & set(ib))
        raise StageReplayError(f"{a.path} ran {len(ia)} items and {b.path} {len(ib)}, {common} of them in common "
                               "(config.item_ids differ)",
                               "compare runs of the same items: the same --data and --n (and no --shard)")
    if ca.dataset_hash != cb.dataset_hash:  # the experiment says whether its records compare on other data
        registry.experiment(experiment).check_other_data((str(a.path), str(b.path)),
                                                         (a.matched(checkpoint, experiment),
                                                          b.matched(checkpoint, experiment)))


def _hashes(side: RunSide, checkpoint: str) -> dict[str, Any]:
    hashes = side.manifest.config.model_hashes.get(checkpoint)
    if not isinstance(hashes, dict) or not hashes:
        raise StageReplayError(f"{side.path} records no model hashes for checkpoint {checkpoint}",
                               "compare runs whose manifests name their models (config.model_hashes)")
    return hashes


def manifest_differences(a: RunSide, b: RunSide, checkpoint: str, experiment: str) -> Differences:
    """What differs, in groups of fields: `settings` (the config and the stage of `experiment`), `server` (a serving
    engine's identity and settings, less what changes with each start), `kernels` (by the names `records.kernels`
    gives them), `environment` (the rest of the computing process: packages, commit, proofs), and `locations`
    (paths and URLs, which are no setting)."""
    settings: list[Difference] = []
    server: list[Difference] = []
    locations: list[Difference] = []
    own_a, own_b = _settings(a, checkpoint, experiment), _settings(b, checkpoint, experiment)
    for name in diff_fields(own_a, own_b):
        (locations if _is_location(name) else settings).append(Difference(field=name, a=_at(own_a, name),
                                                                          b=_at(own_b, name)))
    ha, hb = a.manifest.config.dataset_hash, b.manifest.config.dataset_hash
    if ha != hb:  # data the experiment compares on its tokens (`check_comparable`): which file is a setting
        settings.append(Difference(field="config.dataset_hash", a=ha, b=hb))
    ea, eb = a.environment(checkpoint, experiment), b.environment(checkpoint, experiment)
    sa, sb = (_drop(e.get("engine") or {}, VOLATILE) for e in (ea, eb))
    for name in diff_fields(sa, sb, "environment.engine."):
        field = Difference(field=name, a=_at({"environment": {"engine": sa}}, name),
                           b=_at({"environment": {"engine": sb}}, name))
        (locations if _is_location(name) else server).append(field)
    kernels = [Difference(field=name, a=va, b=vb) for name, va, vb in kernel_differences(ea, eb)
               if name != SERVER_IN_KERNELS]
    rest_a, rest_b = ({"tool_version": m.manifest.tool_version, **_drop(e, ("engine", "kernels"))}
                      for m, e in ((a, ea), (b, eb)))
    environment = [Difference(field=name, a=_at(rest_a, name), b=_at(rest_b, name))
                   for name in diff_fields(rest_a, rest_b) if name not in KERNELS_OUTSIDE]
    return Differences(settings=settings, server=server, kernels=kernels, environment=environment,
                       locations=locations)


def _settings(side: RunSide, checkpoint: str, experiment: str) -> dict[str, Any]:
    """The config less its identity, and the stage's section: each key the config does not hold with the same
    value, under `stages.<experiment>/<checkpoint>`."""
    config = {k: v for k, v in side.manifest.config.as_json().items() if k not in IDENTITY}
    data = side.manifest.config.data
    if data.rollouts:  # made before `source` was recorded: its source as a later manifest names it, not a difference
        config["data"] = {**{k: v for k, v in config["data"].items() if k != "rollouts"}, "source": data.source_name()}
    name = f"{experiment}/{checkpoint}"
    section = side.manifest.stage(name)
    stage = section.as_json() if section is not None else {}
    own = {k: v for k, v in stage.items() if config.get(k) != v}
    return {"config": config, **({"stages": {name: own}} if own else {})}


def _at(tree: Any, dotted: str) -> Any:
    """The value at a dotted field name (`diff_fields`' names); None where a side lacks it. Keys may hold dots
    themselves (`stages.matched/primary`), so the longest key that matches is taken at each level."""
    value = tree
    rest = dotted
    while rest:
        if not isinstance(value, dict):
            return None
        key = next((k for k in sorted(value, key=len, reverse=True) if rest == k or rest.startswith(f"{k}.")), None)
        if key is None:
            return None
        value, rest = value[key], rest[len(key) + 1:]
    return value


def _drop(tree: dict[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `tree` without the fields named (one or two levels deep)."""
    out = dict(tree)
    for name in dotted:
        head, _, tail = name.partition(".")
        if not tail:
            out.pop(head, None)
        elif isinstance(out.get(head), dict):
            out[head] = {k: v for k, v in out[head].items() if k != tail}
    return out


def _is_location(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in LOCATIONS


