"""Where item jobs run: in this process, in N local worker processes, or on a Ray cluster.

Every executor yields results in job order, so the parent (the only writer of the ledger) appends records in
the same canonical order whatever the executor: a run's ledger is identical for any --workers.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    from stagereplay.lm import LM
    from stagereplay.model import ModelConfig

Work = Callable[["LM", Any], dict[str, Any]]
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class ExecConfig:
    """How many processes and which backend."""

    workers: int = 1
    executor: str = "local"

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise StageReplayError(f"--workers must be at least 1, got {self.workers}", "pass --workers 1 or more")
        if self.executor not in EXECUTORS:
            raise StageReplayError(f"unknown executor {self.executor!r}", f"use one of {', '.join(EXECUTORS)}")


# The models this process has loaded, most recently used last, so that the stages of one command that share
# a model setting load it (and capture its steps) once. A worker process serves every setting of a command (a
# paper run has three: primary bf16 and fp32, later bf16) and keeps up to MAX_MODELS replicas; the command's
# own process, which runs the jobs itself with --workers 1 (as on a GPU), keeps one, so that it never holds
# two models at once.
_LMS: dict[ModelConfig, LM] = {}
MAX_MODELS = 3


def cached_lm(config: ModelConfig, keep: int = 1) -> LM:
    """The model for `config`, loaded unless it is among the last `keep` this process used."""
    lm = _LMS.pop(config, None)
    if lm is None:
        from stagereplay.lm import load

        while len(_LMS) >= keep:
            _LMS.pop(next(iter(_LMS)))  # the least recently used, dropped before the next one loads
        lm = load(config.path, config.precision, config.device, config.threads, config.attn_impl)
    _LMS[config] = lm
    return lm


def _call(config: ModelConfig, work: Work, job: Any) -> dict[str, Any]:
    return work(cached_lm(config, MAX_MODELS), job)


def run_jobs(config: ModelConfig, work: Work, jobs: Sequence[Any], ex: ExecConfig, lm: LM | None = None
             ) -> Iterator[dict[str, Any]]:
    """`work(lm, job)` for every job, yielded in job order."""
    if not jobs:
        return
    if ex.executor == "ray":
        from stagereplay.ray_executor import run_ray

        yield from run_ray(config, work, jobs, ex.workers)
        return
    if ex.workers == 1:
        lm = lm or cached_lm(config)
        for job in jobs:
            yield work(lm, job)
        return
    pool = _pool(ex.workers)
    futures = [pool.submit(_call, config, work, job) for job in jobs]
    try:
        for f in futures:
            yield f.result()
    finally:
        for f in futures:
            f.cancel()


# Worker processes, kept until the command ends (`shutdown_workers`): starting one (importing torch, loading
# a model) costs seconds, and a paper run comes back to the same model settings several times (its audit
# re-runs them all).
_POOL: dict[int, Any] = {}


def _pool(workers: int) -> Any:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if workers not in _POOL:
        # spawn, not fork: a forked child would inherit torch's thread pools and any CUDA context half-made.
        _POOL[workers] = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    return _POOL[workers]


def shutdown_workers() -> None:
    """Stop the worker processes and free the models loaded here. Called at exit and by each command's end."""
    for pool in _POOL.values():
        pool.shutdown(wait=True, cancel_futures=True)
    _POOL.clear()
    _LMS.clear()


atexit.register(shutdown_workers)
