"""The experiments, by name: what run making, verify, the audit, plan and the report look an experiment up in.

Every experiment arrives the way an installed extension does: an entry point of the group `stagereplay.experiments`,
named as the experiment, naming its `Experiment` subclass (`matched = "stagereplay.experiments.protocol.matched:Matched"` in
stagereplay's own pyproject.toml; an extension declares its own in its pyproject.toml). They are loaded when the
registry is first read (importing stagereplay loads no extension), in the report's order: stagereplay's own in
`ORDER`, then every other distribution's by name. An entry point that does not load, names no `Experiment` subclass,
names another experiment than itself or one already declared is refused in one line naming its distribution.
`register` adds one at run time (a test's)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from importlib.metadata import EntryPoint, entry_points

from stagereplay.errors import StageReplayError
from stagereplay.experiments.core.experiment import Experiment

GROUP = "stagereplay.experiments"
"""The entry point group every experiment is declared in."""
OWN = "stagereplay"
"""The distribution whose experiments come first, in `ORDER`."""
ORDER = ("matched", "precision_2x2", "bridge", "transplant", "resample", "mismatch", "attest")
"""The report's order of stagereplay's own experiments (installed metadata keeps no order of entry points); one it
declares that is not here follows them, by name."""


def _distribution(point: EntryPoint) -> str:
    return point.dist.name if point.dist is not None else "an unknown distribution"


def _own(point: EntryPoint) -> bool:
    return point.dist is not None and point.dist.name.lower().replace("_", "-") == OWN


def _loaded(point: EntryPoint) -> Experiment:
    """The experiment `point` names, made; refused in one line naming its distribution when it is not one."""
    where = f"experiment entry point {point.name!r} ({point.value}) of {_distribution(point)}"
    fix = f"fix or uninstall {_distribution(point)}"
    try:
        kind = point.load()
    except Exception as exc:  # an extension's import may raise anything: it is named, not a traceback of ours
        first = (str(exc).strip().splitlines() or [""])[0]
        raise StageReplayError(f"{where} does not load ({type(exc).__name__}: {first})", fix) from None
    if not (isinstance(kind, type) and issubclass(kind, Experiment)):
        raise StageReplayError(f"{where} names {kind!r}, not an Experiment subclass", fix)
    made = kind()
    if made.name != point.name:
        raise StageReplayError(f"{where} names the experiment {made.name!r}", "name the entry point as its "
                               f"experiment ({made.name} = \"{point.value}\"), or {fix}")
    return made


def load(points: Iterable[EntryPoint]) -> list[tuple[Experiment, str]]:
    """The experiments `points` declare, each with the distribution that declares it, in the report's order (module
    docstring); two that share a name are refused in one line naming both distributions."""
    points = list(points)
    rank = {name: i for i, name in enumerate(ORDER)}
    ordered = sorted(points, key=lambda p: (not _own(p), rank.get(p.name, len(ORDER)), p.name))
    out: list[tuple[Experiment, str]] = []
    by: dict[str, str] = {}
    for point in ordered:
        if point.name in by:
            raise StageReplayError(f"the experiment {point.name!r} is declared by {by[point.name]} and by "
                                   f"{_distribution(point)}", "uninstall one of them")
        by[point.name] = _distribution(point)
        out.append((_loaded(point), by[point.name]))
    return out


def installed() -> list[tuple[Experiment, str]]:
    """Every installed distribution's experiments (`load`); an install of stagereplay whose metadata declares none of
    its own (an install from an older checkout) is refused in one line."""
    points = entry_points(group=GROUP)
    if not any(_own(p) for p in points):
        raise StageReplayError(f"stagereplay's installed metadata declares no experiments (entry point group {GROUP})",
                               "reinstall stagereplay (pip install -e . in its checkout)")
    return load(points)


class Registry(MutableMapping[str, Experiment]):
    """Every experiment by name, in the report's order: the installed entry points' (`installed`, loaded when it is
    first read), then those `register` added."""

    def __init__(self) -> None:
        self._experiments: dict[str, Experiment] | None = None
        self._declared: dict[str, tuple[Experiment, str]] = {}

    def _loaded(self) -> dict[str, Experiment]:
        if self._experiments is None:
            declared = installed()  # a bad entry point is refused here, at every read until it is fixed
            self._experiments = {e.name: e for e, _ in declared}
            self._declared = {e.name: (e, by) for e, by in declared}
        return self._experiments

    def __getitem__(self, name: str) -> Experiment:
        return self._loaded()[name]

    def __setitem__(self, name: str, e: Experiment) -> None:
        self._loaded()[name] = e

    def __delitem__(self, name: str) -> None:
        del self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def distribution(self, name: str) -> str | None:
        """The distribution whose entry point declares the experiment called `name` (None: none, or one `register`
        added in its place)."""
        e, by = self._declared.get(name, (None, None))
        return by if e is not None and self.get(name) is e else None


EXPERIMENTS = Registry()
"""Every experiment, by name, in the report's order."""


def experiment(name: str) -> Experiment:
    """The experiment called `name`; refused in one line when the registry does not know it."""
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise StageReplayError(f"unknown experiment {name!r} (this stagereplay knows "
                               f"{', '.join(EXPERIMENTS)})", "install the package that declares the experiment that "
                               f"made the run (an entry point of the group {GROUP}), or upgrade stagereplay") from None


def of_stage(stage_name: str) -> Experiment:
    """The experiment of a manifest stage `<experiment>/<checkpoint>`."""
    return experiment(stage_name.partition("/")[0])


def register(e: Experiment) -> None:
    """Add (or replace) an experiment at run time: a test's."""
    EXPERIMENTS[e.name] = e


def unregister(name: str) -> None:
    EXPERIMENTS.pop(name, None)


def distribution(name: str) -> str | None:
    """The distribution that declares the experiment called `name` (None: one registered at run time)."""
    return EXPERIMENTS.distribution(name)


def starts_run(name: str) -> bool:
    """Whether the experiment called `name` makes runs (its records hold the prefixes later stages start from)."""
    e = EXPERIMENTS.get(name)
    return e is not None and e.shape.starts_run


def all_experiments() -> Iterator[Experiment]:
    """Every known experiment, in the report's order."""
    yield from list(EXPERIMENTS.values())
