"""Two matched runs' comparison as `compare` writes and prints it (`matched_comparison`): compare.json's answers first,
then what differs, the trajectories, the arms and the divergent items, as renderer-neutral `Table`s, and the figure
that places each divergent item's first divergence against the margins there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stagereplay.experiments.core.compared import RunComparison, differences_answer, differences_table
from stagereplay.experiments.core.difference import PairedDifference
from stagereplay.experiments.core.figures import ReportFigure, png
from stagereplay.experiments.core.format import NA, Table, as_rows, k_of_n, p_value, pct, points
from stagereplay.experiments.protocol.compare_document import (
    BOUNDARY,
    ArmSummary,
    ComparedItem,
    CompareDocument,
    Count,
    RunInfo,
    Side,
)
from stagereplay.records.payloads import TopEntry

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def matched_comparison(c: CompareDocument) -> RunComparison:
    """Two matched runs' comparison as `compare` writes and prints it."""
    return RunComparison(c, header(c), compare_verdict(c), compare_tables(c), [divergence_figure(c)])


def header(c: CompareDocument) -> list[tuple[str, str]]:
    def named(r: RunInfo) -> str:
        engine = "our engine" if r.engine == "ours" else f"{r.engine} engine"
        return f"{r.path}: a {r.command} run of {r.created}, {engine}, {r.precision}"

    return [*((side.upper(), named(r)) for side, r in c.runs.by_side()), ("checkpoint", c.checkpoint),
            ("compare.json schema", str(c.schema_version))]


def compare_verdict(c: CompareDocument) -> list[tuple[str, str]]:
    """(question, answer) pairs: the trajectories, each run's self-consistency, the live labels, what differs."""
    t = c.trajectories
    eq, where = t.equal, t.first_divergence_in
    if eq.n and eq.k == eq.n:
        same = f"yes: on all {eq.n} items, stage 1 and suffix, token for token."
    else:
        same = (f"equal on {eq.k} of {eq.n} items; {where.stage1} first diverge in stage 1, {where.suffix} in the "
                f"suffix" + (f", {where.boundary} where one run's stage 1 ended" if where.boundary else "") + ".")
    inexact = c.replicas.a.live_inexact, c.replicas.b.live_inexact
    if not inexact[0] and not inexact[1]:
        consistent = "yes: every live replica is exact in both runs."
    else:
        consistent = (f"no: A's live replica differs on {len(inexact[0])} item(s), B's on {len(inexact[1])}: "
                      "a difference between the runs on those items says nothing of their settings.")
    answers = [("Same live trajectories?", same), ("Is each run self-consistent?", consistent)]
    live = c.arm("live")
    if live and live.n and live.accuracy_diff is not None:
        d = live.accuracy_diff
        answers.append(("Same answers?", f"live's correctness labels disagree on {_count(live.label_disagreements)}"
                        f" items; accuracy A {pct(live.accuracy.a)}, B {pct(live.accuracy.b)}, A - B "
                        f"{points(d.estimate)} points [{points(d.ci[0])}, {points(d.ci[1])}], McNemar p "
                        f"{p_value(live.mcnemar_p)}."))
    answers.append(differences_answer(c.differences))
    return answers


def compare_tables(c: CompareDocument) -> list[Table]:
    tables = [differences_table(c.differences), trajectories_table(c), arms_table(c)]
    items = items_table(c)
    return tables + ([items] if items is not None else [])


def trajectories_table(c: CompareDocument) -> Table:
    t, reps = c.trajectories, c.replicas
    where = t.first_divergence_in
    rows = [
        ["items (both reached the boundary / not)", f"{t.n} ({t.equal.n} / {len(t.not_compared)})"],
        ["trajectories equal (stage 1 + live suffix)", _count(t.equal)],
        ["first divergence in stage 1", str(where.stage1)],
        ["first divergence in the suffix", str(where.suffix)],
        *([["first divergence where one run's stage 1 ended", str(where.boundary)]] if where.boundary else []),
        ["live replica exact, A", _count(reps.a.exact.get("live"))],
        ["live replica exact, B", _count(reps.b.exact.get("live"))],
        ["trajectories equal where both live replicas are exact", _count(t.self_consistent)],
    ]
    note = ("A trajectory is live's stage 1 and its suffix; the first divergence is the first position where A's "
            "and B's differ. A run whose live replica is not exact is not self-consistent on that item.")
    return Table("table-compare-trajectories", "Live trajectories, A vs B", ("", "items"), as_rows(rows), note)


def arms_table(c: CompareDocument) -> Table:
    """Rows are quantities, columns the arms both runs have, as the matched table reads."""
    arms = c.arms
    labels = ["items", "suffix disagreements", "suffix disagreements over the same stage 1",
              "correctness-label disagreements", "accuracy, A", "accuracy, B",
              "accuracy difference, A - B (points) [95% CI]", "discordant labels: A only / B only",
              "McNemar exact p", "replica exact, A", "replica exact, B"]
    columns = []
    for a in arms:
        d = a.accuracy_diff
        columns.append([str(a.n), _count(a.suffix_disagreements), _count(a.suffix_disagreements_same_stage1),
                        _count(a.label_disagreements), pct(a.accuracy.a), pct(a.accuracy.b),
                        f"{points(d.estimate)} [{points(d.ci[0])}, {points(d.ci[1])}]" if d else NA,
                        f"{a.discordant.a_only} / {a.discordant.b_only}", p_value(a.mcnemar_p),
                        _count(a.replica_exact.a), _count(a.replica_exact.b)])
    if any(a.not_built for a in arms):
        labels.append("not built as named in a run (left out)")
        for a, col in zip(arms, columns, strict=True):
            col.append(str(a.not_built))
    rows = [[label, *(col[i] for col in columns)] for i, label in enumerate(labels)]
    note = ("Each arm of run A against the arm of that name in run B, over the items both took to their boundary. "
            "Where stage 1 differs the two suffixes continue different prefixes: they are compared all the same, "
            "and the row 'over the same stage 1' leaves them out. CI: paired percentile bootstrap over items, "
            f"{_resamples(arms)}. McNemar: exact, on the discordant labels.")
    only = [f"{side.upper()} alone has {', '.join(names)}" for side, names in c.arms_only_in.by_side() if names]
    note += f" Not compared: {'; '.join(only)}." if only else ""
    return Table("table-compare-arms", "Per arm, A vs B", ("", *(a.arm for a in arms)), as_rows(rows), note)


