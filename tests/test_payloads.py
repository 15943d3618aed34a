"""The payload models (`records.payloads`): every payload a real toy run writes reads as its experiment's model and
writes back the same bytes; a field no model declares, or a value of another type, is refused; the older runs kept as
fixtures still read; docs/ledger-schema.md's tables are what the models give."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field, ValidationError
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.experiments.core import payload_doc, registry
from stagereplay.experiments.core.payload_doc import generated_section, markdown
from stagereplay.experiments.protocol import bridge, matched, precision_2x2, resample, transplant
from stagereplay.experiments.protocol.payloads import GridPayload
from stagereplay.records import payload_readers, payloads
from stagereplay.records.ledger import Record, items, read_ledger, read_manifest
from stagereplay.records.record import canonical_json

ROOT = Path(__file__).parents[1]
FIXTURES = Path(__file__).parent / "fixtures"
PAGE = ROOT / "docs" / "ledger-schema.md"
READERS = {"matched": matched.PAYLOAD, "precision_2x2": precision_2x2.PAYLOAD, "bridge": bridge.PAYLOAD,
           "transplant": transplant.PAYLOAD, "resample": resample.PAYLOAD}
"""Each experiment's reader of its payloads (the module's `PAYLOAD`)."""


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every experiment on the toy, in bf16 (where items 2 and 3 diverge, so the transplant has an item): the 2x2
    and the transplant carry matched arms over (`same_as`), the transplant sweeps its layers."""
    out = tmp_path_factory.mktemp("payloads") / "run"
    runner = CliRunner()
    for args in (["matched", "--n", "4", "--precision", "bf16", "--max-new-tokens", "80", "--out", str(out)],
                 ["precision-2x2", str(out), "--precisions", "bf16"], ["bridge", str(out), "--rows", "1"],
                 ["transplant", str(out), "--sweep"], ["resample", str(out), "--k", "2", "--n", "1"]):
        result = runner.invoke(app, [*args, "--quiet"])
        assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def matched_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """matched alone on the toy, as small as a whole payload allows (2 items, 8 suffix tokens): its ok items hold
    every part the forgeries change (arms with their tokens and fingerprints, comparisons, diagnostics)."""
    out = tmp_path_factory.mktemp("payloads-matched") / "run"
    result = CliRunner().invoke(app, ["matched", "--n", "2", "--precision", "bf16", "--max-new-tokens", "8",
                                      "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def _read_back(experiment: str, payload: dict[str, Any]) -> payloads.PayloadModel:
    """The payload as its model; it must write back the recorded bytes."""
    model = READERS[experiment].validate_python(payload)
    assert canonical_json(model.as_payload()) == canonical_json(payload)
    return model


@pytest.mark.slow  # a whole run or several: the slow tier (CI runs it)
def test_every_payload_of_a_toy_run_is_its_model_and_writes_back_the_same_bytes(toy_run):
    seen: Counter[tuple[str, str]] = Counter()
    carried = sweeps = 0
    for r in items(read_ledger(toy_run)):
        model = _read_back(r.experiment, r.payload)
        seen[(r.experiment, type(model).__name__)] += 1
        carried += sum("same_as" in a for a in r.payload["arms"])
        sweeps += "sweep" in r.payload
    assert {e for e, _ in seen} == set(READERS), seen  # every experiment's reader was exercised
    assert seen[("resample", "ResamplePayload")] == 1 and carried and sweeps  # draws, carried arms, a sweep


@pytest.mark.parametrize("run", ["toy_golden", "toy_matched", "run_paper", "schema1"])
def test_the_runs_of_earlier_versions_kept_as_fixtures_read_too(run):
    """Records made before the later optional fields (diagnostics, token texts, ...) read, and write back as made."""
    records = [json.loads(line) for line in (FIXTURES / run / "ledger.jsonl").read_text().splitlines()]
    payloads_read = [_read_back(r["experiment"], r["payload"]) for r in records if r.get("kind", "item") == "item"]
    assert payloads_read


@pytest.mark.parametrize("run", ["toy_golden", "toy_matched", "run_paper", "schema1"])
def test_any_payload_reads_as_the_model_its_experiment_gives_it(run):
    """`Experiment.read` (the experiment found by the record's `experiment` field) gives each record the model its
    module's reader gives it; `ItemHead` (what every payload of arms holds, an outside experiment's too) reads each one,
    its arms as recorded."""
    records = [json.loads(line) for line in (FIXTURES / run / "ledger.jsonl").read_text().splitlines()]
    for r in (Record.model_validate(r) for r in records if r.get("kind", "item") == "item"):
        model = registry.experiment(r.experiment).read(r)
        assert type(model) is type(READERS[r.experiment].validate_python(r.payload))
        assert canonical_json(model.as_payload()) == canonical_json(r.payload)
        head = payload_readers.ItemHead.model_validate(r.payload)
        assert [a.as_payload() for a in head.arms] == r.payload["arms"] and head.status == r.payload["status"]


def test_a_payload_of_no_model_is_refused_by_name():
    """The controls of `Experiment.read`: a status no payload has, and a 2x2 payload without its precision, are not
    the 2x2's payload; read by another experiment, a 2x2 payload is not that experiment's either."""
    raw = next(json.loads(line) for line in (FIXTURES / "run_paper" / "ledger.jsonl").read_text().splitlines()
               if '"experiment":"precision_2x2"' in line and '"kind":"item"' in line)
    record = Record.model_validate(raw)
    grid = registry.experiment("precision_2x2")
    assert isinstance(grid.read(record), GridPayload)
    with pytest.raises(ValidationError, match="status"):
        grid.read(record.model_copy(update={"payload": {**record.payload, "status": "done"}}))
    with pytest.raises(ValidationError, match="precision"):
        grid.read(record.model_copy(update={"payload": {k: v for k, v in record.payload.items() if k != "precision"}}))
    with pytest.raises(ValidationError):
        registry.experiment("mismatch").read(record)


def _first_ok(run: Path, experiment: str) -> dict[str, Any]:
    return next(r.payload for r in items(read_ledger(run)) if r.experiment == experiment
                and r.payload["status"] == "ok")


def _arm(payload: dict[str, Any], **changed: Any) -> dict[str, Any]:
    return {**payload, "arms": [{**payload["arms"][0], **changed}, *payload["arms"][1:]]}


FORGED = {
    "a field no model has": lambda p: {**p, "verdict": "fine"},
    "an arm's field no arm has": lambda p: _arm(p, confidence=0.9),
    "a label that is a string": lambda p: _arm(p, correct="yes"),
    "a label that is a number": lambda p: _arm(p, correct=1),
    "a token ID that is a string": lambda p: _arm(p, suffix_ids=["10", *p["arms"][0]["suffix_ids"][1:]]),
    "an arm without its cache fingerprint": lambda p: {**p, "arms": [
        {k: v for k, v in p["arms"][0].items() if k != "cache_fp"}, *p["arms"][1:]]},
    "a comparison whose equality is a number": lambda p: {**p, "comparisons": [
        {**p["comparisons"][0], "suffix_equal": 1}, *p["comparisons"][1:]]},
    "a status no model has": lambda p: {**p, "status": "done"},
    "a margin that is a string": lambda p: {**p, "diagnostics": {**p["diagnostics"], "margins": {"live": ["0.5"]}}},
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_field_the_model_lacks_or_a_value_of_another_type_is_refused(matched_run, forgery):
    payload = _first_ok(matched_run, "matched")
    _read_back("matched", payload)  # control: as recorded, it reads
    with pytest.raises(ValidationError):
        READERS["matched"].validate_python(FORGED[forgery](payload))


def test_verify_says_an_arm_that_is_not_one(matched_run):
    """`--verify-only`'s claims read each arm as its model: an arm of another type is a finding (control: none as
    recorded)."""
    from stagereplay.audit.verify import claim_findings

    record = next(r for r in items(read_ledger(matched_run)) if r.experiment == "matched" and r.payload["status"] == "ok")
    stage = read_manifest(matched_run).stages["matched/primary"]
    assert claim_findings(record, stage, record) == []
    forged = record.model_copy(update={"payload": _arm(record.payload, correct="yes")})
    found = [f.what for f in claim_findings(forged, stage, record)]
    assert any("arm live: not an arm (correct: " in w for w in found), found


def test_a_serving_arm_keeps_its_nulls_and_leaves_out_what_it_lacks():
    """A field set to None is written as null (no cache fingerprint, no count from the engine); one left unset is
    absent (no `roundtrip`, no `same_as`)."""
    served = {"name": "oneshot", "construction": "oneshot", "engine": "vllm", "precision": "bf16", "suffix_ids": [5, 6],
              "suffix_fp": "f" * 64, "cache_fp": None, "stop": "length", "text": "x", "correct": False,
              "top_logprobs": [[[5, -0.1], [7, -2.5]], [[6, -0.2]]], "num_cached_tokens": None, "took_place": None,
              "restored_positions": 12}
    arm = payloads.read_arm(served)
    assert isinstance(arm, payloads.Arm) and arm.as_payload() == served
    assert canonical_json(arm.as_payload()) == canonical_json(served)


def _page_shows(models: tuple[type[payloads.PayloadModel], ...]) -> bool:
    return generated_section(PAGE.read_text(encoding="utf-8")) == markdown(models)


def test_the_schema_page_shows_what_the_models_give():
    assert _page_shows(payload_doc.models()), ("docs/ledger-schema.md's tables differ from the models: run "
                                          "`python -m stagereplay.experiments.core.payload_doc --write docs/ledger-schema.md`")


def test_a_model_with_one_more_field_is_not_what_the_page_shows():
    """Negative control: the arm with one more field, under its own name and docstring."""

    class Arm(payloads.Arm):
        __doc__ = payloads.Arm.__doc__
        calibrated: bool = Field(description="a field the page does not show")

    wider = tuple(Arm if m is payloads.Arm else m for m in payload_doc.models())
    assert not _page_shows(wider)
    assert markdown(wider).replace("| `calibrated` | `bool` | yes | a field the page does not show |\n", "") == \
        markdown(payload_doc.models())  # that row is the only difference
