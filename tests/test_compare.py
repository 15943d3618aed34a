"""`stagereplay compare` on real runs of the embedded toy (made here through the CLI runner, each once per module),
each property with its negative control: a run against its own replica agrees everywhere, and a planted one-token
difference is found at its step (and not in the forged run against itself); runs of different models or items and
a run whose ledger was edited are refused in one line; what differs between the manifests is named. The margin at a
first divergence is read from the field that reaches that step, or said not to be recorded (synthetic records)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from forge import edit, load, plant_token, save, with_payload
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.errors import StageReplayError
from stagereplay.experiments.protocol.compare import compare_item
from stagereplay.experiments.protocol.compare_document import COMPARE_VERSION, read_compare
from stagereplay.experiments.protocol.payloads import MatchedPayload

runner = CliRunner()
MATCHED = ("matched", "--n", "4", "--max-new-tokens", "16", "--quiet")
STEP = 5
"""The suffix step of the planted token."""


def _matched(out: Path, *extra: str) -> Path:
    result = runner.invoke(app, [*MATCHED, "--out", str(out), *extra])
    assert result.exit_code == 0, (result.output, result.exception)
    return out


def _compare(a: Path, b: Path, out: Path, *extra: str):
    return runner.invoke(app, ["compare", str(a), str(b), "--out", str(out), *extra])


def _compared(a: Path, b: Path, out: Path) -> tuple[dict, str]:
    result = _compare(a, b, out)
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads((out / "compare.json").read_text()), result.stdout


def _one_error_line(result, *expect: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "; " in lines[0], result.stderr
    for part in expect:
        assert part in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compare")


@pytest.fixture(scope="module")
def run_a(root: Path) -> Path:
    return _matched(root / "a")


@pytest.fixture(scope="module")
def run_again(root: Path) -> Path:
    """The same command into another folder: run A's replica."""
    return _matched(root / "again")


@pytest.fixture(scope="module")
def forged(run_a: Path, root: Path) -> tuple[Path, str]:
    """Run A with one token of one item's live suffix (and its replica's) changed at `STEP`, checksums recomputed."""
    item = plant_token(run_a, root / "forged", STEP, nth=1)
    return root / "forged", item


def test_a_run_against_its_replica_agrees_everywhere(run_a, run_again, tmp_path):
    c, printed = _compared(run_a, run_again, tmp_path / "cmp")
    assert c["schema_version"] == COMPARE_VERSION and c["checkpoint"] == "primary"
    assert c["trajectories"]["equal"] == {"k": 4, "n": 4}
    assert c["trajectories"]["self_consistent"] == {"k": 4, "n": 4}
    assert all(i["trajectory_equal"] and i["first_divergence"] is None for i in c["items"])
    assert [a["arm"] for a in c["arms"]] == ["live", "oneshot"]
    for arm in c["arms"]:
        assert arm["suffix_disagreements"] == {"k": 0, "n": 4} and arm["label_disagreements"] == {"k": 0, "n": 4}
        assert arm["accuracy"]["a"] == arm["accuracy"]["b"] and arm["mcnemar_p"] == 1.0
        assert arm["accuracy_diff"]["ci"] == [0.0, 0.0]
    assert not c["differences"]["settings"] and not c["differences"]["kernels"] and not c["differences"]["server"]
    assert "Same live trajectories? Yes" in printed and "wrote " in printed
    page = (tmp_path / "cmp" / "compare.html").read_text()
    assert "<h1>stagereplay compare</h1>" in page and page.count("data:image/png;base64,") == 1
    assert "http://" not in page and "https://" not in page  # self-contained
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "## Per arm, A vs B" in md and "## First divergence per item" not in md  # no item diverges
    assert _compare(run_a, run_again, tmp_path / "quiet", "--quiet").stdout == ""


