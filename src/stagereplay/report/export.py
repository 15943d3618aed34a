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

from stagereplay.experiments.core.registry import experiment
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, atomic_output

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
    "engine",
    "mode",
    "start",
    "response_ids",
    "logprobs",
)
"""Output columns, in order. `part` is the ledger record's sub-unit key ("" when the experiment has none);
`generated_ids` carries a `no_boundary` item's output, which has no arms. `stream`, `draw`, `seed` and `answer`
belong to resample draws (one row per draw) and are empty elsewhere. `engine`, `mode`, `start`, `response_ids` and
`logprobs` belong to scored sides (mismatch: the response every side scored, and the side's log-probability of each of
its tokens from position `start`)."""

_ID_COLUMNS = frozenset({"prompt_ids", "prefix_ids", "suffix_ids", "generated_ids", "response_ids"})
_ARM_COLUMNS = {"arm": "name", "construction": "construction", "precision": "precision", "suffix_ids": "suffix_ids",
                "suffix_fp": "suffix_fp", "cache_fp": "cache_fp", "correct": "correct", "stream": "stream",
                "draw": "draw", "seed": "seed", "answer": "answer", "engine": "engine", "mode": "mode",
                "start": "start", "logprobs": "logprobs"}
"""The columns an arm fills (column: the arm model's field); the others come from the record and its payload."""


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
    payload as its experiment's model (`Experiment.read`, by the record's `experiment` field); one that is not raises
    pydantic's ValidationError (a ValueError). A column is the field of that name of the arm, else of the payload
    (empty where neither has one): nothing here names an experiment."""
    for raw in records:
        record = Record.model_validate(raw)
        if record.kind != "item":
            continue
        payload = experiment(record.experiment).read(record)
        base = {"experiment": record.experiment, "checkpoint": record.checkpoint, "item_id": record.item_id,
                "part": record.part, "seq": record.seq}
        arms: list[Any] = [*getattr(payload, "arms", [])] or [None]
        for arm in arms:
            yield {column: base[column] if column in base else _cell(column, _field(payload, arm, column))
                   for column in COLUMNS}


def _field(payload: Any, arm: Any, column: str) -> Any:
    """What a column holds of one arm of a payload (both models): an arm's column from the arm, any other from the
    payload."""
    if column in _ARM_COLUMNS:
        return getattr(arm, _ARM_COLUMNS[column], None)
    return getattr(payload, column, None)


def _cell(column: str, value: Any) -> Any:
    """A model's field as its column holds it: an encoded array (log-probabilities) decoded to its floats."""
    if column == "logprobs" and isinstance(value, str):
        return [float(x) for x in arrays.decode(value)]
    return value


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
        "start": pa.int64(),
        "logprobs": pa.list_(pa.float64()),
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
    if column == "logprobs":
        return " ".join(repr(float(x)) for x in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([_csv_cell(c, row[c]) for c in COLUMNS])
