"""Item jobs stepping together: up to C items' work as threads whose single-token steps share batched forwards
(engine.batcher), in any executor's process."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from stagereplay.execution.config import Work

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM


def run_batched(lm: LM, work: Work, jobs: Sequence[Any], rows: int) -> Iterator[dict[str, Any]]:
    """`work(lm, job)` for every job, up to `rows` at once as item threads whose steps share batched forwards
    (engine.batcher), yielded in job order."""
    from concurrent.futures import ThreadPoolExecutor

    from stagereplay.engine.batcher import batched

    lm.prove_batch([job.item.prompt_ids for job in jobs[:3] if hasattr(job, "item")])
    with batched(lm, rows) as batcher, ThreadPoolExecutor(max_workers=rows) as threads:
        futures = [threads.submit(batcher.run, work, lm, job) for job in jobs]
        try:
            for f in futures:
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


def run_chunk(lm: LM, jobs: Sequence[Any], work: Work, rows: int) -> list[dict[str, Any]]:
    """`run_batched` on one chunk of jobs, as a list (what a worker process or a Ray actor returns)."""
    return list(run_batched(lm, work, jobs, rows))
