"""Files of rollouts (`mismatch --rollouts`) and of served outputs (`attest --served`), as the reader takes them.

- a rollout file's rows are scored under their own sampling: a run's rollouts sampled at temperature 0.5, dumped to
  a file and scored with processed log-probabilities, give the numbers of the run that made them (the same bits, arm
  for arm), and the audit re-executes the file's run; control: the same rows with their temperature stripped are
  scored at the run's 1.0 and give other numbers;
- every field of a row is typed and range-checked as the file is read: a bad one is refused in one line naming the
  file, the row and the field, exit 2, before the model loads and before anything is written (an existing folder
  is left as it was); a served row sampled otherwise than the claim is refused, as is a greedy row's processed
  score;
- a renamed seed column (`--columns seed=COLUMN`) is read as the row's seed;
- each command's refusals speak its words (`--served`, served outputs; `--rollouts`, rollouts);
- a compressed, Parquet or binary file named as JSONL is called what it is.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.engine.decode import DecodeConfig
from stagereplay.errors import REFUSED, StageReplayError
from stagereplay.experiments.attest.item import item_seed
from stagereplay.experiments.mismatch.item import RolloutEngine, row_decode
from stagereplay.records import arrays
from stagereplay.records.ledger import items, read_ledger
from stagereplay.tasks import DataConfig
from stagereplay.tasks.rollout_fields import ROLLOUTS, SERVED
from stagereplay.tasks.rollouts import read, scan

runner = CliRunner()
SAMPLED = ["--sample", "--temperature", "0.5", "--logprobs-mode", "processed"]
"""The rollouts' sampling: at a temperature other than the run's default, read under it."""
FILE_RUN = ["--precisions", "bf16", "--transplant-at", "0", "--quiet"]
Edit = Callable[[dict[str, Any]], None]


def _invoke(args: list[str]) -> Result:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("file-inputs")


@pytest.fixture(scope="module")
def sampled_run(root: Path) -> Path:
    """A mismatch run of the toy: 2 rollouts of 12 tokens sampled at temperature 0.5, processed log-probabilities,
    the trainer at bf16."""
    out = root / "sampled"
    result = _invoke(["mismatch", "--n", "2", "--max-new-tokens", "12", *SAMPLED, *FILE_RUN, "--out", out])
    assert result.exit_code == 0, result.output
    return out


def _rows(run: Path) -> list[dict[str, Any]]:
    """The run's rollouts as an RL framework dumps them: tokens, the rollout's log-probabilities and each row's
    sampling (temperature, top_k, top_p, seed) as the run recorded it."""
    rows = []
    for r in items(read_ledger(run)):
        if r.experiment == "mismatch" and not r.part:
            lps = arrays.decode(next(a for a in r.payload["arms"] if a["name"] == "rollout")["logprobs"])
            sampling = {k: v for k, v in r.payload["sampling"].items() if k != "sample"}
            rows.append({"id": r.item_id, "prompt_ids": r.payload["prompt_ids"],
                         "response_ids": r.payload["response_ids"], "logprobs": [float(x) for x in lps], **sampling})
    return rows


def _write(path: Path, rows: list[dict[str, Any]], edit: Edit | None = None, at: int = 0) -> Path:
    """`rows` as JSONL, row `at` changed by `edit`."""
    rows = json.loads(json.dumps(rows))
    if edit is not None:
        edit(rows[at])
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _section(run: Path) -> dict[str, Any]:
    return json.loads((run / "results.json").read_text())["mismatch"][0]


def _total(run: Path) -> tuple[float, float]:
    """The total row's bitwise-equal fraction and mean |log-ratio| (rollout vs the trainer)."""
    m = next(p for p in _section(run)["pairs"] if p["row"] == "total")["metrics"]
    return m["bitwise_equal"], m["abs_mean"]


def _trainer_bits(run: Path) -> dict[str, bytes]:
    return {r.item_id: arrays.decode(a["logprobs"]).tobytes() for r in items(read_ledger(run)) if r.part == "bf16"
            for a in r.payload["arms"] if a["name"] == "trainer@bf16"}


