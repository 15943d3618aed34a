"""`compare(run_a, run_b, out)`: two verified runs of the same items under two settings, side by side
(`experiments.protocol.compare`), written to `out` (by default `<A>-vs-<B>` beside run A) as compare.json, compare.md and
compare.html.

Both ledgers are verified first, without a model (`audit.verify.verify_run`: the chain, its binding to the
manifest, completeness, every claim a record makes, results.json): a comparison of records that are not what their
run made would be a comparison of nothing. A difference between the runs is a finding, not an error.
"""

from __future__ import annotations

from pathlib import Path

from stagereplay.audit.verify import verify_run
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.compare_manifests import RunSide, check_comparable, manifest_differences
from stagereplay.experiments.core.compared import RunComparison
from stagereplay.experiments.protocol.compare import build_comparison
from stagereplay.experiments.protocol.compare_tables import matched_comparison
from stagereplay.experiments.protocol.matched_stage import EXPERIMENT as MATCHED
from stagereplay.records.findings import Break
from stagereplay.records.ledger import read_ledger, read_manifest
from stagereplay.report.compare_render import write_compare


def default_out(run_a: Path, run_b: Path) -> Path:
    """Where a comparison goes when no folder is given: `<A>-vs-<B>` beside run A (in A's parent folder)."""
    a, b = Path(run_a).resolve(), Path(run_b).resolve()
    return a.parent / f"{a.name}-vs-{b.name}"


def compare(run_a: Path, run_b: Path, out: Path | None = None, checkpoint: str = "primary") -> RunComparison:
    """Verify both runs, compare them at `checkpoint`, write the three files into `out` (`default_out` when None);
    return the comparison (`.document` is compare.json as its model). Refuses (`StageReplayError`) a run that does
    not verify, runs of different models, tokenizers or items, and an `out` that is one of the runs or a file."""
    run_a, run_b = Path(run_a), Path(run_b)
    given = out is not None
    out = Path(out) if out is not None else default_out(run_a, run_b)
    named = f"--out {out}" if given else f"the default folder {out} (no --out given)"
    for run in (run_a, run_b):
        if out.resolve() == run.resolve():
            raise StageReplayError(f"{named} is the run {run}", "write the comparison beside the runs, not into one")
    if out.exists() and not out.is_dir():
        raise StageReplayError(f"{named} exists and is not a directory",
                               "choose another --out" if given else "pass --out a folder to write into")
    a, b = (verified(run) for run in (run_a, run_b))
    comparison = own_comparison(a, b, checkpoint) or matched_comparison(build_comparison(a, b, checkpoint))
    out.mkdir(parents=True, exist_ok=True)
    write_compare(out, comparison)
    return comparison


def own_comparison(a: RunSide, b: RunSide, checkpoint: str) -> RunComparison | None:
    """The comparison of the experiment that made both runs, where it compares its runs itself
    (`Experiment.compare_runs`); None where the matched comparison is the one."""
    from stagereplay.experiments.core.registry import all_experiments

    for e in all_experiments():
        name = f"{e.name}/{checkpoint}"
        stage_a, stage_b = a.manifest.stage(name), b.manifest.stage(name)
        if not e.starts_run or stage_a is None or stage_b is None:
            continue
        check_comparable(a, b, checkpoint, e.name, also="paper" if e.name == MATCHED else "")
        records = a.matched(checkpoint, e.name), b.matched(checkpoint, e.name)
        own = e.compare_runs(records, list(a.manifest.config.item_ids), checkpoint, (stage_a, stage_b),
                             (str(a.path), str(b.path)), manifest_differences(a, b, checkpoint, e.name))
        if own is not None:
            return own
    return None


def verified(run: Path) -> RunSide:
    """The run, read once its ledger verifies; refused in one line otherwise."""
    if not run.is_dir():
        raise StageReplayError(f"{run} is not a run directory", "pass the folders two `stagereplay matched` runs made")
    manifest = read_manifest(run)
    res = verify_run(run, manifest)
    if not res.chain_ok:
        broken = res.broken_records[0]
        where = f"record {broken.seq}: {broken.reason}" if isinstance(broken, Break) else f"record {broken}"
        raise StageReplayError(f"{run}'s ledger is broken ({where}): its records "
                               f"cannot be compared", f"`stagereplay audit {run} --verify-only` lists every break")
    if not res.reproduced:
        findings = res.findings
        first = findings[0]
        what = f"{first.item_id}: {first.what}" if first.item_id else first.what
        raise StageReplayError(f"{run}'s records do not verify ({len(findings)} finding(s), the first: {what})",
                               f"`stagereplay audit {run} --verify-only` lists them")
    return RunSide(run, manifest, read_ledger(run))
