"""An experiment and a serving engine defined here, in the test, and registered here: each runs through its command,
verify, the audit, plan and the report with no edit anywhere else. That is what the registries promise (adding one is
one module and one registry line, and its command comes from its typed options); the controls show the registries
are what makes them known."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import Field
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.lm import LM, ids_fingerprint
from stagereplay.errors import StageReplayError
from stagereplay.experiments.core import registry
from stagereplay.experiments.core.experiment import Batch, Experiment, Replay
from stagereplay.experiments.core.format import Table, as_rows, k_of_n
from stagereplay.experiments.core.jobs import Job, Params
from stagereplay.experiments.core.shape import Shape
from stagereplay.experiments.protocol.arms import comparison
from stagereplay.records.ledger import Record, read_manifest
from stagereplay.records.manifest import ModelSection, RunConfig, StageSection
from stagereplay.records.payload_readers import ItemHead
from stagereplay.serving import engines
from stagereplay.serving.seam import EngineConfig, EngineKind, EngineOptions, Generation
from stagereplay.tasks.base import Item
from stagereplay.tasks.scoring import scorer_by_name

runner = CliRunner()


# -- an experiment with its own command: the greedy continuation of the prompt, twice from scratch -------------------


@dataclass(frozen=True)
class TwiceOptions:
    steps: int = field(default=6, metadata={"help": "tokens to continue each prompt by"})


class TwiceStage(StageSection):
    steps: int = Field(description="tokens continued")


@dataclass(frozen=True)
class TwiceParams(Params):
    steps: int = 6


def twice_item(lm: LM, job: Job[TwiceParams]) -> ItemHead:
    """The prompt's greedy continuation, generated twice from scratch: a replica, nothing else."""
    arms = []
    prompt = list(job.item.prompt_ids)
    for name in ("first", "again"):
        suffix = list(lm.generate(prompt, job.params.steps))
        text = lm.text(suffix)
        arms.append({"name": name, "construction": "live", "precision": lm.config.precision, "suffix_ids": suffix,
                     "suffix_fp": ids_fingerprint(suffix), "cache_fp": None, "stop": "length", "text": text,
                     "correct": bool(scorer_by_name(job.settings.scorer)(text, job.item.answer))})
    return ItemHead.model_validate({
        "status": "ok", "prompt_ids": prompt, "prefix_ids": prompt, "boundary": len(prompt), "answer": job.item.answer,
        "arms": arms, "comparisons": [comparison(job.item.id, arms[0], arms[1])]})


class Twice(Experiment):
    """The greedy continuation of each prompt, twice from scratch."""

    name: ClassVar[str] = "twice"
    Stage: ClassVar[type[StageSection]] = TwiceStage
    Options: ClassVar[type] = TwiceOptions
    command: ClassVar[str] = "twice"
    shape: ClassVar[Shape] = Shape(label="twice")

    def section(self, prepared, options: TwiceOptions, run) -> StageSection:
        return TwiceStage(model=ModelSection.of(prepared.model), settings=prepared.settings.section(),
                          steps=options.steps)

    def batches(self, prepared, stage, run) -> list[Batch]:
        items = [Item(r.item_id, tuple(r.payload["prompt_ids"]), r.payload["answer"]) for r in run.find(
            "matched", prepared.checkpoint)]
        return [Batch(prepared.model, [Job(i, prepared.settings, TwiceParams(self.stage_of(stage).steps))
                                       for i in items])]

    def work(self, lm: LM, job: Job) -> ItemHead:
        return twice_item(lm, job)

    def units(self, checkpoint: str, stage: StageSection, config: RunConfig, records: list[Record]
              ) -> list[tuple[str, str]]:
        return [(i, "") for i in config.item_ids]

    def claims(self, record: Record, stage: StageSection, matched: Record | None) -> list[str]:
        arms = record.payload["arms"]
        return [] if len(arms) == 2 else ["twice: not two arms"]

    def replay_job(self, replay: Replay) -> Job:
        return Job(replay.item, replay.settings, TwiceParams(self.stage_of(replay.stage).steps))

    def unit_forwards(self, record: Record, stage: StageSection) -> list[int] | None:
        prompt = len(record.payload["prompt_ids"])
        return [prompt, *[1] * (self.stage_of(stage).steps - 1)] * 2

    def peak_caches(self, stage: StageSection) -> int:
        return 1

    def summarize(self, records: list[Record], stage: StageSection, checkpoint: str) -> list[dict[str, Any]]:
        equal = sum(r.payload["comparisons"][0]["suffix_equal"] for r in records)
        return [{"checkpoint": checkpoint, "equal": equal, "n": len(records)}]

    def tables(self, results: Any) -> list[Table]:
        return [Table("table-twice", f"Twice ({s['checkpoint']}): the greedy continuation again",
                      ("replica equal",), as_rows([[k_of_n(s["equal"], s["n"])]])) for s in results or []]


