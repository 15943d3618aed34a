"""A worker process that dies in native code (`ExecConfig(isolated=True)`, how llama.cpp's items run) ends the jobs in
one line naming the item and the signal, keeps the results before it, and leaves a pool that runs again."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stagereplay.engine.model import ModelConfig
from stagereplay.execution.config import ExecConfig
from stagereplay.execution.executors import run_jobs
from stagereplay.execution.local import WorkerDied
from stagereplay.toy import toy_checkpoint


@dataclass(frozen=True)
class Item:
    id: str


@dataclass(frozen=True)
class Job:
    item: Item
    crash: bool = False


def native(lm, job):
    """Reads address 0 from C when the job says so: a segmentation fault, as a crash in an engine's library."""
    if job.crash:
        import ctypes

        ctypes.string_at(0)
    return {"item": job.item.id}


@pytest.mark.slow  # two pools of fresh processes, each loading torch and the toy: the slow tier (CI runs it)
def test_a_crash_in_native_code_names_the_item_and_signal_and_keeps_what_came_before():
    config = ModelConfig(str(toy_checkpoint("primary")), "fp32")
    jobs = [Job(Item("a")), Job(Item("b"), crash=True), Job(Item("c"))]
    done = []
    with pytest.raises(WorkerDied) as died:
        for result in run_jobs(config, native, jobs, ExecConfig(isolated=True)):
            done.append(result["item"])
    assert done == ["a"]
    assert "item b died (killed by SIGSEGV)" in str(died.value) and "run the same command again" in str(died.value)
    # Negative control: without the crash the same isolated jobs all return, from a new pool.
    assert [r["item"] for r in run_jobs(config, native, [Job(Item("b")), Job(Item("c"))],
                                        ExecConfig(isolated=True))] == ["b", "c"]