def _resamples(arms: list[ArmSummary]) -> str:
    d: PairedDifference | None = next((a.accuracy_diff for a in arms if a.accuracy_diff), None)
    return f"{d.n_resamples} resamples, seed {d.seed}" if d else "no items"


def _count(count: Count | None) -> str:
    return NA if count is None else k_of_n(count.k, count.n)


def _diverged(c: CompareDocument) -> list[ComparedItem]:
    """The items whose live trajectories differ, in run order."""
    return [i for i in c.items if isinstance(i, ComparedItem) and i.first_divergence]


def items_table(c: CompareDocument) -> Table | None:
    """One row per item whose trajectories differ: where, each side's token and margin, each side's top."""
    rows = []
    for i in _diverged(c):
        d = i.first_divergence
        assert d is not None
        texts = i.token_texts
        where = f"{d.in_}, step {d.a.step}" if d.in_ != BOUNDARY else \
            f"boundary (A {d.a.stage} step {d.a.step}, B {d.b.stage} step {d.b.step})"
        rows.append([i.item_id, where, *(_token(s.token, texts) for s in (d.a, d.b)),
                     *(_number(s.margin) for s in (d.a, d.b)), *(_top(s.top, texts) for s in (d.a, d.b))])
    if not rows:
        return None
    note = ("Position: stage 1's step (the step that chose that stage-1 token) or the suffix's. Margin: top-1 minus "
            "top-2 there (a logit or a logprob: the same difference); `-`: the record holds no margin at that step "
            "(older records keep none in stage 1; our engine keeps the suffix's top candidates only where live "
            "diverged from an arm of its own record).")
    return Table("table-compare-items", "First divergence per item",
                 ("item", "where", "token A", "token B", "margin A", "margin B", "top A", "top B"),
                 as_rows(rows), note, terminal=False)


def _token(token: int | None, texts: dict[str, str]) -> str:
    if token is None:
        return "(ended)"
    return f"{token} {texts[str(token)]!r}" if str(token) in texts else str(token)


def _top(top: list[TopEntry] | None, texts: dict[str, str]) -> str:
    if top is None:
        return NA
    return ", ".join(f"{_token(int(t), texts)}: {_number(v)}" for t, v in top[:3])


def _number(x: float | None) -> str:
    """A logit-scale number: 3 significant digits."""
    return NA if x is None else "0" if x == 0 else f"{x:.3g}"


def divergence_figure(c: CompareDocument) -> ReportFigure:
    eq = c.trajectories.equal
    return ReportFigure(
        "fig-compare-divergence", "Where the trajectories first diverge, and the margin there",
        "One column per item whose live trajectories differ, at its first divergent position counted from the "
        "stage boundary (negative: in stage 1; 0: the suffix's first step): A's margin there (filled), B's "
        f"(open); a cross at 0 where the record holds none. {eq.k} of {eq.n} items do not diverge.",
        png(_draw(c)), after=("table-compare-items", "table-compare-trajectories"))


def _draw(c: CompareDocument) -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 3.6), layout="constrained")
    ax = fig.add_subplot()
    points_ = [(i.first_divergence, i.stage1_len.a) for i in _diverged(c) if i.first_divergence is not None]
    styles: tuple[tuple[Side, str, str, str], ...] = (("a", "o", "#2b6cb0", "#2b6cb0"), ("b", "s", "none", "#dd6b20"))
    for side, marker, face, edge in styles:
        shown = [(d.position - n, m) for d, n in points_ if (m := d.side(side).margin) is not None]
        ax.scatter([x for x, _ in shown], [y for _, y in shown], s=30, marker=marker, facecolors=face,
                   edgecolors=edge, label=f"margin, {side.upper()}", zorder=3)
    missing = [d.position - n for d, n in points_ for s in (d.a, d.b) if s.margin is None]
    if missing:
        ax.scatter(missing, [0.0] * len(missing), marker="x", color="#a0aec0", label="margin not recorded", zorder=2)
    ax.axvline(-0.5, color="#1a202c", linewidth=1, linestyle="--")  # between stage 1's last token and step 0
    ax.text(-0.5, 0.98, "stage 1 | suffix", transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8,
            backgroundcolor="white")
    xs = [d.position - n for d, n in points_]
    ax.set_xlim(min([*xs, -4]) - 2, max([*xs, 4]) + 2)  # both sides of the boundary always in view
    if not points_:
        ax.text(0.5, 0.5, f"no item diverges ({c.trajectories.equal.n} equal)", ha="center", va="center",
                transform=ax.transAxes, fontsize=10, color="#4a5568")
    else:
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    ax.set_xlabel("first divergent position, from the stage boundary (tokens)")
    ax.set_ylabel("margin there (top-1 minus top-2)")
    ax.grid(alpha=0.3)
    return fig