@pytest.fixture
def twice():
    registry.register(Twice())
    yield
    registry.unregister("twice")


def _run_twice(out) -> None:
    """A matched run of the toy, then the new experiment's stage in the same run, both through the command line."""
    made = runner.invoke(app, ["matched", "--n", "3", "--max-new-tokens", "8", "--quiet", "--out", str(out)])
    assert made.exit_code == 0, made.output
    extended = runner.invoke(app, ["twice", str(out), "--steps", "5", "--quiet"])
    assert extended.exit_code == 0, extended.output


@pytest.fixture(scope="module")
def twice_run(tmp_path_factory) -> Path:
    """`_run_twice`'s run, made once for the tests below (read only: a test that writes into it takes a copy)."""
    out = tmp_path_factory.mktemp("twice") / "run"
    registry.register(Twice())
    try:
        _run_twice(out)
    finally:
        registry.unregister("twice")
    return out


def test_an_experiment_registered_here_runs_from_its_command_verifies_audits_plans_and_reports(
        twice, twice_run, tmp_path):
    help_text = runner.invoke(app, ["twice", "--help"], env={"COLUMNS": "200"}).output
    assert "--steps" in help_text and "tokens to continue each prompt by" in help_text and "twice options" in help_text
    out = Path(shutil.copytree(twice_run, tmp_path / "run"))
    assert read_manifest(out).stages["twice/primary"].as_stage(TwiceStage).steps == 5  # from its option, frozen
    verified = runner.invoke(app, ["audit", str(out), "--verify-only"])
    assert verified.exit_code == 0 and "ledger intact, bound and complete" in verified.output, verified.output
    results = json.loads((out / "results.json").read_text())
    assert results["twice"] == [{"checkpoint": "primary", "equal": 3, "n": 3}]
    assert "Twice (primary): the greedy continuation again" in (out / "report.md").read_text()
    planned = runner.invoke(app, ["plan", str(out)])
    assert planned.exit_code == 0 and any(line.split()[:1] == ["twice/primary"] and line.split()[2] == "3"
                                          for line in planned.output.splitlines()), planned.output
    audited = runner.invoke(app, ["audit", str(out)])
    assert audited.exit_code == 0, audited.output
    summary = json.loads((out / "audit.json").read_text())
    assert summary["reproduced"], summary["mismatches"]
    assert summary["trajectories"]["n"] > 3 * 2  # the matched arms and the new experiment's, re-executed


def test_verify_finds_a_record_of_the_new_experiment_missing(twice, twice_run):
    """Its units come from the experiment (`Experiment.units`): a record removed from the ledger is named."""
    from stagereplay.audit.verify import completeness
    from stagereplay.records.ledger import items, read_ledger

    out = twice_run
    records = [r for r in items(read_ledger(out)) if not (r.experiment == "twice" and r.item_id.endswith("1"))]
    found = completeness(read_manifest(out), records)
    assert any("twice/primary: no record" in f.what for f in found), found


