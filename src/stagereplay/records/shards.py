"""Shards for batch schedulers (SLURM and the like): `--shard I/N` runs every N-th item; `merge` joins the shards.

A merged run is the run that one process would have made: the same manifest identity (less the shard), the
records in canonical order (experiment stage order, then item order of the dataset), the hash chain rebuilt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.records.ledger import Record, diff_fields, open_run, read_ledger, read_manifest


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


def _identity(manifest: dict[str, Any]) -> dict[str, Any]:
    config = dict(manifest.get("config", {}))
    config.pop("shard", None)
    config.pop("item_ids", None)
    return {"config": config, "stages": manifest.get("stages", {})}


def merge_runs(shards: list[Path], out: Path) -> Path:
    """Check the shards belong to one run and cover it exactly once, then write the merged run to `out`.

    Only the manifest and ledger: `stagereplay.runs.merge` adds results and the report."""
    if not shards:
        raise StageReplayError("no shard directories given", "pass the --out folders of every shard")
    manifests = [read_manifest(p) for p in shards]
    base = _identity(manifests[0])
    for path, m in zip(shards[1:], manifests[1:], strict=True):
        differ = diff_fields(base, _identity(m))
        if differ:
            raise StageReplayError(f"shard {path} was made with a different configuration ({', '.join(differ)})",
                                   "merge only shards of one command")
    specs = [m["config"].get("shard") for m in manifests]
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
    lists = [by_index[i]["config"]["item_ids"] for i in range(n_shards)]
    for j in range(max(len(x) for x in lists)):
        order += [x[j] for x in lists if j < len(x)]
    position = {item: k for k, item in enumerate(order)}
    stage_order = list(manifests[0].get("stages", {}))
    records: list[Record] = [r for path in shards for r in read_ledger(path)]
    records.sort(key=lambda r: (stage_order.index(f"{r.experiment}/{r.checkpoint}"), r.part, position[r.item_id]))
    manifest = json.loads(json.dumps(manifests[0]))
    manifest["config"].pop("shard")
    manifest["config"]["item_ids"] = order
    manifest["merged_from"] = [str(p) for p in shards]
    if out.exists():
        raise StageReplayError(f"--out {out} already exists", "merge into a new folder")
    with open_run(out, {**manifest, "stages": {}}) as run:
        for name, stage in manifests[0].get("stages", {}).items():
            run.begin_stage(name, stage)
        for r in records:
            run.append(r.experiment, r.checkpoint, r.item_id, r.payload, r.part)
    return out
