"""Every benchmark in bench/ runs at a tiny size, so none breaks unseen (a benchmark is code).

Each script is run as the README runs it (a subprocess, its own flags) with the tiny arguments of `TINY`,
and its last line must parse as that script's summary line. A new script in bench/ fails
`test_every_bench_script_has_a_smoke_run` until it gets its row here, and
`test_every_bench_script_is_in_the_readme` until bench/README.md has its section. The scripts share code through
one module, bench/common.py, never by importing each other (`test_no_script_imports_another`).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SHARED = "common.py"
"""The helpers the scripts share: imported by them, run by none of its own."""

NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# script: (tiny arguments, with {tmp} for a scratch directory; the regex its last line must match)
TINY: dict[str, tuple[list[str], str]] = {
    "batch.py": (["--models", "toy", "--rows", "1,4", "--items", "4", "--tokens", "4"],
                 rf"^best: \S+ at C=\d+, {NUMBER}x batch 1's tokens/s$"),
    # Two named configurations of our engine on the toy, the second speculating and compared with the first.
    "constructions.py": (["toy", "toy", "{tmp}/out", "--n", "2", "--max-new-tokens", "4", "--config",
                          "plain=--construction oneshot,roundtrip:int8", "--config", "lookup=--speculate prompt-lookup:2"],
                         r"^lookup \(\d+ s\): replicas \d+/2; vs oneshot \d+/2; live by generate\(\): \d+ tokens in \d+ "
                         r"steps \([\d.]+ a step\) \| against plain: trajectories equal \d+/2.*McNemar p [\d.]+$"),
    "decode.py": (["--models", "toy", "--tokens", "4", "--prompts", "1", "--repeats", "1"],
                  rf"^toy .* ours\s+{NUMBER} .* tokens == generate\(\): yes\s+graphs \d+$"),
    "gpu_check.py": (["model", "--device", "cpu", "--out", "{tmp}/out", "--model", "{tmp}/model"],
                     rf"^bandwidth floor: weights / copy bandwidth\s+\S+ GB / {NUMBER} GB/s = \S+ ms a step "
                     rf"\(\d+ steps/s\)$"),
    # Every step of the GPU check at a tiny shape, each under its budget; all must finish.
    "gpu_check.sh": (["--device", "cpu"],
                     rf"^gpu check: (\d+)/\1 steps done in \d+ s; replicas exact: yes; decode steps/s against a floor"
                     rf" of \d+: static {NUMBER} \({NUMBER}x floor\), dynamic {NUMBER} \({NUMBER}x floor\), dynamic"
                     rf" --batch 16 {NUMBER} \({NUMBER}x floor\)$"),
    "gpu_wheels.sh": (["--dry-run"], r"^would download \d+ wheels into .*\.whl for CPython 3\.12 manylinux x86_64$"),
    "gpu_decode.py": (["--shape", "tiny", "--device", "cpu", "--tokens", "8", "--repeats", "1", "--copy-mib", "16"],
                      rf"^ours static: {NUMBER}x floor, tokens == generate\(\): yes$"),
    "step_profile.py": (["--shape", "tiny", "--device", "cpu", "--stage1", "4", "--suffix", "4"],
                        rf"^profile ours dynamic: \d+ steps; per step wall {NUMBER} ms; step {NUMBER}, pick {NUMBER}, "
                        rf"record {NUMBER}, other -?{NUMBER} ms; host reads {NUMBER}$"),
    # Its data step only: the others need llama-cpp-python, which the llamacpp-marked tests run (tests/test_llamacpp.py).
    "llamacpp.py": (["data", "{tmp}/items.jsonl", "--n", "3"], r"^/.*/items\.jsonl$"),
    "row_costs.py": (["--rows", "1,2", "--keys", "8"],
                     rf"^linears per row at C=2 over C=1: {NUMBER} \(bf16\), {NUMBER} \(fp32\); attention in one call"
                     rf" over one per row at C=2: {NUMBER} \(bf16\), {NUMBER} \(fp32\)$"),
    "long_trace.py": (["--items", "1", "--stage1", "16", "--suffix", "8"],
                      rf"^overhead -?{NUMBER}% of forward time, peak RSS \d+ MiB$"),
    "long_trace.py --cache static": (["--items", "1", "--stage1", "16", "--suffix", "8", "--cache", "static"],
                                     rf"^overhead -?{NUMBER}% of forward time, peak RSS \d+ MiB$"),
    "matched_floor.py": (["--n", "2", "--max-new-tokens", "8", "--repeats", "1"],
                         rf"^matched / floor\s+{NUMBER}x\s+\(target <= 1\.15x\)$"),
    "attest.py": (["--n", "6", "--max-new-tokens", "8", "--draws", "199"],
                  rf"^attest: honest FPR at 1% \d+/\d+ \[{NUMBER}, {NUMBER}\]; greedy later checkpoint: AUC {NUMBER} at "
                  rf"128 tokens, 99% power (?:<=|>) \d+; seeded later checkpoint: AUC {NUMBER} at 128 tokens, 99% power "
                  rf"(?:<=|>) \d+$"),
    "mismatch.py": (["throughput", "--shape", "tiny", "--rollouts", "2", "--prompt", "8", "--response", "16"],
                    rf"^scoring: ours {NUMBER} tok/s, bare forward {NUMBER} tok/s, ours / bare {NUMBER}$"),
    "mismatch.py memory": (["memory", "--small", "2", "--large", "4", "--response", "8", "--distinct", "2"],
                           rf"^peak RSS: 2 rollouts {NUMBER} MiB, 4 rollouts {NUMBER} MiB \(ratio {NUMBER}\)$"),
    "paper.py": (["--n", "2", "--workers", "1", "--max-new-tokens", "16"],
                 r"^later: transplants follow the donor \(all-divergent\):.*$"),
    "plan.py": (["--scale", "tiny", "--n", "1"],
                rf"^forwards plan (\d+) run \1 \(equal: yes\), time plan {NUMBER} s run {NUMBER} s \(ratio {NUMBER}\)$"),
    "random_model.py": (["--shape", "tiny", "--out", "{tmp}/model"],
                        rf"^saved a random tiny to .* in {NUMBER} s$"),
    "scale.py": (["--tiny"],
                 rf"^peak RSS \d+ MiB, floor \d+ MiB, caches {NUMBER} MiB, logits kept \d+ MiB$"),
    "resample.py": (["--items", "1", "--k", "1", "--new-tokens", "8", "--repeats", "1"],
                    rf"^draw / decode {NUMBER}\s+reprefill / draw {NUMBER}$"),
    # vLLM's own sampled outputs as a rollout file (the vLLM tier: it needs vLLM's venv).
    "vllm_rollouts.py": (["{tmp}/rollouts.jsonl", "--n", "2", "--max-new-tokens", "4", "--dtype", "float32"],
                         rf"^wrote 2 rollouts \(\d+ tokens\) to \S+rollouts\.jsonl in {NUMBER} s; audit: stagereplay "
                         r"mismatch --rollouts \S+ --model \S+ --out RUN$"),
    # The toy as a GGUF served by llama-server (the server tier: LLAMA_CPP_LIB_PATH names the build): two named
    # configurations, the second speculating and compared with the first, each under a load of 2.
    "attest_servers.py": (["{tmp}/toy.gguf", "{tmp}/out", "--server", "{llama_server}", "--quantize",
                           "{llama_quantize}", "--items", "toy", "--n", "4", "--max-new-tokens", "8", "--draws", "199",
                           "--threads", "1"],
                          r"^attest_servers: honest responses flagged at 1% \d+/\d+ \[[\d.]+, [\d.]+\]; one layer fewer: "
                          r"AUC [\d.]+ at 300 tokens, 99% power .*; Q8_0: AUC [\d.]+ at 300 "
                          r"tokens, 99% power .* \(margin\), .* \(both\); Q4_0: AUC .*; K/V q4_0: refused by llama-server$"),
    # attest itself, one run per source on the toy as a GGUF (llama.cpp in process, llama-server alone and under load,
    # its Q4_0 requantization).
    "attest_fpr.py": (["{tmp}/toy.gguf", "{tmp}/out", "--server", "{llama_server}", "--quantize", "{llama_quantize}",
                       "--items", "toy", "--runs", "1", "--n", "20", "--max-new-tokens", "4"],
                      rf"^attest_fpr: honest runs flagged \d+/3 \[{NUMBER}, {NUMBER}\] over \d+ honest responses; "
                      r"Q4_0 flagged \d/1; \d+ s$"),
    "server.py": (["{tmp}/toy.gguf", "{tmp}/items.jsonl", "{tmp}/out", "--server", "{llama_server}", "--config",
                   "plain=", "--config", "ngram=--spec-type ngram-simple --spec-ngram-simple-size-n 2 "
                   "--spec-ngram-simple-size-m 8", "--slots", "1", "--loads", "2", "--n", "2", "--boundary-after", "4",
                   "--max-new-tokens", "4"],
                  r"^ngram, slots 1, load 2 \(\d+ s\): live replica exact \d+/\d+; oneshot \d+/\d+ differ .*"
                  r"oneshot per item: .*; live drafted \d+, accepted \d+; vs plain: trajectories equal \d+/\d+ .*"
                  r"manifests differ in server_args, .*server\.speculative.*$"),
}


def scripts() -> list[str]:
    return sorted(p.name for p in [*BENCH.glob("*.py"), *BENCH.glob("*.sh")] if p.name != SHARED)


def imported_scripts(source: str) -> set[str]:
    """The bench scripts (module names, no `.py`) that `source` imports, at module level or inside a function."""
    names = {s.removesuffix(".py") for s in scripts() if s.endswith(".py")}
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & names


def test_no_script_imports_another() -> None:
    """A script imports bench/common.py, never another script, so no circle can form between them."""
    offenders = {p.name: sorted(imported_scripts(p.read_text())) for p in sorted(BENCH.glob("*.py"))}
    assert offenders, f"no Python files in {BENCH}"
    assert not {k: v for k, v in offenders.items() if v}, f"bench modules importing a script: {offenders}"


def test_imported_scripts_sees_an_import_of_a_script() -> None:
    """Negative control: the check above finds a script imported at the top or inside a function."""
    assert imported_scripts("from gpu_decode import SHAPE_NAMES\n") == {"gpu_decode"}
    assert imported_scripts("def f():\n    import random_model\n    import torch\n") == {"random_model"}
    assert imported_scripts("from common import sync\nimport json\n") == set()


def undocumented(readme: str) -> list[str]:
    """Scripts (and the shared module) without a `## ` section in `readme` that names them, or, for a script, with no
    command line in it that runs them (`python bench/NAME` or `bash bench/NAME`)."""
    sections = {}
    for part in readme.split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        for name in re.findall(r"`([\w.]+\.(?:py|sh))`", heading):
            sections[name] = body
    missing = []
    for name in [*scripts(), SHARED]:
        body = sections.get(name)
        run = rf"^(?:[A-Z]+=\S+ )*(?:python|bash) bench/{re.escape(name)}\b"
        if body is None or (name != SHARED and not re.search(run, body, re.MULTILINE)):
            missing.append(name)
    return missing


def test_every_bench_script_is_in_the_readme() -> None:
    readme = (BENCH / "README.md").read_text()
    assert undocumented(readme) == [], "bench/README.md lacks a section (with the command that runs it) for these"


def test_undocumented_sees_a_missing_section() -> None:
    """Negative control: dropping a script's section, or the command from it, is caught."""
    readme = (BENCH / "README.md").read_text()
    start = readme.index("\n## `batch.py`")
    end = readme.index("\n## ", start + 1)
    assert undocumented(readme[:start] + readme[end:]) == ["batch.py"]
    commandless = readme[:start] + "\n## `batch.py`: no command\n\nProse only.\n" + readme[end:]
    assert undocumented(commandless) == ["batch.py"]


