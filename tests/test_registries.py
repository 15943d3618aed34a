"""An experiment and a serving engine defined here, in the test, and registered here: each runs through execution,
verify, the audit, plan and the report with no edit anywhere else. That is what the registries promise (adding one is
one module and one registry line); the controls show the registries are what makes them known."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.engine.lm import LM, ids_fingerprint
from stagereplay.errors import StageReplayError
from stagereplay.experiments import registry
from stagereplay.experiments.arms import comparison
from stagereplay.experiments.experiment import Experiment, Replay, Stage
from stagereplay.experiments.format import Table, as_rows, k_of_n
from stagereplay.experiments.jobs import Job, Params, ReplaySettings, execute
from stagereplay.records.ledger import Record, open_run, read_manifest
from stagereplay.serving import engines
from stagereplay.serving.seam import EngineConfig, EngineKind, EngineOptions, Generation
from stagereplay.tasks.scoring import scorer_by_name

runner = CliRunner()


# -- an experiment: the greedy continuation of the prompt, twice from scratch ---------------------------------------


@dataclass(frozen=True)
class TwiceParams(Params):
    steps: int = 6


def twice_item(lm: LM, job: Job[TwiceParams]) -> dict[str, Any]:
    """The prompt's greedy continuation, generated twice from scratch: a replica, nothing else."""
    arms = []
    prompt = list(job.item.prompt_ids)
    for name in ("first", "again"):
        suffix = list(lm.generate(prompt, job.params.steps))
        text = lm.text(suffix)
        arms.append({"name": name, "construction": "live", "precision": lm.config.precision, "suffix_ids": suffix,
                     "suffix_fp": ids_fingerprint(suffix), "cache_fp": None, "stop": "length", "text": text,
                     "correct": bool(scorer_by_name(job.settings.scorer)(text, job.item.answer))})
    return {"status": "ok", "prompt_ids": prompt, "prefix_ids": prompt, "boundary": len(prompt),
            "answer": job.item.answer, "arms": arms, "comparisons": [comparison(job.item.id, arms[0], arms[1])]}


class Twice(Experiment):
    name: ClassVar[str] = "twice"
    label: ClassVar[str] = "twice"

    def work(self, lm: LM, job: Job) -> dict[str, Any]:
        return twice_item(lm, job)

    def units(self, checkpoint: str, stage: Stage, config: dict[str, Any], records: list[Record]
              ) -> list[tuple[str, str]]:
        return [(i, "") for i in config["item_ids"]]

    def claims(self, record: Record, stage: Stage, matched: Record | None) -> list[str]:
        arms = record.payload["arms"]
        return [] if len(arms) == 2 else ["twice: not two arms"]

    def replay_job(self, replay: Replay) -> Job:
        return Job(replay.item, replay.settings, TwiceParams(replay.stage["steps"]))

    def unit_forwards(self, record: Record, stage: Stage) -> list[int] | None:
        prompt = len(record.payload["prompt_ids"])
        return [prompt, *[1] * (stage["steps"] - 1)] * 2

    def peak_caches(self, stage: Stage) -> int:
        return 1

    def summarize(self, records: list[Record], stage: Stage, checkpoint: str) -> list[dict[str, Any]]:
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
    """A matched run of the toy, then the new experiment's stage in the same run, with the library's own loop."""
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution.config import ExecConfig
    from stagereplay.runs import Inputs, matched
    from stagereplay.runs.make import finish
    from stagereplay.tasks import DataConfig, Item

    matched(out, Inputs(n=3, decode=_decode()), quiet=True)
    manifest = read_manifest(out)
    stage = manifest["stages"]["matched/primary"]
    model, settings = ModelConfig(**stage["model"]), ReplaySettings.from_dict(stage["settings"])
    with open_run(out, manifest) as run:
        run.begin_stage("twice/primary", {"model": model.as_dict(), "settings": settings.as_dict(), "steps": 6})
        from stagereplay.engine.model import load_config_and_tokenizer
        from stagereplay.tasks import load_items

        items, _ = load_items(DataConfig(**manifest["config"]["data"]), load_config_and_tokenizer(model.path)[1])
        jobs = [Job(Item(i.id, i.prompt_ids, i.answer), settings, TwiceParams(6)) for i in items]
        execute(run, "twice", "primary", model, twice_item, jobs, ExecConfig(), None, True)
        finish(run, quiet=True)


