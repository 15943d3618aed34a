"""Item jobs on a Ray cluster: persistent actors, a dynamic queue, results yielded in job order.

Actors are started on the first `run_ray` call of a command and live until the command ends
(`shutdown_actors`, called by `execution.local.shutdown_workers` at each command's end and at exit), so every
stage of `paper`, its audit included, reuses them. Each actor holds one CPU, or one GPU (`num_gpus=1`) when
the run is on CUDA, and keeps the model(s) it has loaded as a local worker does (`execution.models.cached_lm`:
one at a time, the last released and collected before the next loads): a stage that comes back to a model
setting an actor already holds does not load it again. Actors compute under this command's kernel variables
(`execution.kernels`), given to them in their runtime environment.

Jobs are handed out as actors free up: each idle actor takes the next job, and `ray.wait` over the jobs in
flight says which actor is free next, so one long item holds up its own actor only. Results are buffered and
yielded in job order, so the ledger the parent writes is the one any other executor writes.

The cluster: the one this process is already connected to; else the one `RAY_ADDRESS` names; else a local
instance started here, which stays up for later calls in this process (Ray stops it at exit). A cluster this
module did not start is never shut down. On a remote cluster every node needs stagereplay installed and the
model directory at the same path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from stagereplay.errors import StageReplayError
from stagereplay.execution.kernels import user_caps
from stagereplay.execution.models import cached_lm

if TYPE_CHECKING:
    from stagereplay.engine.model import ModelConfig
    from stagereplay.engine.proof_stores import MachineStore
    from stagereplay.execution.config import R, Work

JOBS_PER_ACTOR = 1
"""Jobs in flight per actor. One: an actor idles for the parent's round trip (milliseconds) between jobs, and
no job ever waits behind a long one. More would queue jobs on an actor behind whatever it is running."""


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
    """A Ray actor's state: the models this process has loaded (`cached_lm`), reused for every job it takes."""

    def run(self, config: ModelConfig, work: Work[R], job: Any, machine_store: MachineStore | None = None
            ) -> R:
        # Loaded on the first job that needs it, so that a load error reaches the parent as that job's error; its
        # proofs kept in the store found on the actor's own machine.
        return work(cached_lm(config, machine_store=machine_store), job)


def _actor_config(config: ModelConfig) -> ModelConfig:
    # Ray gives a GPU actor exactly one visible device, so inside the actor it is always cuda:0.
    return replace(config, device="cuda") if config.device.startswith("cuda") else config


# The command's actors: what they were started for (the cluster and driver job, and the resource each holds:
# "gpu" or "cpu") and their handles. Replaced when a call asks for another resource, more actors, or comes
# from another Ray session (the old actors died with it); dropped by `shutdown_actors`.
_ACTORS: dict[str, Any] = {"key": None, "handles": []}


def actors(ray: Any, kind: str, count: int) -> list[Any]:
    """`count` actors holding one `kind` each, started now unless this command already has them."""
    context = ray.get_runtime_context()
    key = (context.gcs_address, context.get_job_id(), kind)
    if _ACTORS["key"] != key or len(_ACTORS["handles"]) < count:
        shutdown_actors()
        resources: dict[str, Any] = {"num_gpus": 1} if kind == "gpu" else {"num_cpus": 1}
        caps = user_caps()  # this command's kernels (execution.kernels): an actor on another node inherits nothing
        if caps:
            resources["runtime_env"] = {"env_vars": caps}
        actor_class = ray.remote(**resources)(Replica)
        _ACTORS.update(key=key, handles=[actor_class.remote() for _ in range(count)])
    return list(_ACTORS["handles"][:count])


def shutdown_actors() -> None:
    """Stop this command's actors (freeing their models and GPUs). A no-op when there are none, or when Ray has
    already shut down (its own exit hook stops the actors of a local instance with it)."""
    handles, _ACTORS["handles"], _ACTORS["key"] = _ACTORS["handles"], [], None
    if not handles:
        return
    import ray

    if ray.is_initialized():
        for actor in handles:
            with contextlib.suppress(Exception):  # an actor already dead (its node lost) needs no stopping
                ray.kill(actor)


def run_ray(config: ModelConfig, work: Work[R], jobs: Sequence[Any], workers: int,
            per_actor: int = JOBS_PER_ACTOR, machine_store: MachineStore | None = None) -> Iterator[R]:
    """`work(lm, job)` for every job on `workers` persistent Ray actors, handed out as actors free up, yielded
    in job order. `per_actor` jobs are in flight on each actor at most (`JOBS_PER_ACTOR`); a model an actor loads
    keeps its proofs where `machine_store` finds on the actor's machine (execution.models.cached_lm)."""
    if per_actor < 1:
        raise ValueError(f"per_actor must be at least 1, got {per_actor}")
    ray = _import_ray()
    if not jobs:
        return
    _connect(ray)
    kind = "gpu" if config.device.startswith("cuda") else "cpu"
    pool = actors(ray, kind, workers)[: len(jobs)]  # all `workers` started, so a later, larger stage reuses them
    actor_config = _actor_config(config)
    idle = [pool[i % len(pool)] for i in range(per_actor * len(pool))]  # one entry per free slot
    in_flight: dict[Any, tuple[int, Any]] = {}  # ObjectRef -> (job index, actor)
    done: dict[int, R] = {}
    submitted = yielded = 0
    finished = False
    try:
        while yielded < len(jobs):
            while idle and submitted < len(jobs):
                actor = idle.pop(0)
                in_flight[actor.run.remote(actor_config, work, jobs[submitted], machine_store)] = (submitted, actor)
                submitted += 1
            if yielded not in done:
                ready, _ = ray.wait(list(in_flight), num_returns=1)
                index, actor = in_flight.pop(ready[0])
                idle.append(actor)
                try:
                    done[index] = ray.get(ready[0])
                except ray.exceptions.RayTaskError as exc:
                    # A user-fixable problem inside an actor reads as it would in this process.
                    if isinstance(exc.cause, StageReplayError):
                        raise exc.cause from None
                    raise
            while yielded in done:
                yield done.pop(yielded)
                yielded += 1
        finished = True
    finally:
        if not finished and in_flight:
            # Stopped early (an error, or the caller closed us) with jobs still running: they would hold their
            # actors busy for the next stage, so the actors go; the next call starts fresh ones.
            shutdown_actors()