def test_without_its_registry_line_it_has_no_command_and_its_run_is_refused_in_one_line(twice, twice_run, tmp_path):
    """The control: unregistered, the command is unknown, and the run's report and audit refuse the stage by name,
    never skip it."""
    from stagereplay.report.results import build_results

    out = Path(shutil.copytree(twice_run, tmp_path / "run"))
    registry.unregister("twice")
    unknown = runner.invoke(app, ["twice", str(out)])
    assert unknown.exit_code == 2 and "No such command 'twice'" in unknown.output, unknown.output
    with pytest.raises(StageReplayError, match="unknown experiment 'twice'"):
        build_results(out, read_manifest(out), [])
    result = runner.invoke(app, ["audit", str(out), "--verify-only"])
    assert result.exit_code != 0 and "unknown experiment 'twice'" in result.output, result.output


# -- a serving engine: a deterministic stand-in, in this process -----------------------------------------------------


@dataclass(frozen=True)
class EchoOptions(EngineOptions):
    stride: int = field(default=7, metadata={"help": "the next token is (last * stride + 3) mod the vocabulary"})

    def check(self) -> None:
        if self.stride < 1:
            raise StageReplayError(f"--stride must be at least 1, got {self.stride}", "pass a positive stride")


@dataclass(frozen=True)
class EchoOptionsWithOffset(EchoOptions):
    """The echo engine's options with one more: what adding an option to an engine's options class takes."""

    offset: int = field(default=3, metadata={"help": "what the echo adds after multiplying"})


class EchoEngine:
    """Greedy and deterministic: each token follows from the last; reports what its prefix cache would hold."""

    name = "echo"

    def __init__(self, config: EngineConfig, vocab: int) -> None:
        self.options, self.vocab, self.held = config.own(EchoOptions), vocab, []

    def generate(self, ids: Sequence[int], max_tokens: int, reuse: bool = False) -> Generation:
        ids = list(ids)
        cached = 0
        if reuse:
            while cached < min(len(self.held), len(ids) - 1) and self.held[cached] == ids[cached]:
                cached += 1
        tokens, top, last = [], [], ids[-1]
        offset = getattr(self.options, "offset", 3)
        for _ in range(max_tokens):
            last = (last * self.options.stride + offset) % self.vocab
            tokens.append(last)
            top.append(((last, -0.1), ((last + 1) % self.vocab, -2.5)))
        self.held = ids + tokens[:-1]
        return Generation(tuple(tokens), tuple(top), cached, "length")

    def version(self) -> str:
        return "echo-1"

    def settings(self) -> dict[str, Any]:
        return {"engine": self.name, "version": self.version(), "stride": self.options.stride}

    def close(self) -> None:
        pass


class EchoKind(EngineKind):
    name: ClassVar[str] = "echo"
    options: ClassVar[type[EngineOptions]] = EchoOptions
    engine: ClassVar[type] = EchoEngine

    def load(self, config: EngineConfig, model_path: str, precision: str, threads: int, device: str) -> EchoEngine:
        from stagereplay.engine.model import load_config_and_tokenizer

        return EchoEngine(config, len(load_config_and_tokenizer(model_path)[1]))


@pytest.fixture
def echo():
    engines.register(EchoKind())
    yield
    engines.unregister("echo")


def test_a_serving_engine_registered_here_runs_matched_audits_and_reports(echo, tmp_path):
    from stagereplay.runs import Boundary, Input, Inputs, Numerics, audit, engine_of, matched
    from stagereplay.runs.inputs import DecodeConfig

    out = tmp_path / "run"
    inputs = Inputs(Input(n=3), Boundary(after=4), DecodeConfig(max_new_tokens=8), Numerics(precision="fp32"))
    results = matched(out, inputs, engine=engine_of("echo", None, {"stride": 5}), quiet=True)
    columns = {m.construction: m for m in results.sections["matched"]}
    assert set(columns) == {"oneshot", "prefix-cache"} and all(m.engine == "echo" for m in columns.values())
    assert columns["prefix-cache"].built.k == 3  # its counts say the hit reached decode-written positions
    assert read_manifest(out).stages["matched/primary"].engine.as_json() == {"name": "echo", "seed": 0, "stride": 5}
    assert "echo primary: live vs oneshot" in (out / "report.md").read_text()
    summary = audit(out)
    assert summary.reproduced, summary.findings


