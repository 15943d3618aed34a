"""The audit's contract beyond the forgery table: the manifest is bound (an edit of it alone is caught without
a model), the bound identity holds no location, runs of ledger schema 1 still read and audit with a note,
and every record carries the environment that computed it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.records.ledger import read_ledger, read_manifest
from stagereplay.records.manifest import bound_identity, chain_start

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures"
RUN = FIXTURES / "run_paper"  # a real run: fixtures/make_fixtures.py
SCHEMA_1 = FIXTURES / "schema1"


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(run: Path, change) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    change(manifest)
    (run / "manifest.json").write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize(
    ("case", "change", "reason"),
    [
        ("configuration", lambda m: m["config"]["settings"]["decode"].update(max_new_tokens=99), "identity"),
        ("item ids", lambda m: m["config"]["item_ids"].pop(), "identity"),
        ("model hashes", lambda m: m["config"]["model_hashes"]["primary"].update(weights="0" * 64), "identity"),
        ("a stage's settings", lambda m: m["stages"]["bridge/primary"].update(rows=2), "stage bridge/primary"),
        ("a selection", lambda m: m["stages"]["transplant/primary"]["selected"].pop(), "stage transplant/primary"),
        ("a stage's precision", lambda m: m["stages"]["precision_2x2/primary"].update(precisions=["bf16"]),
         "stage precision_2x2/primary"),
    ],
)
def test_an_edit_of_the_manifest_alone_breaks_the_chain(tmp_path, case, change, reason):
    run = _copy(RUN, tmp_path)
    _edit_manifest(run, change)
    result = runner.invoke(app, ["audit", str(run), "--verify-only"])
    assert result.exit_code == 1 and "ledger damaged" in result.stdout
    line = next(x for x in result.stderr.splitlines() if "ledger record" in x)
    assert ("the run's identity" in line or "configuration or item ids" in line) if reason == "identity" \
        else reason in line, line


def test_an_edit_of_a_location_is_not_a_finding(tmp_path):
    """Paths are where to look, not what was run: the chain binds the files' hashes, and a path may move."""
    run = _copy(RUN, tmp_path)
    before = chain_start(read_manifest(run))

    def move(m):
        m["config"]["model"]["path"] = "/elsewhere/primary"
        m["config"]["data"]["path"] = "/elsewhere/items.jsonl"
        m["config"]["later_model"] = "/elsewhere/later"
        for stage in m["stages"].values():
            stage["model"]["path"] = "/elsewhere/x"

    _edit_manifest(run, move)
    assert chain_start(read_manifest(run)) == before
    assert "path" not in json.dumps(bound_identity(read_manifest(run)))
    assert runner.invoke(app, ["audit", str(run), "--verify-only"]).exit_code == 0


def test_each_record_names_its_environment_recorded_in_full_before_it():
    chain = read_ledger(RUN)
    environments = {r.env: r.payload for r in chain if r.kind == "environment"}
    assert len(environments) >= 1
    for name in ("cuda", "cudnn", "driver", "gpu", "kernels", "packages", "git", "determinism"):
        assert all(name in env for env in environments.values()), name
    kernels = next(iter(environments.values()))["kernels"]
    assert set(kernels) == {"sdpa", "reduced_precision", "cpu"}
    assert "float32_matmul_precision" in kernels["reduced_precision"]  # and on CUDA, TF32 and the reductions
    items = [r for r in chain if r.kind == "item"]
    assert items and all(r.env in environments for r in items)
    hashes = read_manifest(RUN).config.model_hashes["primary"]
    assert {"generation_config", "tokenizer_files"} <= set(hashes)


def test_stage_records_come_before_their_items():
    chain = read_ledger(RUN)
    first_item = {}
    for r in chain:
        first_item.setdefault((r.kind, r.experiment, r.checkpoint), r.seq)
    stages = {(e, c): s for (k, e, c), s in first_item.items() if k == "stage"}
    assert set(stages) == {tuple(n.split("/")) for n in read_manifest(RUN).stages}
    for (kind, e, c), seq in first_item.items():
        if kind == "item":
            assert stages[(e, c)] < seq


