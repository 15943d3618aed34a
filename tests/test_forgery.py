"""The forgery table: edits a careful forger would make, every checksum recomputed (tests/forge.py), and the
finding each must produce, naming the item and the field.

`audit --verify-only` (no model) must catch every forgery whose edit contradicts something recorded beside
it; two (a cache fingerprint, a suffix token with its fingerprint, each with the comparisons recomputed) are
consistent with everything recorded, and only re-execution can tell: for those the table asserts that
`--verify-only` passes, so the line between the two audits is stated, not assumed. The full audit must
catch them all. The documentation's bad-input page (docs/reference/errors.md) lists the same rows.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from forge import carry_over, edit, load, save, with_payload
from typer.testing import CliRunner

from stagereplay.audit.verify import verify_run
from stagereplay.cli import app
from stagereplay.records.findings import Finding
from stagereplay.records.ledger import Record, read_manifest

runner = CliRunner()
pytestmark = pytest.mark.slow  # a run forged every way, verified and audited in full: the slow tier (CI runs it)


Chain = list[Record]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir, items_file) -> Path:
    """matched (bf16, so some pairs diverge), the 2x2, the bridge and a transplant of the first two.

    Which pairs diverge depends on the CPU's bf16 kernels: of these 16 items, within 32 suffix tokens, at least
    2 did on the AVX-512 machine this test was written on and 1 on another with AMX tiles. A suffix of 64 tokens
    diverges wherever one of 32 does, and more often (3 of 16 on the AMX machine), so the transplant finds its
    two on both."""
    out = tmp_path_factory.mktemp("forgery") / "run"
    steps = [["matched", "--model", str(tiny_dir("qwen2")), "--data", str(items_file), "--n", "16",
              "--boundary-after", "16", "--max-new-tokens", "64", "--out", str(out)],
             ["precision-2x2", str(out)], ["bridge", str(out), "--rows", "2"],
             ["transplant", str(out), "--select", "first:2"]]
    for args in steps:
        result = runner.invoke(app, [*args, "--quiet"])
        assert result.exit_code == 0, result.output + result.stderr
    return out


@dataclass
class Targets:
    """Distinct items for each forgery, so that all of them fit in one ledger for one full audit."""

    pool: list[str]  # items with a matched record and no transplant
    selected: list[str]  # the transplant's frozen selection, in ledger order


def targets(chain: Chain, manifest: dict[str, Any]) -> Targets:
    selected = [r.item_id for r in chain if r.kind == "item" and r.experiment == "transplant"]
    assert len(selected) == 2, "a random bf16 Qwen2 diverges on at least two of 16 items within 64 tokens"
    pool = [i for i in manifest["config"]["item_ids"] if i not in selected]
    return Targets(pool, selected)


def _find(chain: Chain, experiment: str, item: str) -> int:
    return next(k for k, r in enumerate(chain) if r.kind == "item" and r.experiment == experiment
                and r.item_id == item)


def flip_cache_equal(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "matched", t.pool[0])
    p = edit(chain[k])
    p["comparisons"][0]["cache_equal"] = not p["comparisons"][0]["cache_equal"]
    chain[k] = with_payload(chain[k], p, recompare=False)
    return t.pool[0], "comparison live vs oneshot: cache_equal"


def change_cache_fp(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "matched", t.pool[1])
    p = edit(chain[k])
    p["arms"][2]["cache_fp"] = "0" * 64  # the oneshot arm; its comparisons are recomputed to agree
    chain[k] = with_payload(chain[k], p)
    carry_over(chain, k)  # and the 2x2's copy of it (same_as)
    return t.pool[1], "arm oneshot: cache_fp"


def change_first_divergence(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "matched", t.pool[2])
    p = edit(chain[k])
    p["comparisons"][0]["first_divergence"] = (p["comparisons"][0]["first_divergence"] or 0) + 3
    chain[k] = with_payload(chain[k], p, recompare=False)
    return t.pool[2], "comparison live vs oneshot: first_divergence"


def flip_correct(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "matched", t.pool[3])
    p = edit(chain[k])
    p["arms"][0]["correct"] = not p["arms"][0]["correct"]  # the live arm; label_equal and fp recomputed
    chain[k] = with_payload(chain[k], p)
    return t.pool[3], "arm live: correct"


def change_suffix_token(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "matched", t.pool[4])
    p = edit(chain[k])
    suffix = p["arms"][2]["suffix_ids"]
    suffix[0] = (suffix[0] + 1) % 50  # its suffix_fp and the comparisons are recomputed to agree
    chain[k] = with_payload(chain[k], p)
    carry_over(chain, k)  # and the 2x2's copy of it (same_as)
    return t.pool[4], "arm oneshot: suffix_ids"


def delete_item_record(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    del chain[_find(chain, "matched", t.pool[5])]
    return t.pool[5], "matched/primary: no record"


def drop_last_record(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    last = chain.pop()
    assert last.item_id == t.selected[-1]
    return last.item_id, "transplant/primary: no record"


def duplicate_record(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "matched", t.pool[6])
    chain.insert(k + 1, chain[k])
    return t.pool[6], "matched/primary: 2 records"


def remove_item_everywhere(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    m["config"]["item_ids"].remove(t.pool[7])
    chain[:] = [r for r in chain if not (r.kind == "item" and r.item_id == t.pool[7])]
    return t.pool[7], "config.item_ids lacks an item of the dataset"


def flip_transplant_correct(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    k = _find(chain, "transplant", t.selected[0])
    p = edit(chain[k])
    arm = next(a for a in p["arms"] if a["name"] == "live->oneshot")
    arm["correct"] = not arm["correct"]
    chain[k] = with_payload(chain[k], p)
    return t.selected[0], "arm live->oneshot: correct"


def change_selection(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    m["stages"]["transplant/primary"]["selected"] = sorted([*m["stages"]["transplant/primary"]["selected"],
                                                            t.pool[8]])
    return t.pool[8], "selected is not what rule first:2 picks"


def change_stage_precision(chain: Chain, m: dict[str, Any], t: Targets) -> tuple[str, str]:
    m["stages"]["matched/primary"]["model"]["precision"] = "fp32"
    for k, r in enumerate(chain):
        if r.kind == "item" and r.experiment == "matched":
            p = edit(r)
            for arm in p["arms"]:
                arm["precision"] = "fp32"
            chain[k] = with_payload(r, p, recompare=False)  # no comparison covers a precision
    return "", "stage matched/primary: model precision differs"


Forgery = Callable[[Chain, dict[str, Any], Targets], tuple[str, str]]
TABLE: list[tuple[Forgery, bool]] = [  # (forgery, caught without a model)
    (flip_cache_equal, True),
    (change_cache_fp, False),
    (change_first_divergence, True),
    (flip_correct, True),
    (change_suffix_token, False),
    (delete_item_record, True),
    (drop_last_record, True),
    (duplicate_record, True),
    (remove_item_everywhere, True),
    (flip_transplant_correct, True),
    (change_selection, True),
    (change_stage_precision, True),
]


def forge(src: Path, dst: Path, forgeries: list[Forgery]) -> list[tuple[str, str]]:
    shutil.copytree(src, dst)
    chain, manifest = load(dst)
    t = targets(chain, manifest)
    expected = [f(chain, manifest, t) for f in forgeries]
    save(dst, chain, manifest)
    return expected


def _reported(findings: list[Finding], item: str, field: str) -> bool:
    return any(f.item_id == item and field in f.what for f in findings)


def test_the_untouched_run_passes_verify_only(run):
    assert verify_run(run, read_manifest(run)).reproduced


@pytest.mark.parametrize(("forgery", "without_model"), TABLE, ids=[f.__name__ for f, _ in TABLE])
def test_verify_only_reports_each_forgery_it_can(run, tmp_path, forgery, without_model):
    [(item, field)] = forge(run, tmp_path / "run", [forgery])
    checked = verify_run(tmp_path / "run", read_manifest(tmp_path / "run"))
    assert checked.chain_ok, "the forger recomputed the chain"
    if without_model:
        assert _reported(checked.findings, item, field), checked.findings
    else:
        assert checked.reproduced, "consistent with everything recorded: only re-execution can tell"


def test_the_full_audit_reports_every_forgery(run, tmp_path):
    """Every forgery at once, each on its own item, and one re-executing audit: each is named."""
    expected = forge(run, tmp_path / "run", [f for f, _ in TABLE])
    result = runner.invoke(app, ["audit", str(tmp_path / "run"), "--quiet"])
    assert result.exit_code == 1
    findings = [Finding.model_validate(f) for f in json.loads((tmp_path / "run" / "audit.json").read_text())["mismatches"]]
    missed = [(item, field) for item, field in expected if not _reported(findings, item, field)]
    assert missed == [], findings
    printed = result.stderr.splitlines()  # and printed, one line per finding, naming the item and the field
    assert all(any(item in line and field in line for line in printed) for item, field in expected)
