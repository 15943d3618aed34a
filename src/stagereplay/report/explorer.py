"""One compared pair's story, from its ledger record: prompt, stage 1, the two suffixes aligned at the first
divergent token, each arm's margin and top-5 there, and the per-layer cache difference.

Stories come from matched records (live vs the fresh construction) and fixed-prefix 2x2 records (the
constructions compared at one precision). The report's per-item explorer (`explorer_html`, one anchor
`id="item-<item_id>"` per divergent item) and the terminal's `stagereplay show RUN ITEM` (`print_story`) render
the same `Story`. Token texts come from the record itself (`token_texts`, each token decoded alone when the
record was made), so the report reads records, never a model or tokenizer; a record made before token texts
were recorded prints its tokens as `<id>`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from stagereplay.experiments.core.registry import experiment
from stagereplay.records.ledger import Record
from stagereplay.records.manifest import StageSection
from stagereplay.records.payload_readers import Diagnosed
from stagereplay.records.payloads import Arm, CacheDiff, Divergence

if TYPE_CHECKING:
    from rich.console import Console

Decoder = Callable[[int], str]
CONTEXT_CHARS = 60  # how much of the common text before the divergent token is shown


@dataclass(frozen=True)
class Story:
    """One compared pair of one item (matched: live vs the fresh construction; 2x2: the first two constructions
    at one precision)."""

    item_id: str
    checkpoint: str
    precision: str
    a: str
    b: str
    prompt: tuple[int, ...]
    stage1: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], tuple[int, ...]]
    correct: tuple[bool, bool]
    first_step_logit_maxabs: float | None
    divergence: Divergence | None  # the first divergent step, both arms' margins and top-5 there; None if equal
    cache: CacheDiff | None  # per layer and position band (engine.diagnostics.cache_difference)
    experiment: str = "matched"
    texts: dict[str, str] | None = None  # the record's token_texts: token id (as text) -> its text
    label: str = ""  # how the report names the experiment's pairs beside the checkpoint ('' for matched's)

    @property
    def where(self) -> str:
        """`primary` for a matched pair, `primary, 2x2` for a fixed-prefix one (the experiment's `label`)."""
        return f"{self.checkpoint}, {self.label}" if self.label else self.checkpoint

    def decoder(self) -> Decoder:
        """Token id -> its recorded text (newlines shown as ⏎), or `<id>` when the record has none."""
        texts = self.texts or {}

        def decode(token: int) -> str:
            text = texts.get(str(token))
            return f"<{token}>" if text is None else text.replace("\n", "⏎")

        return decode

    @property
    def anchor(self) -> str:
        return f"item-{self.item_id}"


def _precision(arm: Arm, stage: StageSection | None) -> str:
    """What an arm ran at: a serving engine that computes in its own types says it (its stage's `runs_at`); any
    other arm (ours, a --cross arm) ran at its recorded precision."""
    if stage is not None and stage.runs_at and stage.engine is not None and arm.engine == stage.engine.name:
        return stage.runs_at
    return arm.precision


def stories(records: list[Record], item_id: str | None = None,
            stages: Mapping[str, StageSection] | None = None) -> list[Story]:
    """Every item record with diagnostics (of `item_id` only, when given), as the story of its first comparison:
    live vs the construction (matched), the first two constructions (2x2, one per precision), and so on. `stages`:
    the manifest's, which say what a serving engine's arms ran at."""
    out = []
    for r in records:
        if r.kind != "item" or (item_id is not None and r.item_id != item_id):
            continue
        kind = experiment(r.experiment)
        if not kind.shape.continuations:
            continue
        try:
            own = kind.read(r)  # as its experiment's own model
            p = Diagnosed.model_validate(r.payload)  # what a story reads of it
        except ValidationError:  # a record that is not its model is the audit's finding; the report goes on
            continue
        if getattr(own, "diagnostics", None) is None:
            continue
        if not p.diagnostics or not p.comparisons or p.prefix_ids is None:  # (each reached its boundary)
            continue
        main = p.comparisons[0]  # matched records list live vs the construction first; 2x2 the first pair
        a, b = main.a, main.b
        arms = {arm.name: arm for arm in p.arms}
        diag = p.diagnostics.pairs.get(f"{a} vs {b}")
        out.append(Story(
            item_id=r.item_id, checkpoint=r.checkpoint, a=a, b=b,
            precision=_precision(arms[a], (stages or {}).get(f"{r.experiment}/{r.checkpoint}")),
            prompt=tuple(p.prompt_ids), stage1=tuple(p.prefix_ids[len(p.prompt_ids):]),
            suffixes=(tuple(arms[a].suffix_ids), tuple(arms[b].suffix_ids)),
            correct=(arms[a].correct, arms[b].correct),
            first_step_logit_maxabs=diag.first_step_logit_maxabs if diag else None,
            divergence=diag.divergence if diag else None, cache=diag.cache if diag else None,
            experiment=r.experiment, texts=p.token_texts,
            label=experiment(r.experiment).shape.label,
        ))
    return out


def _text(ids: tuple[int, ...], decode: Decoder) -> str:
    return "".join(decode(t) for t in ids)


def aligned(story: Story, decode: Decoder) -> tuple[str, tuple[str, str], tuple[str, str]]:
    """(common text before the divergence, trimmed), and per arm (its divergent token, the rest of its suffix)."""
    d = story.divergence.step if story.divergence else len(story.suffixes[0])
    common = _text(story.suffixes[0][:d], decode)
    if len(common) > CONTEXT_CHARS:
        common = "…" + common[-CONTEXT_CHARS:]
    a, b = ((decode(s[d]) if d < len(s) else "", _text(s[d + 1 :], decode)) for s in story.suffixes)
    return common, a, b


def _num(x: float | None) -> str:
    return "-" if x is None else "0" if x == 0 else f"{x:.3g}"


def margins_line(story: Story) -> str:
    d = story.divergence
    first = f"max-abs logit difference at the first suffix step {_num(story.first_step_logit_maxabs)}"
    if d is None:
        return f"Suffixes agree; {first}."
    return (f"Margin (top-1 minus top-2 logit) at suffix token {d.step}: {story.a} {_num(d.a.margin)}, "
            f"{story.b} {_num(d.b.margin)}; max-abs logit difference there {_num(d.logit_maxabs)}; {first}.")


def top_rows(story: Story, decode: Decoder) -> list[tuple[str, str, str, str, str]]:
    """(rank, token a, logit a, token b, logit b) at the first divergent step."""
    d = story.divergence
    if d is None:
        return []
    ta, tb = d.a.top, d.b.top
    return [(str(i + 1), repr(decode(x[0]))[1:-1], _num(x[1]), repr(decode(y[0]))[1:-1], _num(y[1]))
            for i, (x, y) in enumerate(zip(ta, tb, strict=False))]


def layer_rows(story: Story) -> list[tuple[str, str, str, str, str]]:
    """(layer, K rel L2, V rel L2, K max-abs, V max-abs) of the live vs fresh cache."""
    if not story.cache or not story.cache.layers:
        return []
    return [(str(row.layer), _num(row.k.rel_l2), _num(row.v.rel_l2), _num(row.k.maxabs), _num(row.v.maxabs))
            for row in story.cache.layers]


# --- HTML ----------------------------------------------------------------------------------------

_CSS = """
section.item { border-top: 1px solid #e2e8f0; padding: .4rem 0 .8rem; }
section.item h3 { font-size: 1rem; margin: .4rem 0; } section.item h3 small { font-weight: normal; color: #4a5568; }
section.item:target { background: #fffbea; }
.align { overflow-x: auto; font-family: ui-monospace, monospace; font-size: .85rem; white-space: pre; }
.align .arm { display: inline-block; width: 11rem; color: #4a5568; font-family: system-ui, sans-serif; }
.align .same { color: #718096; } .align mark { background: #fbd38d; font-weight: 600; }
.ctx { font-size: .8rem; color: #4a5568; overflow-wrap: anywhere; }
.scroll { overflow-x: auto; } table.cache td, table.top5 td { font-family: ui-monospace, monospace; }
"""


def _mark(token: str) -> str:
    return f"<mark>{escape(token)}</mark>" if token else "<mark>(ended)</mark>"


def story_html(story: Story) -> str:
    decode = story.decoder()
    common, (ta, ra), (tb, rb) = aligned(story, decode)
    ok = {True: "✓", False: "✗"}
    lines = [f'<div><span class="arm">{escape(name)} {ok[c]}</span><span class="same">{escape(common)}</span>'
             f"{_mark(tok)}{escape(rest)}</div>"
             for name, c, tok, rest in ((story.a, story.correct[0], ta, ra), (story.b, story.correct[1], tb, rb))]
    step = story.divergence.step if story.divergence else None
    top = top_rows(story, decode)
    top_html = ""
    if top:
        head = (f"<tr><th>rank</th><th>{escape(story.a)}</th><th>logit</th><th>{escape(story.b)}</th>"
                "<th>logit</th></tr>")
        body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in top)
        top_html = f'<table class="top5"><thead>{head}</thead><tbody>{body}</tbody></table>'
    cache_html = ""
    layers = layer_rows(story)
    if layers:
        cols = "".join(f"<th>layer {escape(r[0])}</th>" for r in layers)
        k = "".join(f"<td>{escape(r[1])}</td>" for r in layers)
        v = "".join(f"<td>{escape(r[2])}</td>" for r in layers)
        cache_html = (f'<div class="scroll"><table class="cache"><thead><tr><th>cache, rel. L2</th>{cols}</tr>'
                      f"</thead><tbody><tr><th>K</th>{k}</tr><tr><th>V</th>{v}</tr></tbody></table></div>")
    return (
        f'<section class="item" id="{escape(story.anchor)}"><h3>{escape(story.item_id)} <small>'
        f"{escape(story.where)} · {escape(story.a)} vs {escape(story.b)} @ {escape(story.precision)} · "
        f"first divergence at suffix token {step}</small></h3>"
        f'<p class="ctx">prompt: <code>{escape(_text(story.prompt, decode))}</code> · stage 1: '
        f"<code>{escape(_text(story.stage1, decode))}</code></p>"
        f'<div class="align">{"".join(lines)}</div>{top_html}'
        f'<p class="note">{escape(margins_line(story))}</p>{cache_html}</section>'
    )


