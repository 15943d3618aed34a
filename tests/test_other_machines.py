"""A run checked on another machine: inputs that moved (`--model`, `--later-model`, `--data`, checked against the
bound hashes), and an audit that compares the kernels each record was computed under with its own before it
re-executes, so that a unit not reproduced under other kernels is told apart from an integrity finding.

Other kernels are made on this machine, whatever its CPU: a worker started with `ATEN_CPU_CAPABILITY=default`
runs ATen's scalar kernels instead of its vectorised ones (AVX2 or AVX-512) and records that in its environment.
That stands for a run made on another CPU. Whether its bf16 bits differ from this process's is the kernels'
affair (they did on the CPUs tried); where a test needs a unit that is not reproduced, it forges a token, which
no kernels reproduce.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from forge import edit, load, save, with_payload
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.records.kernels import describe, kernel_differences

runner = CliRunner()
SCALAR = {"ATEN_CPU_CAPABILITY": "default"}


def _env(capability: str = "AVX512", threads: int = 1, **extra) -> dict:
    return {"device": "cpu", "machine": "x86_64", "python": "3.11.7", "git": {"commit": "a"},
            "packages": {"torch": "2.13.0+cpu", "transformers": "5.24.0"},
            "determinism": {"threads": threads, "deterministic_algorithms": True},
            "kernels": {"cpu": {"capability": capability, "features": {"avx2": True, "avx512": True},
                                "mkldnn_enabled": True, "env": {"ATEN_CPU_CAPABILITY": None}}}, **extra}


# -- which fields choose kernels -------------------------------------------------------------------------------


def test_kernel_fields_name_what_differs_with_both_values():
    assert kernel_differences(_env(), _env()) == []
    differ = kernel_differences(_env("AVX512", threads=1), _env("AVX2", threads=2))
    assert differ == [("threads", 1, 2), ("ISA", "AVX512", "AVX2")]
    assert describe(differ) == "threads 1 (run) vs 2 (here); ISA AVX512 (run) vs AVX2 (here)"


def test_fields_that_choose_no_kernel_are_not_differences():
    """Negative control: another commit, Python or platform string is the same kernels."""
    other = _env(python="3.12.1", git={"commit": "b"}, platform="another")
    assert kernel_differences(_env(), other) == []


def test_a_field_an_older_run_did_not_record_counts_as_differing():
    old = _env()
    del old["kernels"]["cpu"]["features"]
    assert [d[0] for d in kernel_differences(old, _env())] == ["CPU features"]


def test_an_unset_cap_is_no_cap_whether_or_not_it_was_listed():
    listed = _env()
    listed["kernels"]["cpu"]["env"]["MKL_CBWR"] = None
    assert kernel_differences(listed, _env()) == []
    capped = _env()
    capped["kernels"]["cpu"]["env"]["MKL_CBWR"] = "AVX2"
    assert [d[0] for d in kernel_differences(capped, _env())] == ["kernel caps"]


def test_gpu_runs_compare_the_gpu_not_the_cpu():
    a = {**_env(capability="AVX2"), "device": "cuda:0", "gpu": "NVIDIA H200", "cuda": "12.8"}
    b = {**_env(capability="AVX512"), "device": "cuda:1", "gpu": "NVIDIA H100", "cuda": "12.8"}
    assert kernel_differences(a, b) == [("GPU", "NVIDIA H200", "NVIDIA H100")]


# -- a run made under other kernels ----------------------------------------------------------------------------


def _matched(out: Path, model: Path, items: Path, precision: str = "bf16", env: dict | None = None) -> None:
    """`stagereplay matched` in a fresh process, under `env` added to this one's."""
    args = [sys.executable, "-m", "stagereplay.cli", "matched", "--model", str(model), "--data", str(items),
            "--n", "6", "--boundary-after", "12", "--max-new-tokens", "24", "--precision", precision,
            "--quiet", "--out", str(out)]
    done = subprocess.run(args, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def scalar_runs(tmp_path_factory, tiny_dir, items_file) -> dict[str, Path]:
    """The same matched command under scalar kernels (bf16 and fp32) and under this process's (bf16)."""
    root = tmp_path_factory.mktemp("other-kernels")
    runs = {"scalar-bf16": root / "scalar-bf16", "scalar-fp32": root / "scalar-fp32", "here-bf16": root / "here"}
    _matched(runs["scalar-bf16"], tiny_dir("qwen2"), items_file, "bf16", SCALAR)
    _matched(runs["scalar-fp32"], tiny_dir("qwen2"), items_file, "fp32", SCALAR)
    _matched(runs["here-bf16"], tiny_dir("qwen2"), items_file, "bf16")
    return runs


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_an_audit_under_other_kernels_says_so_first_and_exits_3(scalar_runs, tmp_path):
    """A bf16 unit not reproduced under other kernels (a forged token, on any CPU; and whatever the scalar kernels
    moved) is said to be that, not tampering."""
    run = _copy(scalar_runs["scalar-bf16"], tmp_path)
    _forge_a_token(run)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    first = result.stderr.splitlines()[0]
    assert first.startswith("environment: this machine's kernels differ from the run's for 6 of 6 records")
    assert "kernel caps ATEN_CPU_CAPABILITY=default (run) vs none (here)" in first
    assert result.exit_code == 3, result.stderr
    assert "not reproduced here (other kernels):" in result.stderr
    assert "integrity holds" in result.stdout and "confined to bf16/fp16" in result.stdout
    audit = json.loads((run / "audit.json").read_text())
    assert audit["integrity_ok"] and not audit["reproduced"]
    assert audit["not_reproduced_here"]["units"] >= 1
    assert audit["not_reproduced_here"]["by_precision"].keys() == {"bf16"}
    assert {m["kind"] for m in audit["mismatches"]} == {"not_reproduced_here"}


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_the_same_run_under_its_own_kernels_reproduces(scalar_runs, tmp_path):
    """The control: the run made here is reproduced here, with no environment line."""
    run = _copy(scalar_runs["here-bf16"], tmp_path)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert "environment:" not in result.stderr
    assert "audit: every record reproduced" in result.stdout


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_a_forged_token_under_the_runs_own_kernels_is_an_integrity_finding(scalar_runs, tmp_path):
    """Beside the exit 3 above: the same kind of difference in a run made here is tampering (exit 1)."""
    run = _copy(scalar_runs["here-bf16"], tmp_path)
    _forge_a_token(run)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 1, result.stderr
    assert "suffix_ids not reproduced" in result.stderr
    assert "integrity findings (tampering or a broken run)" in result.stdout


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_an_integrity_finding_is_one_under_any_kernels(scalar_runs, tmp_path):
    """A label that does not follow from its text is tampering wherever the audit runs."""
    run = _copy(scalar_runs["scalar-bf16"], tmp_path)
    chain, manifest = load(run)
    k = next(k for k, r in enumerate(chain) if r.kind == "item" and r.payload["status"] == "ok")
    payload = edit(chain[k])
    payload["arms"][0]["correct"] = not payload["arms"][0]["correct"]
    chain[k] = with_payload(chain[k], payload)
    save(run, chain, manifest)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 1, result.stderr
    assert "correct is not what scorer" in result.stderr


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_fp32_units_with_other_tokens_under_other_kernels_are_suspicious(scalar_runs, tmp_path):
    run = _copy(scalar_runs["scalar-fp32"], tmp_path)
    item = _forge_a_token(run)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 3, result.stderr
    assert "fp32 units with other tokens or labels" in result.stdout and item in result.stdout
    audit = json.loads((run / "audit.json").read_text())
    assert audit["not_reproduced_here"]["fp32_token_differences"] == [f"matched/primary {item}"]


def _forge_a_token(run: Path) -> str:
    """Change one suffix token of the first ok item's live arms, fingerprints and comparisons recomputed."""
    chain, manifest = load(run)
    k = next(k for k, r in enumerate(chain) if r.kind == "item" and r.payload["status"] == "ok")
    payload = edit(chain[k])
    for arm in payload["arms"]:
        if arm["name"].startswith("live"):
            arm["suffix_ids"][0] = (arm["suffix_ids"][0] + 1) % 50
    chain[k] = with_payload(chain[k], payload)
    save(run, chain, manifest)
    return chain[k].item_id


# -- inputs that moved -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moved(tmp_path_factory, tiny_dir, items_file) -> dict[str, Path]:
    """A run made here whose model and data then moved (copies, the originals renamed away)."""
    root = tmp_path_factory.mktemp("moved")
    model, data = root / "model", root / "items.jsonl"
    shutil.copytree(tiny_dir("qwen2"), model)
    shutil.copyfile(items_file, data)
    run = root / "run"
    _matched(run, model, data)
    model.rename(root / "model-moved")
    data.rename(root / "items-moved.jsonl")
    return {"run": run, "model": root / "model-moved", "data": root / "items-moved.jsonl"}


def test_a_moved_model_is_refused_with_the_flag_to_pass(moved, tmp_path):
    run = _copy(moved["run"], tmp_path)
    result = runner.invoke(app, ["audit", str(run), "--quiet"])
    assert result.exit_code == 2
    assert result.stderr.strip().endswith("pass --model PATH where it is now (checked against the run's hashes)")


def test_relocated_inputs_audit_and_are_recorded_in_the_audit_not_the_run(moved, tmp_path):
    run = _copy(moved["run"], tmp_path)
    manifest = (run / "manifest.json").read_bytes()
    result = runner.invoke(app, ["audit", str(run), "--model", str(moved["model"]), "--data", str(moved["data"]),
                                 "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert f"note: primary model found at {moved['model']} (--model, hashes match)" in result.stderr
    assert (run / "manifest.json").read_bytes() == manifest
    audit = json.loads((run / "audit.json").read_text())
    assert [m["input"] for m in audit["relocated"]] == ["primary model", "data"]


def test_a_model_with_other_hashes_is_refused_naming_the_hash(moved, tmp_path, tiny_dir):
    run = _copy(moved["run"], tmp_path)
    ledger = (run / "ledger.jsonl").read_bytes()
    result = runner.invoke(app, ["audit", str(run), "--model", str(tiny_dir("llama")), "--data", str(moved["data"])])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and "is not the run's primary model: its config hash differs (" in line
    assert line.endswith("; pass the directory of the model the run was made with")
    assert (run / "ledger.jsonl").read_bytes() == ledger and not (run / "audit.json").exists()


def test_a_data_file_with_another_hash_is_refused(moved, tmp_path):
    run = _copy(moved["run"], tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(moved["data"].read_text().replace("Think", "think"))
    result = runner.invoke(app, ["audit", str(run), "--verify-only", "--data", str(other)])
    assert result.exit_code == 2 and "is not the run's dataset: its dataset_hash differs" in result.stderr


def test_an_experiment_extends_a_run_whose_model_moved(moved, tmp_path):
    run = _copy(moved["run"], tmp_path)
    refused = runner.invoke(app, ["bridge", str(run), "--rows", "2", "--quiet"])
    assert refused.exit_code == 2 and "pass --model PATH where it is now" in refused.stderr
    result = runner.invoke(app, ["bridge", str(run), "--rows", "2", "--model", str(moved["model"]), "--quiet"])
    assert result.exit_code == 0, result.stderr
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["stages"]["bridge/primary"]["model"]["path"] == str(moved["model"])
    assert manifest["config"]["model"]["path"] != str(moved["model"])  # the run keeps where it was made
    verified = runner.invoke(app, ["audit", str(run), "--verify-only", "--data", str(moved["data"])])
    assert verified.exit_code == 0, verified.stderr


def test_a_toy_run_from_another_checkout_finds_the_embedded_checkpoint(tmp_path):
    """The toy fixture records the path of the checkout that made it; the packaged checkpoint has its hashes."""
    from stagereplay.toy import toy_checkpoint

    run = Path(shutil.copytree(Path(__file__).parent / "fixtures" / "toy_matched", tmp_path / "toy"))
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["config"]["model"]["path"] = str(tmp_path / "elsewhere" / "primary")  # a location: not bound
    for stage in manifest["stages"].values():
        stage["model"]["path"] = manifest["config"]["model"]["path"]
    (run / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    result = runner.invoke(app, ["audit", str(run), "--verify-only"])
    assert result.exit_code == 0, result.stderr
    assert f"primary model found at {toy_checkpoint('primary')} (the embedded toy checkpoint, hashes match)" in \
        result.stderr
    wrong = runner.invoke(app, ["audit", str(run), "--verify-only", "--model", str(toy_checkpoint("later"))])
    assert wrong.exit_code == 2 and "its weights hash differs" in wrong.stderr


# -- a sampled audit -------------------------------------------------------------------------------------------


def _sampled(run: Path, seed: int, n: int = 2) -> tuple[int, dict]:
    result = runner.invoke(app, ["audit", str(run), "--sample", str(n), "--seed", str(seed), "--quiet"])
    return result.exit_code, json.loads((run / "audit.json").read_text())


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_a_sampled_audit_re_executes_a_seeded_recorded_sample(scalar_runs, tmp_path):
    run = _copy(scalar_runs["here-bf16"], tmp_path)
    code, audit = _sampled(run, seed=0)
    assert code == 0, audit["mismatches"]
    picked = audit["sample"]["units"]["matched/primary"]
    assert len(picked) == 2 and audit["sample"]["re_executed"] == 2 and audit["sample"]["of"] == 6
    assert audit["trajectories"]["n"] == 2 * 4  # two records of four arms: the rest only verified
    assert _sampled(run, seed=0)[1]["sample"]["units"] == audit["sample"]["units"]
    others = [_sampled(run, seed=s)[1]["sample"]["units"]["matched/primary"] for s in (1, 2, 3)]
    assert any(o != picked for o in others)  # the seed chooses


@pytest.mark.slow  # audits of two recorded runs under other kernels: the slow tier
def test_a_sampled_audit_catches_a_forgery_only_in_its_sample(scalar_runs, tmp_path):
    """What only re-execution can tell is caught in a sampled unit and missed outside the sample; what
    follows from recorded fields is caught everywhere, since every record is verified."""
    run = _copy(scalar_runs["here-bf16"], tmp_path)
    picked = {u[0] for u in _sampled(run, seed=0)[1]["sample"]["units"]["matched/primary"]}
    forged = _forge_a_token(run)
    seed = next(s for s in range(50) if (forged in {u[0] for u in _sampled(run, s)[1]["sample"]["units"][
        "matched/primary"]}) != (forged in picked))
    inside, outside = (0, seed) if forged in picked else (seed, 0)
    assert _sampled(run, inside)[0] == 1
    assert _sampled(run, outside)[0] == 0
