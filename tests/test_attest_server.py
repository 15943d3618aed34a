"""`attest --engine http --url URL` against a real llama-server (the build .ci/llamacpp.sh makes) serving the toy as
a GGUF file, claimed as that GGUF (so served by llama.cpp: the null holds llama.cpp's own variants, in process, beside
our fp32 decode): serving the claimed weights (the primary checkpoint in f32) it is consistent; serving other weights
(the later checkpoint) on the same prompts it is flagged, each decided against the same honest floor measured here.
The server's identity is recorded as mismatch's http runs record it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from servers import llama_server
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.records.ledger import items, read_ledger

pytestmark = pytest.mark.server
runner = CliRunner()
ARGS = ["attest", "--n", "20", "--max-new-tokens", "16", "--quiet"]


def _attest(checkpoint: str, root: Path) -> tuple[int, Path, str]:
    """An attest run of the claimed toy (primary) against llama-server serving `checkpoint` as an f32 GGUF."""
    from gguf_files import write_toy_gguf

    claimed = root / "toy-primary.gguf"
    if not claimed.exists():
        write_toy_gguf(claimed, "primary")
    model = claimed if checkpoint == "primary" else write_toy_gguf(root / f"toy-{checkpoint}.gguf", checkpoint)
    run = root / f"run-{checkpoint}"
    with llama_server(model, root / f"{checkpoint}.log") as server:
        result = runner.invoke(app, [*ARGS, "--model", str(claimed), "--engine", "http", "--url", server.url,
                                     "--out", str(run)])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, run, server.url


def _section(run: Path) -> dict:
    return json.loads((run / "results.json").read_text())["attest"][0]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attest-server")


def test_an_honest_llama_server_is_not_flagged_and_its_identity_is_recorded(root: Path):
    code, run, url = _attest("primary", root)
    s = _section(run)
    assert code == 0 and s["outcome"] == "consistent", s
    assert s["claim_engine"] == "llama.cpp" and "llama.cpp" in s["null_engines"], s
    manifest = json.loads((run / "manifest.json").read_text())
    engine = manifest["environment"]["engine"]
    assert engine["api"] == "llama-server" and engine["server"]["server"] == "llama-server", engine
    assert engine["checked"]["verbatim_ids"] and engine["checked"]["greedy"], engine
    assert manifest["stages"]["attest/primary"]["engine"]["url"] == url
    served = [r.payload for r in items(read_ledger(run)) if r.experiment == "attest" and r.part == ""]
    assert len(served) == 20 and all(p["source"] == "server" and p["logprobs"] for p in served)


def test_a_llama_server_serving_other_weights_is_flagged(root: Path):
    """The control of the test above: the same prompts, the same claim, the server running the later checkpoint."""
    code, run, _ = _attest("later", root)
    s = _section(run)
    assert code == 1 and s["outcome"] == "flagged", s


def test_llama_cpp_in_process_serving_the_claimed_file_is_consistent(root: Path):
    """`--engine llama.cpp` serves the claim in process: its own arms (state restore, matched's) are no option of the
    run's, so attest takes it, and the claimed file served by llama.cpp is consistent with its own null."""
    from gguf_files import write_toy_gguf

    claimed = root / "toy-primary.gguf"
    if not claimed.exists():
        write_toy_gguf(claimed, "primary")
    run = root / "run-in-process"
    result = runner.invoke(app, [*ARGS, "--model", str(claimed), "--engine", "llama.cpp", "--out", str(run)])
    assert result.exit_code == 0 and _section(run)["outcome"] == "consistent", result.output


def test_a_trusted_llama_server_in_the_null_makes_the_claim_of_its_engine_decidable(root: Path):
    """`--honest-url`: the claim names llama.cpp, and the null holds our fp32 decode alone (no llama.cpp in process):
    the later checkpoint's server exceeds that null, and the run cannot say No (inconclusive: the null misses the
    claim's engine). With the claimed file's own llama-server as a trusted deployment in the null (variant `url`,
    its engine llama.cpp as the server says), the same served run is flagged."""
    from gguf_files import write_toy_gguf

    claimed = root / "toy-primary.gguf"
    if not claimed.exists():
        write_toy_gguf(claimed, "primary")
    later = root / "toy-later.gguf"
    if not later.exists():
        write_toy_gguf(later, "later")
    args = [*ARGS, "--model", str(claimed), "--honest", "fp32", "--claim-engine", "llama.cpp"]
    with llama_server(later, root / "later-served.log") as served, \
            llama_server(claimed, root / "trusted.log") as trusted:
        alone = runner.invoke(app, [*args, "--engine", "http", "--url", served.url, "--out", str(root / "alone")])
        joined = runner.invoke(app, [*args, "--engine", "http", "--url", served.url, "--honest-url", trusted.url,
                                     "--out", str(root / "joined")])
    assert alone.exit_code == 3 and _section(root / "alone")["null_engines"] == ["hf"], alone.output
    assert "engine" in [b["kind"] for b in _section(root / "alone")["blockers"]]
    s = _section(root / "joined")
    assert joined.exit_code == 1 and s["outcome"] == "flagged", joined.output
    assert s["null_engines"] == ["hf", "llama.cpp"], s
    stage = json.loads((root / "joined" / "manifest.json").read_text())["stages"]["attest/primary"]
    assert stage["honest"] == ["fp32", "url"] and stage["honest_urls"] == [trusted.url], stage
