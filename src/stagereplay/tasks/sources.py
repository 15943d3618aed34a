"""Items as benchmarks are stored: JSONL, JSON, CSV and Parquet files, `datasets.save_to_disk` folders, and Hugging
Face datasets (`hf:NAME[:CONFIG][:SPLIT]`), read into rows, mapped (`--columns`) and hashed.

The dataset hash covers the rows as read, whatever the format: a JSONL file's is the SHA-256 of its bytes (as it
always was, so existing runs still verify), every other source's is the SHA-256 of its rows written as JSONL,
one `json.dumps(row)` per line (`rows_sha256`). A JSONL file written that way (`stagereplay toy items`, or
`f.write(json.dumps(row) + "\\n")` per row) hashes as its Parquet or `save_to_disk` copy does, and gives the same
items, so a run is the same run whatever the format its data came in.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.tasks.jsonl import Row, file_sha256, parse_row

HF_PREFIX = "hf:"
TARGETS = ("prompt", "messages", "user", "answer", "id")
"""What `--columns` may map: `user=COL` makes a one-message chat of that column (the chat template applies)."""
FORMATS = "a JSONL, JSON, CSV or Parquet file, a datasets.save_to_disk folder, or hf:NAME[:CONFIG][:SPLIT]"
DATASETS_FIX = "pip install 'stagereplay[datasets]' (or pip install datasets)"


@dataclass(frozen=True)
class Table:
    """Raw rows as read, each with where it came from (for error messages), and the dataset hash."""

    rows: list[tuple[str, Any]]
    sha256: str


def rows_sha256(rows: list[Any]) -> str:
    """SHA-256 of the rows as JSONL text: `json.dumps(row)` (Python's defaults) and a newline per row."""
    h = hashlib.sha256()
    for row in rows:
        h.update((json.dumps(row, default=str) + "\n").encode())
    return h.hexdigest()


def parse_columns(text: str | None) -> dict[str, str]:
    """`prompt=problem,answer=answer,id=unique_id` -> {target: column}."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for part in text.split(","):
        target, eq, column = (s.strip() for s in part.partition("="))
        if not eq or not column or target not in TARGETS:
            raise StageReplayError(f"invalid --columns entry {part!r}",
                                   f"write TARGET=COLUMN pairs, comma-separated, with TARGET one of {', '.join(TARGETS)}")
        if target in out:
            raise StageReplayError(f"--columns maps {target} twice", "map each target once")
        out[target] = column
    return out


def _table(rows: list[Any], where: str) -> Table:
    return Table([(f"{where} row {i + 1}", r) for i, r in enumerate(rows)], rows_sha256(rows))


def _jsonl(path: Path) -> Table:
    """Parsed line by line, so a bad line fails with its number."""
    rows: list[tuple[str, Any]] = []
    with open(path, "rb") as f:
        for lineno, raw_line in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError:
                raise StageReplayError(f"{where} is not UTF-8 text", "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise StageReplayError(f"{where} is not valid JSON ({exc.msg})", "fix or remove that line") from None
    return Table(rows, file_sha256(path))


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise StageReplayError(f"{path} is not UTF-8 text", "save the file as UTF-8") from None


def _json(path: Path) -> Table:
    """A JSON array of objects; a `.json` file that is really JSONL is read as JSONL."""
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # one object per line, named .json
            return _jsonl(path)
        raise StageReplayError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})", "fix the file") from None
    if not isinstance(data, list):
        raise StageReplayError(f"{path} holds a JSON {type(data).__name__}, not an array of rows",
                               "write the items as a JSON array of objects (or JSONL)")
    return _table(data, str(path))


def _csv(path: Path) -> Table:
    """A header row, then one item per row; every value is text."""
    return _table(list(csv.DictReader(io.StringIO(_text(path), newline=""))), str(path))


def _parquet(path: Path) -> Table:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's errors name the damage; one line of it is enough
        raise StageReplayError(f"cannot read {path} as Parquet: {str(exc).splitlines()[0]}",
                               "pass a Parquet file, or name the file by its format") from None
    return _table(rows, str(path))


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise StageReplayError("reading a datasets folder or hf:NAME needs the datasets package, which is not "
                               "installed", DATASETS_FIX) from None
    return datasets


def _one_split(ds: Any, where: str, fix: str) -> Any:
    """A Dataset, or the only split of a DatasetDict."""
    if isinstance(ds, _datasets().DatasetDict):
        splits = list(ds.keys())
        if len(splits) != 1:
            raise StageReplayError(f"{where} holds the splits {', '.join(splits)}", fix)
        return ds[splits[0]]
    return ds


def is_saved_dataset(path: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _saved(path: Path) -> Table:
    ds = _datasets().load_from_disk(str(path))
    ds = _one_split(ds, str(path), f"pass --data {path}/SPLIT, the folder of one split")
    return _table(ds.to_list(), str(path))


def parse_hub(spec: str) -> tuple[str, str | None, str | None]:
    """`hf:NAME[:CONFIG][:SPLIT]` -> (name, config, split); `hf:NAME::SPLIT` gives a split without a config."""
    parts = spec.removeprefix(HF_PREFIX).split(":")
    if not parts[0] or len(parts) > 3:
        raise StageReplayError(f"invalid --data {spec!r}", "write hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT")
    name, config, split = parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else ""
    return name, config or None, split or None


def _hub(spec: str) -> Table:
    datasets = _datasets()
    name, config, split = parse_hub(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline and not cached, unknown name, config or split: one line names which
        problem = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise StageReplayError(
            f"cannot load {spec} ({type(exc).__name__}: {problem})",
            f"check the name, config and split; offline, load it once with network access "
            f"(datasets.load_dataset({name!r}, {config!r}, split={split!r})) so it is in the local cache, or "
            "pass a save_to_disk folder or a file") from None
    ds = _one_split(ds, spec, f"pass {HF_PREFIX}{name}:{config or ''}:SPLIT")
    return _table(ds.to_list(), spec)


def read_table(spec: str) -> Table:
    """The raw rows of `--data` and their hash, by the source's kind (file suffix, folder, `hf:`)."""
    if spec.startswith(HF_PREFIX):
        return _hub(spec)
    path = Path(spec)
    if path.is_dir():
        if not is_saved_dataset(path):
            raise StageReplayError(f"data file not found: {path} is a folder not written by datasets.save_to_disk",
                                   f"pass --data {FORMATS}")
        return _saved(path)
    if not path.is_file():
        raise StageReplayError(f"data file not found: {path}", f"pass --data {FORMATS}")
    readers = {".json": _json, ".csv": _csv, ".parquet": _parquet, ".pq": _parquet}
    return readers.get(path.suffix.lower(), _jsonl)(path)  # any other name is read as JSONL


def map_columns(raw: Any, columns: dict[str, str], where: str) -> Any:
    """The row with each mapped target set from its column (the row's other fields kept)."""
    if not columns or not isinstance(raw, dict):
        return raw
    missing = [c for c in columns.values() if c not in raw]
    if missing:
        raise StageReplayError(f"{where} has no column {missing[0]!r} (--columns)",
                               f"map --columns to the data's columns: {', '.join(map(str, raw))}")
    mapped = {**raw, **{target: raw[column] for target, column in columns.items()}}
    if "user" in columns:
        mapped["messages"] = [{"role": "user", "content": str(raw[columns["user"]])}]
    return mapped


def read_rows(spec: str | Path, columns: str | None = None, answers: bool = True) -> tuple[list[Row], str]:
    """Every row parsed (and mapped) before anything runs, so bad data fails fast naming its row; and the hash.
    `answers=False`: the rows' answers are not read (`jsonl.parse_row`)."""
    parse_columns(columns)  # a bad mapping fails before the data is read
    return table_rows(read_table(str(spec)), columns, str(spec), answers)


def table_rows(table: Table, columns: str | None, spec: str, answers: bool = True) -> tuple[list[Row], str]:
    mapping = parse_columns(columns)
    rows: list[Row] = []
    seen: set[str] = set()
    for where, raw in table.rows:
        row = parse_row(map_columns(raw, mapping, where), len(rows), where, answers)
        if row.id in seen:
            raise StageReplayError(f"{where}: duplicate id {row.id!r}", "give every item a unique id")
        seen.add(row.id)
        rows.append(row)
    if not rows:
        raise StageReplayError(f"data file {spec} holds no items", "add at least one JSON line (or row)")
    return rows, table.sha256


def dataset_at(spec: str, columns: str | None = None, answers: bool = True) -> tuple[list[Any], str] | None:
    """The rows (each with its `id`) and hash of a run's dataset of prompts where it is recorded, or None when it is
    not at hand there (a file moved, an `hf:` dataset not in the local cache or without the datasets package): a
    location only."""
    if spec.startswith(HF_PREFIX):
        try:
            table = read_table(spec)
        except StageReplayError:  # not in the cache, or no datasets package here
            return None
        return table_rows(table, columns, spec, answers)
    path = Path(spec)
    if not (path.is_file() or (path.is_dir() and is_saved_dataset(path))):
        return None
    return read_rows(spec, columns, answers)