def test_an_option_added_to_an_engines_options_class_is_on_the_command_line_and_in_the_manifest(
        echo, tmp_path, monkeypatch):
    """The option is declared once, as a field of the options class: the command line has it, in the engine's panel,
    and the manifest records it where the engine's identity is (the run's config and the stage)."""
    monkeypatch.setattr(EchoKind, "options", EchoOptionsWithOffset)
    shown = runner.invoke(app, ["matched", "--help"], env={"COLUMNS": "200"}).output
    assert "--offset" in shown and "what the echo adds after multiplying (default 3)" in shown, shown
    assert "echo options" in shown
    out = tmp_path / "run"
    made = runner.invoke(app, ["matched", "--engine", "echo", "--offset", "11", "--n", "2", "--boundary-after", "4",
                               "--max-new-tokens", "6", "--precision", "fp32", "--quiet", "--out", str(out)])
    assert made.exit_code == 0, made.output
    manifest = read_manifest(out)
    assert manifest.config.engine.as_json() == {"name": "echo", "seed": 0, "stride": 7, "offset": 11}
    assert manifest.stages["matched/primary"].engine.as_json()["offset"] == 11
    # The control: the options class without the field has no such option.
    monkeypatch.setattr(EchoKind, "options", EchoOptions)
    result = runner.invoke(app, ["matched", "--engine", "echo", "--offset", "11", "--n", "1", "--out",
                                 str(tmp_path / "again")])
    assert result.exit_code == 2 and "No such option: --offset" in result.output, result.output


def test_an_option_the_registered_engine_does_not_take_is_refused(echo, tmp_path):
    result = runner.invoke(app, ["matched", "--engine", "echo", "--n-ctx", "64", "--n", "1", "--out",
                                 str(tmp_path / "run")])
    assert result.exit_code == 2 and "--n-ctx is not an option of --engine echo; --engine echo takes --stride" in (
        result.stderr), result.stderr
    engines.unregister("echo")  # the control: unregistered, the engine is unknown
    result = runner.invoke(app, ["matched", "--engine", "echo", "--n", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "unknown engine 'echo'" in result.stderr


def test_an_engine_option_given_as_zero_is_given_and_checked(echo, tmp_path):
    """0 is a value given on the command line, not an option left out: the engine's options refuse it in one line
    (were it dropped, the run would go on with the default stride and exit 0)."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--engine", "echo", "--stride", "0", "--n", "1", "--out", str(out)])
    assert result.exit_code == 2 and "--stride must be at least 1, got 0" in result.stderr, result.output
    assert not out.exists()


def test_an_experiment_declares_its_shape_in_one_object_and_its_command_is_its_name():
    """A fact of an experiment's shape declared as a class flag of its own would be silently ignored by everything
    that reads `shape`: it is refused where the class is made, naming the shape to declare. The control is the same
    fact in its shape, accepted; an experiment names its command as it is named unless it says otherwise."""
    with pytest.raises(TypeError, match=r"declares continuations, label as class attributes.*shape = Shape"):
        type("Flagged", (Twice,), {"label": "x", "continuations": False})
    shaped = type("Shaped", (Twice,), {"shape": Shape(continuations=False, label="x")})
    assert shaped.shape.label == "x" and not shaped.shape.continuations
    named = type("Named", (Twice,), {"name": "two_steps", "command": ""})
    assert named.command == ""  # says it has no command
    assert type("Default", (Twice,), {"name": "two_steps"}).command == "two-steps"
    assert registry.experiment("precision_2x2").command == "precision-2x2"
