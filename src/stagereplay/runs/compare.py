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
from stagereplay.experiments.core.compare_manifests import RunSide, check_comparable
from stagereplay.experiments.core.compared import RunComparison
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
    comparison = own_comparison(a, b, checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    write_compare(out, comparison)
    return comparison


def own_comparison(a: RunSide, b: RunSide, checkpoint: str) -> RunComparison:
    """The comparison of the experiment that made both runs (`Experiment.compare_runs`: matched's live trajectories,
    mismatch's gap, attest's decision); refused in one line where the runs hold no records of one experiment that
    starts runs at `checkpoint`."""
    from stagereplay.experiments.core.registry import all_experiments

    starters = [e for e in all_experiments() if e.shape.starts_run]
    for e in starters:
        name = f"{e.name}/{checkpoint}"
        if a.manifest.stage(name) is None or b.manifest.stage(name) is None:
            continue
        own = e.compare_runs(a, b, checkpoint)
        if own is not None:
            return own
    held = next((e for e in starters if a.checkpoints(e.name) or b.checkpoints(e.name)), starters[0])
    check_comparable(a, b, checkpoint, held.name)  # names the checkpoints the runs hold
    raise StageReplayError(f"{a.path} and {b.path} hold no records of one experiment at checkpoint {checkpoint}",
                           "compare two runs of one experiment (matched, mismatch, attest, ...)")


def verified(run: Path) -> RunSide:
    """The run, read once its ledger verifies; refused in one line otherwise."""
    if not run.is_dir():
        raise StageReplayError(f"{run} is not a run directory", "pass the folders two runs were made in")
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
