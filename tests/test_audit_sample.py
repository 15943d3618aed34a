"""An audit says how much it checked. `--sample N` re-executes N units of each stage and part (a precision, an honest
variant, attest's reference), as `plan` rows them, and the command, audit.json and `plan RUN` agree on it; a sampled
audit that reproduced says how many of how many records it re-executed, never "every record"; one that re-executed
nothing is INCONCLUSIVE, not a pass. `audit --verify-only` never calls a run complete whose records its experiment
cannot summarize (a mismatch record with one log-probability fewer than its tokens): the record is named and the
run FLAGGED. A torn ledger's notice is a one-line `warning:`, not a Python warning.

The runs are the toy's smallest: an attest run of 3 items (a served run, one honest variant, the reference: 9 records
in one stage), a matched run of 3 items and a mismatch run of 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from stagereplay.audit.reexecute import AuditConfig, exit_code, sample_units
from stagereplay.cli import app
from stagereplay.errors import FLAGGED, INCONCLUSIVE, OK
from stagereplay.records.audit_summary import AuditSummary, Sample
from stagereplay.records.ledger import Record, items, read_ledger
from stagereplay.records.summary import Count
from stagereplay.report.audit_lines import verdict_line

runner = CliRunner()
MATCHED = ["matched", "--n", "3", "--max-new-tokens", "8", "--quiet"]


def _invoke(args: list[str]) -> Result:
    return runner.invoke(app, args, env={"COLUMNS": "120"})


def _made(result: Result) -> None:
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("audit-sample")


@pytest.fixture(scope="module")
def attest_run(root: Path) -> Path:
    run = root / "attest"
    _made(_invoke(["attest", "--n", "3", "--max-new-tokens", "4", "--honest", "bf16", "--quiet", "--out", str(run)]))
    return run


@pytest.fixture(scope="module")
def matched_run(root: Path) -> Path:
    run = root / "matched"
    _made(_invoke([*MATCHED, "--out", str(run)]))
    return run


def test_a_sample_of_one_re_executes_one_unit_of_each_part_and_says_how_many(attest_run: Path):
    """One stage, three parts: `--sample 1` re-executes three records of nine, one of each part, and says so; the
    audit's table (audit.json, the report) and `plan RUN` count the same three."""
    result = _invoke(["audit", str(attest_run), "--sample", "1", "--quiet"])
    assert result.exit_code == OK, result.output
    assert ("(re-executed 3 of 9 records: a seeded sample of 1 per stage and part, seed 0)" in result.output
            ), result.output
    assert "audit: 3 of 9 records re-executed, all reproduced; the other 6 verified without the model" in result.output
    assert "every record reproduced" not in result.output
    sample = json.loads((attest_run / "audit.json").read_text())["sample"]
    assert sample["per_stage"] == 1 and sample["re_executed"] == 3 and sample["of"] == 9, sample
    assert sorted(part for _, part in sample["units"]["attest/primary"]) == ["", "bf16", "reference"], sample
    assert "a seeded sample of 3 of 9 (1 per stage" in (attest_run / "report.md").read_text()
    planned = _invoke(["plan", str(attest_run)])
    assert planned.exit_code == OK, planned.output
    rows = [line.split() for line in planned.output.splitlines() if line.startswith("audit@")]
    assert sum(int(row[2]) for row in rows) == 3, planned.output
    assert "per stage and part" in _invoke(["audit", "--help"]).output.replace("\n", " ").replace("│", "")


def test_a_full_audit_says_every_record_and_a_sampled_one_how_many(matched_run: Path):
    """A run without parts: `--sample 2` re-executes 2 of its 3 records; the full audit all 3."""
    sampled = _invoke(["audit", str(matched_run), "--sample", "2", "--quiet"])
    assert sampled.exit_code == OK, sampled.output
    assert "audit: 2 of 3 records re-executed, all reproduced; the other 1 verified" in sampled.output
    full = _invoke(["audit", str(matched_run), "--quiet"])
    assert full.exit_code == OK, full.output
    assert "(re-executed all 3 records)" in full.output and "audit: every record reproduced" in full.output
    verified = _invoke(["audit", str(matched_run), "--verify-only"])
    assert verified.exit_code == OK and "ledger intact, bound and complete: 3 records verified" in verified.output


def _records(parts: dict[str, int]) -> list[Record]:
    out = []
    for part, n in parts.items():
        for i in range(n):
            out.append(Record(seq=len(out) + 1, kind="item", experiment="attest", checkpoint="primary",
                              item_id=f"item-{i}", part=part, payload={}, prev_hash="", hash=""))
    return out


