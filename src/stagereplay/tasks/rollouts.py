"""Rollouts as RL frameworks dump them: per row a prompt's token IDs, the response's token IDs, the rollout engine's
log-probability of each response token, and optionally an id and the sampling settings. A JSONL file (one object per
line) or a Parquet file; field names mapped with `--columns prompt_ids=COL,response_ids=COL,logprobs=COL,id=COL`.

A file of thousands of rollouts of thousands of tokens is read as a stream: `scan` reads it once, row by row, checks
every row (token IDs within the vocabulary, the lengths agree, every log-probability finite and at most 0, the whole
sequence within the model's context, ids unique) and keeps per row its id, its prompt and where the row is in the
file; `read` fetches one row's response and log-probabilities when its job runs. Memory follows the prompts, not the
responses. A row that fails a check is refused in one line naming the row and the fix. The dataset hash is the
SHA-256 of the file's bytes.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import Item
from stagereplay.tasks.jsonl import file_sha256

FIELDS = ("prompt_ids", "response_ids", "logprobs", "id")
"""What `--columns` maps for a rollout file (each defaults to its own name)."""
SAMPLING = ("temperature", "top_p", "top_k", "seed")
"""Sampling settings a row may carry (recorded with its item; the run's own where absent)."""
POSITIVE_SLACK = 1e-4
"""A log-probability above 0 by at most this is rounding (an engine's fp32 log_softmax of a near-certain token)."""


@dataclass(frozen=True)
class RolloutItem(Item):
    """An item of a rollout file: its prompt, and where its response and log-probabilities are in the file."""

    source: str = field(default="", compare=False)
    position: int = field(default=0, compare=False)
    """A JSONL row's byte offset, or a Parquet row's index."""
    response_len: int = field(default=0, compare=False)
    columns: str | None = field(default=None, compare=False)
    """The `--columns` mapping its row was read with (None: every field under its own name): reading the row again
    (a job, the audit's re-execution) maps it the same way."""
    logprobs: bool = field(default=True, compare=False)
    """Whether its row must give log-probabilities (a rollout file's must; a file of served outputs' may)."""


@dataclass(frozen=True)
class Rollout:
    """One row's response, as the rollout engine sampled it."""

    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    sampling: dict[str, float | int]


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() in (".parquet", ".pq")


def mapping(columns: str | None) -> dict[str, str]:
    """{field: column} from `prompt_ids=COL,...`; every field not named maps to itself."""
    out = {f: f for f in FIELDS}
    for part in (columns or "").split(",") if columns else []:
        target, eq, column = (s.strip() for s in part.partition("="))
        if not eq or not column or target not in FIELDS:
            raise StageReplayError(f"invalid --columns entry {part!r} for a rollout file",
                                   f"write TARGET=COLUMN pairs, comma-separated, with TARGET one of {', '.join(FIELDS)}")
        out[target] = column
    return out


def _rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """(where, position, raw row), streamed: JSONL line by line (position: byte offset), Parquet by record batch
    (position: row index)."""
    if is_parquet(path):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow names the damage; one line of it is enough
            raise StageReplayError(f"cannot read {path} as Parquet: {str(exc).splitlines()[0]}",
                                   "pass a Parquet file, or a JSONL file") from None
        index = 0
        for batch in pf.iter_batches(batch_size=256):
            for row in batch.to_pylist():
                yield f"{path} row {index + 1}", index, row
                index += 1
        return
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            try:
                yield where, start, json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise StageReplayError(f"{where} is not valid JSON", "fix or remove that line") from None


def _ids(value: Any, name: str, where: str, vocab: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise StageReplayError(f"{where}: {name} is not a non-empty list of token IDs", f"give every row its {name}")
    out = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise StageReplayError(f"{where}: {name} holds {t!r}, not a token ID of this tokenizer (0..{vocab - 1})",
                                   "score the rollouts with the model and tokenizer that made them")
        out.append(t)
    return tuple(out)


def _logprobs(value: Any, n: int, where: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)):
        raise StageReplayError(f"{where}: logprobs missing", "give the rollout engine's log-probability of every "
                                                             "response token (vLLM: SamplingParams(logprobs=0))")
    if len(value) != n:
        raise StageReplayError(f"{where}: {len(value)} logprobs for {n} response tokens",
                               "give one log-probability per response token, in order")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > POSITIVE_SLACK:
            raise StageReplayError(f"{where}: logprobs[{i}] is {v!r}, not a finite log-probability (<= 0)",
                                   "give the log-probability of the sampled token itself (finite, at most 0)")
        out.append(float(v))
    return tuple(out)


def _sampling(raw: dict[str, Any]) -> dict[str, float | int]:
    return {k: raw[k] for k in SAMPLING if raw.get(k) is not None}


def _parse(raw: Any, where: str, fields: dict[str, str], vocab: int, logprobs: bool = True
           ) -> tuple[str | None, tuple[int, ...], Rollout]:
    """One row checked; without `logprobs` a row may leave them out (its Rollout's are then empty)."""
    if not isinstance(raw, dict):
        raise StageReplayError(f"{where} is not an object", "write one JSON object per row")
    needed = ("prompt_ids", "response_ids", "logprobs") if logprobs or fields["logprobs"] in raw else (
        "prompt_ids", "response_ids")
    missing = [f for f in needed if fields[f] not in raw]
    if missing:
        raise StageReplayError(f"{where} has no column {fields[missing[0]]!r} ({missing[0]})",
                               f"map it with --columns {missing[0]}=COLUMN (its columns: {', '.join(map(str, raw))})")
    prompt = _ids(raw[fields["prompt_ids"]], "prompt_ids", where, vocab)
    response = _ids(raw[fields["response_ids"]], "response_ids", where, vocab)
    given = _logprobs(raw[fields["logprobs"]], len(response), where) if "logprobs" in needed else ()
    rid = raw.get(fields["id"])
    return (None if rid is None else str(rid)), prompt, Rollout(response, given, _sampling(raw))


def scan(path: str | Path, columns: str | None, vocab: int, context: int, n: int | None = None,
         logprobs: bool = True) -> tuple[list[RolloutItem], str]:
    """Every row checked (module docstring), the first `n` kept as items; and the file's hash. Without `logprobs`,
    a row may leave its log-probabilities out."""
    p = Path(path)
    if not p.is_file():
        raise StageReplayError(f"rollout file not found: {p}", "pass --rollouts FILE (JSONL or Parquet)")
    fields = mapping(columns)
    items: list[RolloutItem] = []
    seen: set[str] = set()
    for where, position, raw in _rows(p):
        rid, prompt, rollout = _parse(raw, where, fields, vocab, logprobs)
        rid = rid if rid is not None else f"r{len(items):06d}"
        if rid in seen:
            raise StageReplayError(f"{where}: duplicate id {rid!r}", "give every rollout a unique id")
        total = len(prompt) + len(rollout.response_ids)
        if total > context:
            raise StageReplayError(f"{where}: prompt + response is {total} tokens, past the model's context of "
                                   f"{context}", "drop the row, or score it with a model of a longer context")
        seen.add(rid)
        items.append(RolloutItem(rid, prompt, "", source=str(p), position=position,
                                 response_len=len(rollout.response_ids), columns=columns, logprobs=logprobs))
        if n is not None and len(items) >= n:
            break
    if not items:
        raise StageReplayError(f"rollout file {p} holds no rollouts", "write one row per rollout")
    if n is not None and len(items) < n:
        raise StageReplayError(f"--n {n} is larger than the {len(items)} rollouts in {p}",
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
    for group in range(meta.num_row_groups):
        rows = meta.row_group(group).num_rows
        if index < rows:
            return _row_group(path, group)[index]
        index -= rows
    raise StageReplayError(f"{path} has no row {index + 1} any more", "restore the rollout file the run was made with")


def read(item: RolloutItem, columns: str | None = None) -> Rollout:
    """The response and log-probabilities of `item` from its file (checked again: the file may have changed), its
    fields mapped by `columns`, else as the item was read (`RolloutItem.columns`)."""
    path, fields = Path(item.source), mapping(columns if columns is not None else item.columns)
    if is_parquet(path):
        raw = _parquet_row(str(path), item.position)
        where = f"{path} row {item.position + 1}"
    else:
        with open(path, "rb") as f:
            f.seek(item.position)
            raw = json.loads(f.readline())
        where = f"{path} at byte {item.position}"
    _, _, rollout = _parse(raw, where, fields, vocab=1 << 31, logprobs=item.logprobs)
    return rollout
