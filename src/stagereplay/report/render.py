"""The report's views of `results.json`: Markdown, the terminal (rich), and the report files on disk.

All three render the same `Table`s (`stagereplay.report.tables`), so they cannot disagree.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stagereplay.records.ledger import atomic_output
from stagereplay.report.diagnostic_figures import diagnostic_figures
from stagereplay.report.explorer import explorer_html
from stagereplay.report.figures import build_figures
from stagereplay.report.html import render_html
from stagereplay.report.results import Results
from stagereplay.report.tables import Table, build_tables, load_results, run_summary
from stagereplay.report.verdict import verdict, verdict_text

if TYPE_CHECKING:
    from rich.console import Console


def render_markdown(results: Results, tables: list[Table]) -> str:
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


def print_tables(results: Results, console: Console | None = None) -> None:
    """Print the tables to the terminal, as a CLI command does when it finishes."""
    from rich.console import Console

    console = console or Console()
    for question, answer in verdict(results):
        console.print(f"{question} {answer[0].upper()}{answer[1:]}")
    for table in build_tables(results):
        if table.terminal:
            print_table(table, console, caption=True)


def print_table(table: Table, console: Console, caption: bool = False) -> None:
    """One table on the terminal, legible at its width: cells wrap between words (`fit_widths`), and a table whose
    headers' words do not fit side by side is printed as several, each with the first column and as many of the
    others as fit (`column_groups`), so that no header is broken inside a word."""
    from rich.table import Table as RichTable

    groups = column_groups(table, console.width)
    for n, columns in enumerate(groups):
        part = Table(table.id, table.title + (f" ({n + 1}/{len(groups)})" if len(groups) > 1 else ""),
                     tuple(table.headers[i] for i in columns), tuple(tuple(row[i] for i in columns)
                                                                    for row in table.rows), table.note)
        rich = RichTable(title=part.title, caption=(table.note or None) if caption and n == len(groups) - 1 else None,
                         title_justify="left")
        for header, width in zip(part.headers, fit_widths(part, console.width), strict=True):
            rich.add_column(header, width=width, overflow="fold")
        for row in part.rows:
            rich.add_row(*row)
        console.print(rich)


def column_groups(table: Table, width: int) -> list[list[int]]:
    """The table's columns in groups that fit `width` side by side, each group led by the first column: one group
    where every header's longest word fits beside the others (and each column its longest cell word up to
    `WORD_FOLD` characters)."""
    def floor(i: int) -> int:
        cells = [table.headers[i], *(row[i] for row in table.rows)]
        head = max((len(w) for w in table.headers[i].split()), default=1)
        return max(head, min(max((len(w) for c in cells for w in c.split()), default=1), WORD_FOLD))

    floors = [floor(i) for i in range(len(table.headers))]
    if sum(floors) + 3 * len(floors) + 1 <= width or len(floors) < 3:
        return [list(range(len(floors)))]
    groups: list[list[int]] = []
    group, used = [0], floors[0] + 4
    for i in range(1, len(floors)):
        if len(group) > 1 and used + floors[i] + 3 > width:
            groups.append(group)
            group, used = [0], floors[0] + 4
        group.append(i)
        used += floors[i] + 3
    return [*groups, group]


WORD_FOLD = 12
"""The most characters of a cell's longest word a column is sized to keep whole when columns are grouped; a longer
word (a hash, a path) folds."""


def fit_widths(table: Table, width: int) -> list[int]:
    """Column widths that fit `width` and break cells only between words where the words allow it.

    rich shrinks the widest columns first, which cuts a one-word cell such as `oneshot->live` to `oneshot-…` in an
    80-column terminal, and squeezes a column to nothing beside a long one-word cell (a hash). Here every column
    gets at least its longest word, and the room left is shared in proportion to what each column needs beyond
    that. Where the longest words alone overflow, every column keeps its header's longest word (a header is never
    broken inside a word) and the room left is shared out evenly, no column given more than its longest word needs
    (`_water_fill`): the long cells fold.
    """
    cells = [[table.headers[i], *(row[i] for row in table.rows)] for i in range(len(table.headers))]
    natural = [max((len(c) for c in col), default=1) for col in cells]
    least = [max((len(w) for c in col for w in c.split()), default=1) for col in cells]
    room = width - 3 * len(cells) - 1  # per column: a border and one space of padding each side; one more border
    if sum(natural) <= room:
        return natural
    if sum(least) > room:
        heads = [max((len(w) for w in h.split()), default=1) for h in table.headers]
        return _water_fill(heads, least, room)
    spare, want = max(room - sum(least), 0), [n - m for n, m in zip(natural, least, strict=True)]
    total = sum(want) or 1
    return [m + spare * w // total for m, w in zip(least, want, strict=True)]


def _water_fill(floor: list[int], need: list[int], room: int) -> list[int]:
    """Widths from `floor` up to `need`, the room beyond the floors shared evenly: the columns that need least get
    all they need, the rest share what is left alike."""
    widths = list(floor)
    spare = room - sum(floor)
    open_ = sorted((i for i in range(len(need)) if need[i] > floor[i]), key=lambda i: need[i] - floor[i])
    while open_ and spare > 0:
        share = max(spare // len(open_), 1)
        i = open_.pop(0)
        add = min(need[i] - widths[i], share)
        widths[i] += add
        spare -= add
    return widths


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

    return explorer_html(read_ledger(run_dir, strict=False), read_manifest(run_dir).stages)