def test_a_rollout_file_is_scored_under_its_rows_sampling(sampled_run: Path, root: Path):
    """Scored as a file, the run's own rollouts give its numbers, bit for bit; the audit re-executes the file's run
    (its trainer parts under the rows' sampling). Control: the rows without their temperature are scored at 1.0."""
    rows = _rows(sampled_run)
    assert {r["temperature"] for r in rows} == {0.5}
    good = _write(root / "sampled.jsonl", rows)
    ran = _invoke(["mismatch", "--rollouts", good, "--logprobs-mode", "processed", *FILE_RUN, "--out", root / "file"])
    assert ran.exit_code == 0, ran.output
    assert _total(root / "file") == _total(sampled_run)
    assert _trainer_bits(root / "file") == _trainer_bits(sampled_run)
    audit = _invoke(["audit", root / "file", "--quiet"])
    assert audit.exit_code == 0, audit.output
    stripped = _write(root / "stripped.jsonl", [{k: v for k, v in r.items() if k != "temperature"} for r in rows])
    ran = _invoke(["mismatch", "--rollouts", stripped, "--logprobs-mode", "processed", *FILE_RUN, "--out",
                   root / "stripped"])
    assert ran.exit_code == 0, ran.output
    bitwise, abs_mean = _total(root / "stripped")
    assert bitwise < _total(sampled_run)[0] and abs_mean > 10 * _total(sampled_run)[1], _total(root / "stripped")
    assert all(a != b for a, b in zip(_trainer_bits(root / "stripped").values(),
                                      _trainer_bits(sampled_run).values(), strict=True))


def test_a_rows_sampling_becomes_the_decode_it_is_scored_under():
    run = DecodeConfig()
    assert row_decode(run, {"temperature": 0.5, "top_k": 20, "top_p": 0.9, "seed": 3}) == DecodeConfig(
        temperature=0.5, top_k=20, top_p=0.9)
    assert row_decode(run, {"temperature": 0}) == run  # greedy: warps nothing (its processed score is refused)
    assert row_decode(run, {}) == row_decode(run, None) == run


def test_an_engine_that_cannot_take_a_rows_sampling_refuses_its_processed_score():
    class Fixed(RolloutEngine):
        def sampling(self) -> dict[str, float | int | bool]:
            return {}

        def sample(self, prompt: list[int]) -> Any:
            raise AssertionError

        def prefills(self, prompt: list[int], response: list[int], tokens_fp: str) -> list[Any]:
            return []

    engine, row = Fixed(), DecodeConfig(temperature=0.5)
    assert engine.for_row(row, "raw") is engine
    with pytest.raises(StageReplayError, match=r"sampled at temperature 0\.5"):
        engine.for_row(row, "processed")


# -- refusals through the commands: one line, exit 2, nothing written ---------------------------------------------

