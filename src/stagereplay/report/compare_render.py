"""A comparison of two runs (`experiments.core.compared.RunComparison`, each experiment's own) written and printed:
compare.json, compare.md and a self-contained compare.html, its renderer-neutral `Table`s rendered as `report.render`
does a run's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stagereplay.experiments.core.compared import RunComparison
from stagereplay.records.ledger import atomic_write
from stagereplay.report.html import render_html
from stagereplay.report.render import markdown_tables, print_table

if TYPE_CHECKING:
    from rich.console import Console

FILES = ("compare.json", "compare.md", "compare.html")


def write_compare(out: Path, comparison: RunComparison) -> list[Path]:
    """compare.json, compare.md and a self-contained compare.html in `out`, each written atomically."""
    c = comparison
    page = render_html(c.header, c.tables, c.figures, c.verdict)
    page = page.replace("<title>stagereplay report</title>", "<title>stagereplay compare</title>", 1)
    page = page.replace("<h1>stagereplay report</h1>", "<h1>stagereplay compare</h1>", 1)
    texts = (c.document.write(), compare_markdown(c), page)
    paths = [out / name for name in FILES]
    for path, text in zip(paths, texts, strict=True):
        atomic_write(path, text)
    return paths


def compare_markdown(c: RunComparison) -> str:
    lines = ["# stagereplay compare", ""]
    lines += [f"- **{k}**: {v}" for k, v in c.header]
    lines += [""] + [f"**{q}** {a[0].upper()}{a[1:]}\n" for q, a in c.verdict]
    lines += [f"The figure{'s are' if len(c.figures) > 1 else ' is'} in `compare.html` beside this file.", ""] if c.figures else []
    lines += markdown_tables(c.tables)
    return "\n".join(lines).rstrip() + "\n"


def print_compare(c: RunComparison, console: Console | None = None) -> None:
    """The answers and the short tables, on the terminal."""
    from rich.console import Console

    console = console or Console()
    for question, answer in c.verdict:
        console.print(f"{question} {answer[0].upper()}{answer[1:]}", highlight=False)
    for table in c.tables:
        if table.terminal:
            print_table(table, console)
