"""The report: tables, number format, omitted sections, atomic writes, and the HTML in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import tables_text
from pydantic import ValidationError

from stagereplay.experiments.core.format import bound, points
from stagereplay.experiments.core.stats import wilson_interval
from stagereplay.report.render import print_tables, write_report
from stagereplay.report.results import Results
from stagereplay.report.tables import build_tables, load_results

FIXTURES = Path(__file__).parent / "fixtures"
RUN_SMALL = FIXTURES / "run_paper"  # made by fixtures/make_fixtures.py
CHROMIUM_TIMEOUT_S = 60


def _copy_run(tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(RUN_SMALL, dst)
    return dst


def _results() -> dict[str, Any]:
    return json.loads((RUN_SMALL / "results.json").read_text())


def _paper_results() -> dict[str, Any]:
    """The reference paper's headline counts at n = 200 (checkpoint names as in a `paper` run)."""
    results = _results()
    m = results["matched"][0]
    m.update(
        n=200,
        n_boundary=200,
        n_no_boundary=0,
        replica_exact={"live": {"k": 200, "n": 200}, "oneshot": {"k": 200, "n": 200}},
        suffix_disagreements={"k": 166, "n": 200},
        label_disagreements={"k": 20, "n": 200},
        accuracy={"live": 0.62, "oneshot": 0.61},
        accuracy_diff={
            "estimate": 0.01,
            "ci": [-0.035, 0.055],
            "confidence": 0.95,
            "n_resamples": 10_000,
            "seed": 0,
        },
        discordant={"live_only": 11, "other_only": 9},
        mcnemar_p=0.8238029479980469,
    )
    results["matched"] = [m]
    grid = results["precision_2x2"]
    grid["disagreements"] = [
        {
            "precision": "bf16",
            "k": 166,
            "n": 200,
            "wilson": list(wilson_interval(166, 200)),
            "label_k": 20,
            "first_divergence": list(range(166)),
        },
        {
            "precision": "fp32",
            "k": 0,
            "n": 200,
            "wilson": list(wilson_interval(0, 200)),
            "label_k": 0,
            "first_divergence": [],
        },
    ]
    for t, n in zip(results["transplant"], (24, 43), strict=True):
        t["n_items"] = n
        t["directions"] = [
            {
                "direction": d,
                "n": n,
                "follows_donor": n,
                "follows_recipient": 0,
                "neither": 0,
                "donor_wilson": None,
                "divergence_from_donor": [None] * n,
            }
            for d in ("live->oneshot", "oneshot->live")
        ]
    return results


# --- fixture and tables --------------------------------------------------------------------------


def test_fixture_is_an_intact_real_run(tmp_path: Path) -> None:
    """The fixture is what `fixtures/make_fixtures.py` got from a real `paper` run: bound, complete, every
    derivable claim holding, results.json what its ledger gives; and it fills every section the tests read."""
    from stagereplay.audit.verify import verify_run
    from stagereplay.records.ledger import read_manifest

    run = _copy_run(tmp_path)
    checked = verify_run(run, read_manifest(run))
    assert checked.reproduced, checked
    results = _results()
    assert [m["checkpoint"] for m in results["matched"]] == ["primary", "later"]
    assert results["matched"][0]["n_no_boundary"] >= 1
    assert all(t["n_items"] >= 1 for t in results["transplant"]) and results["transplant"][0]["sweep"]
    assert results["audit"]["reproduced"] is True