def _refused(result: Result, out: Path, *says: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == REFUSED and len(lines) == 1, (result.exit_code, result.output)
    line = lines[0]
    assert line.startswith("error: ") and "; " in line and all(s in line for s in says), line
    assert "Traceback" not in result.output and not out.exists()
    return line


ROLLOUT_ROWS: list[tuple[str, Edit, str]] = [
    ("temperature str", lambda r: r.update(temperature="hot"), "temperature is 'hot' (a string)"),
    ("temperature negative", lambda r: r.update(temperature=-1.0), "temperature is -1.0"),
    ("temperature nan", lambda r: r.update(temperature=float("nan")), "temperature is nan"),
    ("temperature bool", lambda r: r.update(temperature=True), "temperature is True (a bool)"),
    ("temperature 0, processed", lambda r: r.update(temperature=0), "temperature is 0 (greedy)"),
    ("top_p 0", lambda r: r.update(top_p=0), "top_p is 0, not a number in (0, 1]"),
    ("top_p above 1", lambda r: r.update(top_p=1.5), "top_p is 1.5"),
    ("top_k fraction", lambda r: r.update(top_k=2.5), "top_k is 2.5 (a float)"),
    ("top_k str", lambda r: r.update(top_k="5"), "top_k is '5' (a string)"),
    ("seed negative", lambda r: r.update(seed=-1), "seed is -1"),
    ("seed past 64 bits", lambda r: r.update(seed=1 << 64), "seed is 18446744073709551616"),
    ("response float", lambda r: r["response_ids"].__setitem__(2, 5.0), "response_ids[2] is 5.0 (a float): token "
                                                                      "IDs must be integers"),
    ("response bool", lambda r: r["response_ids"].__setitem__(0, True), "response_ids[0] is True (a bool): token "
                                                                       "IDs must be integers"),
    ("prompt null", lambda r: r["prompt_ids"].__setitem__(1, None), "prompt_ids[1] is None (null)"),
    ("response huge", lambda r: r["response_ids"].__setitem__(0, 10**30), "not a token ID of this tokenizer"),
    ("logprob inf", lambda r: r["logprobs"].__setitem__(3, float("-inf")), "logprobs[3] is -inf"),
    ("logprob positive", lambda r: r["logprobs"].__setitem__(0, 0.5), "logprobs[0] is 0.5"),
    ("logprobs short", lambda r: r["logprobs"].pop(), "logprobs for 12 response tokens"),
    ("logprobs null", lambda r: r.update(logprobs=None), "logprobs is None (null)"),
    ("id list", lambda r: r.update(id=[1]), "id is [1] (a list)"),
]


@pytest.mark.parametrize(("edit", "says"), [(e, s) for _, e, s in ROLLOUT_ROWS], ids=[n for n, _, _ in ROLLOUT_ROWS])
def test_a_bad_rollout_row_is_refused_before_anything_is_written(sampled_run: Path, tmp_path: Path, edit: Edit,
                                                                  says: str):
    path = _write(tmp_path / "rollouts.jsonl", _rows(sampled_run), edit, at=1)
    out = tmp_path / "run"
    line = _refused(_invoke(["mismatch", "--rollouts", path, "--logprobs-mode", "processed", *FILE_RUN, "--out", out]),
                    out, says, "rollouts.jsonl line 2")
    assert "--served" not in line and "served" not in line


def test_a_bad_rollout_row_is_refused_under_raw_log_probabilities_too(sampled_run: Path, tmp_path: Path):
    """The file read as the run loads its items (no processed mode reads it first)."""
    path = _write(tmp_path / "rollouts.jsonl", _rows(sampled_run), lambda r: r.update(temperature="hot"))
    out = tmp_path / "run"
    _refused(_invoke(["mismatch", "--rollouts", path, *FILE_RUN, "--out", out]), out, "line 1: temperature is 'hot'")


def test_a_compressed_truncated_or_binary_rollout_file_is_called_what_it_is(sampled_run: Path, tmp_path: Path):
    good = _write(tmp_path / "good.jsonl", _rows(sampled_run))
    zipped = tmp_path / "rollouts.jsonl.gz"
    zipped.write_bytes(gzip.compress(good.read_bytes()))
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(good.read_bytes()[:-40])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(good.read_bytes() + b'{"id": "caf\xe9"}\n')
    out = tmp_path / "run"
    for path, says in ((zipped, "is gzip-compressed, not JSONL text; decompress it (gunzip -k rollouts.jsonl.gz)"),
                       (cut, "cut.jsonl line 2 is not valid JSON"), (latin, "latin.jsonl line 3 is not UTF-8 text")):
        _refused(_invoke(["mismatch", "--rollouts", path, *FILE_RUN, "--out", out]), out, says)


@pytest.fixture(scope="module")
def served(sampled_run: Path) -> list[dict[str, Any]]:
    """The sampled run's prompts and responses as served outputs of a seeded server: each row's seed, no
    log-probabilities."""
    return [{"id": r["id"], "prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"][:6], "seed": 7 + i}
            for i, r in enumerate(_rows(sampled_run))]


CLAIM = ["--sample", "--temperature", "1", "--honest", "bf16", "--quiet"]
SERVED_ROWS: list[tuple[str, Edit, str]] = [
    ("seed str", lambda r: r.update(seed="abc"), "seed is 'abc' (a string), not an integer in 0..18446744073709551615"),
    ("seed fraction", lambda r: r.update(seed=1.5), "seed is 1.5 (a float)"),
    ("seed bool", lambda r: r.update(seed=False), "seed is False (a bool)"),
    ("response float", lambda r: r["response_ids"].__setitem__(0, 3.0), "token IDs must be integers"),
    ("logprob nan", lambda r: r.update(logprobs=[float("nan")] * 6), "logprobs[0] is nan"),
    ("logprobs long", lambda r: r.update(logprobs=[-1.0] * 7), "7 logprobs for 6 response tokens"),
    ("temperature other than the claim's", lambda r: r.update(temperature=0.7),
     "temperature is 0.7, and the claim samples with temperature 1, top_k 0, top_p 1"),
    ("top_p other than the claim's", lambda r: r.update(top_p=0.9), "top_p is 0.9, and the claim samples with"),
]


@pytest.mark.parametrize(("edit", "says"), [(e, s) for _, e, s in SERVED_ROWS], ids=[n for n, _, _ in SERVED_ROWS])
def test_a_bad_served_row_is_refused_before_anything_is_written(served: list[dict[str, Any]], tmp_path: Path,
                                                                 edit: Edit, says: str):
    path = _write(tmp_path / "served.jsonl", served, edit, at=1)
    out = tmp_path / "run"
    line = _refused(_invoke(["attest", "--served", path, *CLAIM, "--out", out]), out, says, "served.jsonl line 2")
    assert "rollout" not in line


