"""Where item jobs run: in this process, in N local worker processes, or on a Ray cluster.

Every executor yields results in job order, so the parent (the only writer of the ledger) appends records in
the same canonical order whatever the executor: a run's ledger is identical for any --workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from stagereplay.execution.config import ExecConfig, R, Work
from stagereplay.execution.item_threads import chunks, run_chunk
from stagereplay.execution.local import run_local
from stagereplay.execution.ray_cluster import run_ray

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig
    from stagereplay.engine.proof_stores import MachineStore


def run_jobs(config: ModelConfig, work: Work[R], jobs: Sequence[Any], ex: ExecConfig, lm: LM | None = None,
             machine_store: MachineStore | None = None) -> Iterator[R]:
    """`work(lm, job)` for every job, yielded in job order. A model loaded for them, in this process or another,
    keeps its fast step's proofs in that process's memory and the store `machine_store` finds on its machine
    (records.proofs.machine_store; execution.models.cached_lm)."""
    if not jobs:
        return
    if ex.executor == "ray" and config.batch > 1:  # each actor steps a chunk's jobs `batch` at a time
        chunk_work: Any = partial(run_chunk, work=work, rows=config.batch)  # a chunk's results, in job order
        for results in run_ray(config, chunk_work, chunks(jobs, config.batch, ex.workers), ex.workers,
                               machine_store=machine_store):
            yield from results
    elif ex.executor == "ray":
        yield from run_ray(config, work, jobs, ex.workers, machine_store=machine_store)
    else:
        yield from run_local(config, work, jobs, ex.workers, lm, ex.isolated, machine_store)
