"""The experiments arrive through the entry point group `stagereplay.experiments`, stagereplay's own as an extension's:
the registry holds stagereplay's in the report's order, then every other distribution's by name; an entry point that
does not load, names no experiment, names another experiment than itself or one already declared is refused in one
line naming its distribution, in the library and on the command line. The control: a well-formed extension's entry
point, loaded the same way, is accepted after stagereplay's own."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import EntryPoint, distributions, entry_points
from pathlib import Path

import pytest

from stagereplay.errors import REFUSED, StageReplayError
from stagereplay.experiments.core import registry

FAKE = "stagereplay-fake"


def _fake(folder: Path, lines: str) -> list[EntryPoint]:
    """A distribution `stagereplay-fake` installed in `folder` declaring `lines` in the group, and its entry points."""
    info = folder / "stagereplay_fake-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {FAKE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.GROUP}]\n{lines}\n")
    (dist,) = distributions(path=[str(folder)])
    return list(dist.entry_points.select(group=registry.GROUP))


def _own() -> list[EntryPoint]:
    return [p for p in entry_points(group=registry.GROUP) if p.dist is not None and p.dist.name == registry.OWN]


def test_stagereplays_own_come_first_in_the_reports_order_then_every_other_by_name():
    own = {p.name for p in _own()}
    assert set(registry.ORDER) == own, "ORDER lists every experiment stagereplay's pyproject.toml declares"
    others = sorted(p.name for p in entry_points(group=registry.GROUP) if p.name not in own)
    assert list(registry.EXPERIMENTS) == [*registry.ORDER, *others]
    assert all(registry.distribution(name) == registry.OWN for name in registry.ORDER)


def test_an_extensions_entry_point_is_loaded_after_stagereplays_own(tmp_path: Path):
    """The control: the test plugin's experiment, declared by another distribution, loads as that distribution's."""
    loaded = registry.load([*_fake(tmp_path, "echo = stagereplay_echo:Echo"), *_own()])
    assert [e.name for e, _ in loaded] == [*registry.ORDER, "echo"]
    assert loaded[-1][1] == FAKE


@pytest.mark.parametrize(("line", "says"), [
    ("broken = stagereplay_no_such_module:Broken", "does not load (ModuleNotFoundError: No module named"),
    ("dumps = json:dumps", "not an Experiment subclass"),
    ("other = stagereplay.experiments.protocol.bridge:Bridge", "names the experiment 'bridge'"),
    ("matched = stagereplay.experiments.protocol.matched:Matched", f"declared by {registry.OWN} and by {FAKE}"),
], ids=["does-not-load", "not-an-experiment", "another-name", "declared-twice"])
def test_a_bad_entry_point_is_refused_in_one_line_naming_its_distribution(line: str, says: str, tmp_path: Path):
    with pytest.raises(StageReplayError) as refused:
        registry.load([*_own(), *_fake(tmp_path, line)])
    message = str(refused.value)
    assert says in message and FAKE in message and "\n" not in message, message


def test_the_command_line_refuses_a_broken_extension_in_one_line(tmp_path: Path):
    """A broken extension installed beside stagereplay: `stagereplay --help` says which, in one line, and exits
    REFUSED."""
    _fake(tmp_path, "broken = stagereplay_no_such_module:Broken")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "from stagereplay.cli import main; main()", "--help"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == REFUSED, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: experiment entry point 'broken'") and f"uninstall {FAKE}" in done.stderr


def test_every_experiment_is_a_library_function_found_in_the_registry():
    """`stagereplay.runs` holds each registered experiment's function by its name and its options by their type's
    name, an installed extension's (the plugin's `echo`) as stagereplay's own; `stagereplay` holds what an
    experiment's package exports (mismatch's `mismatch_metrics`). A name no experiment has is an AttributeError."""
    import stagereplay
    import stagereplay.runs as runs

    for e in registry.all_experiments():
        made = getattr(runs, e.name)
        assert made.__name__ == e.name, made
        if e.name not in vars(runs):  # made from the registry (`runs.library_function`), not written in runs
            assert made.__doc__ == e.__doc__
        assert getattr(runs, e.Options.__name__) is e.Options
    assert runs.attest.__name__ == "attest" and "out" in runs.attest.__code__.co_varnames
    assert "run_dir" in runs.echo.__code__.co_varnames  # it extends a run
    from stagereplay.experiments.mismatch.metrics import mismatch_metrics

    assert stagereplay.mismatch_metrics is mismatch_metrics
    for module in (runs, stagereplay):
        with pytest.raises(AttributeError):
            module.no_such_experiment  # noqa: B018