def test_a_served_row_sampled_under_a_greedy_claim_is_refused_and_a_greedy_one_is_taken(
        served: list[dict[str, Any]], tmp_path: Path):
    out = tmp_path / "run"
    sampled = _write(tmp_path / "sampled.jsonl", served, lambda r: r.update(temperature=1.0))
    _refused(_invoke(["attest", "--served", sampled, "--honest", "bf16", "--out", out]), out,
             "line 1: temperature is 1, and the claim is greedy")
    greedy = _write(tmp_path / "greedy.jsonl", [{**r, "temperature": 0} for r in served])
    planned = _invoke(["attest", "--served", greedy, "--honest", "bf16", "--plan"])
    assert planned.exit_code == 0, planned.output


def test_a_bad_served_file_leaves_an_existing_folder_as_it_was(served: list[dict[str, Any]], tmp_path: Path):
    path = _write(tmp_path / "served.jsonl", served, lambda r: r.update(seed="abc"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "kept.txt").write_text("kept")
    result = _invoke(["attest", "--served", path, *CLAIM, "--out", out])
    assert result.exit_code == REFUSED and "seed is 'abc'" in result.output, result.output
    assert [p.name for p in out.iterdir()] == ["kept.txt"] and (out / "kept.txt").read_text() == "kept"


def test_each_command_names_its_own_file(tmp_path: Path):
    """A missing file is told to pass the option its command has; so is a --columns entry it cannot map."""
    out = tmp_path / "run"
    line = _refused(_invoke(["attest", "--served", tmp_path / "nowhere.jsonl", "--quiet", "--out", out]), out,
                    "file of served outputs not found", "pass --served FILE")
    assert "rollout" not in line
    line = _refused(_invoke(["mismatch", "--rollouts", tmp_path / "nowhere.jsonl", "--quiet", "--out", out]), out,
                    "rollout file not found", "pass --rollouts FILE")
    assert "served" not in line
    there = tmp_path / "there.jsonl"
    there.write_text("")
    _refused(_invoke(["attest", "--served", there, "--columns", "answer=a", "--out", out]), out,
             "invalid --columns entry 'answer=a' for a file of served outputs")
    _refused(_invoke(["mismatch", "--rollouts", there, "--out", out]), out, "there.jsonl holds no rollouts")


def test_a_renamed_seed_column_is_the_rows_seed(served: list[dict[str, Any]], tmp_path: Path):
    """`--columns seed=COLUMN` (attest --help documents it) maps the row's seed: the scan reads it, and so does the
    job that replays the claimed sampler with it; the control, unmapped, finds no seed and derives one."""
    rows = [{("request_seed" if k == "seed" else k): v for k, v in r.items()} for r in served]
    path = _write(tmp_path / "served.jsonl", rows)
    DataConfig(path=str(path), columns="seed=request_seed", source="served")  # accepted, as --columns is
    found, _ = scan(path, "seed=request_seed", 1 << 31, 1 << 31, kind=SERVED)
    claim = DecodeConfig(sample=True)
    assert [r.sampling["seed"] for r in found] == [item_seed(r, claim, None) for r in found] == [7, 8]
    assert [read(r).sampling["seed"] for r in found] == [7, 8]
    bare, _ = scan(path, None, 1 << 31, 1 << 31, kind=SERVED)
    assert all("seed" not in r.sampling and item_seed(r, claim, None) not in (7, 8) for r in bare)
    assert "seed" in _invoke(["attest", "--help"]).output
    planned = _invoke(["attest", "--served", path, "--columns", "seed=request_seed", *CLAIM, "--plan"])
    assert planned.exit_code == 0, planned.output


# -- the reader alone ------------------------------------------------------------------------------------------------

ROW = {"id": "a", "prompt_ids": [1, 2, 3], "response_ids": [4, 5], "logprobs": [-0.5, -1.0]}


def _scan(tmp_path: Path, rows: list[Any], kind=ROLLOUTS, columns: str | None = None, name: str = "f.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return scan(path, columns, 64, 1 << 20, kind=kind)[0]


def test_values_that_stand_for_integers_are_read_as_them(tmp_path: Path):
    """A seed or top-k written as a float without a fraction (a data frame's integer column holding a null) is the
    integer, where the float holds it exactly; vLLM's top-k -1 (off) is 0; a BOM before the first row is no fault."""
    (found,) = _scan(tmp_path, [{**ROW, "seed": 3.0, "top_k": -1, "temperature": 1}])
    assert found.sampling == {"seed": 3, "top_k": 0, "temperature": 1.0}
    assert isinstance(found.sampling["seed"], int) and isinstance(found.sampling["temperature"], float)
    with pytest.raises(StageReplayError, match=r"seed is 1\.15\d*e\+18 \(a float\)"):
        _scan(tmp_path, [{**ROW, "seed": float(2**60)}])
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROW).encode() + b"\n")
    assert [i.id for i in scan(path, None, 64, 1 << 20)[0]] == ["a"]


