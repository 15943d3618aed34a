"""Every reading command on a run of every registered experiment, a rollout-file mismatch included: export (Parquet
and CSV), show, report, `audit --verify-only`, audit, compare (against the run itself, and against a run of the same
experiment on other data: refused only in one line that says why) and plan on the recorded run. Each exits 0 with
no traceback, and its output names the experiment's own fields (its records' arms or fields, its tables, its
stage).

The runs are as small as the toy allows: one run of the protocol (matched on 3 items, which one of them diverges
within 8 tokens, so the transplant has an item; the 2x2, the bridge, the transplant and resample added to it), a
generated mismatch run of 2 rollouts of 6 tokens, a rollout file of that run's own tokens, its columns renamed, and an attest
run of 3 items of 4 tokens (two honest variants).
Each command runs once per run (`Readings`), and each experiment's own fields are looked for in what it printed.

Controls: an experiment whose reader raises fails the check; an experiment defined in a test module
(`echo_experiment`) and registered with one line runs from its own command and through every command the same
way, and unregistered its run is refused by name.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.experiments import registry
from stagereplay.experiments.experiment import Experiment
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, items, read_ledger

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures"
PROTOCOL = ["matched", "--n", "3", "--precision", "bf16", "--max-new-tokens", "8"]
"""The run the protocol's other stages extend: item 2 of the toy diverges at its 7th token in bf16."""
EXTENSIONS: dict[str, list[str]] = {
    "precision_2x2": ["precision-2x2", "--precisions", "bf16"],
    "bridge": ["bridge", "--rows", "1"],
    "transplant": ["transplant"],
    "resample": ["resample", "--k", "1", "--n", "1"],
}
"""How each experiment that extends a run adds its stage to the protocol run (the smallest stage it makes)."""
STARTS: dict[str, list[str]] = {
    "matched": PROTOCOL,
    "mismatch": ["mismatch", "--n", "2", "--max-new-tokens", "6", "--precisions", "bf16,fp32"],
    "attest": ["attest", "--n", "3", "--max-new-tokens", "4", "--honest", "bf16,fp32"],
}
"""How each experiment that makes a run makes a small one."""
RENAMED = "prompt_ids=pid,response_ids=rid,logprobs=lp,id=key"
"""The rollout file's columns, renamed: the audit must read it with the mapping the run was made with."""


def _ok(result: Result, what: str) -> str:
    """The output of a command that must exit 0 with no traceback."""
    assert result.exit_code == 0 and "Traceback" not in result.output, f"{what}: {result.output}"
    return result.output


def _invoke(args: list[str]) -> Result:
    return runner.invoke(app, [*args], env={"COLUMNS": "80"})


@dataclass
class Readings:
    """What every reading command printed or wrote for one run, each command run once (`read_all`)."""

    run: Path
    other: Path
    work: Path
    """Where the exports and comparisons were written."""
    outputs: dict[str, Result] = field(default_factory=dict)

    @property
    def records(self) -> list[Record]:
        return list(items(read_ledger(self.run)))


def read_all(run: Path, other: Path, work: Path, sample: bool = False) -> Readings:
    """Every reading command on `run` (and `compare` against `other`, a run on other data), outputs kept by name;
    `show` is each experiment's (`problems`). `sample`: the audit re-executes one unit per stage, not every one."""
    read = Readings(run, other, work)
    commands = {
        "export-parquet": ["export", str(run), "--output", str(work / "rows.parquet")],
        "export-csv": ["export", str(run), "--format", "csv", "--output", str(work / "rows.csv")],
        "report": ["report", str(run)],
        "verify": ["audit", str(run), "--verify-only"],
        "audit": ["audit", str(run), *(["--sample", "1"] if sample else []), "--quiet"],
        "compare-self": ["compare", str(run), str(run), "--out", str(work / "self")],
        "compare-other": ["compare", str(run), str(other), "--out", str(work / "other")],
        "plan": ["plan", str(run)],
    }
    for name, args in commands.items():
        read.outputs[name] = _invoke(args)
    return read


