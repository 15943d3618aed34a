"""The self-contained HTML report: inline CSS, figures as inline base64 PNG, no external URL.

It must open offline, from an e-mail attachment or an archived run folder, years later. A short inline
script records on `<body data-images-loaded="N/M">` how many figures decoded, which the browser test
reads back from the rendered DOM.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagereplay.experiments.core.figures import ReportFigure
    from stagereplay.report.tables import Table

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 72rem;
       padding: 0 1rem; color: #1a202c; line-height: 1.45; }
h1 { font-size: 1.6rem; margin-bottom: .25rem; }
h2 { font-size: 1.15rem; margin-top: 2rem; border-bottom: 1px solid #e2e8f0; padding-bottom: .2rem; }
dl.run { display: grid; grid-template-columns: max-content auto; gap: .1rem 1rem; font-size: .9rem; }
dl.run dt { font-weight: 600; } dl.run dd { margin: 0; font-family: ui-monospace, monospace; }
table { border-collapse: collapse; margin: .5rem 0; font-size: .9rem; }
th, td { border: 1px solid #cbd5e0; padding: .3rem .6rem; text-align: left; vertical-align: top; }
th { background: #edf2f7; } tbody tr:nth-child(even) { background: #f7fafc; }
td { font-variant-numeric: tabular-nums; }
p.note { font-size: .85rem; color: #4a5568; margin: .2rem 0 1rem; max-width: 60rem; }
figure { margin: 1rem 0 2rem; } figure img { max-width: 100%; height: auto; border: 1px solid #e2e8f0; }
figcaption { font-size: .85rem; color: #4a5568; max-width: 60rem; }
nav ul { font-size: .9rem; columns: 2; }
p.verdict { max-width: 60rem; background: #f7fafc; border-left: 3px solid #2b6cb0; padding: .5rem .8rem; }
"""

_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-loaded", ok + "/" + imgs.length);
});
"""


def render_html(run: list[tuple[str, str]], tables: list[Table], figures: list[ReportFigure],
                verdict: Sequence[tuple[str, str]] = (), explorer: str = "") -> str:
    """The whole page. `run` is (label, value) pairs for the header; every string is escaped.

    `verdict` is (question, answer) pairs shown first; `explorer` is the per-item section
    (`report.explorer.explorer_html`, already escaped), shown last.
    """
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>stagereplay report</title>",
        f"<style>{_CSS}</style></head>",
        '<body data-images-loaded="pending">',
        "<h1>stagereplay report</h1>",
        '<dl class="run">',
        *(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in run),
        "</dl>",
        _verdict(verdict),
        _nav(tables, figures, bool(explorer)),
        "<main>",
        *_body(tables, figures),
        explorer,
        "</main>",
        f"<script>{_SCRIPT}</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _body(tables: list[Table], figures: list[ReportFigure]) -> list[str]:
    """Tables in order, each figure right after the last table it illustrates."""
    placed: dict[int, list[ReportFigure]] = {}
    for f in figures:
        hits = [i for i, t in enumerate(tables) if any(_matches(t.id, p) for p in f.after)]
        placed.setdefault(hits[-1] if hits else len(tables), []).append(f)
    out: list[str] = []
    for i in range(len(tables) + 1):
        if i < len(tables):
            out.append(_table(tables[i]))
        out.extend(_figure(f) for f in placed.get(i, []))
    return out


def _matches(table_id: str, pattern: str) -> bool:
    return table_id.startswith(pattern) if pattern.endswith("-") else table_id == pattern


def _verdict(verdict: Sequence[tuple[str, str]]) -> str:
    if not verdict:
        return ""
    said = " ".join(f"<strong>{escape(q)}</strong> {escape(a[0].upper() + a[1:])}" for q, a in verdict)
    return f'<h2 id="verdict">Verdict</h2><p class="verdict">{said}</p>'


def _nav(tables: list[Table], figures: list[ReportFigure], explorer: bool = False) -> str:
    links = [f'<li><a href="#{escape(t.id)}">{escape(t.title)}</a></li>' for t in tables]
    links += [f'<li><a href="#{escape(f.id)}">Figure: {escape(f.title)}</a></li>' for f in figures]
    links += ['<li><a href="#explorer">Divergent items</a></li>'] if explorer else []
    return "<nav><ul>" + "".join(links) + "</ul></nav>"


def _table(t: Table) -> str:
    head = "".join(f'<th scope="col">{escape(h)}</th>' for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in t.rows)
    note = f'<p class="note">{escape(t.note)}</p>' if t.note else ""
    return (
        f'<h2>{escape(t.title)}</h2><table id="{escape(t.id)}">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"
    )


def _figure(f: ReportFigure) -> str:
    data = base64.b64encode(f.png).decode("ascii")
    return (
        f'<figure id="{escape(f.id)}"><h2>{escape(f.title)}</h2>'
        f'<img alt="{escape(f.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{escape(f.caption)}</figcaption></figure>"
    )
