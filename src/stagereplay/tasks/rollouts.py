"""Rollouts as RL frameworks dump them: per row a prompt's token IDs, the response's token IDs, the rollout engine's
log-probability of each response token, and optionally an id and the sampling settings. A JSONL file (one object per
line) or a Parquet file; field names mapped with `--columns prompt_ids=COL,response_ids=COL,logprobs=COL,id=COL` (and
temperature, top_p, top_k, seed). A file of served outputs (`attest --served`) is the same format, its
log-probabilities optional; a refusal speaks of the file as its command does (`FileKind`).

A file of thousands of rollouts of thousands of tokens is read as a stream: `scan` reads it once, row by row, checks
every row (every field typed and in range, `tasks.rollout_fields`; token IDs within the vocabulary, the lengths agree,
the whole sequence within the model's context, ids unique) and keeps per row its id, its prompt, its sampling
settings and where the row is in the file; `read` fetches one row's response and log-probabilities when its job
runs. Memory follows the prompts, not the responses. A row that fails a check is refused in one line naming the
file, the row, the field and the fix; a compressed or binary file is refused as such, before its first row. The
dataset hash is the SHA-256 of the file's bytes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item
from stagereplay.tasks.jsonl import file_sha256
from stagereplay.tasks.rollout_fields import (
    COLUMNS,
    ROLLOUTS,
    FileKind,
    logprobs,
    row_id,
    sampling,
    token_ids,
)

MAGIC = ((b"\x1f\x8b", "gzip-compressed", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd-compressed", "unzstd"),
         (b"BZh", "bzip2-compressed", "bunzip2 -k"), (b"\xfd7zXZ\x00", "xz-compressed", "unxz -k"),
         (b"PK\x03\x04", "a zip archive", "unzip"))
"""A compressed file's first bytes, what it is, and the command that decompresses it."""
PARQUET_MAGIC = b"PAR1"
SHOWN_COLUMNS = 12
"""How many of a row's columns a refusal lists."""


@dataclass(frozen=True)
class RolloutItem(Item):
    """An item of a rollout file: its prompt, its sampling settings, and where its response and log-probabilities
    are in the file."""

    source: str = field(default="", compare=False)
    position: int = field(default=0, compare=False)
    """A JSONL row's byte offset, or a Parquet row's index."""
    response_len: int = field(default=0, compare=False)
    columns: str | None = field(default=None, compare=False)
    """The `--columns` mapping its row was read with (None: every field under its own name): reading the row again
    (a job, the audit's re-execution) maps it the same way."""
    kind: FileKind = field(default=ROLLOUTS, compare=False)
    """What the file is to its command (a rollout file's rows must give log-probabilities; a file of served
    outputs' may)."""
    sampling: dict[str, float | int] = field(default_factory=dict, compare=False)
    """The sampling settings its row gives (`tasks.rollout_fields.SAMPLING`; empty where it gives none)."""
    where: str = field(default="", compare=False)
    """Its row as a refusal names it (`FILE line N`, `FILE row N`)."""


@dataclass(frozen=True)
class Rollout:
    """One row's response, as the rollout engine sampled it."""

    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    sampling: dict[str, float | int]


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def mapping(columns: str | None, kind: FileKind = ROLLOUTS) -> dict[str, str]:
    """{field: column} from `prompt_ids=COL,...`; every field not named maps to itself."""
    out = {f: f for f in COLUMNS}
    for part in (columns or "").split(",") if columns else []:
        target, eq, column = (s.strip() for s in part.partition("="))
        if not eq or not column or target not in COLUMNS:
            raise StageReplayError(f"invalid --columns entry {part!r} for a {kind.name}",
                                   f"write TARGET=COLUMN pairs, comma-separated, with TARGET one of {', '.join(COLUMNS)}")
        out[target] = column
    return out


def _not_text(path: Path) -> None:
    """Refuse a JSONL file that is compressed, Parquet or binary, by its first bytes."""
    with open(path, "rb") as f:
        head = f.read(8)
    for magic, what, command in MAGIC:
        if head.startswith(magic):
            raise StageReplayError(f"{path} is {what}, not JSONL text",
                                   f"decompress it ({command} {path.name}) and pass the JSONL it holds")
    if head.startswith(PARQUET_MAGIC):
        raise StageReplayError(f"{path} is a Parquet file named as JSONL", "name it .parquet")


def _json_row(raw: bytes, where: str) -> Any:
    """One JSONL line's object, or a one-line refusal saying what the line is instead."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise StageReplayError(f"{where} is not UTF-8 text (binary data?)",
                               "write the file as UTF-8 JSONL, one object per line") from None
    if "\x00" in text:
        raise StageReplayError(f"{where} holds NUL bytes: binary data, not JSON",
                               "write the file as UTF-8 JSONL, one object per line")
    try:
        return json.loads(text.removeprefix("\ufeff"))
    except RecursionError:
        raise StageReplayError(f"{where} is not valid JSON (nested too deeply)", "fix or remove that line") from None
    except ValueError as exc:  # json's decode errors, and an integer of more digits than Python reads
        reason = str(exc).split(":")[0] if isinstance(exc, json.JSONDecodeError) else str(exc).split(";")[0]
        raise StageReplayError(f"{where} is not valid JSON ({reason})",
                               "fix or remove that line (a line cut short: was the file written to the end?)") from None


def _rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(where, position, raw row), streamed: JSONL line by line (position: byte offset), Parquet by record batch
    (position: row index)."""
    if is_parquet(path):
        import pyarrow.parquet as pq

        index = 0
        try:
            pf = pq.ParquetFile(path)
            for batch in pf.iter_batches(batch_size=256):
                for row in batch.to_pylist():
                    yield f"{path} row {index + 1}", index, row
                    index += 1
        except StageReplayError:
            raise
        except Exception as exc:  # pyarrow names the damage; one line of it is enough
            raise StageReplayError(f"cannot read {path} as Parquet (after {index} rows): "
                                   f"{(str(exc).splitlines() or [type(exc).__name__])[0]}",
                                   "pass a Parquet file, or a JSONL file") from None
        return
    _not_text(path)
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            yield where, start, _json_row(raw, where)


