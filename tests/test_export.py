"""The ledger export keeps every record and every token ID, in Parquet and in CSV."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagereplay.report.export import COLUMNS, export_ledger

FIXTURE = Path(__file__).parent / "fixtures" / "run_paper"  # made by fixtures/make_fixtures.py


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(FIXTURE, dst)
    return dst


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    """The item records (the chain's stage and environment records give no rows)."""
    records = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind", "item") == "item"]


def _expected_rows(records: list[dict[str, Any]]) -> list[tuple[int, str | None, dict[str, Any]]]:
    """(seq, arm name, record) per expected row: one per arm, one with arm None when there are none."""
    rows: list[tuple[int, str | None, dict[str, Any]]] = []
    for rec in records:
        arms = rec["payload"].get("arms") or []
        rows.extend((rec["seq"], a["name"], rec) for a in arms)
        if not arms:
            rows.append((rec["seq"], None, rec))
    return rows


def _arm(rec: dict[str, Any], name: str | None) -> dict[str, Any]:
    return next((a for a in rec["payload"].get("arms") or [] if a["name"] == name), {})


def test_fixture_has_the_cases_the_export_must_handle(run_dir: Path) -> None:
    records = _ledger(run_dir)
    assert any(r["payload"]["status"] == "no_boundary" for r in records)
    names = {a["name"] for r in records for a in r["payload"]["arms"]}
    assert {"live", "oneshot#replica", "incremental@fp32", "live->oneshot"} <= names


def test_fixture_ledger_is_a_valid_hash_chain(run_dir: Path) -> None:
    """The fixture is written as the ledger writes records: the ledger's own parser and hash agree."""
    from stagereplay.records.ledger import parse_record, read_manifest
    from stagereplay.records.manifest import chain_start

    path = run_dir / "ledger.jsonl"
    prev = chain_start(read_manifest(run_dir))
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        record = parse_record(line, lineno, path)
        assert (record.seq, record.prev_hash, record.computed_hash()) == (lineno - 1, prev, record.hash)
        prev = record.hash


def test_parquet_round_trips_token_ids(run_dir: Path) -> None:
    out = export_ledger(run_dir, "parquet")
    assert out == run_dir / "ledger.parquet"
    table = pq.read_table(out)
    assert table.column_names == list(COLUMNS)
    for column in ("prompt_ids", "prefix_ids", "suffix_ids", "generated_ids"):
        assert table.schema.field(column).type == pa.list_(pa.int64())
    assert table.schema.field("seq").type == pa.int64()
    assert table.schema.field("correct").type == pa.bool_()

    rows = table.to_pylist()
    expected = _expected_rows(_ledger(run_dir))
    assert len(rows) == len(expected)
    for row, (seq, name, rec) in zip(rows, expected, strict=True):
        payload, arm = rec["payload"], _arm(rec, name)
        assert (row["seq"], row["arm"], row["item_id"]) == (seq, name, rec["item_id"])
        assert row["experiment"] == rec["experiment"] and row["checkpoint"] == rec["checkpoint"]
        assert row["prompt_ids"] == payload["prompt_ids"]
        assert row["prefix_ids"] == payload.get("prefix_ids")
        assert row["boundary"] == payload.get("boundary")
        assert row["suffix_ids"] == arm.get("suffix_ids")
        assert row["suffix_fp"] == arm.get("suffix_fp")
        assert row["correct"] == arm.get("correct")


def test_no_boundary_record_is_one_row_with_null_arm(run_dir: Path) -> None:
    rows = pq.read_table(export_ledger(run_dir, "parquet")).to_pylist()
    nb = [r for r in rows if r["status"] == "no_boundary"]
    records = [r for r in _ledger(run_dir) if r["payload"]["status"] == "no_boundary"]
    assert len(nb) == len(records) > 0
    for row, rec in zip(nb, records, strict=True):
        assert row["arm"] is None and row["suffix_ids"] is None and row["boundary"] is None
        assert row["generated_ids"] == rec["payload"]["generated_ids"]


def test_csv_round_trips_token_ids(run_dir: Path, tmp_path: Path) -> None:
    out = export_ledger(run_dir, "csv", out=tmp_path / "sub" / "flat.csv")
    with out.open(newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames or ()) == COLUMNS
        rows = list(reader)

    def ids(cell: str) -> list[int]:
        return [int(t) for t in cell.split()]

    expected = _expected_rows(_ledger(run_dir))
    assert len(rows) == len(expected)
    for row, (seq, name, rec) in zip(rows, expected, strict=True):
        arm = _arm(rec, name)
        assert int(row["seq"]) == seq
        assert row["arm"] == (name or "")
        assert ids(row["prompt_ids"]) == rec["payload"]["prompt_ids"]
        assert ids(row["prefix_ids"]) == (rec["payload"].get("prefix_ids") or [])
        assert ids(row["suffix_ids"]) == arm.get("suffix_ids", [])
        assert row["correct"] == {True: "true", False: "false", None: ""}[arm.get("correct")]


def test_export_is_atomic_and_leaves_no_temp_files(run_dir: Path) -> None:
    target = run_dir / "ledger.csv"
    target.write_text("old")
    export_ledger(run_dir, "csv")
    assert target.read_text().startswith("experiment,")
    assert not list(run_dir.glob(".*.tmp"))


def test_malformed_line_fails_loudly_with_its_line_number(run_dir: Path) -> None:
    with (run_dir / "ledger.jsonl").open("a") as fh:
        fh.write('{"seq": 999, "payload": \n')
    with pytest.raises(ValueError, match=r"ledger\.jsonl:\d+: not a JSON ledger record"):
        export_ledger(run_dir, "parquet")
    assert not (run_dir / "ledger.parquet").exists()


def test_bad_format_and_missing_ledger(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown export format"):
        export_ledger(run_dir, "xlsx")  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        export_ledger(tmp_path / "empty", "csv")
