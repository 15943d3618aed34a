"""The report's views of `results.json`: Markdown, the terminal (rich), and the report files on disk.

All three render the same `Table`s (`stagereplay.report.tables`), so they cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagereplay.records.ledger import atomic_output
from stagereplay.report.diagnostic_figures import diagnostic_figures
from stagereplay.report.explorer import explorer_html
from stagereplay.report.figures import build_figures
from stagereplay.report.html import render_html
from stagereplay.report.tables import Table, build_tables, load_results, run_summary
from stagereplay.report.verdict import verdict, verdict_text

if TYPE_CHECKING:
    from rich.console import Console


def render_markdown(results: dict[str, Any], tables: list[Table]) -> str:
    lines = ["# stagereplay report", ""]
    lines += [f"- **{k}**: {v}" for k, v in run_summary(results)]
    said = verdict_text(results)
    lines += ["", "## Verdict", "", said] if said else []
    lines += ["", "Figures are in `report.html` beside this file.", ""]
    lines += markdown_tables(tables)
    return "\n".join(lines).rstrip() + "\n"


def markdown_tables(tables: list[Table]) -> list[str]:
    """Each table as a titled Markdown table, its note below it: the lines of report.md and compare.md."""
    lines: list[str] = []
    for table in tables:
        lines += [f"## {table.title}", "", _md_row(table.headers), _md_row(("---",) * len(table.headers))]
        lines += [_md_row(row) for row in table.rows]
        lines += ["", table.note, ""] if table.note else [""]
    return lines


def _md_row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def print_tables(results: dict[str, Any], console: Console | None = None) -> None:
    """Print the tables to the terminal, as a CLI command does when it finishes."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = console or Console()
    for question, answer in verdict(results):
        console.print(f"{question} {answer[0].upper()}{answer[1:]}")
    for table in build_tables(results):
        if not table.terminal:
            continue
        rich = RichTable(title=table.title, caption=table.note or None, title_justify="left")
        for header, width in zip(table.headers, fit_widths(table, console.width), strict=True):
            rich.add_column(header, width=width, overflow="fold")
        for row in table.rows:
            rich.add_row(*row)
        console.print(rich)


def fit_widths(table: Table, width: int) -> list[int]:
    """Column widths that fit `width` and break cells only between words where the words allow it.

    rich shrinks the widest columns first, which cuts a one-word cell such as `oneshot->live` to `oneshot-…` in an
    80-column terminal. Here every column gets at least its longest word, and the room left is shared in
    proportion to what each column needs beyond that; only a table whose longest words alone overflow folds.
    """
    cells = [[table.headers[i], *(row[i] for row in table.rows)] for i in range(len(table.headers))]
    natural = [max((len(c) for c in col), default=1) for col in cells]
    least = [max((len(w) for c in col for w in c.split()), default=1) for col in cells]
    room = width - 3 * len(cells) - 1  # per column: a border and one space of padding each side; one more border
    if sum(natural) <= room:
        return natural
    spare, want = max(room - sum(least), 0), [n - m for n, m in zip(natural, least, strict=True)]
    total = sum(want) or 1
    return [m + spare * w // total for m, w in zip(least, want, strict=True)]


def write_report(run_dir: Path) -> tuple[Path, Path]:
    """Write `report.md` and a self-contained `report.html` into `run_dir`; return their paths.

    Both are written atomically (temporary file in the same folder, then `os.replace`), so an
    interrupted report never leaves a truncated file behind.
    """
    run_dir = Path(run_dir)
    results = load_results(run_dir / "results.json")
    tables = build_tables(results)
    figures = build_figures(results) + diagnostic_figures(results)
    page = render_html(run_summary(results), tables, figures, verdict(results), _explorer(run_dir))
    md_path, html_path = run_dir / "report.md", run_dir / "report.html"
    for path, text in ((md_path, render_markdown(results, tables)), (html_path, page)):
        with atomic_output(path) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return md_path, html_path


def _explorer(run_dir: Path) -> str:
    """The per-item explorer from the run's ledger; empty when the run has no ledger or no divergent item."""
    from stagereplay.records.ledger import read_ledger, read_manifest

    records = read_ledger(run_dir, strict=False)
    if not any(r.payload.get("diagnostics") for r in records):
        return ""
    return explorer_html(records, read_manifest(run_dir).stages)
