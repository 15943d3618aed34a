"""A careful forger's tools: edit a run's manifest and records, then recompute everything a checksum would
catch (fingerprints that follow from an edit, comparisons, stage records, the identity hash, every link and
hash of the chain), so that only what the audit re-derives can tell."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagereplay.engine.lm import ids_fingerprint
from stagereplay.experiments.protocol.arms import comparison
from stagereplay.records.ledger import Record, canonical_json, items, read_manifest
from stagereplay.records.manifest import bound_stage, chain_start
from stagereplay.report.results import build_results


def load(run: Path) -> tuple[list[Record], dict[str, Any]]:
    """The chain, and the manifest as JSON to edit."""
    chain = [Record.model_validate_json(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    return chain, read_manifest(run).as_json()


def save(run: Path, chain: list[Record], edited: dict[str, Any], results: bool = True) -> None:
    """Write the manifest, refresh each stage record from it, rebuild the chain from its identity hash, and
    rebuild results.json from the forged records (`results` False: leave it as it was, for a forged payload that no
    summary reads)."""
    (run / "manifest.json").write_text(json.dumps(edited, indent=2) + "\n")
    manifest = read_manifest(run)
    stages = manifest.stages
    prev, lines, rebuilt = chain_start(manifest), [], []
    for i, r in enumerate(chain):
        update: dict[str, Any] = {"seq": i, "prev_hash": prev}
        name = f"{r.experiment}/{r.checkpoint}"
        if r.kind == "stage" and name in stages:
            update["payload"] = bound_stage(stages[name])
        r = r.model_copy(update=update)
        r = r.model_copy(update={"hash": r.computed_hash()})
        lines.append(canonical_json(r.model_dump()) + b"\n")
        rebuilt.append(r)
        prev = r.hash
    (run / "ledger.jsonl").write_bytes(b"".join(lines))
    if results:
        built = build_results(run, manifest, items(rebuilt))
        (run / "results.json").write_text(json.dumps(built.as_json(), indent=2) + "\n")


def with_payload(record: Record, payload: dict[str, Any], recompare: bool = True) -> Record:
    """The record with `payload`; with `recompare`, its suffix fingerprints and comparisons recomputed from the
    arms as the experiment would have written them."""
    payload = json.loads(json.dumps(payload))
    if recompare:
        for arm in payload.get("arms", []):
            arm["suffix_fp"] = ids_fingerprint(arm["suffix_ids"])
        arms = {a["name"]: a for a in payload.get("arms", [])}
        payload["comparisons"] = [comparison(record.item_id, arms[c["a"]], arms[c["b"]])
                                  for c in payload.get("comparisons", [])]
    return record.model_copy(update={"payload": payload})


def edit(record: Record) -> dict[str, Any]:
    """A deep copy of the record's payload to edit."""
    return json.loads(json.dumps(record.payload))


def carry_over(chain: list[Record], k: int) -> None:
    """After editing the matched record `chain[k]`, edit the copies too: every 2x2 or transplant arm that carries
    one of its arms over (`same_as`) gets that arm's fields, and what follows from the arms is recomputed (a 2x2's
    comparisons, a transplant's outcomes), as a careful forger would."""
    from stagereplay.experiments.protocol.transplant import followed

    source = chain[k]
    arms = {f"{source.experiment}/{source.checkpoint}:{a['name']}": a for a in source.payload.get("arms", [])}
    for i, r in enumerate(chain):
        if r.kind != "item" or r.experiment not in ("precision_2x2", "transplant") or r.item_id != source.item_id:
            continue
        p = edit(r)
        for a in p.get("arms", []):
            if a.get("same_as") in arms:
                a.update({f: v for f, v in arms[a["same_as"]].items() if f not in ("name", "construction")})
        if r.experiment == "transplant" and p.get("status") == "ok":
            suffix = {a["name"]: tuple(a["suffix_ids"]) for a in p["arms"]}
            fresh = next(a["name"] for a in p["arms"] if a["name"] != "live" and "->" not in a["name"])
            p["baseline_diverges"] = suffix["live"] != suffix[fresh]
            for key, prefix in (("directions", ""), ("control", "control:")):
                for direction in p.get(key, {}):
                    donor, _, recipient = direction.partition("->")
                    p[key][direction] = followed(suffix[f"{prefix}{direction}"], suffix[donor],
                                                 suffix[recipient]).as_payload()
        chain[i] = with_payload(r, p)


def forge_arm(run: Path, to: Path, arm_name: str) -> None:
    """A copy of `run` at `to` whose first reached item has its arm `arm_name`'s last suffix token changed (and its
    top-1 logprob's token with it), every checksum recomputed: `--verify-only` passes it, re-execution does not."""
    import shutil

    shutil.copytree(run, to)
    (to / "audit.json").unlink(missing_ok=True)
    chain, manifest = load(to)
    i = next(k for k, r in enumerate(chain) if r.kind == "item" and r.payload["status"] == "ok")
    payload = edit(chain[i])
    arm = next(a for a in payload["arms"] if a["name"] == arm_name)
    arm["suffix_ids"][-1] = (arm["suffix_ids"][-1] + 1) % 256
    arm["top_logprobs"][-1][0][0] = arm["suffix_ids"][-1]
    chain[i] = with_payload(chain[i], payload)
    save(to, chain, manifest)


def plant_token(run: Path, to: Path, step: int, arms: tuple[str, ...] = ("live", "live#replica"), nth: int = 0
                ) -> str:
    """A copy of `run` at `to` whose `nth` matched item (of those whose live suffix reaches `step`) has the suffix
    token at `step` of each arm in `arms` changed to another (and a serving arm's top-1 logprob's token with it),
    every checksum recomputed; the run still verifies. Live and its replica by default, so the forged run stays
    self-consistent. Returns the item's id."""
    import shutil

    shutil.copytree(run, to)
    (to / "audit.json").unlink(missing_ok=True)
    chain, manifest = load(to)
    reach = [k for k, r in enumerate(chain) if r.kind == "item" and r.experiment == "matched"
             and r.payload["status"] == "ok"
             and len(next(a for a in r.payload["arms"] if a["name"] == "live")["suffix_ids"]) > step]
    i = reach[nth]
    payload = edit(chain[i])
    for arm in (a for a in payload["arms"] if a["name"] in arms):
        arm["suffix_ids"][step] = (arm["suffix_ids"][step] + 1) % 256
        if arm.get("top_logprobs"):
            arm["top_logprobs"][step][0][0] = arm["suffix_ids"][step]
    chain[i] = with_payload(chain[i], payload)
    save(to, chain, manifest)
    return chain[i].item_id