def problems(e: Experiment, read: Readings) -> list[str]:
    """What of every command on `read.run` fails for experiment `e`: a command that did not exit 0 (or printed a
    traceback), or whose output does not name `e`'s own fields. Empty: every command read it. `show` runs here, on
    the first item `e` recorded."""
    out: list[str] = []
    mine = [r for r in read.records if r.experiment == e.name]
    if not mine:
        return [f"the run holds no {e.name} record"]
    item = mine[0].item_id
    outputs = {**read.outputs, "show": _invoke(["show", str(read.run), item])}
    for name, result in outputs.items():
        if name == "compare-other":
            continue
        if result.exit_code != 0 or "Traceback" in result.output or (
                result.exception is not None and not isinstance(result.exception, SystemExit)):
            out.append(f"{name}: exit {result.exit_code}: {result.output[-400:]}")
    other = read.outputs["compare-other"]
    if other.exit_code not in (0, 2) or "Traceback" in other.output or (
            other.exit_code == 2 and other.output.strip().count("\n") != 0):
        out.append(f"compare on other data: neither compared nor refused in one line: {other.output[-400:]}")
    if out:
        return out
    try:
        payloads = [e.read(r) for r in mine]
    except Exception as exc:  # a reader that raises is what the check finds
        return [f"{e.name}'s reader: {exc}"]
    arms = {a.name for p in payloads for a in getattr(p, "arms", [])}
    for fmt in ("parquet", "csv"):
        rows = (pq.read_table(read.work / "rows.parquet").to_pylist() if fmt == "parquet" else
                list(csv.DictReader((read.work / "rows.csv").open())))
        exported = {row["arm"] for row in rows if row["experiment"] == e.name}
        if not exported or not arms <= exported:
            out.append(f"export {fmt}: {e.name}'s arms {sorted(arms - exported)} are not rows")
    shown = outputs["show"].output
    own = [p for r, p in zip(mine, payloads, strict=True) if r.item_id == item]
    names = {a.name for p in own for a in getattr(p, "arms", [])} or {k for p in own for k in type(p).model_fields}
    if not any(n in shown for n in names):
        out.append(f"show {item}: names none of {e.name}'s {sorted(names)}: {shown[-400:]}")
    results = json.loads((read.run / "results.json").read_text())
    report = (read.run / "report.md").read_text()
    titles = [t.title for t in e.tables(e.results_of(results.get(e.name)))]
    if not titles or not all(t in report for t in titles):
        out.append(f"report: {e.name}'s tables {titles} are not all in report.md")
    if f"{e.name}/primary" not in read.outputs["plan"].output:
        out.append(f"plan: no {e.name}/primary row: {read.outputs['plan'].output[-400:]}")
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("every")


@pytest.fixture(scope="module")
def protocol_run(root: Path) -> Path:
    """The protocol on the toy: matched, then every experiment that extends a run, each with its smallest stage."""
    run = root / "protocol"
    _ok(_invoke([*PROTOCOL, "--quiet", "--out", str(run)]), "matched")
    for name, args in EXTENSIONS.items():
        _ok(_invoke([args[0], str(run), *args[1:], "--quiet"]), name)
    return run


@pytest.fixture(scope="module")
def mismatch_run(root: Path) -> Path:
    run = root / "mismatch"
    _ok(_invoke([*STARTS["mismatch"], "--quiet", "--out", str(run)]), "mismatch")
    return run


@pytest.fixture(scope="module")
def attest_run(root: Path) -> Path:
    run = root / "attest"
    _ok(_invoke([*STARTS["attest"], "--quiet", "--out", str(run)]), "attest")
    return run


@pytest.fixture(scope="module")
def rollout_file_run(root: Path, mismatch_run: Path) -> Path:
    """A rollout file of the generated run's own tokens and log-probabilities, its columns renamed, audited."""
    rows = []
    for r in items(read_ledger(mismatch_run)):
        if r.experiment == "mismatch" and not r.part:
            rollout = next(a for a in r.payload["arms"] if a["name"] == "rollout")
            rows.append({"key": r.item_id, "pid": r.payload["prompt_ids"], "rid": r.payload["response_ids"],
                         "lp": [float(x) for x in arrays.decode(rollout["logprobs"])]})
    path = root / "rollouts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = root / "file"
    _ok(_invoke([*_file_args(root), "--quiet", "--out", str(run)]), "mismatch --rollouts")
    return run


def _file_args(root: Path) -> list[str]:
    return ["mismatch", "--rollouts", str(root / "rollouts.jsonl"), "--columns", RENAMED, "--precisions", "bf16"]


@pytest.fixture(scope="module")
def readings(root: Path, protocol_run: Path, mismatch_run: Path, rollout_file_run: Path, attest_run: Path
             ) -> dict[str, Readings]:
    """Every reading command, once per run: the protocol run (against the toy's 200-item matched run: other data; its
    audit re-executes a unit per stage), the generated mismatch run (against the rollout file's), the rollout
    file's (against the generated one; its audit re-reads every row through the run's column mapping), and the attest
    run (against the generated mismatch run)."""
    runs = {"protocol": (protocol_run, FIXTURES / "toy_matched"), "mismatch": (mismatch_run, rollout_file_run),
            "mismatch (rollout file)": (rollout_file_run, mismatch_run), "attest": (attest_run, mismatch_run)}
    out = {}
    for n, (key, (run, other)) in enumerate(runs.items()):
        work = root / f"read-{n}"
        work.mkdir()
        out[key] = read_all(run, other, work, sample=key == "protocol")
    return out