def test_every_bench_script_has_a_smoke_run() -> None:
    missing = [s for s in scripts() if s not in TINY]
    assert not missing, f"bench scripts without a tiny smoke run in tests/test_bench.py: {missing}"
    assert not [s for s in TINY if s.split()[0] not in scripts()], "TINY names a script that bench/ no longer has"


def last_line(text: str) -> str:
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_last_line_rejects_a_crash() -> None:
    """Negative control: a traceback's last line does not pass as any script's summary."""
    crash = "Traceback (most recent call last):\n  ...\nKeyError: 'boundary'\n"
    assert not any(re.match(pattern, last_line(crash)) for _, pattern in TINY.values())


SLOW = ("paper.py", "constructions.py", "long_trace.py", "long_trace.py --cache static", "gpu_check.sh", "plan.py",
        "matched_floor.py", "mismatch.py memory", "attest.py", "resample.py", "batch.py", "scale.py", "decode.py",
        "step_profile.py", "gpu_decode.py", "gpu_check.py")
"""Scripts whose smoke run is a whole protocol run, several runs or a sweep of decodes (over 4 s on 2 cores): the
slow tier, which CI also runs."""
SERVER = ("attest_fpr.py", "attest_servers.py", "server.py")
"""Scripts whose smoke run starts llama-server: the server tier (tests/test_server.py says how to run it)."""
VLLM_PYTHON = "STAGEREPLAY_VLLM_PYTHON"
"""Where set (.ci/run sets it in the server tier), the vLLM venv's interpreter: attest_servers.py's smoke run adds
vllm serve's configurations."""
VLLM = ("vllm_rollouts.py",)
"""Scripts whose smoke run needs vLLM: the vLLM tier (its venv; tests/test_vllm.py runs it too)."""