def explorer_html(records: list[Record], stages: Mapping[str, StageSection] | None = None) -> str:
    """The explorer section: an index of divergent pairs (matched and 2x2), then one section per pair, the first of
    each item anchored. Empty if none."""
    mine = [s for s in stories(records, stages=stages) if s.divergence is not None]
    if not mine:
        return ""
    seen: set[str] = set()
    rows, sections = [], []
    for s in mine:
        d = s.divergence
        assert d is not None
        rows.append(f'<tr><td><a href="#{escape(s.anchor)}">{escape(s.item_id)}</a></td><td>{escape(s.where)}'
                    f"</td><td>{escape(s.a)} vs {escape(s.b)} @ {escape(s.precision)}</td><td>{d.step}</td>"
                    f"<td>{_num(d.a.margin)}</td><td>{_num(d.b.margin)}</td><td>{_num(d.logit_maxabs)}</td></tr>")
        if s.item_id in seen:  # the same item diverged in another pair (2x2, a second checkpoint): one anchor
            sections.append(story_html(s).replace(f'id="{escape(s.anchor)}"', "", 1))
        else:
            sections.append(story_html(s))
        seen.add(s.item_id)
    index = ('<table id="table-explorer"><thead><tr><th>item</th><th>checkpoint</th><th>pair</th>'
             "<th>first divergence</th><th>margin, first arm</th><th>margin, second arm</th>"
             "<th>logit max-abs diff</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")
    note = ('<p class="note">Every compared pair whose suffixes differ: live vs fresh (matched), and the fixed-prefix '
            "constructions at each precision (2x2). Margin: the top-1 minus top-2 fp32 logit at the first divergent "
            "token; the highlighted token is where the suffixes part.</p>")
    return (f'<style>{_CSS}</style><h2 id="explorer">Divergent items ({len(seen)})</h2>{index}{note}'
            + "".join(sections))


