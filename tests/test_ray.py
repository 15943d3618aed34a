"""`--executor ray` writes the ledger the local executor writes: same records, payloads and hash chain."""

from __future__ import annotations

import os

import pytest

from stagereplay.engine.boundary import After
from stagereplay.engine.decode import DecodeConfig
from stagereplay.records.ledger import items, read_ledger
from stagereplay.runs import ExecConfig, Inputs, matched

try:
    import ray
except ImportError:  # the optional extra: required where CI is set, else the module is skipped
    if os.environ.get("CI"):
        raise
    pytest.skip("Ray is not installed (pip install 'stagereplay[ray]')", allow_module_level=True)


@pytest.fixture(scope="module")
def local_ray():
    """A private two-CPU Ray instance for this module; run_ray uses it and must leave it running."""
    import sys

    from stagereplay.execution.local import shutdown_workers

    # The fake jobs below are this module's functions; actors cannot import a test module, so they travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    shutdown_workers()
    ray.shutdown()


def _matched(out, model, data, workers=1, executor="local", **inputs_given):
    inputs = Inputs.of(model=str(model), data=str(data), n=6, boundary=After(8), decode=DecodeConfig(max_new_tokens=16),
                    **inputs_given)
    return matched(out, inputs, ex=ExecConfig(workers, executor), quiet=True)


@pytest.mark.slow  # a local Ray cluster's actors: the slow tier
def test_ray_actors_and_local_workers_batch_too(tmp_path, tiny_dir, items_file, local_ray):
    """`--batch 4` on two Ray actors and on two local workers (each takes 4 jobs at a time and steps them together)
    records what one process does: the same item payloads, with the batch recorded in each environment."""
    import json

    model = tiny_dir("qwen2")
    runs = {name: tmp_path / name for name in ("ray", "workers", "local")}
    _matched(runs["ray"], model, items_file, workers=2, executor="ray", precision="fp32", batch=4)
    _matched(runs["workers"], model, items_file, workers=2, executor="local", precision="fp32", batch=4)
    _matched(runs["local"], model, items_file, workers=1, executor="local", precision="fp32", batch=4)
    payloads = {name: [json.dumps(r.payload, sort_keys=True) for r in items(read_ledger(run))]
                for name, run in runs.items()}
    assert len(payloads["local"]) == 6 and payloads["ray"] == payloads["workers"] == payloads["local"]
    envs = [r.payload for r in read_ledger(runs["ray"]) if r.kind == "environment"]
    assert envs and all(e["determinism"]["batch"] == 4 for e in envs)


@pytest.mark.slow  # a local Ray cluster's actors: the slow tier
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_ray_ledger_equals_local_ledger(tmp_path, tiny_dir, items_file, local_ray, cache):
    """The actors load with the run's whole model setting, its cache kind included (a static run recorded by a
    dynamic-cache actor would differ in every cache fingerprint)."""
    model = tiny_dir("qwen2")
    _matched(tmp_path / "ray", model, items_file, workers=2, executor="ray", cache=cache)
    assert ray.is_initialized()  # a cluster run_ray did not start is left alone
    _matched(tmp_path / "local", model, items_file, workers=1, executor="local", cache=cache)
    by_ray, local = items(read_ledger(tmp_path / "ray")), items(read_ledger(tmp_path / "local"))
    assert len(local) == 6
    assert [r.item_id for r in by_ray] == [r.item_id for r in local]  # job order, whatever finished first
    for a, b in zip(by_ray, local, strict=True):
        assert a.payload == b.payload
        assert a.env == b.env  # the actors' environment is the parent's: one machine, one set of versions
    # The whole chains, stage and environment records included, are the same bytes.
    assert (tmp_path / "ray" / "ledger.jsonl").read_bytes() == (tmp_path / "local" / "ledger.jsonl").read_bytes()
    # Negative control: one token changed in one payload changes that record's hash.
    changed = local[3].payload | {"prefix_ids": [*local[3].payload["prefix_ids"][:-1], -1]}
    assert local[3].model_copy(update={"payload": changed}).computed_hash() != by_ray[3].hash