def _cases() -> list[Any]:
    """Every registered experiment, by the run that holds it, and the rollout-file mismatch."""
    cases = [pytest.param(e.name, "protocol" if e.name in EXTENSIONS or e.name == "matched" else e.name, id=e.name)
             for e in registry.all_experiments()]
    return [*cases, pytest.param("mismatch", "mismatch (rollout file)", id="mismatch-rollout-file")]


def test_every_registered_experiment_has_a_small_run_here():
    """A new experiment is read by every command only once the test knows how to make a small run of it."""
    known = set(EXTENSIONS) | set(STARTS)
    assert {e.name for e in registry.all_experiments()} <= known, "give the new experiment a small run above"


@pytest.mark.parametrize(("name", "run"), _cases())
def test_every_reading_command_reads_the_experiment(name: str, run: str, readings: dict[str, Readings]):
    assert problems(registry.experiment(name), readings[run]) == []


def test_a_mismatch_run_compares_with_a_file_of_its_own_tokens(readings: dict[str, Readings]):
    """A generated run and a file of its own tokens compare on the tokens: every rollout is the same, and what
    differs is where the items came from."""
    compared = _ok(readings["mismatch"].outputs["compare-other"], "compare")
    assert "2/2 (100.0%)" in compared and "config.source" in compared, compared
    tables = [line for line in compared.splitlines() if line[:1] in "┏┃┡│└"]
    assert tables and all(len(line) <= 80 for line in tables), compared


def test_a_mismatch_item_tells_where_each_side_parts_from_the_rollout(readings: dict[str, Readings]):
    run = readings["mismatch"].run
    item = next(r.item_id for r in readings["mismatch"].records)
    shown = _ok(_invoke(["show", str(run), item]), "show")
    assert "first differs" in shown and "max |log-ratio|" in shown and "trainer@fp32" in shown, shown


def test_an_experiment_whose_reader_raises_fails_the_check(readings: dict[str, Readings], monkeypatch):
    """The control: with matched's reader broken, the commands that read its records (the export, show) fail, and
    the check says so."""
    def broken(self: Experiment, record: Record) -> Any:
        raise ValueError("this reader cannot read")

    read = readings["protocol"]
    work = read.run.parent / "read-broken"
    work.mkdir()
    matched = registry.experiment("matched")
    monkeypatch.setattr(type(matched), "read", broken)
    again = Readings(read.run, read.other, work, dict(read.outputs))
    again.outputs["export-parquet"] = _invoke(["export", str(read.run), "--output", str(work / "rows.parquet")])
    found = problems(matched, again)
    assert any(p.startswith("export-parquet") for p in found) and any(p.startswith("show") for p in found), found


def test_an_experiment_defined_in_a_test_module_is_read_by_every_command(protocol_run: Path, root: Path):
    """`echo` (tests/echo_experiment.py), registered with one line, runs from its own command into a copy of the
    protocol run and every reading command reads it; unregistered, its run is refused by name."""
    import shutil

    from echo_experiment import Echo

    run = root / "echo"
    shutil.copytree(protocol_run, run)
    for leftover in ("audit.json",):
        (run / leftover).unlink(missing_ok=True)
    registry.register(Echo())
    try:
        help_text = _invoke(["echo", "--help"]).output
        assert "--echo-tokens" in help_text, help_text
        _ok(_invoke(["echo", str(run), "--echo-tokens", "2", "--quiet"]), "echo")
        work = root / "read-echo"
        work.mkdir()
        read = read_all(run, FIXTURES / "toy_matched", work)
        assert problems(registry.experiment("echo"), read) == []
        item = next(r.item_id for r in read.records if r.experiment == "echo")
        shown = _invoke(["show", str(run), item]).output
        assert "echo_length: 2" in shown and "echoed_ids: 2 token IDs" in shown, shown
    finally:
        registry.unregister("echo")
    refused = _invoke(["export", str(run)])
    assert refused.exit_code == 2 and "unknown experiment 'echo'" in refused.output, refused.output


def _rows(plan: str, name: str) -> list[str]:
    return [line for line in plan.splitlines() if line.startswith(f"{name}/")]


def test_a_mismatch_run_is_priced_before_it_runs_as_it_ran(readings: dict[str, Readings], root: Path):
    """`mismatch ... --plan` (a rollout file's included: each response at its own length) prices the forwards, tokens
    and caches that `plan RUN` measures on the run those options made, row for row."""
    for key, args in (("mismatch", STARTS["mismatch"]), ("mismatch (rollout file)", _file_args(root))):
        before = _ok(_invoke([*args, "--plan"]), "--plan")
        after = readings[key].outputs["plan"].output
        assert _rows(before, "mismatch") == _rows(after, "mismatch") != [], (before, after)


