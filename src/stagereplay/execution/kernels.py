"""Which CPU kernels a run computes with: this machine's own, or portable ones that every x86-64 CPU with AVX2 runs.

bf16 and fp32 bits follow the kernels. On a CPU, ATen, MKL and oneDNN pick theirs by the instruction set, so
the same run gives other bits on an AVX2 machine, an AVX-512 one and one with AMX tiles (docs/reference/toy.md
has the toy's figures on each). MKL also picks its code by the CPU's vendor. `PORTABLE` holds all three to code
paths that every x86-64 CPU with AVX2 runs alike: ATen to its AVX2 kernels; MKL, under conditional numerical
reproducibility (`MKL_CBWR`), to its `COMPATIBLE` branch, the one it documents for Intel and non-Intel
processors alike (SSE2, without the approximate reciprocals whose bits differ between vendors; MKL runs its
`AVX2` branch on Intel processors only, and on an AMD one quietly falls back to its own dispatch); oneDNN to
AVX2, which also routes bf16 matmuls away from it as on a machine without AVX-512. Every such CPU then runs the
same code paths, and an audit on another machine re-executes under them. The environment records the MKL
branch in force (`mkl_branch`), so a cap that a library ignored shows in the ledger. On a CPU with AMX tiles
portable kernels are also faster at batch 1: a one-row bf16 matmul on AMX tiles costs more than on AVX2
(docs/reference/performance.md).

The libraries read these variables when torch loads, so a choice is made before the first import of torch and
holds for the process and every worker it starts (local workers and a local Ray instance inherit the
environment; Ray actors are given it). The ledger records them in each process's environment
(`KERNEL_ENV`), and the audit compares them (`records.kernels`).

- `native`: whatever this process's environment says (no variable is touched);
- `portable`: `PORTABLE`, refused once torch has loaded without it;
- `auto` (the default): `portable` for the embedded toy on an x86-64 CPU, so the README's run gives the figures
  the docs show on any such machine, when this process can still choose (torch not loaded, no kernel variable
  set by the user); else `native`. A model of the user's runs on the kernels of the user's machine.

A command that extends or audits a run follows the kernels its manifest recorded (`follow_run`), when it can.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

from stagereplay.errors import StageReplayError

PORTABLE: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""The environment of portable kernels (ATen and oneDNN held to their AVX2 code paths, MKL to its branch for
every vendor's CPU)."""
CHOICES = ("auto", "native", "portable")
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE",
              "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
"""Environment variables that cap or pin the CPU kernels of ATen, oneDNN and MKL (each process's environment
records them: `records.provenance`)."""


def check_kernels(kernels: str) -> None:
    if kernels not in CHOICES:
        raise StageReplayError(f"unknown --kernels {kernels!r}", f"use one of {', '.join(CHOICES)}")


def _x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def user_caps() -> dict[str, str]:
    """The kernel variables set in this process's environment (what workers started from here are given)."""
    return {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}


def choose(kernels: str, toy: bool, device: str) -> dict[str, str]:
    """The variables `kernels` asks to set for a run on `device` (`toy`: the embedded toy model); {} for none."""
    check_kernels(kernels)
    cpu = device == "cpu"
    if kernels == "portable":
        if not cpu or not _x86_64():
            raise StageReplayError(f"--kernels portable holds x86-64 CPU kernels; this run is on {device} "
                                   f"({platform.machine()})", "pass --kernels native")
        return dict(PORTABLE)
    if kernels == "auto" and toy and cpu and _x86_64() and not user_caps() and "torch" not in sys.modules:
        return dict(PORTABLE)
    return {}


def pin(caps: Mapping[str, str], strict: bool = True) -> bool:
    """Set `caps` in this process's environment, before torch loads, for it and the workers it starts. Returns
    whether they hold. Once torch has loaded they hold only if the environment already had them; otherwise a
    `strict` pin is refused (the libraries have chosen their kernels) and a lenient one is dropped."""
    if all(os.environ.get(k) == v for k, v in caps.items()):
        return True
    if "torch" in sys.modules:
        if strict:
            shown = " ".join(f"{k}={v}" for k, v in caps.items())
            raise StageReplayError("these kernels must be chosen before torch loads, and this process has loaded it",
                                   f"run the command in a fresh process, or start Python with {shown}")
        return False
    os.environ.update(caps)
    return True


def recorded_caps(environment: Mapping[str, Any]) -> dict[str, str]:
    """The kernel variables set in the environment a run's manifest recorded (records.provenance.environment)."""
    env = (environment.get("kernels") or {}).get("cpu") or {}
    return {k: str(v) for k, v in (env.get("env") or {}).items() if v}


def follow_run(environment: Mapping[str, Any]) -> bool:
    """Compute under the kernel variables a run recorded, where this process can still choose: torch not loaded
    and no kernel variable set by the user (whose choice stands; the audit names any difference). Returns whether
    the run's variables hold here."""
    caps = recorded_caps(environment)
    if user_caps() or not caps:
        return user_caps() == caps
    return pin(caps, strict=False)
