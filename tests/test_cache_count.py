"""The most K/V caches alive at once in each experiment, as the benchmarks page states them, and no cache outliving its item.

Every cache the engine makes while counting (`new_cache`, and `clone_cache` for snapshots, continuations,
transplants and replays) is registered by a weak reference; the peak is the most alive right after any was made.
One toy item per experiment, on a freshly loaded model, so its first captured step is made while counting: the
negative control turns off the collection after a capture (`release_capture_garbage`) and the captured step
keeps its first cache alive, one more than the page says and still alive after the item.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.capture  # the caches a captured step keeps alive

BENCHMARKS = Path(__file__).parents[1] / "docs" / "reference" / "benchmarks.md"
NAMES = {"matched": "matched", "precision-2x2": "precision_2x2", "bridge": "bridge", "transplant": "transplant",
         "resample": "resample"}


def stated_caches_alive() -> dict[str, int]:
    """The line "The most K/V caches alive at once per item: matched 4, ...", read from docs/reference/benchmarks.md,
    so that what the docs state is what the tests hold the engine to."""
    text = " ".join(BENCHMARKS.read_text().split())
    found = re.search(r"The most K/V caches alive at once per item: ((?:[\w-]+ \d+, )+[\w-]+ \d+)", text)
    assert found, "docs/reference/benchmarks.md no longer states the most K/V caches alive per experiment"
    counts = {NAMES[name]: int(n) for name, n in (pair.rsplit(" ", 1) for pair in found.group(1).split(", "))}
    assert set(counts) == set(NAMES.values()), counts
    return counts


# The most K/V caches alive at once, per experiment, at any item, as the docs state them.
CACHES_ALIVE = stated_caches_alive()


class Count:
    def __init__(self) -> None:
        self.alive: weakref.WeakSet[Any] = weakref.WeakSet()
        self.peak = 0

    def made(self, cache: Any) -> None:
        self.alive.add(cache)
        self.peak = max(self.peak, len(self.alive))


@contextmanager
def counting_caches() -> Iterator[Count]:
    """Count every cache the engine makes: `new_cache` and `clone_cache` make them all (a transplant and a replay
    clone), wrapped here in each module that binds them."""
    from stagereplay.engine import cache, lm, transplant

    count = Count()
    patched = []
    for name in ("new_cache", "clone_cache"):
        real = getattr(cache, name)

        def counted(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            made = _real(*args, **kwargs)
            count.made(made)
            return made

        for module in (cache, lm, transplant):
            if hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, counted)
    try:
        yield count
    finally:
        for module, name, real in patched:
            setattr(module, name, real)


def _jobs(lm: Any) -> dict[str, tuple[Any, Any]]:
    """One toy item's job for each experiment (the matched prefix computed first, uncounted)."""
    from stagereplay.engine.decode import DecodeConfig
    from stagereplay.experiments.core.jobs import Job, ReplaySettings
    from stagereplay.experiments.protocol import bridge, matched, precision_2x2, resample, transplant
    from stagereplay.tasks import DataConfig, load_items

    item = load_items(DataConfig(n=1), lm.tokenizer)[0][0]
    settings = ReplaySettings(boundary="marker:</think>", decode=DecodeConfig(max_new_tokens=24))
    lm.stepper.capture = False  # eager here, so that the first captured step is the counted item's
    state = lm.live(item, settings.rule(), settings.decode, keep_going=False)
    lm.stepper.capture = True
    prefix = list(state.prefix)
    del state
    cfg = transplant.TransplantConfig()
    rcfg = resample.ResampleConfig(k=2)
    return {
        "matched": (matched.matched_item, Job(item, settings, matched.MatchedParams("oneshot"))),
        "precision_2x2": (precision_2x2.grid_item, Job(item, settings, precision_2x2.GridParams(
            tuple(prefix), ("incremental", "oneshot"), lm.config.precision))),
        "bridge": (bridge.bridge_item, Job(item, settings, bridge.BridgeParams(tuple(prefix)))),
        "transplant": (transplant.transplant_item, Job(item, settings, transplant.TransplantParams(
            tuple(prefix), cfg))),
        "resample": (resample.resample_item, Job(item, settings, resample.ResampleParams(
            tuple(prefix), rcfg, lm.config.precision, "live"))),
    }


def _fresh_lm() -> Any:
    from stagereplay.engine.lm import load
    from stagereplay.toy import toy_checkpoint

    lm = load(str(toy_checkpoint("primary")), "bf16")
    assert lm.stepper.capture, "steps are not captured here: the counts would not cover the captured step"
    return lm


def _count(lm: Any, experiment: str) -> tuple[int, int]:
    """(most caches alive at once, caches still alive after the item) for one item of `experiment`."""
    work, job = _jobs(lm)[experiment]
    with counting_caches() as count:
        payload = work(lm, job)
        del payload
        left = len(count.alive)
    return count.peak, left


@pytest.mark.parametrize("experiment", sorted(CACHES_ALIVE))
def test_caches_alive_at_once_are_what_the_docs_say(experiment):
    peak, left = _count(_fresh_lm(), experiment)
    assert (peak, left) == (CACHES_ALIVE[experiment], 0)


def test_a_captured_step_that_keeps_its_first_cache_is_caught(monkeypatch):
    """Negative control: without the collection after a capture, dynamo's reference cycles keep the cache of the
    first captured step (and, after other tests' captures in the same process, those of later recompiles):
    more caches than the docs say, still alive when the item is done."""
    from stagereplay.engine import decode

    monkeypatch.setattr(decode, "release_capture_garbage", lambda: None)
    peak, left = _count(_fresh_lm(), "matched")
    assert left >= 1 and peak > CACHES_ALIVE["matched"]


def test_the_model_a_process_drops_is_gone_before_the_next_loads(monkeypatch):
    """`cached_lm` releases a model before loading the next (one resident at a time); the negative control keeps
    two, and the first is then alive while the second loads."""
    from stagereplay.engine import lm as lm_module
    from stagereplay.engine.model import ModelConfig
    from stagereplay.execution import models
    from stagereplay.toy import toy_checkpoint

    path = str(toy_checkpoint("primary"))
    load = lm_module.load
    alive_at_load: list[bool] = []
    first: list[Any] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        alive_at_load.append(bool(first) and first[0]() is not None)
        return load(*args, **kwargs)

    monkeypatch.setattr(lm_module, "load", watched)
    for keep, expected in ((1, False), (2, True)):
        models._LMS.clear()
        alive_at_load.clear()
        first.clear()
        lm = models.cached_lm(ModelConfig(path=path, precision="bf16"), keep)
        lm.generate([1, 2, 3], 4)  # its step captured: the cycles that hold a model until collected
        first.append(weakref.ref(lm.model))
        del lm
        models.cached_lm(ModelConfig(path=path, precision="fp32"), keep)
        assert alive_at_load == [False, expected]
    models._LMS.clear()