def test_plan_before_a_run_refuses_what_the_run_would_refuse(root: Path, rollout_file_run: Path):
    """With a rollout file, decoding options are refused in one line, before and instead of a run."""
    for extra in (["--plan"], ["--out", str(root / "never")]):
        refused = _invoke([*_file_args(root), "--max-new-tokens", "4", "--sample", *extra])
        assert refused.exit_code == 2 and "--max-new-tokens, --sample decode nothing with --rollouts" in refused.output
        assert refused.output.strip().count("\n") == 0, refused.output
    assert not (root / "never").exists()


def test_a_command_offers_only_the_inputs_its_experiment_uses():
    """`mismatch --help` offers no stage boundary, scorer, cross arm or batch, and speaks of a response; the control:
    `matched --help`, whose experiment uses them all, offers them."""
    wide = {"COLUMNS": "240"}
    mismatch = runner.invoke(app, ["mismatch", "--help"], env=wide).output
    matched = runner.invoke(app, ["matched", "--help"], env=wide).output
    unused = ("--boundary-after", "--boundary-marker", "--boundary-regex", "--scorer", "--cross", "--batch",
              "--max-stage1-tokens")
    def offers(flag: str, text: str) -> bool:  # an option's own line of the help, not a mention in another's text
        return re.search(rf"^│ {flag}\s", text, re.MULTILINE) is not None

    assert all(offers(flag, matched) for flag in unused) and "suffix length limit after the boundary" in matched
    assert not any(offers(flag, mismatch) for flag in unused), mismatch
    assert "suffix length limit" not in mismatch and "response length limit" in mismatch, mismatch
    assert all(target in mismatch for target in ("prompt_ids", "response_ids", "logprobs")), mismatch
    refused = _invoke(["mismatch", "--boundary-after", "4", "--out", "never"])
    assert refused.exit_code == 2 and "--boundary-after" in refused.output and not Path("never").exists()


@pytest.mark.parametrize("name", [e.name for e in registry.all_experiments() if e.starts_run])
def test_every_experiment_that_makes_a_run_prices_it_before_it_runs(name: str, tmp_path: Path):
    """`<command> ... --plan` prices the run its options would make, runs nothing and writes nothing."""
    out = tmp_path / "never"
    planned = _ok(_invoke([*STARTS[name], "--plan", "--out", str(out)]), f"{name} --plan")
    assert _rows(planned, name) and any(line.startswith("audit@") for line in planned.splitlines()), planned
    assert not out.exists()


def test_verify_reads_a_record_of_its_own_kind_as_its_experiments_model(mismatch_run: Path, root: Path):
    """A mismatch record given a field its model does not have, every checksum recomputed, is found by `--verify-only`
    as not a mismatch payload; the control: the run as made verifies."""
    import shutil

    import forge

    _ok(_invoke(["audit", str(mismatch_run), "--verify-only"]), "verify")
    forged = root / "forged"
    shutil.copytree(mismatch_run, forged)
    chain, manifest = forge.load(forged)
    i = next(k for k, r in enumerate(chain) if r.kind == "item" and r.experiment == "mismatch")
    chain[i] = forge.with_payload(chain[i], {**forge.edit(chain[i]), "verdict": "fine"}, recompare=False)
    forge.save(forged, chain, manifest, results=False)
    found = _invoke(["audit", str(forged), "--verify-only"])
    assert found.exit_code == 1 and f"{chain[i].item_id}: mismatch/primary" in found.output, found.output
    assert "not a mismatch payload" in found.output, found.output


def test_a_rollout_run_recorded_before_sources_were_named_reads_as_its_source(rollout_file_run: Path, root: Path):
    """A manifest that says `"rollouts": true` (a run made before `source` was recorded) verifies, reads its file as a
    rollout file, and compares with the same run recorded as `"source": "rollouts"` with nothing differing in its data;
    the control: the manifest as written keeps its `rollouts` field."""
    import shutil

    import forge

    old = root / "old-manifest"
    shutil.copytree(rollout_file_run, old)
    chain, manifest = forge.load(old)
    data = manifest["config"]["data"]
    assert data.pop("source") == "rollouts"
    manifest["config"]["data"] = {**data, "rollouts": True}
    forge.save(old, chain, manifest)
    assert json.loads((old / "manifest.json").read_text())["config"]["data"]["rollouts"] is True
    _ok(_invoke(["audit", str(old), "--verify-only"]), "verify")
    compared = _ok(_invoke(["compare", str(old), str(rollout_file_run), "--out", str(root / "old-vs-new")]), "compare")
    assert "config.data" not in compared and "2/2 (100.0%)" in compared, compared