def _parse(raw: Any, where: str, fields: dict[str, str], vocab: int, kind: FileKind = ROLLOUTS
           ) -> tuple[str | None, tuple[int, ...], Rollout]:
    """One row checked (`tasks.rollout_fields`); where `kind` does not need log-probabilities a row may leave them
    out (its Rollout's are then empty)."""
    if not isinstance(raw, dict):
        raise StageReplayError(f"{where} is not an object", "write one JSON object per row")
    needed = ("prompt_ids", "response_ids", "logprobs") if kind.logprobs or raw.get(fields["logprobs"]) is not None \
        else ("prompt_ids", "response_ids")
    missing = [f for f in needed if fields[f] not in raw]
    if missing:
        names = ", ".join(map(str, list(raw)[:SHOWN_COLUMNS])) + (", ..." if len(raw) > SHOWN_COLUMNS else "")
        raise StageReplayError(f"{where} has no column {fields[missing[0]]!r} ({missing[0]})",
                               f"map it with --columns {missing[0]}=COLUMN (its columns: {names})")
    prompt = token_ids(raw[fields["prompt_ids"]], "prompt_ids", where, vocab, kind)
    response = token_ids(raw[fields["response_ids"]], "response_ids", where, vocab, kind)
    given = logprobs(raw[fields["logprobs"]], len(response), where, kind) if "logprobs" in needed else ()
    settings = sampling(raw, fields, where)
    return row_id(raw.get(fields["id"]), where), prompt, Rollout(response, given, settings)


def scan(path: str | Path, columns: str | None, vocab: int, context: int, n: int | None = None,
         kind: FileKind = ROLLOUTS) -> tuple[list[RolloutItem], str]:
    """The rows checked (module docstring) and kept as items, the first `n` of them (every row without `n`), and the
    file's hash. Refusals speak of the file as `kind` says."""
    p = Path(path)
    if not p.is_file():
        raise StageReplayError(f"{kind.name} not found: {p}", f"pass {kind.option} FILE (JSONL or Parquet)")
    fields = mapping(columns, kind)
    items: list[RolloutItem] = []
    seen: set[str] = set()
    for where, position, raw in _rows(p):
        rid, prompt, rollout = _parse(raw, where, fields, vocab, kind)
        rid = rid if rid is not None else f"r{len(items):06d}"
        if rid in seen:
            raise StageReplayError(f"{where}: duplicate id {rid!r}", f"give each of the {kind.rows} a unique id")
        total = len(prompt) + len(rollout.response_ids)
        if total > context:
            raise StageReplayError(f"{where}: prompt + response is {total} tokens, past the model's context of "
                                   f"{context}", "drop the row, or use a model of a longer context")
        seen.add(rid)
        items.append(RolloutItem(rid, prompt, "", source=str(p), position=position,
                                 response_len=len(rollout.response_ids), columns=columns, kind=kind,
                                 sampling=rollout.sampling, where=where))
        if n is not None and len(items) >= n:
            break
    if not items:
        raise StageReplayError(f"{kind.name} {p} holds no {kind.rows}", "write one object per row")
    if n is not None and len(items) < n:
        raise StageReplayError(f"--n {n} is larger than the {len(items)} {kind.rows} in {p}",
                               f"pass --n {len(items)} or fewer")
    return items, file_sha256(p)


@functools.lru_cache(maxsize=2)
def _row_group(path: str, group: int) -> list[dict[str, Any]]:
    """One Parquet row group's rows (a job reads its row's group, and the next job most likely the same one)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(group).to_pylist()


def _parquet_row(path: str, index: int) -> dict[str, Any]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    left = index
    for group in range(meta.num_row_groups):
        rows = meta.row_group(group).num_rows
        if left < rows:
            return _row_group(path, group)[left]
        left -= rows
    raise StageReplayError(f"{path} has no row {index + 1} any more", "restore the file the run was made with")


def read(item: RolloutItem, columns: str | None = None) -> Rollout:
    """The response and log-probabilities of `item` from its file (checked again: the file may have changed), its
    fields mapped by `columns`, else as the item was read (`RolloutItem.columns`)."""
    path = Path(item.source)
    fields = mapping(columns if columns is not None else item.columns, item.kind)
    if is_parquet(path):
        raw = _parquet_row(str(path), item.position)
        where = f"{path} row {item.position + 1}"
    else:
        with open(path, "rb") as f:
            f.seek(item.position)
            where = f"{path} at byte {item.position}"
            raw = _json_row(f.readline(), where)
    _, _, rollout = _parse(raw, where, fields, vocab=1 << 31, kind=item.kind)
    return rollout
