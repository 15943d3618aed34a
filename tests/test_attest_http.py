"""`attest --engine http --url URL` on the fake of llama-server's API (tests/servers.py), for what does not need a
real server: the served part is asked of the server and recorded with its identity, every reading command reads such
a run, and a server the run could not trust, or options a server run does not use, are refused in one line before
anything is written. The real llama-server, honest and substituted, is tests/test_attest_server.py."""

from __future__ import annotations

import json

import pytest
from fake_server import fake_server
from typer.testing import CliRunner, Result

from stagereplay.cli import app
from stagereplay.engine.model import load_config_and_tokenizer
from stagereplay.errors import StageReplayError
from stagereplay.experiments.attest.item import AttestParams
from stagereplay.experiments.attest.served import ServedAttestParams, served_params, token_ids
from stagereplay.experiments.core import registry
from stagereplay.records import arrays
from stagereplay.records.ledger import items, read_ledger
from stagereplay.serving.arms import ServingArms
from stagereplay.serving.engines import engine_config
from stagereplay.serving.seam import SEED_SPAN, Generation
from stagereplay.toy import toy_checkpoint

runner = CliRunner()
SMALL = ["attest", "--n", "3", "--max-new-tokens", "4", "--honest", "bf16,fp32", "--quiet"]


def _invoke(args: list[str]) -> Result:
    return runner.invoke(app, args, env={"COLUMNS": "80"})


@pytest.fixture(scope="module")
def tokenizer():
    return load_config_and_tokenizer(str(toy_checkpoint("primary")))[1]


@pytest.fixture(scope="module")
def served(tokenizer, tmp_path_factory: pytest.TempPathFactory):
    """An attest run against the well-behaved fake, kept serving for the module (the audit asks it again)."""
    root = tmp_path_factory.mktemp("attest-http")
    with fake_server(tokenizer) as (url, fake):
        run = root / "run"
        result = _invoke([*SMALL, "--engine", "http", "--url", url, "--out", str(run)])
        yield run, url, fake, result, root


def test_the_served_part_is_asked_of_the_server_and_recorded_with_its_identity(served):
    """Part '' of each item holds the server's reply (the fake's tokens, its log-probabilities), at most
    --max-new-tokens, and the manifest holds the server's identity and the checks it passed. The fake's tokens are
    not the toy's, so a statistic exceeds the null; three prompts cannot support the level, so the run reads
    inconclusive (exit 3), never flagged."""
    run, url, fake, result, _ = served
    assert result.exit_code == 3, result.output
    section = json.loads((run / "results.json").read_text())["attest"][0]
    assert section["outcome"] == "inconclusive" and "too few" in [b["kind"] for b in section["blockers"]], section
    records = [r for r in items(read_ledger(run)) if r.experiment == "attest"]
    parts = [r for r in records if r.part == ""]
    assert len(parts) == 3
    for r in parts:
        p = r.payload
        last, expected = p["prompt_ids"][-1], []
        for _ in range(4):  # the fake's greedy rule: each token (last * 7 + 3) mod V
            last = (last * 7 + 3) % len(fake.tokenizer)
            expected.append(last)
        assert p["source"] == "server" and p["response_ids"] == expected, p
        assert list(arrays.decode(p["logprobs"])) == pytest.approx([-0.1] * 4)
    assert all(n == 4 for _, n in fake.asked[-3:])
    manifest = json.loads((run / "manifest.json").read_text())
    stage = manifest["stages"]["attest/primary"]
    assert stage["source"] == "server" and stage["engine"]["url"] == url and stage["cross"] == "hf"
    config = manifest["config"]  # the run's identity: the server's outputs, no simulated setting
    assert config["source"] == "server" and not any(k.startswith("served_") for k in config), config
    engine = manifest["environment"]["engine"]
    assert engine["server"]["build"] == "fake-1" and engine["checked"]["verbatim_ids"] is True
    reference = next(r for r in records if r.part == "reference")
    served_side = next(a for a in reference.payload["arms"] if a["name"] == "served")
    assert served_side["engine"] == "http" and served_side["response_ids"] == reference.payload["arms"][0][
        "response_ids"]
    assert "a running server (http" in (run / "report.md").read_text()