def test_a_served_row_may_leave_its_logprobs_out_and_a_rollout_may_not(tmp_path: Path):
    for value in (None, "absent"):
        row = {k: v for k, v in ROW.items() if k != "logprobs"} if value == "absent" else {**ROW, "logprobs": None}
        assert [i.id for i in _scan(tmp_path, [row], SERVED)] == ["a"]
        with pytest.raises(StageReplayError, match="logprobs"):
            _scan(tmp_path, [row], ROLLOUTS)


@pytest.mark.parametrize(("head", "says"), [
    (b"\x28\xb5\x2f\xfd\x00\x00", "is zstd-compressed, not JSONL text; decompress it (unzstd f.jsonl)"),
    (b"PK\x03\x04\x00\x00", "is a zip archive"),
    (b"BZh91AY", "is bzip2-compressed"),
    (b"\xfd7zXZ\x00\x00", "is xz-compressed"),
    (b"PAR1\x00\x00", "is a Parquet file named as JSONL; name it .parquet"),
    (b'{"id": "a"}\x00\n', "line 1 holds NUL bytes"),
    (b"[[[[" * 5000 + b"\n", "line 1 is not valid JSON"),
    (b'{"id": ' + b"9" * 5000 + b"}\n", "line 1 is not valid JSON"),
])
def test_a_file_that_is_not_jsonl_text_is_called_what_it_is(tmp_path: Path, head: bytes, says: str):
    path = tmp_path / "f.jsonl"
    path.write_bytes(head)
    with pytest.raises(StageReplayError, match=None) as caught:
        scan(path, None, 64, 1 << 20)
    assert says in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_a_parquet_files_fields_are_typed_as_a_jsonl_files(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(name: str, **columns: Any) -> Path:
        path = tmp_path / name
        pq.write_table(pa.table({"prompt_ids": [[1, 2], [3]], "response_ids": [[4], [5, 6]],
                                 "logprobs": [[-0.1], [-0.2, -0.3]], **columns}), path)
        return path

    good = parquet("good.parquet", seed=[1, 2])
    found, _ = scan(good, None, 64, 1 << 20)
    assert [r.sampling for r in found] == [{"seed": 1}, {"seed": 2}] and read(found[1]).response_ids == (5, 6)
    with pytest.raises(StageReplayError, match=r"row 1: seed is 'x' \(a string\)"):
        scan(parquet("seed.parquet", seed=["x", "y"]), None, 64, 1 << 20)
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"prompt_ids": [[1.0, 2.0]], "response_ids": [[4.0]], "logprobs": [[-0.1]]}), floats)
    with pytest.raises(StageReplayError, match=r"floats.parquet row 1: prompt_ids\[0\] is 1.0 \(a float\): token IDs "
                                               "must be integers"):
        scan(floats, None, 64, 1 << 20)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    with pytest.raises(StageReplayError, match=r"cannot read .*broken\.parquet as Parquet"):
        scan(broken, None, 64, 1 << 20)


def test_a_row_refused_names_the_file_the_row_and_the_field(tmp_path: Path):
    rows = [ROW, {**ROW, "id": "b", "response_ids": [4, 99]}]
    with pytest.raises(StageReplayError) as caught:
        _scan(tmp_path, rows)
    assert str(caught.value) == (f"{tmp_path / 'f.jsonl'} line 2: response_ids[1] is 99, not a token ID of this "
                                 "tokenizer (0..63); check the rollouts against the model whose tokenizer made them")
    with pytest.raises(StageReplayError, match="check the served outputs against"):
        _scan(tmp_path, rows, SERVED)


def test_an_edited_row_read_again_by_its_job_is_refused(tmp_path: Path):
    """A job reads its row again (the file may have changed since the scan): the same checks refuse it."""
    (item,) = _scan(tmp_path, [ROW])
    (tmp_path / "f.jsonl").write_text(json.dumps({**ROW, "logprobs": [-0.5, "x"]}) + "\n")
    with pytest.raises(StageReplayError, match="at byte 0: logprobs\\[1\\] is 'x'"):
        read(item)
    assert np.isfinite(read(_scan(tmp_path, [ROW])[0]).logprobs).all()
