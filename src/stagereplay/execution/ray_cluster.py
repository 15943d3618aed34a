"""Item jobs on a Ray cluster: one model replica per actor, results yielded in job order.

Each actor loads the model once (`stagereplay.engine.lm.load`, with the run's precision, threads and attention
implementation) and then runs `work(lm, job)` for the jobs dealt to it round-robin. The parent keeps a bounded
window of jobs in flight and collects them in job order, so the ledger it writes is the one any other
executor writes.

The cluster: the one this process is already connected to; else the one `RAY_ADDRESS` names; else a local
instance started here, which stays up for later calls in this process (Ray stops it at exit). A cluster this
module did not start is never shut down. On a remote cluster every node needs stagereplay installed and the
model directory at the same path.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError

if TYPE_CHECKING:
    from stagereplay.engine.lm import LM
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution.config import Work

IN_FLIGHT_PER_ACTOR = 2
"""Jobs queued per actor: one running, one ready to start, so no actor waits on the parent."""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise StageReplayError(
            "--executor ray needs Ray installed", "pip install 'stagereplay[ray]'"
        ) from None
    return ray


def _connect(ray: Any) -> None:
    """Use the connected cluster, else `RAY_ADDRESS`'s, else start a local one (no dashboard, quiet workers)."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(include_dashboard=False, log_to_driver=False)


class Replica:
    """A Ray actor's state: one loaded model, reused for every job dealt to this actor."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.lm: LM | None = None

    def run(self, work: Work, job: Any) -> dict[str, Any]:
        # Loaded on the first job, not in __init__, so that a load error reaches the parent as the job's error.
        if self.lm is None:
            from stagereplay.engine.lm import load

            c = self.config
            self.lm = load(c.path, c.precision, c.device, c.threads, c.attn_impl)
        return work(self.lm, job)


def _actor_config(config: ModelConfig) -> ModelConfig:
    # Ray gives a GPU actor exactly one visible device, so inside the actor it is always cuda:0.
    return replace(config, device="cuda") if config.device.startswith("cuda") else config


def run_ray(config: ModelConfig, work: Work, jobs: Sequence[Any], workers: int) -> Iterator[dict[str, Any]]:
    """`work(lm, job)` for every job on `workers` Ray actors (one model replica each), yielded in job order."""
    ray = _import_ray()
    if not jobs:
        return
    _connect(ray)
    resources = {"num_gpus": 1} if config.device.startswith("cuda") else {"num_cpus": 1}
    actor_class = ray.remote(**resources)(Replica)
    actors = [actor_class.remote(_actor_config(config)) for _ in range(min(workers, len(jobs)))]
    window = IN_FLIGHT_PER_ACTOR * len(actors)
    pending: deque[Any] = deque()
    try:
        submitted = 0
        for _ in range(len(jobs)):
            while submitted < len(jobs) and len(pending) < window:
                actor = actors[submitted % len(actors)]
                pending.append(actor.run.remote(work, jobs[submitted]))
                submitted += 1
            try:
                result = ray.get(pending.popleft())
            except ray.exceptions.RayTaskError as exc:
                # A user-fixable problem inside an actor reads as it would in this process.
                if isinstance(exc.cause, StageReplayError):
                    raise exc.cause from None
                raise
            yield result
    finally:
        for actor in actors:  # frees each replica's model; queued jobs die with their actor
            ray.kill(actor)