def test_paper_numbers_print_in_the_documented_format() -> None:
    text = tables_text(_paper_results())
    assert "+1.0 [-3.5, +5.5]" in text  # accuracy difference and paired CI, in points
    assert "[0.00%, 1.88%]" in text  # fp32: 0/200 with its Wilson upper bound
    assert "166/200 (83.0%)" in text
    assert "86.2%" in text and "91.8%" in text  # Wilson lower bounds for 24/24 and 43/43
    assert "0.824" in text  # McNemar


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.018845, "1.88%"), (0.0, "0.00%"), (0.862, "86.2%"), (0.0999, "9.99%"), (1.0, "100.0%")],
)
def test_bound_format(value: float, expected: str) -> None:
    assert bound(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [(0.01, "+1.0"), (-0.035, "-3.5"), (0.055, "+5.5"), (-0.0001, "+0.0")]
)
def test_points_format(value: float, expected: str) -> None:
    assert points(value) == expected


def test_missing_sections_are_omitted() -> None:
    results = _results()
    results.update(precision_2x2=None, bridge=None, transplant=[], audit=None)
    ids = [t.id for t in build_tables(Results.model_validate(results))]
    assert ids[0] == "table-matched"
    assert not [i for i in ids if i.startswith(("table-2x2", "table-bridge", "table-transplant", "table-audit"))]
    results["matched"] = []
    assert build_tables(Results.model_validate(results)) == []


def test_null_values_print_as_dash() -> None:
    results = _results()
    m = results["matched"][0]
    m.update(n_boundary=0, n_no_boundary=m["n"], accuracy={"live": None, "oneshot": None}, accuracy_diff=None)
    m.update(mcnemar_p=None, suffix_disagreements={"k": 0, "n": 0}, label_disagreements={"k": 0, "n": 0})
    matched = build_tables(Results.model_validate(results))[0]
    rows = {row[0]: row[1] for row in matched.rows}
    assert rows["accuracy, live"] == "-" and rows["McNemar exact p"] == "-"
    assert rows["suffix disagreements"] == "0/0"


def test_markers_inside_a_token_are_a_row_of_the_matched_table() -> None:
    results = _results()
    m = results["matched"][0]
    assert "n_marker_inside_token" not in m  # negative control: a marker matched on its token ID has no such row
    assert not [r for r in build_tables(Results.model_validate(results))[0].rows if "inside a token" in r[0]]
    m["n_marker_inside_token"] = 1
    rows = {row[0]: row[1] for row in build_tables(Results.model_validate(results))[0].rows}
    assert rows["boundary marker ended inside a token"] == f"1/{m['n_boundary']} ({100 / m['n_boundary']:.1f}%)"


def test_transplant_table_has_control_row_and_recomputes_missing_wilson() -> None:
    results = _paper_results()
    primary = next(t for t in build_tables(Results.model_validate(results)) if t.id == "table-transplant-primary")
    assert [r[1] for r in primary.rows] == ["all", "all", "none (control)", "none (control)"]
    assert primary.rows[0][3:5] == ("24/24 (100.0%)", "86.2%")  # donor_wilson was null: computed


def test_audit_mismatches_and_bridge_differences_get_detail_tables() -> None:
    results = _results()
    results["audit"].update(
        chain_ok=False, broken_records=[7], mismatches=[{"item_id": "toy-1", "what": "suffix_fp of oneshot"}]
    )
    results["bridge"]["items"][0].update(
        cache_equal=False, first_difference={"layer": 3, "tensor": "v", "position": 17, "reason": "value"}
    )
    tables = {t.id: t for t in build_tables(Results.model_validate(results))}
    assert ("toy-1", "suffix_fp of oneshot") in tables["table-audit-mismatches"].rows
    assert ("broken ledger records", "seq 7") in tables["table-audit"].rows
    assert tables["table-bridge-differences"].rows[0][2] == "layer 3, v, position 17"


def test_print_tables_to_a_console() -> None:
    from rich.console import Console

    console = Console(record=True, width=140)
    print_tables(Results.model_validate(_results()), console)
    out = console.export_text()
    assert "Matched: live cache vs fresh prefill" in out and "Transplant (later)" in out
    assert "follows donor per band" not in out  # the long sweep table stays in the files


