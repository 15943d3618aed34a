"""Flatten a run's ledger into one table row per item and arm, with the token IDs, for Parquet or CSV.

The ledger is the record of truth; this is the analyst's view of it (pandas, DuckDB, R). Every ledger
record yields at least one row: a record with no arms (a `no_boundary` item) gives one row with
`arm = None`, so a filtered-out item stays visible. Arm names are copied as found; nothing here assumes
which arms an experiment writes.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from stagereplay.records.ledger import Record, atomic_output
from stagereplay.records.payload_readers import ItemHead
from stagereplay.records.payloads import Arm, Draw

COLUMNS: tuple[str, ...] = (
    "experiment",
    "checkpoint",
    "item_id",
    "part",
    "status",
    "arm",
    "construction",
    "precision",
    "prompt_ids",
    "prefix_ids",
    "boundary",
    "suffix_ids",
    "suffix_fp",
    "cache_fp",
    "correct",
    "seq",
    "generated_ids",
    "stream",
    "draw",
    "seed",
    "answer",
)
"""Output columns, in order. `part` is the ledger record's sub-unit key ("" when the experiment has none);
`generated_ids` carries a `no_boundary` item's output, which has no arms. `stream`, `draw`, `seed` and `answer`
belong to resample draws (one row per draw) and are empty elsewhere."""

_ID_COLUMNS = frozenset({"prompt_ids", "prefix_ids", "suffix_ids", "generated_ids"})


def iter_ledger(path: Path) -> Iterator[dict[str, Any]]:
    """Yield ledger records in file order; a line that is not one JSON object is an error, never skipped."""
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON ledger record ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: a ledger record must be a JSON object")
            yield record


def ledger_rows(records: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One row per (item record, arm); one row with `arm = None` for a record without arms. The chain's
    stage and environment records (ledger schema 2) are provenance, not rows. Each record is read as its model, its
    payload as any experiment's is (`records.payload_readers.ItemHead`); one that is not raises pydantic's
    ValidationError (a ValueError)."""
    for raw in records:
        record = Record.model_validate(raw)
        if record.kind != "item":
            continue
        payload = ItemHead.model_validate(record.payload)
        base = {
            "experiment": record.experiment,
            "checkpoint": record.checkpoint,
            "item_id": record.item_id,
            "part": record.part,
            "status": payload.status,
            "prompt_ids": payload.prompt_ids,
            "prefix_ids": payload.prefix_ids,
            "boundary": payload.boundary,
            "seq": record.seq,
            "generated_ids": payload.generated_ids,
        }
        arms: list[Arm | Draw | None] = [*payload.arms] or [None]
        for arm in arms:
            draw = arm if isinstance(arm, Draw) else None
            row = {
                **base,
                "arm": arm.name if arm else None,
                "construction": arm.construction if arm else None,
                "precision": arm.precision if arm else None,
                "suffix_ids": arm.suffix_ids if arm else None,
                "suffix_fp": arm.suffix_fp if arm else None,
                "cache_fp": arm.cache_fp if arm else None,
                "correct": arm.correct if arm else None,
                "stream": draw.stream if draw else None,
                "draw": draw.draw if draw else None,
                "seed": draw.seed if draw else None,
                "answer": draw.answer if draw else None,
            }
            yield {column: row[column] for column in COLUMNS}


def export_ledger(run_dir: Path, fmt: Literal["parquet", "csv"], out: Path | None = None) -> Path:
    """Write `run_dir/ledger.jsonl` as `ledger.<fmt>` (or `out`), atomically; return the path written.

    Parquet keeps token IDs as `list<int64>` columns. CSV writes them as space-separated integers;
    there, an empty cell is a missing value (and also an empty ID list), booleans are `true`/`false`.
    """
    if fmt not in ("parquet", "csv"):
        raise ValueError(f"unknown export format {fmt!r}: choose 'parquet' or 'csv'")
    run_dir = Path(run_dir)
    ledger = run_dir / "ledger.jsonl"
    if not ledger.is_file():
        raise FileNotFoundError(f"no ledger at {ledger}")
    target = Path(out) if out is not None else run_dir / f"ledger.{fmt}"
    rows = list(ledger_rows(iter_ledger(ledger)))
    with atomic_output(target) as tmp:
        if fmt == "parquet":
            _write_parquet(rows, tmp)
        else:
            _write_csv(rows, tmp)
    return target


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = pa.list_(pa.int64())
    types = {
        "boundary": pa.int64(),
        "correct": pa.bool_(),
        "seq": pa.int64(),
        "draw": pa.int64(),
        "seed": pa.int64(),
        **dict.fromkeys(_ID_COLUMNS, ids),
    }
    schema = pa.schema([pa.field(c, types.get(c, pa.string())) for c in COLUMNS])
    columns = {c: [row[c] for row in rows] for c in COLUMNS}
    pq.write_table(pa.table(columns, schema=schema), path)


def _csv_cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column in _ID_COLUMNS:
        return " ".join(str(int(t)) for t in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([_csv_cell(c, row[c]) for c in COLUMNS])
