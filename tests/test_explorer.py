"""The diagnostics on a real (tiny random Qwen2) matched run: ledger fields, results.json, the verdict, the per-item
explorer in headless Chromium (also at 200 divergent items), `stagereplay show`, and 80-column terminal tables."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import tables_text
from test_report import _run_chromium
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.experiments.core.stats import first_divergence
from stagereplay.records.ledger import Record, canonical_json, read_ledger
from stagereplay.report.render import write_report
from stagereplay.report.results import Results

runner = CliRunner()


@pytest.fixture(scope="module")
def run(bf16_run) -> Path:
    return bf16_run


def _matched(run: Path) -> list[Record]:
    return [r for r in read_ledger(run) if r.kind == "item" and r.experiment == "matched"
            and r.payload["status"] == "ok"]


def _divergent(run: Path) -> list[Record]:
    return [r for r in _matched(run) if not r.payload["comparisons"][0]["suffix_equal"]]


def test_records_carry_margins_logits_and_cache_differences(run):
    records = _matched(run)
    assert _divergent(run), "the bf16 run must have divergent items for this test to mean anything"
    for r in records:
        p = r.payload
        arms = {a["name"]: a for a in p["arms"]}
        diag = p["diagnostics"]
        assert all(len(diag["margins"][name]) == len(arms[name]["suffix_ids"]) for name in arms)  # one per step
        main = diag["pairs"]["live vs oneshot"]
        d = first_divergence(arms["live"]["suffix_ids"], arms["oneshot"]["suffix_ids"])
        assert (main["divergence"] or {}).get("step") == d
        if d is not None:
            div = main["divergence"]
            # The arms part where their top-1 tokens differ, and each arm picked its own top-1.
            assert div["a"]["top"][0][0] == arms["live"]["suffix_ids"][d]
            assert div["b"]["top"][0][0] == arms["oneshot"]["suffix_ids"][d]
            assert div["a"]["margin"] == diag["margins"]["live"][d]
            assert div["logit_maxabs"] > 0
        assert [layer["layer"] for layer in main["cache"]["layers"]] == list(range(len(main["cache"]["layers"])))
        # Replicas are bit-exact: their logits agree to the bit at the first step, and nothing diverges.
        for pair in ("live vs live#replica", "oneshot vs oneshot#replica"):
            assert diag["pairs"][pair]["first_step_logit_maxabs"] == 0.0
            assert diag["pairs"][pair]["divergence"] is None and diag["pairs"][pair]["cache"] is None


def test_results_list_divergences_first_step_differences_and_cache_medians(run):
    m = json.loads((run / "results.json").read_text())["matched"][0]
    divergent = _divergent(run)
    assert [d["item_id"] for d in m["divergences"]] == [r.item_id for r in divergent]
    assert [d["first_divergence"] for d in m["divergences"]] == m["first_divergence"]
    assert all(set(d["margin"]) == {"live", "oneshot"} for d in m["divergences"])
    assert sorted(m["first_step_logit_maxabs"]) == sorted(r.item_id for r in _matched(run))
    assert {tuple(sorted(row)) for row in m["cache_diff"]} == {("k_maxabs", "k_rel_l2", "layer", "v_maxabs",
                                                                 "v_rel_l2")}
    assert m["margins"]["at_divergence"]["n"] == len(divergent)


def test_verdict_answers_each_question_with_its_number(run):
    from stagereplay.report.verdict import verdict

    results = json.loads((run / "results.json").read_text())
    m = results["matched"][0]
    answers = dict(verdict(Results.model_validate(results)))
    k, n = m["suffix_disagreements"]["k"], m["suffix_disagreements"]["n"]
    assert answers["Are replicas exact?"].startswith("yes")
    assert answers["Is replay faithful in bf16?"].startswith("no") and f"{k}/{n}" in answers["Is replay faithful in bf16?"]
    assert answers["Is replay faithful in fp32?"].startswith("not measured")  # a matched-only run says so
    assert answers["Does the cache carry the divergence?"].startswith("not tested")
    assert "at the first divergent token" in answers["How close were the decisions where the arms diverged?"]
    # Negative control: a replica that is not exact turns the first answer.
    m["replica_exact"]["live"]["k"] -= 1
    assert dict(verdict(Results.model_validate(results)))["Are replicas exact?"].startswith("no")


def test_every_table_reads_at_80_columns(run):
    text = tables_text(json.loads((run / "results.json").read_text()), width=80)
    assert "Why pairs diverged" in text and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 80


# --- the explorer --------------------------------------------------------------------------------


def _many(run: Path, dst: Path, n: int) -> Path:
    """A copy of the run whose ledger repeats its divergent matched records as `n` items (the chain is not kept)."""
    shutil.copytree(run, dst)
    source = _divergent(run)
    lines = []
    for i in range(n):
        r = source[i % len(source)]
        lines.append(canonical_json(r.model_copy(update={"item_id": f"many-{i:03d}", "seq": i}).model_dump()))
    (dst / "ledger.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return dst


def test_report_has_an_anchor_per_divergent_item_in_chromium(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    html = write_report(copy)[1]
    dom = _run_chromium(html, tmp_path / "profile", "--dump-dom").stdout
    for r in _divergent(run):
        assert f'id="item-{r.item_id}"' in dom
        assert f'href="#item-{r.item_id}"' in dom
    assert dom.count("<mark>") == 2 * len(_divergent(run))  # the first divergent token of each arm
    figures = dom.count('<img alt="')
    assert f'data-images-loaded="{figures}/{figures}"' in dom and 'id="fig-margins"' in dom
    assert 'id="verdict"' in dom and 'id="table-diagnostics"' in dom


def test_explorer_with_200_items_stays_one_file_and_loads(run, tmp_path):
    copy = _many(run, tmp_path / "many", 200)
    html = write_report(copy)[1]
    page = html.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    dom = _run_chromium(html, tmp_path / "profile", "--dump-dom").stdout
    assert len(re.findall(r'id="item-many-\d{3}"', dom)) == 200
    assert "Divergent items (200)" in dom
    assert html.stat().st_size < 5_000_000


# --- stagereplay show ----------------------------------------------------------------------------


def test_show_prints_one_items_story_at_80_columns(run):
    r = _divergent(run)[0]
    result = runner.invoke(app, ["show", str(run), r.item_id], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    out = result.output
    for part in ("prompt:", "stage 1:", "Margin (top-1 minus top-2 logit)", "Top 5 at the first divergent token",
                 "per layer", "per position band"):
        assert part in out
    arms = [line for line in out.splitlines() if line.startswith(("live (", "oneshot ("))]
    assert len(arms) == 2 and all("[" in line for line in arms)  # both arms, the divergent token in brackets
    assert arms[0].index("[") == arms[1].index("[")  # aligned
    assert max(len(line) for line in out.splitlines()) <= 80


def test_show_refuses_an_unknown_item_in_one_line(run):
    result = runner.invoke(app, ["show", str(run), "no-such-item"])
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "no-such-item" in result.stderr


# --- token texts from the ledger; 2x2 pairs --------------------------------------------------------


def test_records_carry_the_texts_of_the_tokens_they_show(run, tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir("qwen2"))
    for r in _matched(run):
        p, texts = r.payload, r.payload["token_texts"]
        shown = {*p["prompt_ids"], *p["prefix_ids"], *(t for a in p["arms"] for t in a["suffix_ids"])}
        assert {str(t) for t in shown} <= set(texts)
        assert all(texts[str(t)] == tokenizer.decode([t], skip_special_tokens=False) for t in shown)


def test_the_explorer_renders_token_texts_from_the_record_alone(run):
    """The story's text is the record's `token_texts`; without them (a record made before they were recorded, the
    negative control) tokens print as `<id>`, whatever the model directory holds."""
    from stagereplay.report.explorer import stories, story_html

    record = _divergent(run)[0]
    forged = {k: "§" for k in record.payload["token_texts"]}
    html = story_html(stories([record.model_copy(update={"payload": {**record.payload, "token_texts": forged}})])[0])
    assert "§" in html and "&lt;" not in html.split("prompt:")[1].split("</code>")[0]
    bare = {k: v for k, v in record.payload.items() if k != "token_texts"}
    html = story_html(stories([record.model_copy(update={"payload": bare})])[0])
    assert "§" not in html and f"&lt;{record.payload['prompt_ids'][0]}&gt;" in html


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory, tiny_dir, items_file) -> Path:
    out = tmp_path_factory.mktemp("explorer-2x2") / "run"
    result = runner.invoke(app, ["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--n", "4",
                                 "--boundary-after", "16", "--max-new-tokens", "24", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["precision-2x2", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_show_and_the_explorer_cover_2x2_pairs(grid_run):
    from stagereplay.report.explorer import explorer_html, stories

    records = [r for r in read_ledger(grid_run) if r.kind == "item"]
    told = stories(records)
    grid = [s for s in told if s.experiment == "precision_2x2"]
    assert {(s.precision, s.a, s.b) for s in grid} == {("bf16", "incremental@bf16", "oneshot@bf16"),
                                                        ("fp32", "incremental@fp32", "oneshot@fp32")}
    assert len(grid) == 8 and len(told) == 12  # 4 items: one matched story, two 2x2 stories each
    item = grid[0].item_id
    result = runner.invoke(app, ["show", str(grid_run), item], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "primary, 2x2 · incremental@fp32 vs oneshot@fp32 @ fp32" in result.output
    assert "primary · live vs oneshot @ bf16" in result.output
    divergent = [s for s in told if s.divergence is not None]
    html = explorer_html(records)
    assert html.count('<section class="item"') == len(divergent)
    assert html.count("2x2</td>") == sum(s.experiment == "precision_2x2" for s in divergent)