# --- terminal ------------------------------------------------------------------------------------


def print_story(story: Story, console: Console) -> None:
    """`stagereplay show`: the story in a terminal, readable at 80 columns."""
    decode = story.decoder()
    from rich.table import Table
    from rich.text import Text

    console.print(Text(f"{story.item_id} · {story.where} · {story.a} vs {story.b} @ {story.precision}",
                       style="bold"))
    console.print(Text("prompt:  ") + Text(_text(story.prompt, decode)))
    console.print(Text("stage 1: ") + Text(_text(story.stage1, decode)))
    if story.divergence is None:
        label = f"both ({'correct' if story.correct[0] else 'wrong'})"
        console.print(Text(f"{label}: ") + Text(_text(story.suffixes[0], decode)), overflow="fold")
    else:
        # The divergent token in brackets (and reversed where the terminal has styles): both rows share the text
        # before it, so the brackets line up.
        common, a, b = aligned(story, decode)
        width = max(len(story.a), len(story.b)) + 11
        for name, c, (tok, rest) in ((story.a, story.correct[0], a), (story.b, story.correct[1], b)):
            line = Text(f"{name} ({'correct' if c else 'wrong'})".ljust(width)) + Text(common, style="dim")
            line += Text(f"[{tok or '(ended)'}]", style="reverse bold") + Text(rest)
            console.print(line, overflow="fold")
    console.print(margins_line(story))
    top = top_rows(story, decode)
    if top:
        table = Table(title="Top 5 at the first divergent token", title_justify="left")
        for header in ("rank", story.a, "logit", story.b, "logit"):
            table.add_column(header, overflow="fold")
        for row in top:
            table.add_row(*row)
        console.print(table)
    layers = layer_rows(story)
    if layers:
        table = Table(title=f"Cache, {story.a} vs {story.b}, per layer", title_justify="left")
        for header in ("layer", "K rel L2", "V rel L2", "K max-abs", "V max-abs"):
            table.add_column(header, justify="right")
        for row in layers:
            table.add_row(*row)
        console.print(table)
        bands = Table(title=f"Cache, {story.a} vs {story.b}, per position band (all layers)", title_justify="left")
        for header in ("band", "positions", "K rel L2", "V rel L2", "K max-abs", "V max-abs"):
            bands.add_column(header, justify="right")
        for band in story.cache.bands if story.cache else []:
            bands.add_row(band.band, f"{band.start}-{band.end - 1}", _num(band.k.rel_l2), _num(band.v.rel_l2),
                          _num(band.k.maxabs), _num(band.v.maxabs))
        console.print(bands)


