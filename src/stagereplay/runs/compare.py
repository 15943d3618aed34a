"""`compare(run_a, run_b, out)`: two verified runs of the same items under two settings, side by side
(`report.compare`), written to `out` as compare.json, compare.md and compare.html.

Both ledgers are verified first, without a model (`audit.verify.verify_run`: the chain, its binding to the
manifest, completeness, every claim a record makes, results.json): a comparison of records that are not what their
run made would be a comparison of nothing. A difference between the runs is a finding, not an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stagereplay.audit.verify import verify_run
from stagereplay.errors import StageReplayError
from stagereplay.records.ledger import read_ledger, read_manifest
from stagereplay.report.compare import build_comparison
from stagereplay.report.compare_manifests import RunSide
from stagereplay.report.compare_render import write_compare


def compare(run_a: Path, run_b: Path, out: Path, checkpoint: str = "primary") -> dict[str, Any]:
    """Verify both runs, compare them at `checkpoint`, write the three files into `out`; return compare.json's
    content. Refuses (`StageReplayError`) a run that does not verify, runs of different models, tokenizers or
    items, and an `out` that is one of the runs."""
    run_a, run_b, out = Path(run_a), Path(run_b), Path(out)
    for run in (run_a, run_b):
        if out.resolve() == run.resolve():
            raise StageReplayError(f"--out {out} is the run {run}", "write the comparison beside the runs, not into one")
    if out.exists() and not out.is_dir():
        raise StageReplayError(f"--out {out} exists and is not a directory", "choose another --out")
    sides = [verified(run) for run in (run_a, run_b)]
    comparison = build_comparison(sides[0], sides[1], checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    write_compare(out, comparison)
    return comparison


def verified(run: Path) -> RunSide:
    """The run, read once its ledger verifies; refused in one line otherwise."""
    if not run.is_dir():
        raise StageReplayError(f"{run} is not a run directory", "pass the folders two `stagereplay matched` runs made")
    manifest = read_manifest(run)
    res = verify_run(run, manifest)
    if not res["chain_ok"]:
        first = res["broken_records"][0]
        raise StageReplayError(f"{run}'s ledger is broken (record {first.seq}: {first.reason}): its records "
                               f"cannot be compared", f"`stagereplay audit {run} --verify-only` lists every break")
    if not res["reproduced"]:
        findings = res["mismatches"]
        first = findings[0]
        what = f"{first.item_id}: {first.what}" if first.item_id else first.what
        raise StageReplayError(f"{run}'s records do not verify ({len(findings)} finding(s), the first: {what})",
                               f"`stagereplay audit {run} --verify-only` lists them")
    return RunSide(run, manifest, read_ledger(run))
