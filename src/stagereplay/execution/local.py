"""Item jobs in this process or in N local worker processes, results in job order.

The parent (the only writer of the ledger) appends records in job order whatever runs them, so a run's ledger
is identical for any --workers.
"""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from stagereplay.execution.config import Work

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig

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
        from stagereplay.engine.lm import load

        while len(_LMS) >= keep:
            _LMS.pop(next(iter(_LMS)))  # the least recently used, dropped before the next one loads
        lm = load(config.path, config.precision, config.device, config.threads, config.attn_impl)
    _LMS[config] = lm
    return lm


def _call(config: ModelConfig, work: Work, job: Any) -> dict[str, Any]:
    return work(cached_lm(config, MAX_MODELS), job)


# Worker processes, kept until the command ends (`shutdown_workers`): starting one (importing torch, loading
# a model) costs seconds, and a paper run comes back to the same model settings several times (its audit
# re-runs them all).
_POOL: dict[int, Any] = {}


def run_local(config: ModelConfig, work: Work, jobs: Sequence[Any], workers: int, lm: LM | None = None
              ) -> Iterator[dict[str, Any]]:
    """`work(lm, job)` for every job, in this process (`workers == 1`) or a pool, yielded in job order."""
    if workers == 1:
        lm = lm or cached_lm(config)
        for job in jobs:
            yield work(lm, job)
        return
    pool = _pool(workers)
    futures = [pool.submit(_call, config, work, job) for job in jobs]
    try:
        for f in futures:
            yield f.result()
    finally:
        for f in futures:
            f.cancel()


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
