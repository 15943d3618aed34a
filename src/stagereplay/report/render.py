"""The report's views of `results.json`: Markdown, the terminal (rich), and the report files on disk.

All three render the same `Table`s (`stagereplay.report.tables`), so they cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagereplay.records.ledger import atomic_output
from stagereplay.report.figures import build_figures
from stagereplay.report.html import render_html
from stagereplay.report.tables import Table, build_tables, load_results, run_summary

if TYPE_CHECKING:
    from rich.console import Console


def render_markdown(results: dict[str, Any], tables: list[Table]) -> str:
    lines = ["# stagereplay report", ""]
    lines += [f"- **{k}**: {v}" for k, v in run_summary(results)]
    lines += ["", "Figures are in `report.html` beside this file.", ""]
    for table in tables:
        lines += [f"## {table.title}", "", _md_row(table.headers), _md_row(("---",) * len(table.headers))]
        lines += [_md_row(row) for row in table.rows]
        lines += ["", table.note, ""] if table.note else [""]
    return "\n".join(lines).rstrip() + "\n"


def _md_row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def print_tables(results: dict[str, Any], console: Console | None = None) -> None:
    """Print the tables to the terminal, as a CLI command does when it finishes."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console()
    for table in build_tables(results):
        if not table.terminal:
            continue
        rich = RichTable(title=table.title, caption=table.note or None, title_justify="left")
        for header in table.headers:
            rich.add_column(header)
        for row in table.rows:
            rich.add_row(*row)
        console.print(rich)


def render_tables_text(results: dict[str, Any], width: int = 120) -> str:
    """The terminal tables as plain text (no colour codes), for logs and tests."""
    import io

    from rich.console import Console

    buffer = io.StringIO()
    print_tables(results, Console(file=buffer, width=width, color_system=None, force_terminal=False))
    return buffer.getvalue()


def write_report(run_dir: Path) -> tuple[Path, Path]:
    """Write `report.md` and a self-contained `report.html` into `run_dir`; return their paths.

    Both are written atomically (temporary file in the same folder, then `os.replace`), so an
    interrupted report never leaves a truncated file behind.
    """
    run_dir = Path(run_dir)
    results = load_results(run_dir / "results.json")
    tables = build_tables(results)
    page = render_html(run_summary(results), tables, build_figures(results))
    md_path, html_path = run_dir / "report.md", run_dir / "report.html"
    for path, text in ((md_path, render_markdown(results, tables)), (html_path, page)):
        with atomic_output(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return md_path, html_path