def show_item(run_dir: Path, item_id: str, checkpoint: str | None = None, console: Console | None = None) -> None:
    """Print every story of `item_id` in the run (of one checkpoint, when given): each compared pair with
    diagnostics (matched, 2x2, bridge), and what each other experiment tells of its records of the item
    (`Experiment.told`)."""
    from rich.console import Console
    from rich.text import Text

    from stagereplay.errors import StageReplayError
    from stagereplay.records.ledger import items, read_ledger, read_manifest

    manifest = read_manifest(run_dir)  # a folder that is not a run stops here, with its one-line error
    records = [r for r in items(read_ledger(run_dir, strict=False))
               if checkpoint in (None, r.checkpoint) and r.item_id == item_id]
    if not records:
        raise StageReplayError(f"item {item_id!r} is not in this run", "pick an item id from the report's items")
    found = stories(records, item_id, manifest.stages)
    console = console or Console()
    for story in found:
        print_story(story, console)
    storied = {(s.experiment, s.checkpoint) for s in found}
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        if (r.experiment, r.checkpoint) not in storied:
            groups.setdefault((r.experiment, r.checkpoint), []).append(r)
    for (name, at), group in groups.items():
        console.print(Text(f"{item_id} · {name} · {at}", style="bold"))
        for line in experiment(name).told(group):
            console.print(Text(line), overflow="fold")
