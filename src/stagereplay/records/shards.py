"""Shards for batch schedulers (SLURM and the like): `--shard I/N` runs every N-th item; `merge` joins the shards.

A merged run is the run that one process would have made: the same manifest identity (less the shard), the
records in canonical order (experiment stage order, then item order of the dataset), the hash chain rebuilt.
Shards must agree on everything the chain binds except their items: model, tokenizer, generation-config and
dataset hashes and every setting (their paths may differ: shards made on other machines). Each record keeps
the environment that computed it; shards computed in different environments merge, and the merged manifest
names each shard's environments (`shard_environments`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.records.ledger import (
    SCHEMA_VERSION,
    Record,
    diff_fields,
    items,
    open_run,
    read_ledger,
    read_manifest,
)
from stagereplay.records.manifest import Manifest, bound_config, bound_stage


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """`I/N` with 0 <= I < N."""
    if spec is None:
        return None
    i, sep, n = spec.partition("/")
    if not sep or not i.isdigit() or not n.isdigit() or not 0 <= int(i) < int(n):
        raise StageReplayError(f"bad --shard {spec!r}", "use I/N with 0 <= I < N, e.g. 0/4")
    return int(i), int(n)


def shard_items(items: list[Any], shard: tuple[int, int] | None) -> list[Any]:
    if shard is None:
        return items
    i, n = shard
    return items[i::n]


def _identity(manifest: Manifest) -> dict[str, Any]:
    """What shards of one run share: the bound configuration less the shard and its items, and the stages."""
    config = bound_config(manifest.config)
    config.pop("shard", None)
    config.pop("item_ids", None)
    stages = {name: bound_stage(stage) for name, stage in manifest.stages.items()}
    return {"schema_version": manifest.schema_version, "config": config, "stages": stages}


def environment_notes(manifest: Manifest) -> list[str]:
    """One line per shard when the shards of a merged run were computed in different environments."""
    envs = manifest.shard_environments or {}
    if len({tuple(v) for v in envs.values()}) <= 1:
        return []
    return [f"shard {spec} was computed in environment {', '.join(h[:12] for h in hashes)}"
            for spec, hashes in envs.items()]


def merge_runs(shards: list[Path], out: Path) -> Path:
    """Check the shards belong to one run and cover it exactly once, then write the merged run to `out`.

    Only the manifest and ledger: `stagereplay.runs.merge` adds results and the report."""
    if not shards:
        raise StageReplayError("no shard directories given", "pass the --out folders of every shard")
    manifests = [read_manifest(p) for p in shards]
    for path, m in zip(shards, manifests, strict=True):
        if m.schema_version != SCHEMA_VERSION:
            raise StageReplayError(f"shard {path} has ledger schema {m.schema_version}, not {SCHEMA_VERSION}",
                                   "merge it with the stagereplay that made it")
    base = _identity(manifests[0])
    for path, m in zip(shards[1:], manifests[1:], strict=True):
        differ = diff_fields(base, _identity(m))
        models = [f for f in differ if f.startswith("config.model_hashes.")]
        if models:
            raise StageReplayError(f"shard {path} was made with a different model or tokenizer "
                                   f"({', '.join(models)} differ)", "merge only shards of one model")
        if differ:
            raise StageReplayError(f"shard {path} was made with a different configuration ({', '.join(differ)})",
                                   "merge only shards of one command")
    specs = [m.config.shard for m in manifests]
    if None in specs:
        raise StageReplayError(f"{shards[specs.index(None)]} is not a shard (no --shard in its manifest)",
                               "merge only runs made with --shard I/N")
    parsed = [p for p in (parse_shard(s) for s in specs) if p is not None]
    totals = {n for _, n in parsed}
    n_shards = totals.pop() if len(totals) == 1 else 0
    if totals or sorted(i for i, _ in parsed) != list(range(n_shards)):
        raise StageReplayError(f"shards {', '.join(map(str, specs))} do not cover the run exactly once",
                               "pass every shard I/N for I = 0..N-1, each once")
    by_index = {i: m for (i, _), m in zip(parsed, manifests, strict=True)}
    # Dataset order: shard i holds items i, i+N, i+2N, ...
    order: list[str] = []
    lists = [by_index[i].config.item_ids for i in range(n_shards)]
    for j in range(max(len(x) for x in lists)):
        order += [x[j] for x in lists if j < len(x)]
    position = {item: k for k, item in enumerate(order)}
    stage_order = list(manifests[0].stages)
    chains = [read_ledger(path) for path in shards]
    environments = {r.env: r.payload for chain in chains for r in chain if r.kind == "environment"}
    records: list[Record] = [r for chain in chains for r in items(chain)]
    records.sort(key=lambda r: (stage_order.index(f"{r.experiment}/{r.checkpoint}"), r.part, position[r.item_id]))
    first = manifests[0].as_json()
    config = {k: v for k, v in first["config"].items() if k != "shard"}
    manifest = Manifest.model_validate({
        **first, "config": {**config, "item_ids": order}, "stages": {},
        "merged_from": [str(p) for p in shards],
        "shard_environments": {spec: sorted({r.env for r in items(chain)})
                               for spec, chain in zip(specs, chains, strict=True)}})
    if out.exists():
        raise StageReplayError(f"--out {out} already exists", "merge into a new folder")
    with open_run(out, manifest) as run:
        for name, stage in manifests[0].stages.items():
            run.begin_stage(name, stage)
        for r in records:
            run.append(r.experiment, r.checkpoint, r.item_id, r.payload, r.part, environments.get(r.env))
    return out
