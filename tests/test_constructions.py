"""The constructions engines call lossless, on our engine, on the embedded toy: several fresh constructions in one
run, live's K/V sent through fp8 and int8 and back at the boundary, live built by transformers' own generate() with
speculation or a quantized cache, and a static cache's allocated length as a setting. Each property with a negative
control. What these settings do to the toy's numbers is reported by the runs (docs/how-to/lossless.md), not
asserted here, except where a property must hold whatever the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stagereplay.cli import app

runner = CliRunner()


def _run(out: Path, *args: str) -> list[dict]:
    result = runner.invoke(app, ["matched", "--n", "3", "--precision", "fp32", "--max-new-tokens", "24", "--quiet",
                                 "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    return [r["payload"] for r in lines if r["kind"] == "item"]


def _arms(payload: dict) -> dict[str, dict]:
    return {a["name"]: a for a in payload["arms"]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[dict]:
    return _run(tmp_path_factory.mktemp("plain") / "run")


def test_several_constructions_in_one_run_each_set_against_live_and_audited(tmp_path):
    out = tmp_path / "run"
    payloads = _run(out, "--construction", "oneshot,chunked:4,roundtrip:int8")
    for p in payloads:
        assert {"live", "live#replica", "oneshot", "oneshot#replica", "chunked:4", "chunked:4#replica",
                "roundtrip:int8", "roundtrip:int8#replica"} == set(_arms(p))
        pairs = {(c["a"], c["b"]) for c in p["comparisons"]}
        assert {("live", "oneshot"), ("live", "chunked:4"), ("live", "roundtrip:int8")} <= pairs
    results = json.loads((out / "results.json").read_text())
    assert [m["construction"] for m in results["matched"]] == ["oneshot", "chunked:4", "roundtrip:int8"]
    audit = runner.invoke(app, ["audit", str(out), "--quiet"])
    assert audit.exit_code == 0, audit.output
    twice = runner.invoke(app, ["matched", "--construction", "oneshot,oneshot", "--out", str(tmp_path / "x")])
    assert twice.exit_code == 2 and "names a construction twice" in twice.stderr  # the control: refused


def test_a_round_trip_changes_the_cache_and_a_representable_cache_comes_back_unchanged():
    """fp8 and int8 must change live's K/V (their fingerprints differ from live's), and a tensor whose values the
    format holds exactly must come back bit for bit (the control: the round trip is a round trip, not noise)."""
    import torch

    from stagereplay.engine.kv_roundtrip import roundtrip_tensor

    exact = torch.tensor([[0.0, 1.0, -2.0, 0.5, 4.0, -0.25, 8.0, 16.0]])
    for fmt in ("fp8-e4m3", "fp8-e5m2"):
        assert torch.equal(roundtrip_tensor(exact, fmt), exact)
    blocks = torch.tensor([[127.0, -64.0, 1.0, 0.0] * 8])  # multiples of the block's scale (1)
    assert torch.equal(roundtrip_tensor(blocks, "int8"), blocks)
    rough = torch.randn(2, 3, 5, 64, generator=torch.Generator().manual_seed(0))
    for fmt in ("fp8-e4m3", "fp8-e5m2", "int8"):
        back = roundtrip_tensor(rough, fmt)
        assert back.shape == rough.shape and back.dtype == rough.dtype and not torch.equal(back, rough)
    assert float((roundtrip_tensor(rough, "int8") - rough).abs().max()) < float(
        (roundtrip_tensor(rough, "fp8-e5m2") - rough).abs().max())  # int8 blocks keep more than e5m2's 2 bits


def test_a_round_trip_construction_continues_from_lives_cache_changed(tmp_path, plain):
    payloads = _run(tmp_path / "run", "--construction", "roundtrip:fp8-e5m2")
    for p, q in zip(payloads, plain, strict=True):
        arms = _arms(p)
        assert arms["roundtrip:fp8-e5m2"]["cache_fp"] != arms["live"]["cache_fp"]
        assert arms["roundtrip:fp8-e5m2"]["cache_fp"] == arms["roundtrip:fp8-e5m2#replica"]["cache_fp"]
        assert arms["live"] == _arms(q)["live"]  # live itself is the plain run's: the construction is the change


def test_speculation_records_the_tokens_its_steps_accepted(tmp_path, plain):
    """The model as its own draft: every candidate is accepted, so steps add several tokens; generate() ran, and
    live is still the greedy trajectory's tokens (fp32 on the toy). The control: a quantized cache without
    speculation adds one token per step."""
    payloads = _run(tmp_path / "self", "--speculate", "self")
    for p, q in zip(payloads, plain, strict=True):
        live = _arms(p)["live"]
        assert live["generated"]["speculate"] == "self" and max(live["generated"]["added"]) > 1
        assert sum(live["generated"]["added"]) >= len(p["prefix_ids"]) - len(p["prompt_ids"]) + len(
            live["suffix_ids"])
        assert live["cache_fp"] is not None and len(p["stage1_top"]) == len(p["prefix_ids"]) - len(p["prompt_ids"])
        assert p["prefix_ids"] == q["prefix_ids"] and live["suffix_ids"] == _arms(q)["live"]["suffix_ids"]
    lookup = _run(tmp_path / "lookup", "--speculate", "prompt-lookup:4", "--n", "1")
    assert all(_arms(p)["live"]["generated"]["added"][0] == 1 for p in lookup)  # the prefill's one token
    quantized = _run(tmp_path / "fp8", "--quantized-cache", "fp8", "--n", "1")
    assert len(lookup) == len(quantized) == 1 and all(set(_arms(p)["live"]["generated"]["added"]) == {1} for p in quantized)
    audit = runner.invoke(app, ["audit", str(tmp_path / "self"), "--quiet"])
    assert audit.exit_code == 0, audit.output


@pytest.fixture
def quanto_python_unpack(monkeypatch):
    """quanto's own Python kernel of `quanto::unpack` (its default, registered beside the CPU one) unpacks its 2-bit
    K/V on the CPU, in place of its C++ extension: the same integer ops (masks and shifts), but the extension is
    compiled at its first use, minutes on two cores."""
    from types import SimpleNamespace

    import torch
    from optimum.quanto.library.extensions import cpp

    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    calls = []

    def counted(packed, bits):
        calls.append(bits)
        return torch.ops.quanto.unpack.default.redispatch(default, packed, bits)

    monkeypatch.setattr(cpp.ext, "_lib", SimpleNamespace(unpack=counted))
    return calls


def test_a_two_bit_cache_moves_the_continuation_and_its_replica_stays_exact(tmp_path, plain, quanto_python_unpack):
    """quanto's 2-bit cache must change the toy's continuation on some item (its K/V keeps 4 levels), while its own
    replica is exact (the control: the difference is the cache's, not noise). Its state holds no plain K/V."""
    payloads = _run(tmp_path / "run", "--quantized-cache", "quanto:2")
    moved = 0
    for p, q in zip(payloads, plain, strict=True):
        arms = _arms(p)
        live, again = arms["live"], arms["live#replica"]
        assert live["cache_fp"] is None and live["generated"]["cache"] == "quanto:2"
        assert live["suffix_ids"] == again["suffix_ids"]
        trajectory = p["prefix_ids"] + live["suffix_ids"]
        moved += trajectory != q["prefix_ids"] + _arms(q)["live"]["suffix_ids"]
    assert moved > 0
    assert set(quanto_python_unpack) == {2}  # its K/V was unpacked, by the kernel put in place of the extension


def test_what_generate_cannot_run_is_refused_in_one_line(tmp_path):
    for args, says in ((["--speculate", "draft:" + str(tmp_path)], "no draft model at"),
                       (["--speculate", "prompt-lookup:0"], "unknown --speculate"),
                       (["--quantized-cache", "quanto:8"], "unknown --quantized-cache"),
                       (["--speculate", "self", "--cache", "static"], "runs on a dynamic cache"),
                       (["--speculate", "self", "--batch", "2"], "one item at a time")):
        result = runner.invoke(app, ["matched", "--n", "1", "--out", str(tmp_path / "run"), *args])
        assert result.exit_code == 2 and says in result.stderr, (args, result.stderr)
        assert not (tmp_path / "run").exists()


def test_a_static_caches_allocated_length_is_a_recorded_setting(tmp_path):
    """`--static-len` allocates more positions than the items need and is recorded in the model settings; the
    default records nothing new (the control), and fewer positions than an item needs are never allocated."""
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig

    _run(tmp_path / "long", "--cache", "static", "--static-len", "600", "--n", "1")  # a setting: one item shows it
    _run(tmp_path / "default", "--cache", "static", "--n", "1")
    model = {name: json.loads((tmp_path / name / "manifest.json").read_text())["config"]["model"]
             for name in ("long", "default")}
    assert model["long"]["static_len"] == 600 and "static_len" not in model["default"]
    from stagereplay.toy import toy_checkpoint

    dc = DecodeConfig(max_new_tokens=16, max_stage1_tokens=32)
    for static_len, allocated in ((8, 50 + 32 + 16 - 1), (600, 600)):
        config = ModelConfig(str(toy_checkpoint("primary")), "fp32", cache="static", static_len=static_len)
        assert LM.cache_len(_Shell(config), 50, dc) == allocated  # never fewer than the item needs


class _Shell:
    """What `LM.cache_len` reads of a model: its settings and context."""

    def __init__(self, config) -> None:
        self.config, self.context = config, 512
