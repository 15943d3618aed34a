"""The manifest's part in the hash chain: the run's frozen identity and each stage's frozen section.

The ledger's first record links to the hash of the run's identity (`chain_start`), and each stage's frozen
section enters the chain as a `stage` record before that stage's first item. An edit of the configuration,
the item ids, a stage's settings or a transplant selection then breaks the chain, and `audit --verify-only`
sees it without a model.

What is bound is what decides the numbers, not where the files lay: a model or data *path* is a location
(the same run made from another checkout, or merged from shards made on other machines, must bind the same
identity), while the model's config, weight, tokenizer and generation-config hashes and the dataset hash,
which are bound, identify the inputs. The audit checks that the model found at the path has those hashes.
"""

from __future__ import annotations

import json
from typing import Any

from stagereplay.records.record import GENESIS, Record, diff_fields, sha256_json

UNBOUND_CONFIG = (("model", "path"), ("data", "path"), ("later_model",))
"""Locations in `config` that the chain does not bind (their files are bound by hash)."""


Stage = dict[str, Any]
"""A stage's frozen section of the manifest (`stages["<experiment>/<checkpoint>"]`), as JSON gives it back."""


def _drop(obj: dict[str, Any], path: tuple[str, ...]) -> None:
    *parents, last = path
    for key in parents:
        obj = obj.get(key) if isinstance(obj.get(key), dict) else {}  # type: ignore[assignment]  # walks dicts
    obj.pop(last, None)


def bound_config(config: dict[str, Any]) -> dict[str, Any]:
    """The configuration as the chain binds it: everything but the locations of its files."""
    out: dict[str, Any] = json.loads(json.dumps(config))
    for path in UNBOUND_CONFIG:
        _drop(out, path)
    return out


def bound_stage(stage: dict[str, Any]) -> dict[str, Any]:
    """A stage's frozen section as the chain binds it (its model path is a location; the run binds its hashes)."""
    out: dict[str, Any] = json.loads(json.dumps(stage))
    _drop(out, ("model", "path"))
    return out


def bound_identity(manifest: dict[str, Any]) -> dict[str, Any]:
    return {"schema_version": manifest.get("schema_version"), "command": manifest.get("command"),
            "config": bound_config(manifest.get("config", {}))}


def binds(manifest: dict[str, Any]) -> bool:
    """Schema 1 runs predate the binding: their chain starts at 64 zeros and they have no stage records."""
    return int(manifest.get("schema_version", 0)) >= 2


def chain_start(manifest: dict[str, Any]) -> str:
    """The `prev_hash` of the first record: the hash of the run's frozen identity (GENESIS for schema 1)."""
    return sha256_json(bound_identity(manifest)) if binds(manifest) else GENESIS


def stage_name(record: Record) -> str:
    return f"{record.experiment}/{record.checkpoint}"


def binding_problems(manifest: dict[str, Any], chain: list[Record]) -> list[dict[str, Any]]:
    """Where the manifest and the chain disagree, as {seq, reason}: the identity (checked by the first record's
    link), the stages (each declared stage has one stage record, equal to its section, before its items) and
    the environments (each item names one recorded before it, whose hash is its content)."""
    if not binds(manifest):
        return []
    problems: list[dict[str, Any]] = []
    if chain and chain[0].prev_hash != chain_start(manifest):
        problems.append({"seq": 0, "reason": "the manifest's configuration or item ids are not the ones the "
                                             "ledger was made under (prev_hash of the first record)"})
    declared = manifest.get("stages", {})
    staged: dict[str, Record] = {}
    environments: set[str] = set()
    for r in chain:
        name = stage_name(r)
        if r.kind == "stage":
            if name in staged:
                problems.append({"seq": r.seq, "reason": f"stage {name} is recorded twice"})
            elif name not in declared:
                problems.append({"seq": r.seq, "reason": f"stage {name} is not declared in the manifest"})
            elif r.payload != bound_stage(declared[name]):
                fields = diff_fields(r.payload, bound_stage(declared[name]))
                problems.append({"seq": r.seq, "reason": f"the manifest's stage {name} differs from the one "
                                                         f"the ledger was made under ({', '.join(fields)})"})
            staged[name] = r
        elif r.kind == "environment":
            if r.env != sha256_json(r.payload):
                problems.append({"seq": r.seq, "reason": "environment record does not match its hash"})
            elif r.env in environments:
                problems.append({"seq": r.seq, "reason": "environment recorded twice"})
            environments.add(r.env)
        else:
            if name not in staged:
                problems.append({"seq": r.seq, "reason": f"item {r.item_id} comes before its stage {name} record"})
            if r.env not in environments:
                problems.append({"seq": r.seq, "reason": f"item {r.item_id} names an environment not recorded "
                                                         "before it"})
    for name in declared:
        if name not in staged:
            problems.append({"seq": len(chain), "reason": f"stage {name} of the manifest has no stage record"})
    return problems