def test_a_planted_token_is_found_at_its_step(run_a, forged, tmp_path):
    run, item = forged
    assert runner.invoke(app, ["audit", str(run), "--verify-only"]).exit_code == 0, "the forgery verifies"
    c, printed = _compared(run_a, run, tmp_path / "cmp")
    by = {i["item_id"]: i for i in c["items"]}
    d = by[item]["first_divergence"]
    assert d["in"] == "suffix" and d["a"]["step"] == d["b"]["step"] == STEP
    assert d["position"] == by[item]["stage1_len"]["a"] + STEP and by[item]["stage1_equal"]
    assert d["a"]["token"] != d["b"]["token"] and (d["a"]["token"] + 1) % 256 == d["b"]["token"]
    chain, _ = load(run_a)
    record = next(r for r in chain if r.kind == "item" and r.item_id == item)
    assert d["a"]["margin"] == record.payload["diagnostics"]["margins"]["live"][STEP]  # our engine: every step's
    assert d["a"]["recorded"] == "margins"
    assert all(i["trajectory_equal"] for i in c["items"] if i["item_id"] != item)
    assert c["trajectories"]["first_divergence_in"] == {"stage 1": 0, "suffix": 1, "boundary": 0}
    live = next(a for a in c["arms"] if a["arm"] == "live")
    assert live["suffix_disagreements"] == {"k": 1, "n": 4} and live["first_divergence"] == [STEP]
    oneshot = next(a for a in c["arms"] if a["arm"] == "oneshot")
    assert oneshot["suffix_disagreements"]["k"] == 0
    assert c["replicas"]["a"]["live_inexact"] == c["replicas"]["b"]["live_inexact"] == []  # both self-consistent
    assert "first divergence in the suffix" in printed
    assert f"{item}" in (tmp_path / "cmp" / "compare.md").read_text()
    # Negative control: the forged run against itself diverges nowhere.
    same, _ = _compared(run, run, tmp_path / "self")
    assert same["trajectories"]["equal"] == {"k": 4, "n": 4}
    assert all(a["suffix_disagreements"]["k"] == 0 for a in same["arms"])


def test_runs_of_different_models_are_refused(run_a, root, tmp_path):
    from stagereplay.toy import toy_checkpoint

    # One item is enough: the models are compared before the items (had they not been, the refusal would name the
    # items, and this test would fail).
    later = _matched(root / "later", "--model", str(toy_checkpoint("later")), "--n", "1")
    _one_error_line(_compare(run_a, later, tmp_path / "cmp"), "different models", str(later))
    assert not (tmp_path / "cmp").exists()


def test_runs_of_different_items_are_refused(run_a, run_again, root, tmp_path):
    fewer = _matched(root / "fewer", "--n", "1")
    _one_error_line(_compare(run_a, fewer, tmp_path / "cmp"), "config.item_ids differ", "the same --data and --n")
    _one_error_line(_compare(run_a, run_again, tmp_path / "cmp", "--checkpoint", "later"),
                    "no matched records at checkpoint later", "--checkpoint one of: primary")


def test_a_run_edited_without_its_hash_is_refused(run_a, run_again, root, tmp_path):
    edited = root / "edited"
    shutil.copytree(run_a, edited)
    lines = (edited / "ledger.jsonl").read_text().splitlines(keepends=True)
    k = next(i for i, line in enumerate(lines) if '"kind":"item"' in line)
    lines[k] = lines[k].replace('"correct":false', '"correct":true', 1)
    assert lines[k] != (run_a / "ledger.jsonl").read_text().splitlines(keepends=True)[k]
    (edited / "ledger.jsonl").write_text("".join(lines))
    _one_error_line(_compare(edited, run_again, tmp_path / "cmp"), f"{edited}'s ledger is broken",
                    f"stagereplay audit {edited} --verify-only")
    # A careful forger rechains it, but a claim (the suffix's fingerprint) no longer follows.
    claims = root / "claims"
    shutil.copytree(run_a, claims)
    chain, manifest = load(claims)
    i = next(k for k, r in enumerate(chain) if r.kind == "item")
    payload = edit(chain[i])
    payload["arms"][0]["suffix_ids"][0] += 1
    chain[i] = with_payload(chain[i], payload, recompare=False)
    save(claims, chain, manifest)
    _one_error_line(_compare(run_again, claims, tmp_path / "cmp"), f"{claims}'s records do not verify", "suffix_fp")


