"""How item jobs are run: the job function's type and the executor settings every backend shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM

R = TypeVar("R")
Work = Callable[["LM", Any], R]
"""A job function: `work(lm, job)` gives the job's result (`Work[R]`: an item's payload, or a job's result with its
environment, `experiments.core.jobs.JobResult`), whichever process runs it."""
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class ExecConfig:
    """How many processes and which backend."""

    panel: ClassVar[str] = "Execution"

    workers: int = field(default=1, metadata={"help": "local worker processes (or Ray actors)"})
    executor: str = field(default="local", metadata={"help": "local | ray"})
    isolated: bool = field(default=False, metadata={"cli": False, "help": (
        "jobs in a worker process even at one worker: native code that crashes (a serving engine's library) takes "
        "the worker down, not the run, which then says so in one line and resumes from the item")})

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise StageReplayError(f"--workers must be at least 1, got {self.workers}", "pass --workers 1 or more")
        if self.executor not in EXECUTORS:
            raise StageReplayError(f"unknown executor {self.executor!r}", f"use one of {', '.join(EXECUTORS)}")