def _marks(script: str) -> tuple[pytest.MarkDecorator, ...]:
    return ((pytest.mark.slow,) if script in SLOW else (pytest.mark.server,) if script in SERVER
            else (pytest.mark.vllm,) if script in VLLM else ())


def _serve_the_toy(tmp_path: Path) -> str:
    """The toy as a GGUF and arithmetic items for bench/server.py; the llama-server binary to start."""
    from gguf_files import write_toy_gguf
    from servers import llama_server_binary

    write_toy_gguf(tmp_path / "toy.gguf")
    subprocess.run([sys.executable, str(BENCH / "llamacpp.py"), "data", str(tmp_path / "items.jsonl"), "--n", "2"],
                   check=True, capture_output=True)
    return str(llama_server_binary())


@pytest.mark.parametrize("script", [pytest.param(s, marks=_marks(s)) for s in sorted(TINY)])
def test_bench_script_runs_tiny(script: str, tmp_path: Path) -> None:
    args, pattern = TINY[script]
    if script in SERVER:
        binary = _serve_the_toy(tmp_path)
        quantizer = str(Path(binary).parent / "llama-quantize")
        args = [a.replace("{llama_server}", binary).replace("{llama_quantize}", quantizer) for a in args]
    vllm = os.environ.get(VLLM_PYTHON) if script == "attest_servers.py" else None
    if vllm:  # .ci/run names the vLLM venv's interpreter: vllm serve joins the null, its fp8 cache refused on the toy
        args = [*args, "--vllm", vllm]
    runner = ["bash"] if script.split()[0].endswith(".sh") else [sys.executable]
    cmd = [*runner, str(BENCH / script.split()[0]), *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    # A shell script's python3 is this interpreter; its scratch files (OUT, the temporary directory) in tmp_path.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OUT": str(tmp_path / "out"), "TMPDIR": str(tmp_path),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    line = last_line(proc.stdout)
    assert re.match(pattern, line), f"{script}: last line {line!r} does not match {pattern!r}"
    if vllm:
        assert re.search(r"^vllm serve x4: \d+ tokens served$", proc.stdout, re.M), proc.stdout[-2000:]
        assert "vllm K/V fp8: refused by vllm serve; " in line, line