def _decode():
    from stagereplay.engine.decode import DecodeConfig

    return DecodeConfig(max_new_tokens=8)


def test_an_experiment_registered_here_runs_verifies_audits_plans_and_reports(twice, tmp_path):
    from stagereplay.audit.verify import verify_run
    from stagereplay.plan.recorded import plan_run
    from stagereplay.runs import audit

    out = tmp_path / "run"
    _run_twice(out)
    manifest = read_manifest(out)
    checked = verify_run(out, manifest)
    assert checked["reproduced"], checked["mismatches"]
    results = json.loads((out / "results.json").read_text())
    assert results["twice"] == [{"checkpoint": "primary", "equal": 3, "n": 3}]
    assert "Twice (primary): the greedy continuation again" in (out / "report.md").read_text()
    rows = {s.name: s for s in plan_run(out, audited=False)}
    assert rows["twice/primary"].units == 3 and rows["twice/primary"].caches == 1
    summary = audit(out)
    assert summary["reproduced"], summary["mismatches"]
    assert summary["trajectories"]["n"] > 3 * 2  # the matched arms and the new experiment's, re-executed


def test_verify_finds_a_record_of_the_new_experiment_missing(twice, tmp_path):
    """Its units come from the experiment (`Experiment.units`): a record removed from the ledger is named."""
    from stagereplay.audit.verify import completeness
    from stagereplay.records.ledger import items, read_ledger

    out = tmp_path / "run"
    _run_twice(out)
    records = [r for r in items(read_ledger(out)) if not (r.experiment == "twice" and r.item_id.endswith("1"))]
    found = completeness(read_manifest(out), records)
    assert any("twice/primary: no record" in f["what"] for f in found), found


def test_without_its_registry_line_a_run_of_it_is_refused_in_one_line(twice, tmp_path):
    """The control: unregistered, the same run's report and audit refuse the stage by name, never skip it."""
    from stagereplay.report.results import build_results

    out = tmp_path / "run"
    _run_twice(out)
    registry.unregister("twice")
    with pytest.raises(StageReplayError, match="unknown experiment 'twice'"):
        build_results(out, read_manifest(out), [])
    result = runner.invoke(app, ["audit", str(out), "--verify-only"])
    assert result.exit_code != 0 and "unknown experiment 'twice'" in result.output, result.output


# -- a serving engine: a deterministic stand-in, in this process -----------------------------------------------------


@dataclass(frozen=True)
class EchoOptions(EngineOptions):
    stride: int = field(default=7, metadata={"help": "the next token is (last * stride + 3) mod the vocabulary"})


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
        for _ in range(max_tokens):
            last = (last * self.options.stride + 3) % self.vocab
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
    from stagereplay.engine.boundary import After
    from stagereplay.runs import Inputs, audit, matched, serving_arms

    out = tmp_path / "run"
    results = matched(out, Inputs(n=3, boundary=After(4), decode=_decode(), precision="fp32"),
                      serving=serving_arms("echo", None, {"stride": 5}), quiet=True)
    columns = {m["construction"]: m for m in results["matched"]}
    assert set(columns) == {"oneshot", "prefix-cache"} and all(m["engine"] == "echo" for m in columns.values())
    assert columns["prefix-cache"]["built"]["k"] == 3  # its counts say the hit reached decode-written positions
    assert read_manifest(out)["stages"]["matched/primary"]["engine"] == {"name": "echo", "seed": 0, "stride": 5}
    assert "echo primary: live vs oneshot" in (out / "report.md").read_text()
    summary = audit(out)
    assert summary["reproduced"], summary["mismatches"]


def test_an_option_the_registered_engine_does_not_take_is_refused(echo, tmp_path):
    result = runner.invoke(app, ["matched", "--engine", "echo", "--n-ctx", "64", "--n", "1", "--out",
                                 str(tmp_path / "run")])
    assert result.exit_code == 2 and "--n-ctx is not an option of --engine echo; --engine echo takes --stride" in (
        result.stderr), result.stderr
    engines.unregister("echo")  # the control: unregistered, the engine is unknown
    result = runner.invoke(app, ["matched", "--engine", "echo", "--n", "1", "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "unknown engine 'echo'" in result.stderr
