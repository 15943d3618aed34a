"""Every reading command on a run of every registered experiment, an installed extension's (tests/plugin) and a
rollout-file mismatch included: export (Parquet and CSV), show, report, `audit --verify-only`, audit, compare
(against the run itself, and against a run on other data: refused only in one line that says why) and plan on the
recorded run. Each exits 0 with no traceback, and its output holds the experiment's own fields (its records' arms as
export rows, its tables in the report, its stage in the plan, and in `show` the item told record by record: every
arm by name and every line the experiment tells of it, in its own section).

Every experiment makes its own smallest run (`Experiment.smallest_run`), with nothing here naming it: one that makes
runs makes one with its command, and one that extends a run adds its stage to the run its smallest run names
(matched's, for every stage of the protocol and the plugin's: 3 items, one of which diverges within 8 tokens, so the
transplant has a pair). Beside them, a rollout file of the generated mismatch run's own tokens, its columns renamed.
Each command runs once per run (`Readings`).

Controls: an experiment whose reader raises fails the check; a `show` that leaves out an experiment's section, or
tells another value than its record holds, fails it; an installed extension unregistered has its run refused by name.
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
from stagereplay.experiments.core import registry
from stagereplay.experiments.core.experiment import Experiment
from stagereplay.experiments.core.small_run import SmallRun
from stagereplay.records import arrays
from stagereplay.records.ledger import Record, items, read_ledger

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures"
OTHER_DATA = FIXTURES / "toy_matched"
"""A run on other data (the toy's 200-item matched run), that each run is compared against."""
RENAMED = "prompt_ids=pid,response_ids=rid,logprobs=lp,id=key"
"""The rollout file's columns, renamed: the audit must read it with the mapping the run was made with."""
ROLLOUT_FILE = "mismatch (rollout file)"
"""The key of the rollout file's run among the runs read."""
PLUGIN = "tests/plugin"
"""The extension the README's test command installs: an experiment in a package of its own."""


def _ok(result: Result, what: str) -> str:
    """The output of a command that must exit 0 with no traceback."""
    assert result.exit_code == 0 and "Traceback" not in result.output, f"{what}: {result.output}"
    return result.output


def _invoke(args: list[str], columns: int = 80) -> Result:
    return runner.invoke(app, [*args], env={"COLUMNS": str(columns)})


def _small(e: Experiment) -> SmallRun:
    assert e.smallest_run is not None, (f"{e.name} ({registry.distribution(e.name) or 'registered here'}) gives no "
                                        "smallest run: set its Experiment.smallest_run")
    return e.smallest_run


def _home(e: Experiment) -> str:
    """The run that holds `e`'s smallest stage: its own, or the one its smallest run extends."""
    return (e.smallest_run.extends if e.smallest_run else None) or e.name


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


def _sections(shown: str, item: str) -> list[tuple[str, list[str]]]:
    """`show`'s output cut at its headings (`<item> · ...`): each heading with the lines under it, right-stripped."""
    out: list[tuple[str, list[str]]] = []
    for line in shown.splitlines():
        if line.startswith(f"{item} · "):
            out.append((line.rstrip(), []))
        elif out:
            out[-1][1].append(line.rstrip())
    return out


def show_problems(e: Experiment, item: str, own: list[Record], shown: str) -> list[str]:
    """What `show` (its output `shown`) leaves out of `e`'s records `own` of `item`, read in `e`'s own section (its
    story, headed `<item> · <checkpoint>[, <label>] · ...`, or what it tells, headed `<item> · <experiment> ·
    <checkpoint>`): every arm but a replica by name, and every line `e.told` gives of them. Empty: it tells them."""
    checkpoints = {r.checkpoint for r in own}
    told_at = {f"{item} · {e.name} · {c}" for c in checkpoints}
    story_at = tuple(f"{item} · {c}{', ' + e.shape.label if e.shape.label else ''} · " for c in checkpoints)
    mine = [(h, lines) for h, lines in _sections(shown, item) if h in told_at or h.startswith(story_at)]
    if not mine:
        return [f"show {item}: no section of {e.name}: {shown[-400:]}"]
    text = "\n".join(line for h, lines in mine for line in (h, *lines))
    out = []
    for r in own:
        arms = [a.name for a in getattr(e.read(r), "arms", None) or [] if not a.name.endswith("#replica")]
        missing = [a for a in arms if a not in text]
        if missing:
            out.append(f"show {item}: {e.where(r)}'s arms {missing} are not in its section: {text[-400:]}")
    if any(h in told_at for h, _ in mine):
        lines = {line for _, section in mine for line in section}
        untold = [line.rstrip() for line in e.told(own) if line.strip() and line.rstrip() not in lines]
        if untold:
            out.append(f"show {item}: {e.name} tells {untold} of its records, not in its section: {text[-400:]}")
    return out


def problems(e: Experiment, read: Readings) -> list[str]:
    """What of every command on `read.run` fails for experiment `e`: a command that did not exit 0 (or printed a
    traceback), or whose output leaves out `e`'s own fields. Empty: every command read it. `show` runs here, on the
    first item `e` recorded (`show_problems`)."""
    out: list[str] = []
    mine = [r for r in read.records if r.experiment == e.name]
    if not mine:
        return [f"the run holds no {e.name} record"]
    item = mine[0].item_id
    outputs = {**read.outputs, "show": _invoke(["show", str(read.run), item], columns=400)}
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
    out += show_problems(e, item, [r for r in mine if r.item_id == item], outputs["show"].output)
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
def small_runs(root: Path) -> dict[str, Path]:
    """Every registered experiment's smallest run, by the name of the experiment that made it: each experiment that
    makes runs makes its own, then each that extends one adds its stage to the run its smallest run names (in the
    registry's order). An experiment without a smallest run is left out (the test below names it)."""
    runs: dict[str, Path] = {}
    every = [e for e in registry.all_experiments() if e.smallest_run is not None]
    for e in sorted(every, key=lambda e: not e.shape.starts_run):
        small = _small(e)
        run = root / e.name if small.extends is None else runs[small.extends]
        _ok(_invoke([*small.command_line(e.command, run), "--quiet"]), e.name)
        runs.setdefault(e.name, run)
    return runs


@pytest.fixture(scope="module")
def mismatch_run(small_runs: dict[str, Path]) -> Path:
    return small_runs["mismatch"]


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


def _starting(name: str) -> list[str]:
    """The command and options of the smallest run of the experiment called `name`, which makes runs."""
    e = registry.experiment(name)
    return [e.command, *_small(e).options]


@pytest.fixture(scope="module")
def readings(root: Path, small_runs: dict[str, Path], rollout_file_run: Path) -> dict[str, Readings]:
    """Every reading command, once per run: each experiment's that makes runs, by its name, against the toy's 200-item
    matched run (other data; a run that other experiments extend audits a unit per stage), and the rollout file's
    against the generated mismatch run (its audit re-reads every row through the run's column mapping)."""
    extended = {_home(e) for e in registry.all_experiments() if _home(e) != e.name}
    runs = {name: (run, OTHER_DATA) for name, run in small_runs.items() if registry.experiment(name).shape.starts_run}
    runs[ROLLOUT_FILE] = (rollout_file_run, small_runs["mismatch"])
    out = {}
    for n, (key, (run, other)) in enumerate(runs.items()):
        work = root / f"read-{n}"
        work.mkdir()
        out[key] = read_all(run, other, work, sample=key in extended)
    return out


def _cases() -> list[Any]:
    """Every registered experiment, by the run that holds it, and the rollout-file mismatch."""
    cases = [pytest.param(e.name, _home(e), id=e.name) for e in registry.all_experiments()]
    return [*cases, pytest.param("mismatch", ROLLOUT_FILE, id="mismatch-rollout-file")]


def test_every_registered_experiment_gives_its_smallest_run():
    """A new experiment is read by every command only once it says how to make a small run of it: one that makes runs
    makes its own, one that extends a run names an experiment that makes them."""
    for e in registry.all_experiments():
        small = _small(e)
        assert e.command, f"{e.name} has no command to make its smallest run with"
        if e.shape.starts_run:
            assert small.extends is None, f"{e.name} makes runs: its smallest run extends none"
        else:
            assert small.extends is not None and registry.starts_run(small.extends), (
                f"{e.name} extends a run: its smallest run names the experiment that makes it, not {small.extends!r}")


def test_an_experiment_from_outside_stagereplay_is_installed():
    """The extension under tests/plugin is installed, so the check below reads an outsider's experiment too."""
    outside = [e.name for e in registry.all_experiments() if registry.distribution(e.name) not in (None, registry.OWN)]
    assert outside, (f"no experiment from outside stagereplay is installed: pip install -e {PLUGIN} (the README's "
                     "test command installs it)")


@pytest.mark.parametrize(("name", "run"), _cases())
def test_every_reading_command_reads_the_experiment(name: str, run: str, readings: dict[str, Readings]):
    e = registry.experiment(name)
    _small(e)
    assert problems(e, readings[run]) == []


def test_a_mismatch_run_compares_with_a_file_of_its_own_tokens(readings: dict[str, Readings]):
    """A rollout file of a generated run's own tokens and the run compare on the tokens: every rollout is the same,
    and what differs is where the items came from."""
    compared = _ok(readings[ROLLOUT_FILE].outputs["compare-other"], "compare")
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

    read = readings["matched"]
    work = read.run.parent / "read-broken"
    work.mkdir()
    matched = registry.experiment("matched")
    monkeypatch.setattr(type(matched), "read", broken)
    again = Readings(read.run, read.other, work, dict(read.outputs))
    again.outputs["export-parquet"] = _invoke(["export", str(read.run), "--output", str(work / "rows.parquet")])
    found = problems(matched, again)
    assert any(p.startswith("export-parquet") for p in found) and any(p.startswith("show") for p in found), found


def test_a_show_that_leaves_out_a_record_or_tells_another_value_fails_the_check(readings: dict[str, Readings]):
    """The controls of the `show` check, on the run every stage of the protocol extends: matched's story cut out (its
    arms' names are still printed, in the stages that carry its arms over), or another experiment's section telling
    a value its record does not hold (a number of it changed), are each found; the output as printed passes."""
    read = readings["matched"]
    item = next(r.item_id for r in read.records if r.kind == "item")
    shown = _ok(_invoke(["show", str(read.run), item], columns=400), "show")
    own = {e.name: [r for r in read.records if r.experiment == e.name and r.item_id == item]
           for e in registry.all_experiments()}
    told = [e for e in registry.all_experiments() if own[e.name] and any(
        h == f"{item} · {e.name} · primary" for h, _ in _sections(shown, item))]
    assert told, shown
    for e in [registry.experiment("matched"), *told]:
        assert show_problems(e, item, own[e.name], shown) == [], e.name
    without = "\n".join(line for h, lines in _sections(shown, item) if not h.startswith(f"{item} · primary · ")
                        for line in (h, *lines))
    assert "oneshot" in without and show_problems(registry.experiment("matched"), item, own["matched"], without)
    for e in told:
        at = f"{item} · {e.name} · primary"
        head, body = shown.split(at, 1)
        lines = body.split("\n")
        k = next(i for i, line in enumerate(lines) if re.search(r"\d", line))
        lines[k] = re.sub(r"\d+", lambda m: str(int(m.group()) + 1), lines[k], count=1)
        found = show_problems(e, item, own[e.name], head + at + "\n".join(lines))
        assert found and f"{e.name} tells" in found[0], (e.name, found)


def test_an_installed_extension_has_its_command_and_unregistered_its_run_is_refused(
        readings: dict[str, Readings], monkeypatch: pytest.MonkeyPatch):
    """Every experiment an installed distribution other than stagereplay declares has its command, with an option
    per field of its options; without its registry entry, a run that holds its stage is refused by name."""
    from dataclasses import fields

    outside = [e for e in registry.all_experiments() if registry.distribution(e.name) not in (None, registry.OWN)]
    assert outside, f"no experiment from outside stagereplay is installed: pip install -e {PLUGIN}"
    for e in outside:
        help_text = _invoke([e.command, "--help"], columns=200).output
        assert all(f"--{f.name.replace('_', '-')}" in help_text for f in fields(e.Options)), help_text
        run = readings[_home(e)].run
        with monkeypatch.context() as m:
            m.delitem(registry.EXPERIMENTS, e.name)
            refused = _invoke(["export", str(run)])
        assert refused.exit_code == 2 and f"unknown experiment {e.name!r}" in refused.output, refused.output


def _rows(plan: str, name: str) -> list[str]:
    return [line for line in plan.splitlines() if line.startswith(f"{name}/")]


def test_a_mismatch_run_is_priced_before_it_runs_as_it_ran(readings: dict[str, Readings], root: Path):
    """`mismatch ... --plan` (a rollout file's included: each response at its own length) prices the forwards, tokens
    and caches that `plan RUN` measures on the run those options made, row for row."""
    for key, args in (("mismatch", _starting("mismatch")), (ROLLOUT_FILE, _file_args(root))):
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


@pytest.mark.parametrize("name", [e.name for e in registry.all_experiments() if e.shape.starts_run])
def test_every_experiment_that_makes_a_run_prices_it_before_it_runs(name: str, tmp_path: Path):
    """`<command> ... --plan` prices the run its options would make, runs nothing and writes nothing."""
    out = tmp_path / "never"
    planned = _ok(_invoke([*_starting(name), "--plan", "--out", str(out)]), f"{name} --plan")
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