def test_every_reading_command_reads_a_server_run(served):
    """export, show, report, verify, the audit (which asks the server again), compare and plan, as
    tests/test_every_command.py runs them on every experiment."""
    from test_every_command import problems, read_all

    run, _, _, _, root = served
    work = root / "read"
    work.mkdir()
    read = read_all(run, run, work)
    assert problems(registry.experiment("attest"), read) == []
    assert "every record reproduced" in read.outputs["audit"].output, read.outputs["audit"].output


def test_the_audit_finds_a_server_that_serves_otherwise_now(served, tokenizer):
    """The control of the audit above: the run audited against a server (`--url`) that never emits the tokens the
    first one served first (greedy still, so it passes the check) reproduces no served part."""
    run, _, _, _, _ = served
    first = {r.payload["response_ids"][0] for r in items(read_ledger(run)) if r.experiment == "attest" and not r.part}
    with fake_server(tokenizer, avoid=tuple(first)) as (other, _):
        relocated = _invoke(["audit", str(run), "--url", other, "--quiet"])
    assert relocated.exit_code != 0 and "every record reproduced" not in relocated.output, relocated.output


@pytest.mark.parametrize(("mode", "says"), [
    ("refuse-ids", "refused our request to /completion"),
    ("as-text", "does not take token IDs verbatim"),
    ("sampling", "is not greedy at temperature 0"),
    ("no-logprobs", "returned no top-5 logprobs"),
])
def test_a_server_the_run_cannot_trust_is_refused_in_one_line_and_nothing_is_written(tokenizer, tmp_path, mode,
                                                                                    says):
    """The control is the well-behaved fake's run above."""
    out = tmp_path / "never"
    with fake_server(tokenizer, mode) as (url, _):
        result = _invoke([*SMALL, "--engine", "http", "--url", url, "--out", str(out)])
    assert result.exit_code == 2 and says in result.output, result.output
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output, result.output
    assert not out.exists()


def test_options_a_server_run_does_not_use_are_refused_in_one_line(tokenizer, tmp_path):
    served_file = tmp_path / "served.jsonl"
    served_file.write_text("".join(json.dumps({"prompt_ids": [1, 2], "response_ids": [3]}) + "\n" for _ in range(2)))
    out = tmp_path / "never"
    with fake_server(tokenizer) as (url, fake):
        server = ["--engine", "http", "--url", url]
        cases = {
            "--engine http needs the server's address": ["--engine", "http"],
            "--served gives the served outputs, and --engine http asks a server": [*server, "--served",
                                                                                   str(served_file)],
            "--served-precision simulate a server": [*server, "--served-precision", "fp32"],
            "--served-checkpoint simulate a server": [*server, "--served-checkpoint", "later"],
            "the slot-restore arms": [*server, "--slot-restore"],
            "live@load": [*server, "--concurrency", "2"],
            "a seeded claim (--sample) cannot be checked here: llama-server draws": [*server, "--sample",
                                                                                    "--temperature", "0.8"],
            "--url is an option of a serving engine": ["--url", url],
        }
        for says, args in cases.items():
            result = _invoke(["attest", "--n", "2", "--quiet", *args, "--out", str(out)])
            assert result.exit_code == 2 and says in result.output, (args, result.output)
            assert result.output.strip().count("\n") == 0, result.output
        assert fake.requests == 0  # each refused before the check's first probe
    assert not out.exists()


def test_a_reply_that_is_not_token_ids_of_the_claimed_tokenizer_is_refused():
    """The control: a reply of token IDs in range passes as it is."""
    ok = Generation((5, 6), ((), ()), None, "length")
    assert token_ids(ok, 10, "the server") == [5, 6]
    for reply, says in ((Generation((), (), None, "length"), "returned no token IDs"),
                        (Generation((5, 10), ((), ()), None, "length"), "returned 10, not a token ID")):
        with pytest.raises(StageReplayError) as refused:
            token_ids(reply, 10, "the server")
        assert says in str(refused.value) and "\n" not in str(refused.value) and refused.value.fix


def test_every_part_of_a_server_run_draws_with_the_seed_the_server_takes():
    """A seeded claim's seed is folded below the server's span for every part (the reference replays the seed the
    server drew with); part '' alone is asked of the server."""
    arms = ServingArms(engine_config("http", {"url": "http://127.0.0.1:1"}), "hf")
    for which in ("", "bf16", "reference"):
        wrapped = served_params(AttestParams(which, "server"), arms)
        params = wrapped.attest if isinstance(wrapped, ServedAttestParams) else wrapped
        assert isinstance(wrapped, ServedAttestParams) == (which == "")
        assert isinstance(params, AttestParams) and params.seed_span == SEED_SPAN