def _where(lm, job):
    """A job's result: the actor process that ran it and the model object it was given."""
    return {"job": job, "pid": os.getpid(), "lm": id(lm)}


@pytest.mark.slow  # a local Ray cluster's actors: the slow tier
def test_actors_and_their_models_persist_across_calls(tiny_dir, local_ray):
    """Two stages (two run_ray calls) run on the same two actors, each with the model it loaded for the first:
    one load per actor for the command. Negative control: after shutdown_workers (a command's end), the next
    call gets new actor processes."""
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution.local import shutdown_workers
    from stagereplay.execution.ray_cluster import run_ray

    config = ModelConfig(path=str(tiny_dir("qwen2")))
    first = list(run_ray(config, _where, list(range(6)), 2))
    second = list(run_ray(config, _where, list(range(6, 12)), 2))
    assert [r["job"] for r in first + second] == list(range(12))  # job order
    models = {r["pid"]: r["lm"] for r in first}
    assert len(models) == 2  # both actors took jobs in the first stage
    assert {r["pid"] for r in second} <= set(models)  # the same actor processes
    assert all(models[r["pid"]] == r["lm"] for r in first + second)  # one model per actor, never reloaded
    shutdown_workers()
    third = list(run_ray(config, _where, list(range(2)), 2))
    assert not {r["pid"] for r in third} & set(models)


def _slow_first(lm, job):
    """Job 0 takes 3 s; the others return at once, each with the actor that ran it and when it finished."""
    import time

    if job == 0:
        time.sleep(3)
    return {"job": job, "pid": os.getpid(), "t": time.time()}


@pytest.mark.slow  # a local Ray cluster's actors: the slow tier
@pytest.mark.parametrize("per_actor", [1, 2])
def test_a_long_job_holds_up_only_its_own_actor(tiny_dir, local_ray, per_actor):
    """Jobs go to whichever actor is free: while job 0 runs, the other actor takes every later job, all done
    before job 0, and the results still come in job order. Negative control: with two jobs queued per actor
    (per_actor=2), job 2 waits behind job 0 on its actor, and the check fails."""
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution.ray_cluster import run_ray

    config = ModelConfig(path=str(tiny_dir("qwen2")))
    list(run_ray(config, _where, list(range(2)), 2))  # both actors up and loaded, outside the timing
    out = list(run_ray(config, _slow_first, list(range(8)), 2, per_actor=per_actor))
    assert [r["job"] for r in out] == list(range(8))
    later = out[1:]
    stalled = [r["job"] for r in later if r["pid"] == out[0]["pid"] or r["t"] > out[0]["t"]]
    if per_actor == 1:
        assert not stalled
    else:
        assert 2 in stalled


@pytest.mark.slow  # a local Ray cluster's actors: the slow tier
def test_a_problem_inside_an_actor_reads_as_it_would_locally(tiny_dir, local_ray):
    from stagereplay.engine.model import ModelConfig
    from stagereplay.errors import StageReplayError
    from stagereplay.execution.ray_cluster import run_ray
    from stagereplay.experiments.core.jobs import Job, ReplaySettings
    from stagereplay.experiments.protocol.matched import MatchedParams, matched_item
    from stagereplay.tasks.base import Item

    item = Item(id="x", prompt_ids=(5, 6, 7), answer="1")
    jobs = [Job(item, ReplaySettings(boundary="nonsense:1"), MatchedParams())]
    with pytest.raises(StageReplayError, match="unknown boundary rule"):
        list(run_ray(ModelConfig(path=str(tiny_dir("qwen2"))), matched_item, jobs, 1))


def test_missing_ray_is_a_clear_error(monkeypatch):
    import builtins

    from stagereplay.errors import StageReplayError
    from stagereplay.execution.ray_cluster import run_ray

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(StageReplayError, match="needs Ray installed"):
        next(run_ray(None, None, [1], 1))  # type: ignore[arg-type]
