"""The CPU kernels a run computes with (`--kernels`, execution.kernels): portable ones for the embedded toy by
default, this machine's own for a model of the user's, chosen before torch loads and recorded; a command that
extends or audits a run follows the kernels it recorded.

The choice is made when a process starts, so the end-to-end checks run the CLI in fresh processes; this one
loaded torch in conftest.py, on this machine's own kernels.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from stagereplay.cli import app
from stagereplay.errors import StageReplayError
from stagereplay.execution.kernels import KERNEL_ENV, PORTABLE, choose, pin, recorded_caps

runner = CliRunner()
X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and bool(
    getattr(torch.cpu, "_is_avx2_supported", lambda: False)())
needs_avx2 = pytest.mark.skipif(not X86_AVX2, reason="portable kernels are x86-64 AVX2 code paths")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`stagereplay ARGS` in a fresh process, with no kernel variable unless `env` sets one."""
    full = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV}
    full.update({k: v for k, v in (env or {}).items() if v})
    return subprocess.run([sys.executable, "-m", "stagereplay.cli", *args], env=full, capture_output=True,
                          text=True, timeout=900)


def _environments(run: Path) -> list[dict]:
    lines = (run / "ledger.jsonl").read_text().splitlines()
    return [r["payload"] for r in map(json.loads, lines) if r.get("kind") == "environment"]


def _caps(env: dict) -> dict[str, str]:
    return {k: v for k, v in env["kernels"]["cpu"]["env"].items() if v}


# -- the choice, without a model ---------------------------------------------------------------------------------


def test_an_unknown_choice_and_portable_off_a_cpu_are_refused_in_one_line():
    with pytest.raises(StageReplayError, match="unknown --kernels 'fast'"):
        choose("fast", toy=True, device="cpu")
    with pytest.raises(StageReplayError, match="holds x86-64 CPU kernels; this run is on cuda"):
        choose("portable", toy=True, device="cuda")
    assert choose("native", toy=True, device="cpu") == {}
    assert choose("auto", toy=True, device="cuda") == {}


@needs_avx2
def test_portable_is_refused_once_torch_has_loaded_other_kernels(tmp_path):
    """This process loaded torch without the variables: asking for them now is refused, and nothing runs."""
    assert choose("portable", toy=True, device="cpu") == PORTABLE
    with pytest.raises(StageReplayError, match="must be chosen before torch loads"):
        pin(PORTABLE)
    assert not any(os.environ.get(k) == v for k, v in PORTABLE.items())
    out = tmp_path / "run"
    result = runner.invoke(app, ["matched", "--n", "1", "--kernels", "portable", "--quiet", "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: these kernels must be chosen before torch loads")
    assert len(result.stderr.splitlines()) == 1 and not out.exists()
    # auto keeps this process's kernels instead of failing: the library in a notebook that has loaded torch
    assert choose("auto", toy=True, device="cpu") == {}


@pytest.mark.parametrize(("env", "toy", "expected"), [
    ({}, True, PORTABLE),  # the embedded toy in a fresh process
    ({}, False, {}),  # a model of the user's: this machine's own
    ({"ATEN_CPU_CAPABILITY": "default"}, True, {}),  # kernel variables the user set stand
])
def test_auto_in_a_fresh_process(env, toy, expected):
    code = f"import json; from stagereplay.execution.kernels import choose; print(json.dumps(choose('auto', {toy}, 'cpu')))"
    full = {**{k: v for k, v in os.environ.items() if k not in KERNEL_ENV}, **env}
    done = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if not X86_AVX2:
        expected = {}
    assert json.loads(done.stdout) == expected


# -- end to end, in fresh processes ------------------------------------------------------------------------------

TOY = ("--n", "2", "--max-new-tokens", "12", "--quiet")


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory) -> dict[str, Path]:
    """The toy's matched run with `--kernels` left to its default, and with `native`, each in a fresh process."""
    root = tmp_path_factory.mktemp("kernels")
    runs = {"auto": root / "auto", "native": root / "native"}
    for name, run in runs.items():
        extra = () if name == "auto" else ("--kernels", name)
        done = _cli("matched", *TOY, *extra, "--out", str(run))
        assert done.returncode == 0, done.stderr
    return runs