def test_a_plan_leaves_the_servers_forwards_out():
    """Priced before it runs: a server's responses are its own forwards (the served row has none), a simulated
    server's are ours; every other row is the same."""
    args = ["attest", "--n", "3", "--max-new-tokens", "6", "--honest", "bf16,bf16/chunked:8", "--plan"]
    asked = runner.invoke(app, [*args, "--engine", "http", "--url", "http://127.0.0.1:9"], env={"COLUMNS": "150"})
    simulated = runner.invoke(app, args, env={"COLUMNS": "150"})
    assert asked.exit_code == 0 and simulated.exit_code == 0, asked.output + simulated.output

    def rows(output: str) -> dict[str, list[str]]:
        return {line.split()[0]: line.split()[1:] for line in output.splitlines() if line.startswith("attest/")}

    mine, theirs = rows(simulated.output), rows(asked.output)
    assert theirs["attest/primary"][2] == "0" and int(mine["attest/primary"][2]) > 0
    assert {k: v for k, v in theirs.items() if k != "attest/primary"} == {
        k: v for k, v in mine.items() if k != "attest/primary"}
    assert "attest/primary@bf16/chunked:8" in theirs


def test_a_trusted_deployment_joins_the_null_as_an_honest_variant(tokenizer, tmp_path):
    """`--honest-url URL` adds honest variant `url`: each prompt asked of the deployment (here the fake, whose tokens
    are not the toy's), its reply recorded as that part, scored by the reference and counted in the null, and the
    deployment's engine (the fake says llama-server) recorded as the variant's. The control is the same run without
    it: no `url` part, and the null holds our engine alone."""
    with fake_server(tokenizer) as (url, fake):
        run = tmp_path / "run"
        result = _invoke([*SMALL, "--honest-url", url, "--out", str(run)])
    assert result.exit_code == 0, result.output  # the served toy within a null the fake's tokens widen
    stage = json.loads((run / "manifest.json").read_text())["stages"]["attest/primary"]
    assert stage["honest"] == ["bf16", "fp32", "url"] and stage["honest_urls"] == [url], stage
    assert stage["honest_engines"] == {"url": "llama.cpp"}, stage
    deployed = {r.item_id: r.payload for r in items(read_ledger(run)) if r.experiment == "attest" and r.part == "url"}
    assert len(deployed) == 3 and all(p["response_ids"] == fake.generate(p["prompt_ids"], 4) for p in deployed.values())
    section = json.loads((run / "results.json").read_text())["attest"][0]
    assert section["null_engines"] == ["hf", "llama.cpp"], section
    without = tmp_path / "without"
    assert _invoke([*SMALL, "--out", str(without)]).exit_code == 0
    assert json.loads((without / "results.json").read_text())["attest"][0]["null_engines"] == ["hf"]
    assert not [r for r in items(read_ledger(without)) if r.part == "url"]


@pytest.mark.parametrize(("args", "said"), [
    (["--honest-url", "http://user:secret@127.0.0.1:9"], "holds credentials"),
    (["--honest-url", "127.0.0.1:9"], "is not a server's address"),
    (["--honest", "bf16,url/2", "--honest-url", "http://127.0.0.1:9"], "--honest-url names 1"),
    (["--honest", "bf16,url/x", "--honest-url", "http://127.0.0.1:9"], "unknown honest variant 'url/x'"),
    (["--honest-url", "http://127.0.0.1:9"], "did not answer"),
])
def test_a_deployment_the_run_cannot_ask_is_refused_in_one_line_and_nothing_is_written(tmp_path, args, said):
    run = tmp_path / "run"
    result = _invoke([*SMALL, *args, "--out", str(run)])
    assert result.exit_code == 2 and said in result.output, result.output
    assert "Traceback" not in result.output and not run.exists()
    assert "secret" not in result.output


def test_a_deployment_without_log_probabilities_is_refused_in_one_line(tokenizer, tmp_path):
    with fake_server(tokenizer, "no-logprobs") as (url, _):
        run = tmp_path / "run"
        result = _invoke([*SMALL, "--honest-url", url, "--out", str(run)])
    assert result.exit_code == 2 and "logprobs" in result.output, result.output
    assert "Traceback" not in result.output
