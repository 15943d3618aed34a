"""The captured decode step is the eager step on random tiny models of every supported architecture, and a run
proves it so on its own model before it uses it (engine.proof); both with negative controls.

The sweep (tests/capture_sweep.py) draws configurations with hypothesis from a fixed seed: architectures, GQA
ratios, windows below, at and above the sequence, layer patterns, softcapping, prompt lengths, bf16 and fp32.
It runs under this CPU's native kernels here and under portable ones in a fresh process (kernels are chosen
before torch loads), so CI's changing CPUs (AVX2, AVX-512, AMX) each meet both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from capture_sweep import planted_switch, sweep

from stagereplay.engine.decode import capture_available
from stagereplay.engine.lm import load
from stagereplay.execution.kernels import PORTABLE

pytestmark = [pytest.mark.capture,
              pytest.mark.skipif(not capture_available(), reason="dynamo is unsupported or disabled here")]


def _differing(results):
    return [(c, r) for c, r in results if not r["equal"] or not r["live_equals_generate"]]


@pytest.mark.slow  # a 14-case sweep: the slow tier
def test_captured_steps_equal_eager_steps_on_random_models():
    results = sweep(14)
    assert _differing(results) == []
    # The sweep reaches what can break: the switch the bug lived behind, and both precisions and several archs.
    assert sum(r["triggers"] for _, r in results) >= 3
    assert {c.precision for c, _ in results} == {"bf16", "fp32"}
    assert len({c.arch for c, _ in results}) >= 4


@pytest.mark.slow  # a sweep in a fresh process: the slow tier
def test_captured_steps_equal_eager_steps_under_portable_kernels():
    env = {**os.environ, **PORTABLE, "PYTHONPATH": str(Path(__file__).parent)}
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "capture_sweep.py"), "6"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cases = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 6
    assert all(c["equal"] and c["live_equals_generate"] for c in cases), out.stdout


@pytest.mark.slow  # the sweep's negative control goes with the sweep
def test_the_sweep_fails_with_the_bug_reintroduced():
    """Negative control: a library switch of the bug's kind that moves values while traced (`planted_switch`) fails
    every case that reaches it, on any CPU. (The real switch, released, moves bits only where the kernels behind
    its two paths differ: `python tests/capture_sweep.py 3 --bug` shows what it does on this machine.)"""
    results = sweep(3, only_switch=True, planted=True)
    assert len(results) == 3 and all(r["triggers"] for _, r in results)
    assert all(not r["equal"] for _, r in results), "the sweep did not see the traced step leave the eager one"


def _window_model(tmp_path: Path) -> Path:
    """A Gemma 3 text model with SDPA and a window of 6, far shorter than the sequences below."""
    from tiny import save_window_model

    return save_window_model(tmp_path / "gemma3-w6", 6)


def _generate(lm, prompt, n):
    ids = torch.tensor([prompt])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_a_run_proves_its_captured_step_and_records_it(tmp_path):
    lm = load(str(_window_model(tmp_path)), precision="fp32")
    assert lm.config.attn_impl == "sdpa"  # what transformers picks for Gemma 3
    prompt = lm.tokenizer.encode("What is 3+4?")
    assert lm.generate(prompt, 40) == _generate(lm, prompt, 40)
    assert lm.determinism["fast_steps"] == {"path": "captured", "anchor": "eager", "equal": True,
                                            "first_difference": None}
    proof = lm.prover.proof
    assert proof is not None and proof.positions >= len(prompt) + 40  # every position the call reaches
    assert lm.stepper.capture


def test_a_step_that_differs_is_caught_and_the_run_goes_on_eagerly(tmp_path, caplog):
    """Negative control of the proof: with a library switch of the bug's kind that moves values (`planted_switch`),
    the proof sees it on any CPU, capture goes off with one line (a warning), the environment records it, and live
    still equals generate()."""
    import logging

    from stagereplay.engine.proof_stores import IN_PROCESS

    path = _window_model(tmp_path)
    caplog.set_level(logging.INFO, logger="stagereplay")
    IN_PROCESS.clear()
    lm = load(str(path), precision="fp32")
    prompt = lm.tokenizer.encode("What is 3+4?")
    with planted_switch():
        tokens = lm.generate(prompt, 40)
    assert not lm.stepper.capture
    recorded = lm.determinism["fast_steps"]
    assert not recorded["equal"] and recorded["first_difference"] is not None
    (said,) = [r for r in caplog.records if r.name.startswith("stagereplay")]
    assert said.levelno == logging.WARNING and "captured steps differ from the eager steps" in said.getMessage()
    assert tokens == _generate(lm, prompt, 40)
    IN_PROCESS.clear()  # the failed proof is this model's in this process only
