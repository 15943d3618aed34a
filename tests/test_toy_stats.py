"""The matched table's statistics on a real toy run whose divergences change answers, recomputed
from its ledger by an independent path (scipy, and the raw JSON lines rather than stagereplay's reader).

The run is `fixtures/toy_matched/` (`fixtures/make_toy_matched.py`: `stagereplay matched --n 200` on the
embedded toy). Each check comes with a negative control: the same comparison flags results that were moved
by one count or by a point of accuracy.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

RUN = Path(__file__).parent / "fixtures" / "toy_matched"
CI_TOLERANCE = 0.01
"""Two percentile bootstraps of 10,000 resamples on different random streams: at n = 200 their 2.5% and
97.5% points differ by a few tenths of a point; one point of slack, far below a real error."""


def outcomes(run: Path) -> list[tuple[bool, bool]]:
    """(live correct, one-shot correct) per item that reached the boundary, from the ledger's JSON lines."""
    pairs = []
    for line in (run / "ledger.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "item" or record["payload"]["status"] != "ok":
            continue
        arms = {arm["name"]: arm["correct"] for arm in record["payload"]["arms"]}
        pairs.append((arms["live"], arms["oneshot"]))
    return pairs


def matched_table(run: Path) -> dict[str, Any]:
    return json.loads((run / "results.json").read_text())["matched"][0]


def mismatches(table: dict[str, Any], pairs: list[tuple[bool, bool]]) -> list[str]:
    """Where the recorded table differs from scipy's computation on the ledger's outcomes."""
    found = []
    live = np.array([a for a, _ in pairs], dtype=float)
    fresh = np.array([b for _, b in pairs], dtype=float)
    b = int(np.sum((live == 1) & (fresh == 0)))
    c = int(np.sum((live == 0) & (fresh == 1)))
    if table["discordant"] != {"live_only": b, "other_only": c}:
        found.append(f"discordant {table['discordant']} != {b}, {c}")
    if table["label_disagreements"]["k"] != b + c:
        found.append("label disagreements")
    p = min(1.0, 2 * float(stats.binom.cdf(min(b, c), b + c, 0.5))) if b + c else 1.0
    if table["mcnemar_p"] != pytest.approx(p, rel=1e-9):
        found.append(f"McNemar p {table['mcnemar_p']} != {p}")
    if table["accuracy"] != {"live": pytest.approx(live.mean()), "oneshot": pytest.approx(fresh.mean())}:
        found.append("accuracy")
    diff = table["accuracy_diff"]
    if diff["estimate"] != pytest.approx(live.mean() - fresh.mean()):
        found.append("accuracy difference")
    boot = stats.bootstrap((live - fresh,), np.mean, n_resamples=diff["n_resamples"], method="percentile",
                           confidence_level=diff["confidence"], rng=np.random.default_rng(12345))
    lo, hi = boot.confidence_interval
    if abs(diff["ci"][0] - lo) > CI_TOLERANCE or abs(diff["ci"][1] - hi) > CI_TOLERANCE:
        found.append(f"paired CI {diff['ci']} != scipy's [{lo:.4f}, {hi:.4f}]")
    return found


def test_the_toy_run_changes_answers():
    """The point of the toy: without discordant pairs the checks below would be degenerate (p = 1, a CI of
    [+0, +0]), as they were on a toy that was always right."""
    pairs = outcomes(RUN)
    assert len(pairs) >= 195
    discordant = sum(a != b for a, b in pairs)
    assert discordant >= 2
    correct = sum(a for a, _ in pairs) / len(pairs)
    assert 0.5 < correct < 0.95  # imperfect on purpose, so two routes can end in different answers
    table = matched_table(RUN)
    assert table["mcnemar_p"] < 1 and table["accuracy_diff"]["ci"][0] != table["accuracy_diff"]["ci"][1]


def test_recorded_labels_are_the_last_number_of_each_output():
    """Labels re-scored from each arm's recorded text by a plain regex, not the package's scorer."""
    checked = 0
    for line in (RUN / "ledger.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] != "item" or record["payload"]["status"] != "ok":
            continue
        for arm in record["payload"]["arms"]:
            numbers = re.findall(r"-?\d+", arm["text"])
            assert arm["correct"] == (bool(numbers) and numbers[-1] == record["payload"]["answer"])
            checked += 1
    assert checked >= 4 * 195


def test_matched_statistics_agree_with_scipy_on_the_ledger():
    assert mismatches(matched_table(RUN), outcomes(RUN)) == []


@pytest.mark.parametrize("edit", ["one more live-only", "McNemar of other counts", "CI a point off",
                                  "accuracy a point off"])
def test_the_comparison_catches_a_table_that_is_off(edit):
    table = copy.deepcopy(matched_table(RUN))
    if edit == "one more live-only":
        table["discordant"]["live_only"] += 1
    elif edit == "McNemar of other counts":
        b, c = table["discordant"]["live_only"], table["discordant"]["other_only"]
        table["mcnemar_p"] = min(1.0, 2 * float(stats.binom.cdf(min(b, c) + 1, b + c + 1, 0.5)))
    elif edit == "CI a point off":
        table["accuracy_diff"]["ci"] = [x + 0.015 for x in table["accuracy_diff"]["ci"]]
    else:
        table["accuracy"]["live"] += 0.01
    assert mismatches(table, outcomes(RUN)) != []