def test_the_sample_is_drawn_per_part_and_a_stage_without_parts_draws_as_it_did():
    """Each part gets its own seeded draw (`seed:stage@part`); a stage of one part draws `seed:stage`, so the samples
    audits of runs without parts recorded stay the ones they drew."""
    import random

    records = _records({"": 5, "bf16": 5, "reference": 5})
    picked = sample_units({"attest/primary": records}, AuditConfig(sample=2, seed=7))["attest/primary"]
    assert sorted(r.part for r in picked) == ["", "", "bf16", "bf16", "reference", "reference"]
    assert [r.seq for r in picked] == sorted(r.seq for r in picked)  # in ledger order
    plain = _records({"": 6})
    drawn = sample_units({"matched/primary": plain}, AuditConfig(sample=2, seed=3))["matched/primary"]
    want = sorted(random.Random("3:matched/primary").sample(range(6), 2))
    assert [r.seq for r in drawn] == [plain[k].seq for k in want]


def _summary(**fields) -> AuditSummary:
    return AuditSummary(chain_ok=True, broken_records=[], findings=[], reproduced=True, integrity_ok=True,
                        trajectories=Count(k=0, n=0), comparisons=Count(k=0, n=0), **fields)


def test_an_audit_that_re_executed_nothing_is_inconclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Nothing re-executed (a run that declares no unit) is no pass: INCONCLUSIVE, and the line says so. The
    control: one record re-executed of one is OK."""
    nothing = _summary(items=0, records=0)
    assert exit_code(nothing) == INCONCLUSIVE and "re-executed nothing" in verdict_line(nothing)
    none_sampled = _summary(items=2, records=2, sample=Sample(per_stage=1, seed=0, units={}, re_executed=0, of=2))
    assert exit_code(none_sampled) == INCONCLUSIVE and "re-executed nothing" in verdict_line(none_sampled)
    assert exit_code(_summary(items=1, records=1)) == OK
    assert exit_code(_summary(records=0, verify_only=True)) == INCONCLUSIVE
    monkeypatch.setattr("stagereplay.runs.audit", lambda *_: nothing)
    result = _invoke(["audit", str(tmp_path)])
    assert result.exit_code == INCONCLUSIVE, result.output
    assert result.output.splitlines() == [
        "re-executed no record: no trajectory or comparison was checked",
        "audit: re-executed nothing (the run declares no unit to re-execute), so nothing was reproduced; its ledger "
        "verified without the model"], result.output


def test_verify_never_calls_a_run_complete_that_its_experiment_cannot_summarize(root: Path):
    """A mismatch record whose `prefill` arm holds 5 log-probabilities for 6 tokens, forged with every hash valid and
    no results.json (the run's summary failed as it was written): verify names the record and exits FLAGGED, and
    the full audit finds it too. The control: the run as made verifies."""
    import forge

    from stagereplay.records import arrays

    run = root / "mismatch"
    _made(_invoke(["mismatch", "--n", "2", "--max-new-tokens", "6", "--precisions", "bf16", "--quiet", "--out",
                   str(run)]))
    verified = _invoke(["audit", str(run), "--verify-only"])
    assert verified.exit_code == OK and "ledger intact, bound and complete" in verified.output, verified.output
    chain, manifest = forge.load(run)
    k = next(i for i, r in enumerate(chain) if r.kind == "item" and r.experiment == "mismatch" and not r.part)
    payload = forge.edit(chain[k])
    arm = next(a for a in payload["arms"] if a["name"] == "prefill")
    arm["logprobs"] = arrays.encode(arrays.decode(arm["logprobs"])[:-1], "f32")
    arm["logprobs_fp"] = arrays.fingerprint(arm["logprobs"])
    chain[k] = forge.with_payload(chain[k], payload, recompare=False)
    forge.save(run, chain, manifest, results=False)
    (run / "results.json").unlink()
    found = _invoke(["audit", str(run), "--verify-only"])
    assert found.exit_code == FLAGGED, found.output
    assert "ledger intact, bound and complete" not in found.output
    assert (f"{chain[k].item_id}: mismatch/primary: its summary fails on this record (ValueError: operands could "
            "not be broadcast") in found.output, found.output


def test_a_torn_ledger_is_said_in_one_warning_line(root: Path, matched_run: Path):
    """Resuming a run whose last record was torn sets it aside and redoes it, saying so in one `warning:` line."""
    run = root / "torn"
    shutil.copytree(matched_run, run)
    lines = (run / "ledger.jsonl").read_bytes().splitlines(keepends=True)
    (run / "ledger.jsonl").write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    result = _invoke([*(a for a in MATCHED if a != "--quiet"), "--out", str(run)])
    assert result.exit_code == OK, result.output
    said = [line for line in result.output.splitlines() if "incomplete last record" in line]
    assert said == [f"warning: {run / 'ledger.jsonl'}: an incomplete last record was set aside in ledger.jsonl.torn "
                    "and will be redone"], result.output
    assert "UserWarning" not in result.output
    assert [r.hash for r in items(read_ledger(run))] == [r.hash for r in items(read_ledger(matched_run))]
