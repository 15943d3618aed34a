"""Command-line options made from the library's typed option groups, declared once: each field of a frozen dataclass
is an option (its name as `--field-name` unless its metadata names the flag, its type, its default, its `help`),
shown in the panel its class names (`panel`), and the values come back as the dataclass.

    Group(Inputs, "inputs")                   every field of Inputs' groups (Input, Boundary, ...) in their panels
    Group(Numerics, "numerics", hide={"precision"}, defaults={"batch": 0})    a command's own view of a group
    Group(VllmOptions, "vllm", given_only=True)   an engine's options: not given unless on the command line

`command(body, groups)` is a function typer registers as a command: its signature is made of the groups' options (and
any extra parameters), and it calls `body` with one built value per group. A nested dataclass field (Inputs.decode)
is a group of its own. A `tuple[str, ...]` field is a comma list on the command line.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from stagereplay.cli.app import guarded


@dataclass(frozen=True)
class Group:
    """One dataclass's fields as options of a command."""

    cls: type
    key: str
    """The name the command's body gets the built value under."""
    panel: str | None = None
    """The help panel (None: the class's `panel`, or its name)."""
    hide: frozenset[str] = frozenset()
    """Fields (dotted within nested groups: `input.shard`) the command does not take: they keep their defaults."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """A command's own defaults (dotted names)."""
    helps: Mapping[str, str] = field(default_factory=dict)
    """A command's own help texts (dotted names)."""
    flags: Mapping[str, str] = field(default_factory=dict)
    """A command's own flags (dotted names)."""
    given_only: bool = False
    """Every option defaults to not given (None), and the body gets a dict of the options given (an engine's, so that
    an option another engine takes is refused, never silently dropped)."""


@dataclass(frozen=True)
class _Option:
    """One field as an option: where it goes back (`path` within the group), and its parameter."""

    group: str
    path: tuple[str, ...]
    parameter: inspect.Parameter
    kind: Any


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _comma_list(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ...


def _options(group: Group, cls: type, prefix: tuple[str, ...], panel: str) -> list[_Option]:
    out: list[_Option] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        dotted = ".".join((*prefix, f.name))
        if dotted in group.hide or f.metadata.get("cli") is False:
            continue
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            sub_panel = f.metadata.get("panel") or getattr(tp, "panel", None) or tp.__name__
            out += _options(group, tp, (*prefix, f.name), sub_panel)
            continue
        default = group.defaults.get(dotted, _default(f))
        flag = group.flags.get(dotted) or f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        help_text = group.helps.get(dotted, f.metadata.get("help", ""))
        kind: Any = tp
        if _comma_list(tp):
            kind, default = (str | None), (None if default in ((), None) else ",".join(default))
            help_text += " (comma list)" if "comma" not in help_text else ""
        if group.given_only:
            if default not in (None, "", False, ...):
                help_text += f" (default {default})"
            kind, default = kind | None, None
        if tp is bool and "/" not in flag and (default is True or (group.given_only and _default(f) is True)):
            flag = f"{flag}/--no-{flag[2:]}"
        name = "__".join((group.key, *prefix, f.name))
        parameter = inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                                      # the help is text, not rich markup: `ENGINE[/SETTING]` is no closing tag
                                      default=typer.Option(default, flag, help=escape(help_text),
                                                           rich_help_panel=panel))
        out.append(_Option(group.key, (*prefix, f.name), parameter, tp))
    return out


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _build(cls: type, tree: Mapping[str, Any]) -> Any:
    """`cls` from the values given for its fields (nested dataclasses from their own), the rest at their defaults."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in tree:
            continue
        value = tree[f.name]
        kwargs[f.name] = _build(hints[f.name], value) if _is_dataclass_type(hints[f.name]) else value
    return cls(**kwargs)


def _value(option: _Option, raw: Any) -> Any:
    if _comma_list(option.kind):
        return None if raw is None else tuple(x.strip() for x in raw.split(","))  # "" is a name, refused by its group
    return raw


def command(body: Callable[..., None], groups: Sequence[Group], extra: Sequence[inspect.Parameter] = (),
            doc: str | None = None, arguments: Sequence[inspect.Parameter] = ()) -> Callable[..., None]:
    """A function typer can register as a command: its positional `arguments` first, then the groups' options and
    `extra`; it calls `body` with each group's built value under the group's key and each other parameter's value
    under its name."""
    options: list[_Option] = []
    for g in groups:
        options += _options(g, g.cls, (), g.panel or getattr(g.cls, "panel", None) or g.cls.__name__)
    flags = [decl for o in options for decl in o.parameter.default.param_decls]
    duplicated = sorted({f for f in flags if flags.count(f) > 1})
    if duplicated:
        raise TypeError(f"options declared twice on one command: {', '.join(duplicated)}")
    by_key = {g.key: g for g in groups}

    def run(**values: Any) -> None:
        trees: dict[str, dict[str, Any]] = {g.key: {} for g in groups}
        for o in options:
            raw = values.pop(o.parameter.name)
            group = by_key[o.group]
            if group.given_only and raw is None:  # not given (0 and --no-x are given)
                continue
            if _comma_list(o.kind) and raw is None:
                continue  # the field's own default
            _set(trees[o.group], o.path, _value(o, raw))
        # A value a group refuses (its __post_init__) is bad input: one line, as every other.
        built = guarded(lambda: {g.key: trees[g.key] if g.given_only else _build(g.cls, trees[g.key])
                                 for g in groups})
        body(**built, **values)

    parameters = [*arguments, *(o.parameter for o in options), *extra]
    run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what typer reads
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    run.__doc__ = doc or body.__doc__
    return run


def run_dir_argument() -> inspect.Parameter:
    """RUN_DIR: the run a command reads or extends."""
    return inspect.Parameter("run_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Path, default=typer.Argument(
        ..., help="a run directory made by `stagereplay matched` or `paper`"))


def flags_of(cls: type) -> list[str]:
    """The flags a dataclass's fields become (nested groups included), as a command shows them."""
    return [decl for o in _options(Group(cls, "x"), cls, (), "") for decl in o.parameter.default.param_decls]
