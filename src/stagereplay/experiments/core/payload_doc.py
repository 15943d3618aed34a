"""docs/ledger-schema.md's tables of the payload models (each registered experiment's, `Experiment.payload_models`:
the protocol's with the parts they share, then mismatch's, then attest's), between its markers, generated:

    python -m stagereplay.experiments.core.payload_doc --markdown                        # print them
    python -m stagereplay.experiments.core.payload_doc --write docs/ledger-schema.md     # put them in the page

tests/test_payloads.py fails when the page's tables are not what the models give.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel

from stagereplay.experiments.core.registry import all_experiments


def models() -> tuple[type[BaseModel], ...]:
    """Every payload model the ledger holds, in the order the page shows them: each experiment's in the registry's
    order, a model two of them declare shown once, where it first appears."""
    return tuple(dict.fromkeys(m for e in all_experiments() for m in e.payload_models))

BEGIN, END = "<!-- generated: payload models -->", "<!-- end generated -->"


def _type(t: Any) -> str:
    """An annotation as the doc writes it: `list[int]`, `str | null`, `"ok"`, a model by name."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None) or t is None:
        return "null"
    if origin is Annotated:
        return _type(args[0])
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is tuple:
        return "[" + ", ".join(_type(a) for a in args) + "]"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    return str(getattr(t, "__name__", t))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe in a table cell, code spans included, must be escaped


def markdown(shown: Sequence[type[BaseModel]] | None = None) -> str:
    """A table per model (`models()` unless `shown`): each field, its type, whether every record has it, and its
    description."""
    out = []
    for model in models() if shown is None else shown:
        out += [f"### `{model.__name__}`", "", " ".join((model.__doc__ or "").split()), "",
                "| field | type | always | meaning |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            always = "yes" if field.is_required() else "no"
            meaning = _cell(field.description or "")
            out.append(f"| `{name}` | `{_cell(_type(field.annotation))}` | {always} | {meaning} |")
        if model.model_config.get("extra") == "allow":  # fields named by the data (a sweep row's directions)
            extra = typing.get_type_hints(model)["__pydantic_extra__"]
            out.append(f"| any other | `{_cell(_type(typing.get_args(extra)[1]))}` | no | named by the record's "
                       "data, as the model's description says |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def generated_section(text: str) -> str:
    """What lies between the doc's markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"no section between {BEGIN} and {END}")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_section(text: str, section: str) -> str:
    """`text` with what lies between its markers replaced by `section`."""
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{section}{END}{rest.split(END, 1)[1]}"


def main(argv: Sequence[str]) -> int:
    """`--markdown`: print the tables; `--write PATH`: put them between PATH's markers."""
    if list(argv) == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if len(argv) == 2 and argv[0] == "--write":
        path = Path(argv[1])
        path.write_text(with_section(path.read_text(encoding="utf-8"), markdown()), encoding="utf-8")
        return 0
    sys.stderr.write("usage: python -m stagereplay.experiments.core.payload_doc --markdown | --write docs/ledger-schema.md\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