@needs_avx2
def test_the_toy_runs_on_portable_kernels_by_default_and_records_them(toy_runs):
    manifest = json.loads((toy_runs["auto"] / "manifest.json").read_text())
    assert recorded_caps(manifest["environment"]) == PORTABLE
    envs = _environments(toy_runs["auto"])
    assert envs and all(_caps(e) == PORTABLE and e["kernels"]["cpu"]["capability"] == "AVX2" for e in envs)
    # The branch MKL itself says it runs: the one PORTABLE asks for, on this CPU's vendor too.
    assert {e["kernels"]["cpu"]["mkl_branch"] for e in envs} == {"COMPATIBLE"}
    assert all(e["kernels"]["cpu"]["vendor"] for e in envs)


def test_native_records_no_kernel_variable(toy_runs):
    """Negative control: `--kernels native` leaves the machine's own kernels, and the ledger says so."""
    envs = _environments(toy_runs["native"])
    assert envs and all(_caps(e) == {} for e in envs)
    assert {e["kernels"]["cpu"]["capability"] for e in envs} == {torch.backends.cpu.get_cpu_capability()}
    assert {e["kernels"]["cpu"]["mkl_branch"] for e in envs} == {"off"}


def _mkl_branch_in_a_fresh_process(cbwr: str) -> str:
    code = ("from stagereplay.records.provenance import environment; "
            "print(environment('cpu', {})['kernels']['cpu']['mkl_branch'])")
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "MKL_CBWR": cbwr}, capture_output=True,
                          text=True, timeout=300, check=True)
    return done.stdout.strip()


@needs_avx2
def test_the_recorded_mkl_branch_is_the_one_mkl_runs_not_the_one_asked_for():
    """MKL runs a vendor's branch only on that vendor's CPUs: asked for AVX2 on an AMD CPU it falls back to its
    own dispatch (AUTO) without a word, and computes other bits than an Intel CPU on AVX2 does. COMPATIBLE, the
    portable kernels' branch, holds on every vendor's CPU."""
    from stagereplay.records.provenance import _cpu_vendor

    assert _mkl_branch_in_a_fresh_process("COMPATIBLE") == "COMPATIBLE"
    if _cpu_vendor() == "AuthenticAMD":
        assert _mkl_branch_in_a_fresh_process("AVX2") == "AUTO"


@needs_avx2
@pytest.mark.slow  # runs, extends and audits in fresh processes: the slow tier
def test_extending_and_auditing_a_run_follow_its_kernels(toy_runs, tmp_path):
    """A fresh process that extends the run computes under its variables, and its audit reproduces every
    record whatever this machine's own kernels are; with other variables set by the user, the audit names them
    and exits 3 (the user's choice stands: a token forged in one record is a unit not reproduced under other
    kernels, on any CPU, where under the run's own it would be tampering, exit 1)."""
    import shutil

    from forge import plant_token

    run = Path(shutil.copytree(toy_runs["auto"], tmp_path / "run"))
    done = _cli("bridge", str(run), "--rows", "1", "--quiet")
    assert done.returncode == 0, done.stderr
    assert all(_caps(e) == PORTABLE for e in _environments(run))
    done = _cli("audit", str(run), "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "audit: every record reproduced" in done.stdout
    forged = tmp_path / "forged"
    plant_token(run, forged, 0)
    other = _cli("audit", str(forged), "--quiet", env={"ATEN_CPU_CAPABILITY": "default",
                                                      "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert other.returncode == 3, other.stdout + other.stderr
    assert other.stderr.startswith("environment: this machine's kernels differ from the run's")