# -- schema 1 ----------------------------------------------------------------------------------------------


def _schema_1(tmp_path: Path, tiny_dir, items_file) -> Path:
    """The schema 1 fixture, pointed at this machine's tiny model and items (paths are not bound)."""
    run = _copy(SCHEMA_1, tmp_path)

    def here(m):
        m["config"]["model"]["path"] = str(tiny_dir("qwen2"))
        m["config"]["data"]["path"] = str(items_file)
        for stage in m["stages"].values():
            stage["model"]["path"] = str(tiny_dir("qwen2"))

    _edit_manifest(run, here)
    return run


def test_a_schema_1_run_verifies_with_a_note(tmp_path):
    run = _copy(SCHEMA_1, tmp_path)
    result = runner.invoke(app, ["audit", str(run), "--verify-only"])
    assert result.exit_code == 0, result.stderr
    assert "note: ledger schema 1: its manifest is not bound" in result.stderr


def test_a_schema_1_run_reaudits_and_is_not_extended(tmp_path, tiny_dir, items_file):
    """Schema 1 recorded no environment, so nothing says which kernels made its bf16 records: on the CPU kind
    that made the fixture every record is reproduced (exit 0); on another, the audit must not call the
    differences tampering, but say they were not reproduced under other kernels (exit 3)."""
    run = _schema_1(tmp_path, tiny_dir, items_file)
    ledger = (run / "ledger.jsonl").read_bytes()
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert "note: ledger schema 1" in result.stderr and "trajectories reproduced " in result.stdout
    audit = json.loads((run / "audit.json").read_text())
    assert audit["trajectories"]["n"] == 28 and audit["integrity_ok"], result.stderr
    if result.exit_code == 0:
        assert audit["trajectories"]["k"] == 28
    else:
        assert result.exit_code == 3, result.stderr
        first = result.stderr.splitlines()[0]
        assert first.startswith("environment: this machine's kernels differ from the run's for ")
        assert first.endswith("records: environment not recorded (run) vs this machine's (here)")
        assert {m["kind"] for m in audit["mismatches"]} == {"not_reproduced_here"}
    assert (run / "ledger.jsonl").read_bytes() == ledger
    refused = runner.invoke(app, ["bridge", str(run), "--rows", "3", "--quiet"])
    assert refused.exit_code == 2 and "ledger schema 1, which this stagereplay audits but does not extend" in \
        refused.stderr
    assert (run / "ledger.jsonl").read_bytes() == ledger


def test_findings_and_breaks_are_written_as_audit_json_holds_them():
    """audit.json holds a finding as {item_id, what[, kind]} and a chain break as {seq, reason}: `audit_json` writes
    the models so, a finding's kind only once the audit has told integrity from other kernels (the control: a
    model-free check's finding has none), and they read back as the models they were."""
    from stagereplay.records.audit_summary import AuditSummary, audit_json
    from stagereplay.records.findings import Break, Finding

    found = Finding(item_id="q1", what="matched/primary arm live: suffix_fp not reproduced")
    summary = AuditSummary(chain_ok=False, broken_records=[Break(seq=3, reason="content does not match its hash")],
                           findings=[found, found.of_kind("not_reproduced_here"), Finding(what="results.json x")],
                           reproduced=False)
    text = audit_json(summary)
    assert json.loads(text) == {
        "chain_ok": False,
        "broken_records": [{"seq": 3, "reason": "content does not match its hash"}],
        "mismatches": [{"item_id": "q1", "what": found.what},
                       {"item_id": "q1", "what": found.what, "kind": "not_reproduced_here"},
                       {"item_id": "", "what": "results.json x"}],
        "reproduced": False}
    assert AuditSummary.model_validate_json(text) == summary
    assert found.integrity and not found.of_kind("not_reproduced_here").integrity