@pytest.mark.parametrize("results", [_results, _paper_results], ids=["run_small", "paper"])
def test_every_terminal_table_reads_at_80_columns(results) -> None:
    """Cells wrap between words; a one-word cell such as a transplant direction is never cut."""
    text = tables_text(results(), width=80)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert re.search(r"│ live->oneshot +│", text) and re.search(r"│ oneshot->live +│", text)


def test_rich_default_widths_cut_the_transplant_direction_at_80_columns() -> None:
    """Negative control: the same transplant table with rich's own column widths ends in `live->on…`."""
    import io

    from rich.console import Console
    from rich.table import Table as RichTable

    table = next(t for t in build_tables(Results.model_validate(_paper_results())) if t.id == "table-transplant-primary")
    rich = RichTable(title=table.title)
    for header in table.headers:
        rich.add_column(header)
    for row in table.rows:
        rich.add_row(*row)
    buffer = io.StringIO()
    Console(file=buffer, width=80, color_system=None).print(rich)
    assert "…" in buffer.getvalue()


def test_verdict_gives_each_answer_its_number() -> None:
    from stagereplay.report.verdict import verdict

    answers = dict(verdict(Results.model_validate(_paper_results())))
    assert answers["Is replay faithful in bf16?"].startswith("no: 166/200 (83.0%)")
    assert answers["Is replay faithful in fp32?"].startswith("yes") and "upper bound 1.88%" in answers[
        "Is replay faithful in fp32?"]
    assert answers["Does the cache carry the divergence?"].startswith("yes") and "lower bound 86.2%" in answers[
        "Does the cache carry the divergence?"]
    # Without the 2x2 the fp32 question is not answered from thin air.
    results = _paper_results()
    results["precision_2x2"] = None
    assert dict(verdict(Results.model_validate(results)))["Is replay faithful in fp32?"].startswith("not measured")


class Ratios:
    """An experiment registered after the protocol's, as a module outside the report would declare it: per-token
    ratios of two scorings, with a verdict question of its own, a fact for the bf16 question, a figure of its own
    and a series on the first-divergence figure. Only what the report asks of it is here."""

    name = "ratios"

    def __init__(self) -> None:
        from stagereplay.experiments.core.verdict import Question

        self.question = Question("ratios near one", "Are the per-token ratios near one?",
                               lambda facts: "; ".join(f.phrase for f in facts) + ".",
                               "not measured (run the ratios experiment).")

    def results_of(self, entry: Any) -> Any:
        return entry  # its section read as the JSON object it is

    def tables(self, results: Any) -> list:
        return []

    def diagnosed(self, results: Any) -> list:
        return []

    def verdict_facts(self, results: Any) -> list:
        from stagereplay.experiments.core.verdict import Fact, faithful

        if not results:
            return []
        return [Fact(faithful("bf16"), "rollout vs trainer", holds=True, k=0, n=results["n"]),
                Fact(self.question, f"{results['near']}/{results['n']} within [1/2, 2]")]

    def verdict_questions(self, results: Any) -> list:
        return [self.question] if results else []

    def figures(self, results: Any) -> list:
        from stagereplay.experiments.core.figures import ReportFigure, diagonal_panels, png

        if not results:
            return []
        chart = diagonal_panels([("primary", [0.1, 0.5], [0.2, 0.4], "trainer", "rollout")])
        return [ReportFigure("fig-ratios", "Per-token ratios", "rollout against trainer", png(chart))]

    def series(self, results: Any) -> dict:
        from stagereplay.experiments.core.figures import DIVERGENCE

        return {DIVERGENCE: [("ratios primary", [2, 3], results["n"])]} if results else {}


@pytest.fixture
def ratios():
    from stagereplay.experiments.core import registry

    registry.register(Ratios())
    yield
    registry.unregister("ratios")


def _with_ratios() -> dict[str, Any]:
    return {**_results(), "ratios": {"n": 5, "near": 4}}


