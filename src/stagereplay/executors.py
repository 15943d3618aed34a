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


_WORKER_LM: dict[str, Any] = {}


def _init_worker(config: ModelConfig) -> None:
    from stagereplay.lm import load

    _WORKER_LM["lm"] = load(config.path, config.precision, config.device, config.threads, config.attn_impl)


def _call(work: Work, job: Any) -> dict[str, Any]:
    return work(_WORKER_LM["lm"], job)


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
        if lm is None:
            from stagereplay.lm import load

            lm = load(config.path, config.precision, config.device, config.threads, config.attn_impl)
        for job in jobs:
            yield work(lm, job)
        return
    futures = [_pool(config, ex.workers).submit(_call, work, job) for job in jobs]
    try:
        for f in futures:
            yield f.result()
    finally:
        for f in futures:
            f.cancel()


# Pools of worker processes, one per model setting, kept until the command ends (`shutdown_workers`): starting
# a worker (importing torch, loading the model) costs seconds, and a paper run comes back to the same model
# settings several times (its audit re-runs them all). At most MAX_POOLS are kept, oldest closed first.
_POOL: dict[tuple[Any, int], Any] = {}
MAX_POOLS = 3


def _pool(config: ModelConfig, workers: int) -> Any:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    key = (config, workers)
    if key not in _POOL:
        while len(_POOL) >= MAX_POOLS:
            _POOL.pop(next(iter(_POOL))).shutdown(wait=True, cancel_futures=True)
        # spawn, not fork: a forked child would inherit torch's thread pools and any CUDA context half-made.
        _POOL[key] = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                         initializer=_init_worker, initargs=(config,))
    return _POOL[key]


def shutdown_workers() -> None:
    """Stop the worker processes (and free their model replicas). Called at exit and by each command's end."""
    for pool in _POOL.values():
        pool.shutdown(wait=True, cancel_futures=True)
    _POOL.clear()


atexit.register(shutdown_workers)
