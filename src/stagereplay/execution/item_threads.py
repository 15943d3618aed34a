"""Item jobs stepping together: up to C items' work as threads whose single-token steps share batched forwards
(engine.batcher), in any executor's process."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from stagereplay.execution.config import R, Work

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM


def run_batched(lm: LM, work: Work[R], jobs: Sequence[Any], rows: int) -> Iterator[R]:
    """`work(lm, job)` for every job, up to `rows` at once as item threads whose steps share batched forwards
    (engine.batcher), yielded in job order."""
    from concurrent.futures import ThreadPoolExecutor

    from stagereplay.engine.batcher import batched

    lm.prove_batch([job.item.prompt_ids for job in jobs[:3] if hasattr(job, "item")])
    fewer_malloc_arenas()
    with batched(lm, rows) as batcher, ThreadPoolExecutor(max_workers=rows) as threads:
        futures = [threads.submit(batcher.run, work, lm, job) for job in jobs]
        try:
            for f in futures:
                yield f.result()
        finally:
            for f in futures:
                f.cancel()


MALLOC_ARENAS = 2


def fewer_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """Hold glibc to `arenas` malloc arenas in this process (where the C library is glibc; elsewhere nothing).

    glibc gives a thread that allocates while another holds an arena an arena of its own, up to 8 per core, and
    memory freed in one stays there, so item threads allocating K/V and logits raise the peak RSS
    (`bench/scale.py --batch 8` measures it). The item threads take turns under the interpreter lock, so more arenas
    buy them nothing. Like MALLOC_ARENA_MAX, which it leaves
    alone when set."""
    import ctypes
    import os

    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_arena_max = -8  # malloc.h
    libc.mallopt(m_arena_max, arenas)


CHUNK_BATCHES = 4
"""A worker's chunk holds about this many batches of jobs: its item threads stream through them (a finished item's
row goes to the next job at once), so rows run short only at the chunk's end; results come back a chunk at a time."""


def chunks(jobs: Sequence[Any], rows: int, workers: int) -> list[Sequence[Any]]:
    """`jobs` cut into contiguous chunks for `workers` processes stepping `rows` items together: a multiple of
    `workers` chunks of nearly equal size (the processes finish together), each at most about `CHUNK_BATCHES`
    batches long, and none empty. The cut moves no bit (a row's bits do not depend on its batch-mates)."""
    count = min(len(jobs), workers * max(1, -(-len(jobs) // (workers * rows * CHUNK_BATCHES))))
    size = -(-len(jobs) // max(count, 1))
    return [jobs[i : i + size] for i in range(0, len(jobs), size)]


def run_chunk(lm: LM, jobs: Sequence[Any], work: Work[R], rows: int) -> list[R]:
    """`run_batched` on one chunk of jobs, as a list (what a worker process or a Ray actor returns)."""
    return list(run_batched(lm, work, jobs, rows))