def test_what_differs_between_the_manifests_is_named(run_a, run_again, root, tmp_path):
    fp32 = _matched(root / "fp32", "--precision", "fp32")
    c, printed = _compared(run_a, fp32, tmp_path / "cmp")
    settings = {x["field"]: (x["a"], x["b"]) for x in c["differences"]["settings"]}
    assert settings == {"config.model.precision": ("bf16", "fp32")}
    assert "config.model.precision" in printed and "config.model.precision" in (tmp_path / "cmp" / "compare.md"
                                                                                  ).read_text()
    assert c["runs"]["a"]["precision"] == "bf16" and c["runs"]["b"]["precision"] == "fp32"
    # Negative control: the replica differs in no setting.
    same, _ = _compared(run_a, run_again, tmp_path / "same")
    assert same["differences"]["settings"] == []


def test_compare_json_reads_back_as_its_model_and_writes_the_same_bytes(run_a, forged, tmp_path):
    """compare.json is a versioned model: read back, it writes the bytes it was read from (a divergent item, its
    margins and top candidates included); another schema version is refused by name (control: this one reads)."""
    _compared(run_a, forged[0], tmp_path / "cmp")
    path = tmp_path / "cmp" / "compare.json"
    document = read_compare(path)
    assert document.write() == path.read_text() and document.schema_version == COMPARE_VERSION
    assert document.trajectories.first_divergence_in.suffix == 1
    newer = tmp_path / "newer.json"
    newer.write_text(path.read_text().replace(f'"schema_version": {COMPARE_VERSION}', '"schema_version": 99', 1))
    with pytest.raises(StageReplayError, match="schema_version 99, not this stagereplay's"):
        read_compare(newer)


def test_without_out_the_comparison_is_written_beside_run_a(run_a, run_again, tmp_path):
    """No --out: the three files go into `<A>-vs-<B>` in A's folder, and the command says where, --quiet or not.
    The control: a file already lying there is refused in one line, and nothing is written."""
    a, b = tmp_path / "runs" / "bf16", tmp_path / "runs" / "again"
    shutil.copytree(run_a, a)
    shutil.copytree(run_again, b)
    result = runner.invoke(app, ["compare", str(a), str(b), "--quiet"])
    assert result.exit_code == 0, (result.output, result.exception)
    folder = tmp_path / "runs" / "bf16-vs-again"
    assert sorted(p.name for p in folder.iterdir()) == ["compare.html", "compare.json", "compare.md"]
    assert result.stdout.startswith("wrote ") and str(folder / "compare.json") in result.stdout
    assert "no --out given" in result.stdout
    shutil.rmtree(folder)
    folder.write_text("not a folder")
    line = _one_error_line(runner.invoke(app, ["compare", str(a), str(b)]), "exists and is not a directory",
                           "pass --out")
    assert str(folder) in line and folder.read_text() == "not a folder"


# -- the margin at a divergence, from the field that reaches its step (synthetic records) --------------------------


def _payload(stage1: list[int], suffix: list[int], live: dict | None = None, **extra) -> MatchedPayload:
    """A matched record of one live arm (the fields compare reads; the rest any valid value)."""
    arm = {"name": "live", "construction": "live", "precision": "bf16", "suffix_ids": suffix, "suffix_fp": "0" * 64,
           "cache_fp": None, "stop": "length", "text": "", "correct": False, **(live or {})}
    return MatchedPayload.model_validate({
        "status": "ok", "prompt_ids": [1, 2], "prefix_ids": [1, 2, *stage1], "boundary": 2 + len(stage1),
        "answer": "0", "replica_prefix_equal": True, "arms": [arm], "comparisons": [], **extra})


def _divergence(a: MatchedPayload, b: MatchedPayload) -> dict | None:
    """The item's first divergence as compare.json holds it."""
    return compare_item("x", a, b).as_json()["first_divergence"]