def _verdict_and_figures(results: dict[str, Any]) -> tuple[list[tuple[str, str]], dict[str, bytes]]:
    from stagereplay.report.figures import build_figures
    from stagereplay.report.verdict import verdict

    return verdict(Results.model_validate(results)), {f.id: f.png for f in build_figures(Results.model_validate(results))}


def test_a_registered_experiment_adds_its_verdict_lines_and_figures(ratios) -> None:
    """The report asks every registered experiment: a new one's question is asked after the protocol's, its fact joins
    the question it answers, its figure follows theirs and its series is drawn on the shared figure."""
    before, drawn = _verdict_and_figures(_results())
    after, figures = _verdict_and_figures(_with_ratios())
    assert [q for q, _ in after] == [q for q, _ in before] + ["Are the per-token ratios near one?"]
    assert dict(after)["Are the per-token ratios near one?"] == "4/5 within [1/2, 2]."
    bf16 = dict(after)["Is replay faithful in bf16?"]
    upper = f"{100 * wilson_interval(0, 5)[1]:.2f}%"
    assert bf16 == dict(before)["Is replay faithful in bf16?"][:-1] + (
        f"; 0/5 (0.0%) suffixes differ, rollout vs trainer (Wilson 95% upper bound {upper}).")
    assert list(figures) == [*drawn, "fig-ratios"]
    assert figures["fig-divergence"] != drawn["fig-divergence"]  # its series drawn beside matched's and the 2x2's
    assert all(figures[i] == drawn[i] for i in drawn if i != "fig-divergence")


def test_an_unregistered_experiments_section_says_nothing() -> None:
    """Negative control: the same results without the experiment registered give the protocol's verdict and figures
    alone, byte for byte."""
    assert _verdict_and_figures(_with_ratios()) == _verdict_and_figures(_results())


# --- write_report --------------------------------------------------------------------------------


def test_write_report_files(tmp_path: Path) -> None:
    run = _copy_run(tmp_path)
    md, html = write_report(run)
    assert (md, html) == (run / "report.md", run / "report.html")
    text = md.read_text()
    for title in ("## Matched", "## Fixed-prefix 2x2", "## Bridge", "## Transplant (primary)", "## Audit"):
        assert title in text
    page = html.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page must not fetch anything"
    assert "http://" not in page and "https://" not in page
    from stagereplay.report.figures import build_figures

    figures = build_figures(Results.model_validate(_results()))
    assert {"fig-divergence", "fig-transplant", "fig-sweep-primary"} <= {f.id for f in figures}
    assert page.count('<img alt="') >= len(figures)  # every figure the results call for, inline
    assert not list(run.glob(".*.tmp"))


@pytest.mark.parametrize("fixture", ["run_paper", "toy_matched", "schema1"])
def test_results_json_reads_back_typed_and_writes_its_own_bytes(fixture: str) -> None:
    """results.json read as `Results` holds each experiment's entry as its `Summary`s and writes the file's bytes
    again: the same keys in the same order, absent fields absent, nulls null, floats as they were."""
    from stagereplay.experiments.protocol.matched_summary import MatchedSummary

    text = (FIXTURES / fixture / "results.json").read_text()
    results = Results.model_validate_json(text)
    assert results.sections["matched"] and all(isinstance(m, MatchedSummary) for m in results.sections["matched"])
    assert json.dumps(results.as_json(), indent=2) + "\n" == text


def test_a_summary_writes_only_the_fields_it_was_given() -> None:
    """Negative control: the same section dumped with every field it declares (its unset ones as null) is not the
    file's: a field a section never had stays absent only because it was never set."""
    entry = _results()["matched"][0]
    summary = Results.model_validate(_results()).sections["matched"][0]
    assert summary.as_json() == entry
    assert "built" not in entry and summary.model_dump(mode="json")["built"] is None
    assert summary.model_dump(mode="json") != entry


