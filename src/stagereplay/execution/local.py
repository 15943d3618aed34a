"""Item jobs in this process or in N local worker processes, results in job order.

The parent (the only writer of the ledger) appends records in job order whatever runs them, so a run's ledger
is identical for any --workers. The workers' log lines are the parent's to say (`_Relay`).
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
from collections.abc import Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError
from stagereplay.execution.config import R, Work
from stagereplay.execution.item_threads import chunks, run_batched, run_chunk
from stagereplay.execution.models import cached_lm, release_models
from stagereplay.execution.ray_cluster import shutdown_actors

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig
    from stagereplay.engine.proof_stores import MachineStore

# This worker process's index in its pool (0..N-1), set when the process starts; None in the command's process.
_WORKER_INDEX: int | None = None


def _start_worker(counter: Any, logs: Any) -> None:
    global _WORKER_INDEX
    with counter.get_lock():
        _WORKER_INDEX = int(counter.value)
        counter.value += 1
    # This worker's log lines (`stagereplay.*`, INFO and up) go to the parent, whose handlers say them or not.
    logger = logging.getLogger("stagereplay")
    logger.addHandler(logging.handlers.QueueHandler(logs))
    logger.setLevel(logging.INFO)
    logger.propagate = False


class _Relay:
    """The parent's side of its workers' log lines: each handed to the parent's logger of the same name, so that
    the command's own handlers decide it as they do the parent's lines (its level, --quiet, a line said once:
    cli.app)."""

    def __init__(self, queue: Any) -> None:
        import threading

        self.queue = queue
        queue.cancel_join_thread()  # the parent puts only the stop: a worker killed mid-line must not hold up exit
        self.thread = threading.Thread(target=self._say, name="worker-logs", daemon=True)
        self.thread.start()

    def _say(self) -> None:
        while True:
            try:
                record = self.queue.get()
            except (EOFError, OSError):
                return
            if record is None:
                return
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)

    def stop(self) -> None:
        """After the workers have ended: say what they logged, then stop."""
        self.queue.put(None)
        self.thread.join(timeout=10)


def worker_config(config: ModelConfig, index: int | None) -> ModelConfig:
    """Worker `index`'s model setting: with `--device cuda`, its own GPU `cuda:<index>`; else `config` as given
    (`cpu`, or a `cuda:<i>` the user pinned every worker to). Its records' environments name that device."""
    if index is None or config.device != "cuda":
        return config
    return replace(config, device=f"cuda:{index}")


def check_worker_devices(device: str, workers: int, executor: str = "local") -> None:
    """Refuse `--workers N --device cuda` (local workers, one GPU each) when fewer than N GPUs are visible."""
    if executor != "local" or workers < 2 or device != "cuda":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < workers:
        raise StageReplayError(f"--workers {workers} with --device cuda needs one GPU per worker, {count} visible",
                               f"pass --workers {max(count, 1)} or fewer (or pin one GPU with --device cuda:0)")


def _call(config: ModelConfig, work: Work[R], job: Any, machine_store: MachineStore | None) -> R:
    return work(cached_lm(worker_config(config, _WORKER_INDEX), machine_store=machine_store), job)


# Worker processes, kept until the command ends (`shutdown_workers`): starting one (importing torch, loading
# a model) costs seconds, and a paper run comes back to the same model settings several times (its audit
# re-runs them all). Each pool's log lines come back through its relay.
_POOL: dict[int, Any] = {}
_RELAYS: dict[int, _Relay] = {}


class WorkerDied(StageReplayError):
    """A worker process ended without a result: killed by a signal or exited in native code."""


def run_local(config: ModelConfig, work: Work[R], jobs: Sequence[Any], workers: int, lm: LM | None = None,
              isolated: bool = False, machine_store: MachineStore | None = None) -> Iterator[R]:
    """`work(lm, job)` for every job, in this process (`workers == 1`, unless `isolated`) or a pool, yielded in
    job order; a model loaded for them keeps its proofs where `machine_store` finds (execution.models.cached_lm).
    A worker that dies raises `WorkerDied` naming the job's item and how the process ended."""
    if workers == 1 and not isolated:
        lm = lm or cached_lm(config, machine_store=machine_store)
        if config.batch > 1:
            yield from run_batched(lm, work, jobs, config.batch)
            return
        for job in jobs:
            yield work(lm, job)
        return
    check_worker_devices(config.device, workers)
    pool = _pool(workers)
    if config.batch > 1:  # each worker takes a chunk of jobs and steps them `batch` at a time
        futures = [pool.submit(_call_batched, config, work, chunk, machine_store)
                   for chunk in chunks(jobs, config.batch, workers)]
    else:
        futures = [pool.submit(_call, config, work, job, machine_store) for job in jobs]
    processes = list(getattr(pool, "_processes", {}).values())  # started by the first submit
    try:
        for i, f in enumerate(futures):
            try:
                result = f.result()
            except BrokenProcessPool:
                _POOL.pop(workers, None)  # a broken pool takes no more jobs: the next call starts another
                _stop_relay(workers)
                raise WorkerDied(f"the worker process running item {_item_id(jobs, i, config.batch)} died "
                                 f"({_how_ended(processes)}) without a result",
                                 "the records before it are kept; fix the cause and run the same command "
                                 "again to resume") from None
            if config.batch > 1:
                yield from result
            else:
                yield result
    finally:
        for f in futures:
            f.cancel()


def _item_id(jobs: Sequence[Any], index: int, batch: int) -> str:
    job = jobs[index * batch] if batch > 1 else jobs[index]
    return str(getattr(getattr(job, "item", None), "id", f"#{index}"))


def _how_ended(processes: Sequence[Any]) -> str:
    """How the pool's processes ended: a signal's name (SIGSEGV: a crash in native code) or an exit code."""
    import signal

    for p in processes:
        p.join(timeout=5)
        code = p.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        if code:
            return f"exit code {code}"
    return "it ended without saying why"


def _call_batched(config: ModelConfig, work: Work[R], jobs: Sequence[Any], machine_store: MachineStore | None
                  ) -> list[R]:
    lm = cached_lm(worker_config(config, _WORKER_INDEX), machine_store=machine_store)
    return run_chunk(lm, jobs, work, config.batch)


def _pool(workers: int) -> Any:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    if workers not in _POOL:
        # spawn, not fork: a forked child would inherit torch's thread pools and any CUDA context half-made.
        # Each worker takes the next index as it starts: worker i runs on cuda:i under --device cuda.
        context = mp.get_context("spawn")
        logs = context.Queue()
        _RELAYS[workers] = _Relay(logs)
        _POOL[workers] = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_start_worker,
                                             initargs=(context.Value("i", 0), logs))
    return _POOL[workers]


def _stop_relay(workers: int) -> None:
    relay = _RELAYS.pop(workers, None)
    if relay is not None:
        relay.stop()


def shutdown_workers() -> None:
    """Stop the worker processes and Ray actors, and free the models loaded here. Called at exit and by each
    command's end."""
    shutdown_actors()
    for workers, pool in _POOL.items():
        pool.shutdown(wait=True, cancel_futures=True)
        _stop_relay(workers)
    _POOL.clear()
    release_models()


atexit.register(shutdown_workers)