def test_a_stage1_margin_comes_from_stage1_top_or_is_not_recorded():
    top = [[[10, -0.1], [11, -2.1]], [[12, -0.5], [13, -0.75]]]
    d = _divergence(_payload([10, 12], [7], stage1_top=top), _payload([10, 13], [7]))
    assert d["in"] == "stage 1" and d["position"] == 1 and d["a"]["step"] == 1
    assert d["a"]["margin"] == 0.25 and d["a"]["top"] == top[1] and d["a"]["recorded"] == "stage1_top"
    assert d["b"]["margin"] is None and d["b"]["top"] is None and d["b"]["recorded"] is None  # an older record


def test_a_suffix_margin_comes_from_a_servers_top_logprobs_or_our_margins():
    served = _payload([5], [7, 8], live={"top_logprobs": [[[7, -0.1], [9, -3.1]], [[8, -1.0], [6, -1.5]]]})
    ours = _payload([5], [7, 6], diagnostics={"margins": {"live": [2.0, 0.125]}, "pairs": {}})
    d = _divergence(served, ours)
    assert d["in"] == "suffix" and d["position"] == 2 and d["a"]["step"] == d["b"]["step"] == 1
    assert d["a"]["margin"] == 0.5 and d["a"]["recorded"] == "top_logprobs"
    assert d["b"]["margin"] == 0.125 and d["b"]["top"] is None and d["b"]["recorded"] == "margins"
    bare = _divergence(_payload([5], [7, 8]), ours)
    assert bare["a"]["margin"] is None and bare["a"]["recorded"] is None
    assert _divergence(ours, ours) is None


def test_a_servers_settings_kernels_and_locations_are_told_apart():
    """Synthetic manifests of two server runs: an engine option and the server's cache type are settings and server
    fields; the URL and the model's path are locations; the server's instance (its task counter) is none of them."""
    from stagereplay.experiments.core.compare_manifests import RunSide, manifest_differences
    from stagereplay.records.manifest import Manifest

    def manifest(url: str, cache: str, tasks: int, threads: int) -> Manifest:
        engine = {"name": "http", "seed": 0, "url": url, "concurrency": 4}
        server = {"engine": "http", "url": url, "server": {"server": "llama-server", "build": "b1", "n_ctx": 4096,
                                                           "model_path": f"/{url[-4:]}/m.gguf", "cache_type_k": cache},
                  "checked": {"greedy": True, "instance": {"tasks": tasks}}}
        env = {"device": "cpu", "machine": "x86_64", "packages": {"torch": "2"},
               "determinism": {"threads": threads}, "engine": server}
        model = {"path": f"/{url[-4:]}", "precision": "bf16"}
        settings = {"boundary": "after:4", "decode": {"max_new_tokens": 8}, "scorer": "last-number"}
        return Manifest.model_validate({
            "schema_version": 2, "config": {"model": model, "engine": engine, "item_ids": ["q1"], "data": {},
                                            "settings": settings, "dataset_hash": "h", "model_hashes": {}},
            "stages": {"matched/primary": {"model": model, "settings": settings, "engine": engine,
                                           "arms": ["oneshot", "prefix-cache"]}},
            "environment": env})

    a = RunSide(Path("a"), manifest("http://h:8080", "f16", 10, 1), [])
    b = RunSide(Path("b"), manifest("http://h:8081", "q8_0", 99, 2), [])
    d = manifest_differences(a, b, "primary", "matched")
    named = {g: [x.field for x in d.group(g)] for g in ("settings", "server", "kernels", "environment", "locations")}
    assert named["server"] == ["environment.engine.server.cache_type_k"]
    assert named["locations"] == ["config.engine.url", "config.model.path", "environment.engine.server.model_path",
                                  "environment.engine.url"]
    assert named["kernels"] == ["threads"] and named["settings"] == [] and named["environment"] == []
    assert not manifest_differences(a, a, "primary", "matched").server  # negative control
