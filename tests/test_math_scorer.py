"""The `math` scorer (math-verify): a table of model outputs and gold answers it must score right and wrong,
and the parsed form `resample` counts answers by."""

from __future__ import annotations

import pytest

from stagereplay.errors import StageReplayError
from stagereplay.tasks.base import last_number
from stagereplay.tasks.math_scorer import final_answer_text, last_boxed, math_answer, math_match
from stagereplay.tasks.scoring import answer_extractor, scorer_by_name, scorer_versions

# (model output, gold answer, correct?): what a reasoning model writes after its think block.
TABLE = [
    # fractions
    (r"So the probability is $\boxed{\frac{1}{2}}$.", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    (r"\boxed{\dfrac{3}{4}}", "0.75", True),
    (r"\boxed{\frac12}", "1/2", True),
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", True),
    (r"\boxed{\frac{1}{3}}", "0.5", False),
    (r"The answer is \boxed{2}.", r"\frac{1}{2}", False),
    # radicals
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", True),
    (r"\boxed{-\frac{\sqrt{3}}{2}}", r"-\frac{\sqrt{3}}{2}", True),
    (r"\boxed{\sqrt{3}}", "3", False),
    (r"\boxed{\sqrt{2}}", r"\sqrt{3}", False),
    # intervals and sets
    (r"\boxed{[1, 3)}", "[1,3)", True),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", True),
    (r"\boxed{(1, 3]}", "[1,3)", False),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", True),
    (r"\boxed{(3, -1)}", "(3,-1)", True),
    (r"\boxed{(-1, 3)}", "(3,-1)", False),
    # multiple choice
    (r"\boxed{\text{(B)}}", "B", True),
    (r"\boxed{B}", "(B)", True),
    (r"\boxed{\text{(C)}}", "B", False),
    # units and percentages
    (r"\boxed{5\text{ cm}}", "5", True),
    (r"\boxed{10^{\circ}}", "10", True),
    (r"\boxed{\$18}", "18", True),
    (r"\boxed{50\%}", "0.5", True),
    (r"\boxed{6\text{ cm}}", "5", False),
    # equations, expressions, constants
    (r"\boxed{x = 5}", "5", True),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", True),
    (r"\boxed{\pi}", r"\pi", True),
    (r"\boxed{3.14}", r"\pi", False),
    # the last box counts, braces balanced
    (r"First \boxed{3}, then corrected: \boxed{\frac{7}{2}}", "3.5", True),
    (r"First \boxed{3.5}, then corrected: \boxed{3}", "3.5", False),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", True),
    # no box: the final answer line
    ("b=18,e:18+73=91\nAnswer: 307", "307", True),
    ("Let me add 12 and 7.\nThe answer is 19", "19", True),
    ("Adding up to 300, the total is\n301", "307", False),
    # no answer
    ("I could not solve this.", "12", False),
    ("", "12", False),
    (r"\boxed{}", "12", False),
]


@pytest.mark.parametrize(("output", "gold", "correct"), TABLE)
def test_math_scorer_table(output, gold, correct):
    assert math_match(output, gold) is correct
    assert scorer_by_name("math")(output, gold) is correct


def test_the_table_is_large_and_holds_both_verdicts():
    assert len(TABLE) >= 30
    assert sum(c for *_, c in TABLE) >= 15 and sum(not c for *_, c in TABLE) >= 10


def test_last_number_gets_latex_answers_wrong_where_math_gets_them_right():
    """Negative control for the table: the default scorer fails these rows, so the table tests `math`."""
    rows = [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{\text{(B)}}", "B"), (r"\boxed{2\sqrt{3}}", r"\sqrt{12}")]
    assert [last_number(o, g) for o, g in rows] == [False, False, False]
    assert [math_match(o, g) for o, g in rows] == [True, True, True]


def test_the_last_closed_box_and_the_final_line():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{4} and an unclosed \boxed{5") == "4"
    assert last_boxed("no box") is None
    assert final_answer_text("thinking\n\nAnswer: 7\n\n") == "Answer: 7"
    assert final_answer_text("   \n") is None


def test_resample_counts_answers_by_their_parsed_form():
    answer = answer_extractor("math")
    same = [r"\boxed{0.5}", r"\boxed{\frac{1}{2}}", r"\boxed{\frac{2}{4}}", "so\n1/2", r"\boxed{x = \frac12}"]
    assert {answer(o) for o in same} == {answer(same[0])}
    assert answer(r"\boxed{0.25}") != answer(same[0])  # negative control: another value is another answer
    assert answer(r"\boxed{\sqrt{12}}") == answer(r"\boxed{2\sqrt{3}}")
    assert math_answer("no answer at all") is None
    # the last-number extractor, by contrast, counts the texts as different answers
    last = answer_extractor("last-number")
    assert len({last(o) for o in same}) > 1


def test_the_scorer_names_its_package_versions():
    versions = scorer_versions("math")
    assert versions["math-verify"] and versions["sympy"]
    assert scorer_versions("last-number") == {}


def test_a_missing_math_verify_is_one_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    with pytest.raises(StageReplayError, match="math-verify"):
        scorer_by_name("math")


@pytest.mark.slow  # a whole run or several: the slow tier (CI runs it)
def test_a_math_run_records_the_scorer_version_and_labels_the_toy_as_last_number_does(tmp_path):
    """The toy ends in `Answer: N`: `--scorer math` labels each arm as `last-number` does; the manifest names
    math-verify's version, and a run with the default scorer (the negative control) names none."""
    import json

    from typer.testing import CliRunner

    from stagereplay.cli import app

    runs = {}
    for scorer in ("math", "last-number"):
        out = tmp_path / scorer
        result = CliRunner().invoke(app, ["matched", "--n", "2", "--scorer", scorer, "--out", str(out), "--quiet"])
        assert result.exit_code == 0, result.output
        runs[scorer] = out
    manifest = json.loads((runs["math"] / "manifest.json").read_text())
    assert manifest["config"]["scorer_packages"]["math-verify"] == scorer_versions("math")["math-verify"]
    assert "scorer_packages" not in json.loads((runs["last-number"] / "manifest.json").read_text())["config"]

    def labels(run):
        records = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
        return [(r["item_id"], a["name"], a["correct"]) for r in records for a in r["payload"].get("arms", [])]

    assert labels(runs["math"]) == labels(runs["last-number"]) != []