def test_write_report_refuses_other_schema_versions(tmp_path: Path) -> None:
    run = _copy_run(tmp_path)
    results = _results()
    results["schema_version"] = 0
    (run / "results.json").write_text(json.dumps(results))
    with pytest.raises(ValueError, match="schema_version 0 is not supported"):
        write_report(run)
    del results["schema_version"]  # an unversioned file is refused, not guessed at
    (run / "results.json").write_text(json.dumps(results))
    with pytest.raises(ValueError, match="schema_version None"):
        load_results(run)


def test_failed_report_leaves_previous_files_intact(tmp_path: Path) -> None:
    run = _copy_run(tmp_path)
    write_report(run)
    before = (run / "report.html").read_bytes()
    broken = _results()
    del broken["matched"][0]["discordant"]
    (run / "results.json").write_text(json.dumps(broken))
    with pytest.raises(ValidationError, match="discordant"):
        write_report(run)
    assert (run / "report.html").read_bytes() == before
    assert not list(run.glob(".*.tmp"))


# --- the HTML in headless Chromium ---------------------------------------------------------------


def _chromium() -> str:
    for candidate in (shutil.which("chromium"), "/usr/bin/chromium", shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    if os.environ.get("CI"):
        pytest.fail("chromium not found; CI must install it (apt-get install chromium)")
    pytest.skip("chromium not found: install it with `apt-get install chromium` to run the browser tests")


def _run_chromium(html: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *args,
        html.as_uri(),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S, check=True)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("browser") / "run"
    shutil.copytree(RUN_SMALL, run)
    return write_report(run)[1]


def test_browser_dom_has_every_table_and_loaded_images(rendered: Path, tmp_path: Path) -> None:
    dom = _run_chromium(rendered, tmp_path / "profile", "--dump-dom").stdout
    for table_id in (
        "table-matched",
        "table-2x2",
        "table-2x2-disagreements",
        "table-bridge",
        "table-transplant-primary",
        "table-transplant-later",
        "table-sweep-primary",
        "table-audit",
    ):
        assert f'id="{table_id}"' in dom, table_id
    n = rendered.read_text().count('<img alt="')
    assert n >= 3 and f'data-images-loaded="{n}/{n}"' in dom


def test_browser_image_check_catches_a_broken_image(tmp_path: Path) -> None:
    """Negative control: the same page script reports an undecodable image as not loaded."""
    page = tmp_path / "broken.html"
    page.write_text(_broken_page())
    dom = _run_chromium(page, tmp_path / "profile", "--dump-dom").stdout
    assert 'data-images-loaded="0/1"' in dom


def _broken_page() -> str:
    from stagereplay.report.figures import ReportFigure
    from stagereplay.report.html import render_html

    return render_html([], [], [ReportFigure("fig-x", "broken", "not a PNG", b"not a png")])


def test_browser_screenshot_is_not_blank(rendered: Path, tmp_path: Path) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    shot = tmp_path / "shot.png"
    _run_chromium(rendered, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,2000")
    pixels = mpimg.imread(shot)  # (H, W, channels), floats in [0, 1]
    assert pixels.shape[:2] == (2000, 1200)
    rgb = pixels[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05, "screenshot is blank"
    assert len(np.unique(rgb, axis=0)) > 50  # text, table shading and figures, not a flat fill


# --- import hygiene ------------------------------------------------------------------------------


def test_importing_report_does_not_import_matplotlib() -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    code = "import sys, stagereplay.report, stagereplay.report.export; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def test_figures_leave_the_pyplot_backend_alone() -> None:
    import matplotlib

    from stagereplay.report.figures import build_figures

    before = matplotlib.rcParams["backend"]
    figures = build_figures(Results.model_validate(_results()))
    assert matplotlib.rcParams["backend"] == before
    assert [f.id for f in figures] == ["fig-divergence", "fig-transplant", "fig-sweep-primary"]
    assert all(f.png.startswith(b"\x89PNG\r\n\x1a\n") for f in figures)
