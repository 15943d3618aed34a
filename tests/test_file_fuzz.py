"""Random corruptions of valid rollout and served files: never a traceback, never a corrupted row taken.

- a file of valid rows (benign spellings among them: a seed written 3.0, vLLM's top-k -1) is read whole, and each
  row read again by its job gives back what was written;
- a file with one corrupted row (a wrong type, an out-of-range value, lengths that disagree, a missing field, a
  duplicate id, a line cut short, bytes that are not UTF-8, a NUL) or corrupted whole (compressed) is refused by the
  reader with one line naming the file (and the line, for a row), and nothing else is raised;
- a handful of such files through `attest --served` and `mismatch --rollouts`: exit 2, one line, nothing written.

Drawn by hypothesis, derandomized: the same examples on every run.
"""

from __future__ import annotations

import gzip
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.errors import REFUSED, StageReplayError
from stagereplay.tasks.rollout_fields import ROLLOUTS, SEED_SPAN, SERVED, FileKind
from stagereplay.tasks.rollouts import read, scan

VOCAB = 64
"""The reader's vocabulary here (the toy's is 263: the commands' examples stay below both)."""
OUT_OF_RANGE = 1 << 40
"""A token ID past any vocabulary."""
KINDS = {"rollouts": ROLLOUTS, "served": SERVED}
FAST = settings(derandomize=True, deadline=None, max_examples=150,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
logprob = st.floats(-30.0, 0.0, allow_nan=False)


@st.composite
def valid_row(draw: st.DrawFn, index: int) -> dict[str, Any]:
    """A valid row: tokens, log-probabilities, and any of the sampling settings, some in their benign spellings."""
    response = draw(ids)
    row: dict[str, Any] = {"id": f"row-{index}", "prompt_ids": draw(ids), "response_ids": response,
                           "logprobs": draw(st.lists(logprob, min_size=len(response), max_size=len(response)))}
    optional = {"temperature": st.one_of(st.floats(0, 5, allow_nan=False), st.integers(0, 3)),
                "top_p": st.floats(0.01, 1.0), "top_k": st.one_of(st.integers(-1, 100), st.just(40.0)),
                "seed": st.one_of(st.integers(0, SEED_SPAN - 1), st.just(3.0))}
    for key, values in optional.items():
        if draw(st.booleans()):
            row[key] = draw(values)
    return row


def rows(n: int = 3) -> st.SearchStrategy[list[dict[str, Any]]]:
    return st.tuples(*[valid_row(i) for i in range(n)]).map(list)


BAD_TOKEN = [True, False, 1.5, 2.0, "3", None, [], {}, -1, OUT_OF_RANGE, 10**30]
BAD_IDS = [[], None, "1 2", 3, {}, True]
BAD_LOGPROB = [math.nan, math.inf, -math.inf, 0.5, "x", None, True, [], 10**400]
BAD_SAMPLING = {
    "temperature": [-0.1, -1, math.nan, math.inf, "hot", True, [], {}],
    "top_p": [0, -0.5, 1.0001, math.nan, "0.9", True],
    "top_k": [-2, 2.5, "5", True, math.nan, math.inf, 2.0**60],
    "seed": [-1, SEED_SPAN, 1.5, "abc", True, float(2**60), math.nan, [7]],
}
BAD_ID = [[], {}, True, 1.5, ""]


Row = dict[str, Any]
Fault = tuple[str, Any]
"""A fault: its kind and its value (what goes in, or which field)."""


def faults(kind: FileKind) -> list[Fault]:
    """Every fault a row may be given, each once: a sampled fault is as likely as any other."""
    return [*(("token", v) for v in BAD_TOKEN), *(("ids", v) for v in BAD_IDS),
            *(("logprob", v) for v in BAD_LOGPROB), *(("logprobs", v) for v in ["x", 3, {}, *([None] * kind.logprobs)]),
            ("count", "short"), ("count", "long"), *(("sampling", (k, v)) for k, vs in BAD_SAMPLING.items() for v in vs),
            *(("id", v) for v in BAD_ID), ("duplicate", None),
            *(("missing", f) for f in ["prompt_ids", "response_ids", *(["logprobs"] * kind.logprobs)]),
            *(("not an object", v) for v in [[1, 2], 3, "row", None, True])]


def corrupt(row: Row, fault: Fault, where: int, others: list[str]) -> Row | Any:
    """`row` with `fault` (`where` picks the list entry a token or logprob fault lands on; `others`: the ids of the
    rows before it, which a duplicate repeats)."""
    row, (what, value) = json.loads(json.dumps(row)), fault
    if what in ("token", "ids"):
        field = ("prompt_ids", "response_ids")[where % 2]
        if what == "ids":
            row[field] = value
        else:
            row[field][where % len(row[field])] = value
    elif what == "logprob":
        row["logprobs"][where % len(row["logprobs"])] = value
    elif what == "logprobs":
        row["logprobs"] = value
    elif what == "count":
        row["logprobs"] = row["logprobs"][1:] if value == "short" else [*row["logprobs"], -1.0]
    elif what == "sampling":
        row[value[0]] = value[1]
    elif what == "id":
        row["id"] = value
    elif what == "duplicate":
        row["id"] = others[where % len(others)] if others else True
    elif what == "missing":
        del row[value]
    else:
        return value
    return row


@st.composite
def corrupted_file(draw: st.DrawFn, kind: FileKind) -> tuple[bytes, int | None]:
    """A file's bytes with one fault, and the line it is on (None: the whole file's)."""
    good = draw(rows())
    at = draw(st.integers(0, len(good) - 1))
    lines = [json.dumps(r).encode() for r in good]
    fault = draw(st.sampled_from(["row", "row", "row", "cut", "bytes", "gzip"]))
    if fault == "row":
        bad = corrupt(good[at], draw(st.sampled_from(faults(kind))), draw(st.integers(0, 5)), [r["id"] for r in good[:at]])
        lines[at] = json.dumps(bad).encode()
    elif fault == "cut":
        lines[at] = lines[at][: draw(st.integers(1, len(lines[at]) - 1))]
    elif fault == "bytes":
        place = draw(st.integers(1, len(lines[at]) - 1))
        lines[at] = lines[at][:place] + draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80"])) \
            + lines[at][place:]
    data = b"".join(line + b"\n" for line in lines)
    return (gzip.compress(data), None) if fault == "gzip" else (data, at + 1)


def _refusal(path: Path, kind: FileKind, line: int | None) -> str:
    try:
        scan(path, None, VOCAB, 1 << 20, kind=kind)
    except StageReplayError as refused:
        message = str(refused)
        assert "\n" not in message and str(path) in message, message
        assert line is None or f"line {line}" in message, (line, message)
        return message
    raise AssertionError(f"a corrupted file was taken: {path.read_bytes()!r}")


@FAST
@given(kind=st.sampled_from(sorted(KINDS)), good=rows())
def test_valid_rows_are_read_whole_and_read_again_as_written(kind: str, good: list[dict[str, Any]]):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in good))
        found, _ = scan(path, None, VOCAB, 1 << 20, kind=KINDS[kind])
        assert [i.id for i in found] == [r["id"] for r in good]
        for item, row in zip(found, good, strict=True):
            again = read(item)
            assert item.prompt_ids == tuple(row["prompt_ids"]) and again.response_ids == tuple(row["response_ids"])
            assert again.logprobs == tuple(row["logprobs"]) and again.sampling == item.sampling
            for key, value in item.sampling.items():
                assert value == (max(row[key], 0) if key == "top_k" else row[key]), (key, value, row)
                assert isinstance(value, int if key in ("top_k", "seed") else float)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_fault_is_refused_on_every_row(kind: str, tmp_path: Path):
    """Each fault in turn, on each row of three (a duplicate: of the row before; a first row's: a bool id)."""
    good = [{"id": f"row-{i}", "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "logprobs": [-0.5, -1.0],
             "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 11} for i in range(3)]
    path = tmp_path / "rows.jsonl"
    for fault in faults(KINDS[kind]):
        for at in range(len(good)):
            for where in range(2):
                bad = [*good[:at], corrupt(good[at], fault, where, [r["id"] for r in good[:at]]), *good[at + 1:]]
                path.write_text("".join(json.dumps(r) + "\n" for r in bad))
                _refusal(path, KINDS[kind], at + 1)


@FAST
@given(kind=st.sampled_from(sorted(KINDS)), data=st.data())
def test_a_corrupted_file_is_refused_in_one_line_naming_the_file_and_the_line(kind: str, data: st.DataObject):
    content, line = data.draw(corrupted_file(KINDS[kind]))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        path.write_bytes(content)
        _refusal(path, KINDS[kind], line)


runner = CliRunner()
COMMANDS = {"served": ["attest", "--served", "{file}", "--sample", "--temperature", "1", "--honest", "bf16"],
            "rollouts": ["mismatch", "--rollouts", "{file}", "--precisions", "bf16", "--transplant-at", "0"]}


@settings(derandomize=True, deadline=None, max_examples=8,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(KINDS)), data=st.data())
def test_a_corrupted_file_is_refused_by_its_command_before_anything_is_written(kind: str, data: st.DataObject):
    content, line = data.draw(corrupted_file(KINDS[kind]))
    with tempfile.TemporaryDirectory() as folder:
        path, out = Path(folder) / "rows.jsonl", Path(folder) / "run"
        path.write_bytes(content)
        args = [str(path) if a == "{file}" else a for a in COMMANDS[kind]]
        result = runner.invoke(app, [*args, "--quiet", "--out", str(out)])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == REFUSED and len(lines) == 1, (result.exit_code, result.output)
        assert lines[0].startswith(f"error: {path}") and (line is None or f"line {line}" in lines[0]), lines[0]
        assert not out.exists()
