"""What the engine tiers' mismatch tests read of a run and forge in it (vLLM, llama.cpp, a server): the records by
item and part, an arm's log-probabilities, the one set of tokens every arm scored, and a forged log-probability the
audit must find."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from stagereplay.cli import app

runner = CliRunner()


def by_part(run: Path) -> dict[str, dict[str, dict]]:
    """Per item, per part ('' the rollout's, else a trainer precision), the record's payload."""
    out: dict[str, dict[str, dict]] = {}
    for line in (run / "ledger.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "item" and r["experiment"] == "mismatch":
            out.setdefault(r["item_id"], {})[r["part"]] = r["payload"]
    return out


def arms(payload: dict) -> dict[str, dict]:
    return {a["name"]: a for a in payload["arms"]}


def logprob_array(arm: dict) -> np.ndarray:
    from stagereplay.records import arrays

    return arrays.decode(arm["logprobs"])


def logprob_bits(arm: dict) -> bytes:
    return logprob_array(arm).tobytes()


def one_set_of_tokens(item_parts: dict[str, dict]) -> None:
    """Every arm of every part scored the rollout's tokens (replicas their own, equal ones), and each replica is the
    bits of its arm."""
    from stagereplay.engine.lm import ids_fingerprint

    main = item_parts[""]
    fp = ids_fingerprint([*main["prompt_ids"], *main["response_ids"]])
    for payload in item_parts.values():
        held = arms(payload)
        assert payload["tokens_fp"] == fp and all(a["tokens_fp"] == fp for a in held.values()), payload["arms"]
        for name, arm in held.items():
            if name.endswith("#replica"):
                assert logprob_bits(arm) == logprob_bits(held[name.removesuffix("#replica")]), name


def audit_finds_a_forged_logprob(mismatch_run: Path, tmp_path: Path, arm: str, position: int, units: int) -> None:
    """The audit re-executes every one of `units` trajectories of the run and reproduces them. A forger who moves
    `arm`'s log-probability at `position` of one rollout record by 0.125 and recomputes every checksum passes
    --verify-only and fails the re-execution, on that arm's two fields and nothing but integrity."""
    import forge

    from stagereplay.records import arrays

    run = tmp_path / "run"
    shutil.copytree(mismatch_run, run)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 0, result.output
    audit = json.loads((run / "audit.json").read_text())
    assert audit["reproduced"] and audit["trajectories"]["k"] == audit["trajectories"]["n"] == units
    forged = tmp_path / "forged"
    shutil.copytree(mismatch_run, forged)
    chain, manifest = forge.load(forged)
    i = next(k for k, r in enumerate(chain) if r.kind == "item" and r.experiment == "mismatch" and not r.part)
    payload = forge.edit(chain[i])
    moved = arms(payload)[arm]
    lps = logprob_array(moved).copy()
    lps[position] = np.float32(lps[position] - 0.125)
    moved["logprobs"] = arrays.encode(lps, "f32")
    moved["logprobs_fp"] = arrays.fingerprint(moved["logprobs"])
    chain[i] = forge.with_payload(chain[i], payload, recompare=False)
    forge.save(forged, chain, manifest)
    assert runner.invoke(app, ["audit", str(forged), "--verify-only"]).exit_code == 0
    result = runner.invoke(app, ["audit", str(forged), "--quiet"])
    assert result.exit_code == 1, result.output
    found = json.loads((forged / "audit.json").read_text())["mismatches"]
    named = [m["what"] for m in found if ": arm " in m["what"]]  # and the results rebuilt from it differ
    assert named == [f"mismatch/primary {chain[i].item_id}: arm {arm}: {f} not reproduced"
                     for f in ("logprobs", "logprobs_fp")], found
    assert all(m["kind"] == "integrity" for m in found), found
