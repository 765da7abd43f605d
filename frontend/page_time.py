"""`/runs/{run}/time`: where a step's time goes. Per rank and step the breakdown (compute, overlapped,
wait, exposed, memcpy, idle) as stacked bars; one step's collectives across ranks on a timeline with each
instance's members linked and the critical path drawn; a rank x instance wait heatmap; stragglers with
their verdicts; clock offsets and what the analysis could not compute, and why (docs/time.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from dash import Dash, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from commlens.contract.time import (
    TIME_CATEGORIES,
    UNATTRIBUTED,
    BreakdownBands,
    BreakdownReport,
    ClockOffsets,
    CriticalPath,
    GroupVerdict,
    Instance,
    InstancesPage,
    StepBreakdown,
    StragglerReport,
    TimeStatus,
    TimeSummary,
)
from commlens.vocab import SCHEMES

from .client import ApiClient
from .components import (
    OP_COLORS,
    chart_block,
    colorbar,
    empty,
    figure,
    guarded,
    kv,
    loading,
    long_table,
    message,
    push_state,
    table,
    td_id,
    td_num,
)
from .config import UiConfig
from .fmt import duration_us, exact_bytes, num, pct
from .urls import int_or_none, query, run_path

# Fixed colours: a category keeps its colour whatever the run, scheme or filter.
CATEGORY_COLORS = {
    "compute": "#4c78a8",
    "overlapped": "#72b7b2",
    "wait": "#f58518",
    "exposed": "#e45756",
    "memcpy": "#b279a2",
    "idle": "#d9d9d9",
    "other comm": "#9d755d",
}
CATEGORY_LABELS = {
    "compute": "compute",
    "overlapped": "comm overlapped with compute",
    "wait": "wait in collectives",
    "exposed": "exposed comm",
    "memcpy": "memcpy / memset",
    "idle": "idle",
    "other comm": "other schemes' comm",
}
PATH_COLOR = "#c00000"
SELECTED_COLOR = "#111111"
PAGE_SIZE = 1000  # the API's largest page
MAX_INSTANCES = 5000  # instances of one step drawn at most; the table says when more were left out
# member rows (instances x group size) of one step drawn at most, fetched as one page: at 1,024 ranks about 100
# instances; the table says when more were left out
MAX_MEMBER_ROWS = 100_000
# more ranks than this: the breakdown shows the server's bands of ranks first (/time/breakdown/bands), then the
# ranks of one band (`?band=FIRST`)
SCALE_RANKS = 64
# more (rank, step) bars than this at up to SCALE_RANKS ranks (a long profile): a bar per rank, the mean of its
# steps, first (`/time/breakdown/bands?band=1`), then one rank's steps (`?band=RANK`)
MAX_BARS = 2000

P = TypeVar("P")


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    client = cfg.client(token)
    summary = client.time_summary(run)
    overview = client.time_breakdown_bands(run)
    paths = client.critical_paths(run, segments=False).paths  # the steps, and which have a path to draw
    steps = sorted(set(overview.steps) | {p.step for p in paths})
    banded = _banded(client, run, None, overview)
    step = int_or_none(q.get("step"))
    if step not in steps:
        step = next((p.step for p in paths if p.segment_count), steps[0] if steps else None)
    bands = [(b.first, b.last) for b in banded.bands] if banded else []
    band = int_or_none(q.get("band"))
    band = band if band in {b[0] for b in bands} else None
    wide = overview.ranks > SCALE_RANKS  # a band also bounds the timeline and the waits
    groups = [(v.group, v.scheme) for v in summary.verdicts]
    group = q.get("group") if q.get("group") in {g for g, _ in groups} else None
    scheme = q.get("scheme") if q.get("scheme") in (*SCHEMES, UNATTRIBUTED) else None
    runs = [r.name for r in client.runs(limit=500).items]
    if run not in runs:
        runs.insert(0, run)
    return html.Div(
        [
            dcc.Store(id="tm-run", data=run),
            dcc.Store(id="tm-inst", data=int_or_none(q.get("inst"))),
            dcc.Store(id="tm-status-data", data=summary.status.model_dump(mode="json")),
            dcc.Store(id="tm-bands", data=[list(b) for b in bands] if wide else []),
            html.Div(
                [
                    _dropdown("tm-runsel", "Run", [(r, r) for r in runs], run, clearable=False),
                    _dropdown("tm-step", "Step (timeline, heatmap)", [(str(s), s) for s in steps], step),
                    _dropdown(
                        "tm-scheme",
                        "Scheme (bars)",
                        [("all", "")] + [(s, s) for s in (*SCHEMES, UNATTRIBUTED)],
                        scheme or "",
                        clearable=False,
                    ),
                    _dropdown(
                        "tm-group",
                        "Group",
                        [("all", "")] + [(f"{g} ({s})", g) for g, s in groups],
                        group or "",
                        clearable=False,
                        wide=True,
                    ),
                    html.Div(
                        _dropdown(
                            "tm-band",
                            "Ranks (bars, timeline, waits)" if wide else "Rank (bars: its steps)",
                            [("all ranks (bands)" if wide else "every rank (means)", "")]
                            + [(band_label(*b), str(b[0])) for b in bands],
                            "" if band is None else str(band),
                            wide=True,
                        ),
                        style=None if len(bands) > 1 else {"display": "none"},
                    ),
                ],
                className="controls",
            ),
            status_block(summary.status),
            html.H2("Breakdown per rank and step"),
            loading(html.Div(id="tm-breakdown")),
            html.H2("Timeline of one step across ranks"),
            loading(html.Div(id="tm-timeline")),
            html.H2("Waits per rank and instance"),
            loading(html.Div(id="tm-waits")),
            html.H2("Stragglers"),
            loading(html.Div(id="tm-stragglers")),
            html.H2("Clock offsets"),
            clocks_view(summary.clocks, summary.status),
            html.H2("Per rank"),
            ranks_view(summary),
            mismatches_view(client, run, summary),
        ]
    )


def _dropdown(
    id_: str, label: str, options: Sequence[tuple[str, Any]], value: Any, clearable: bool = False, wide: bool = False
) -> html.Div:
    return html.Div(
        [
            html.Label(label, htmlFor=id_),
            dcc.Dropdown(
                id=id_,
                options=[{"label": text, "value": v} for text, v in options],
                value=value,
                clearable=clearable,
                searchable=len(options) > 12,
                placeholder="none",
            ),
        ],
        className="field wide" if wide else "field",
    )


def _pages(fetch: Callable[[int], tuple[list[P], int | None]], cap: int | None = None) -> list[P]:
    """Every item of a paginated endpoint (or the first `cap`), following next_offset."""
    items: list[P] = []
    offset: int | None = 0
    while offset is not None and (cap is None or len(items) < cap):
        page, offset = fetch(offset)
        items += page
    return items if cap is None else items[:cap]


def _all_breakdown(
    client: ApiClient, run: str, scheme: str | None, ranks: tuple[int, int] | None = None
) -> list[StepBreakdown]:
    """Every (rank, step) row, of the ranks from ranks[0] to ranks[1] where given."""
    first, last = ranks or (None, None)

    def fetch(offset: int) -> tuple[list[StepBreakdown], int | None]:
        page: BreakdownReport = client.time_breakdown(
            run, scheme=scheme, limit=PAGE_SIZE, offset=offset, first=first, last=last
        )
        return page.rows, page.next_offset

    return _pages(fetch)


def _step_instances(client: ApiClient, run: str, step: int, group: str | None) -> tuple[list[Instance], int]:
    """The step's instances with their members, up to MAX_INSTANCES and about MAX_MEMBER_ROWS member rows."""
    total, rows = 0, 0

    def fetch(offset: int) -> tuple[list[Instance], int | None]:
        nonlocal total, rows
        page: InstancesPage = client.time_instances(
            run, step=step, group=group, limit=PAGE_SIZE, offset=offset, max_members=MAX_MEMBER_ROWS
        )
        total, rows = page.total, rows + sum(len(i.members) for i in page.items)
        return page.items, page.next_offset if rows < MAX_MEMBER_ROWS else None

    return _pages(fetch, MAX_INSTANCES), total


def _reasons(status: TimeStatus, *parts: str) -> list[str]:
    return [f"{p.part}: {p.reason}" for p in status.parts if p.part in parts and not p.computed]


def _why(status: TimeStatus, *parts: str) -> str:
    reasons = _reasons(status, *parts)
    return " ".join(r.rstrip(".") + "." for r in reasons) if reasons else ""


# ---------------------------------------------------------------------------------- status


def status_block(status: TimeStatus) -> html.Div:
    """What the analysis computed for this run and, for what it could not, the reason."""
    if not status.available:
        head = message(
            [html.Strong("No time analysis for this run. "), _why(status, *{p.part for p in status.parts})]
            if status.parts
            else "No time analysis for this run: the API reports none (it needs a profiler trace with a timeline; "
            "NCCL logs carry no time).",
            "warn",
        )
    elif any(not p.computed for p in status.parts):
        head = message("Some parts of the time analysis could not be computed; the reasons are below.", "warn")
    else:
        head = None
    by_part: dict[str, list[Any]] = {}  # one row per part: a part can say what it did and what it could not
    for p in status.parts:
        by_part.setdefault(p.part, []).append(p)
    rows = []
    for part, said in by_part.items():
        done = {p.computed for p in said}
        word, badge = (
            ("yes", "st-ok") if done == {True} else ("no", "st-failed") if done == {False} else ("partly", "st-partly")
        )
        rows.append([part, html.Span(word, className=f"badge {badge}"), "; ".join(p.reason for p in said)])
    return html.Div(
        [
            head,
            html.Details(
                [
                    html.Summary("What was computed"),
                    table(["part", "computed", "why / what it rests on"], rows, id_="tm-status"),
                ],
                open=any(not p.computed for p in status.parts),
            )
            if rows
            else None,
        ],
        className="card",
        id="tm-status-block",
    )


# ------------------------------------------------------------------------------- breakdown


def _bar_values(r: StepBreakdown, scheme: str | None) -> dict[str, float]:
    """µs per stacked category of one row; with a scheme, the others' communication is one category
    of its own so the bar still sums to the step."""
    values = {
        "compute": r.compute_us,
        "overlapped": r.overlapped_us,
        "wait": r.wait_us,
        "exposed": r.exposed_us,
        "memcpy": r.memcpy_us,
        "idle": r.idle_us,
    }
    if scheme is None:
        return values
    mine = next((s for s in r.schemes if s.scheme == scheme), None)
    comm = r.overlapped_us + r.wait_us + r.exposed_us
    values["overlapped"] = mine.overlapped_us if mine else 0.0
    values["wait"] = mine.wait_us if mine else 0.0
    values["exposed"] = mine.exposed_us if mine else 0.0
    values["other comm"] = comm - values["overlapped"] - values["wait"] - values["exposed"]
    return values


def band_label(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def _categories(scheme: str | None) -> list[str]:
    cats = list(TIME_CATEGORIES)
    if scheme:  # the other schemes' communication stacks right above this scheme's
        cats.insert(cats.index("exposed") + 1, "other comm")
    return cats


def _category_name(cat: str, scheme: str | None) -> str:
    mine = scheme and cat in ("overlapped", "wait", "exposed")
    return f"{scheme}: {CATEGORY_LABELS[cat]}" if mine else CATEGORY_LABELS[cat]


def _no_breakdown(status: TimeStatus) -> Any:
    why = _why(status, "breakdown", "matching")
    return empty(
        "No breakdown for this run" + (f": {why}" if why else ": it has no profiler steps with device activity.")
    )


def bands_breakdown_view(run: str, overview: BreakdownBands, scheme: str | None, status: TimeStatus) -> Any:
    """Many ranks at a glance: one stacked bar per band of ranks, the mean (rank, step) of the band, with the
    band's slowest and fastest step marked and the slowest steps of the run named; a band opens rank by rank."""
    if not overview.bands:
        return _no_breakdown(status)
    cats = _categories(scheme)
    bands = overview.bands
    labels = [band_label(b.first, b.last) for b in bands]
    per_rank = overview.band == 1
    title = ("Mean step per rank" if per_rank else f"Mean step per band of {overview.band} ranks") + (
        f": {scheme} communication apart" if scheme else ""
    )
    fig = figure(title, "rank" if per_rank else "ranks (band)", "time (ms)", height=440)
    for cat in cats:
        us = [b.categories.get(cat, 0.0) for b in bands]
        fig.add_bar(
            name=_category_name(cat, scheme),
            x=labels,
            y=[v / 1e3 for v in us],
            marker_color=CATEGORY_COLORS[cat],
            customdata=[
                [duration_us(v), pct(v / b.step_us if b.step_us else None)] for v, b in zip(us, bands, strict=True)
            ],
            hovertemplate="%{x}, mean step<br>" + CATEGORY_LABELS[cat] + ": %{customdata[0]} (%{customdata[1]})"
            "<extra></extra>",
        )
    for name, picked, symbol in [
        ("slowest step" if per_rank else "slowest step in the band", [b.slowest for b in bands], "triangle-down"),
        ("fastest", [b.fastest for b in bands], "triangle-up"),
    ]:
        fig.add_scatter(
            name=name,
            x=labels,
            y=[r.step_us / 1e3 for r in picked],
            mode="markers",
            marker={"symbol": symbol, "size": 9, "color": "#111111"},
            customdata=[[r.rank, r.step, duration_us(r.step_us)] for r in picked],
            hovertemplate="%{x}: " + name + ", rank %{customdata[0]} step %{customdata[1]}: %{customdata[2]}"
            "<extra></extra>",
        )
    fig.update_layout(barmode="stack", bargap=0.15, legend={"traceorder": "normal"})
    fig.update_xaxes(type="category", tickangle=-45)
    cols = ["ranks", "rank-steps", "mean step", "fastest step", "slowest step", "slowest rank, step"]
    cols += [f"mean {CATEGORY_LABELS[c]}" for c in cats]
    display, raw = [], []
    for label, b in zip(labels, bands, strict=True):
        means = [b.categories.get(c, 0.0) for c in cats]
        slowest = f"{b.slowest.rank}, {b.slowest.step}"
        display.append(
            [
                label,
                td_num(b.rank_steps),
                td_num(b.step_us, duration_us(b.step_us)),
                td_num(b.fastest.step_us, duration_us(b.fastest.step_us)),
                td_num(b.slowest.step_us, duration_us(b.slowest.step_us)),
                slowest,
                *[td_num(m, duration_us(m)) for m in means],
            ]
        )
        raw.append([label, b.rank_steps, b.step_us, b.fastest.step_us, b.slowest.step_us, slowest, *means])
    shape = (
        f"{overview.rank_steps:,} (rank, step) rows of {overview.ranks:,} ranks: each bar is the mean of a rank's "
        "steps, the triangles its slowest and fastest step"
        if per_rank
        else f"{overview.ranks:,} ranks in {len(bands)} bands of {overview.band}: each bar is the mean (rank, step) "
        "of its band, the triangles its slowest and fastest step"
    )
    note = (
        f"{shape}. Slowest steps: "
        + "; ".join(f"rank {r.rank} step {r.step} {duration_us(r.step_us)}" for r in overview.slowest)
        + (
            ". Pick a rank above to see its steps."
            if per_rank
            else ". Pick a band under Ranks above to see its ranks one by one."
        )
    )
    return chart_block("tm-bars", fig, cols, display, raw, f"{run}-time-breakdown-bands.csv", note=note)


def _banded(
    client: ApiClient, run: str, scheme: str | None, overview: BreakdownBands | None = None
) -> BreakdownBands | None:
    """The bands the breakdown draws first: the server's bands of ranks beyond SCALE_RANKS ranks, a band per rank
    beyond MAX_BARS (rank, step) rows, else None (a bar per (rank, step))."""
    overview = overview or client.time_breakdown_bands(run, scheme=scheme)
    if overview.ranks > SCALE_RANKS:
        return overview
    if overview.rank_steps > MAX_BARS:
        return client.time_breakdown_bands(run, scheme=scheme, band=1)
    return None


def breakdown_figure(client: ApiClient, run: str, scheme: str | None, status: TimeStatus, band: str | None) -> Any:
    """A bar per (rank, step) up to SCALE_RANKS ranks and MAX_BARS rows; beyond, a bar per band of ranks (or per
    rank), or the rows of the band whose first rank is `band` (the URL's `band`)."""
    banded = _banded(client, run, scheme)
    if banded is None:
        return breakdown_view(run, _all_breakdown(client, run, scheme), scheme, status)
    chosen = next((b for b in banded.bands if str(b.first) == band), None)
    if chosen is None:
        return bands_breakdown_view(run, banded, scheme, status)
    rows = _all_breakdown(client, run, scheme, (chosen.first, chosen.last))
    return breakdown_view(run, rows, scheme, status, of_ranks=banded.ranks)


def breakdown_view(
    run: str, rows: list[StepBreakdown], scheme: str | None, status: TimeStatus, of_ranks: int | None = None
) -> Any:
    """A bar per (rank, step); `of_ranks`: the run's rank count when `rows` hold one band of it."""
    if not rows:
        return _no_breakdown(status)
    cats = _categories(scheme)
    ranks = sorted({r.rank for r in rows})
    per = {(r.rank, r.step): _bar_values(r, scheme) for r in rows}
    title = "Time per step and rank" + (f": {scheme} communication apart" if scheme else "")
    fig = figure(title, "rank / profiler step", "time (ms)", height=420)
    x = [[f"rank {r.rank}" for r in rows], [str(r.step) for r in rows]]
    for cat in cats:
        us = [per[(r.rank, r.step)].get(cat, 0.0) for r in rows]
        fig.add_bar(
            name=_category_name(cat, scheme),
            x=x,
            y=[v / 1e3 for v in us],
            marker_color=CATEGORY_COLORS[cat],
            customdata=[
                [duration_us(v), pct(v / r.step_us if r.step_us else None), duration_us(r.step_us)]
                for v, r in zip(us, rows, strict=True)
            ],
            hovertemplate="%{x[0]}, step %{x[1]}<br>"
            + CATEGORY_LABELS[cat]
            + ": %{customdata[0]} (%{customdata[1]} of %{customdata[2]})<extra></extra>",
        )
    fig.update_layout(barmode="stack", bargap=0.15, legend={"traceorder": "normal"})
    cols = ["rank", "step", "step", *[CATEGORY_LABELS[c] for c in cats], "HtoD", "DtoH", "memcpy GB/s"]
    display, raw = [], []
    for r in rows:
        v = per[(r.rank, r.step)]
        lanes = {m.direction: m for m in r.memcpy}
        htod, dtoh = lanes.get("htod"), lanes.get("dtoh")
        rate = ", ".join(f"{m.direction} {m.gbps:.3g}" for m in r.memcpy if m.gbps is not None) or "-"
        display.append(
            [
                r.rank,
                td_id(r.step),
                td_num(r.step_us, duration_us(r.step_us)),
                *[td_num(v.get(c, 0.0), duration_us(v.get(c, 0.0))) for c in cats],
                td_num(htod.bytes if htod else None, exact_bytes(htod.bytes) if htod else "-"),
                td_num(dtoh.bytes if dtoh else None, exact_bytes(dtoh.bytes) if dtoh else "-"),
                rate,
            ]
        )
        raw.append(
            [
                r.rank,
                r.step,
                r.step_us,
                *[v.get(c, 0.0) for c in cats],
                htod.bytes if htod else None,
                dtoh.bytes if dtoh else None,
                rate,
            ]
        )
    cols[2] = "step time"
    shown = f"{len(ranks)} ranks" if of_ranks is None else f"{band_label(ranks[0], ranks[-1])} of {of_ranks:,}"
    note = f"Each microsecond of a step is counted once, in this order: {', '.join(TIME_CATEGORIES)}. {shown}."
    return chart_block("tm-bars", fig, cols, display, raw, f"{run}-time-breakdown.csv", note=note)


# -------------------------------------------------------------------------------- timeline


def _segments(inst: Instance) -> list[tuple[int, float, float | None, float]]:
    """(rank, arrival, last arrival or None, end) per member with both times: the wait before everybody
    arrived and the collective after it are drawn apart."""
    out: list[tuple[int, float, float | None, float]] = []
    for m in inst.members:
        if m.arrival_us is None or m.end_us is None:
            continue
        last = inst.last_arrival_us
        out.append((m.rank, m.arrival_us, last if last is not None and last > m.arrival_us else None, m.end_us))
    return out


def _origin(instances: Sequence[Instance], path: CriticalPath | None) -> float | None:
    if path is not None:
        return path.start_us
    starts = [m.arrival_us for i in instances for m in i.members if m.arrival_us is not None]
    return min(starts) if starts else None


def _draw_path(fig: Any, path: CriticalPath, segments: Sequence[Any], t0: float) -> None:
    """The critical path's segments on the drawn ranks, joined in time order, and the step's end."""
    if not segments:
        return
    xs: list[float | None] = []
    ys: list[int | None] = []
    text: list[str] = []
    for s in sorted(segments, key=lambda s: s.start_us):
        xs += [(s.start_us - t0) / 1e3, (s.end_us - t0) / 1e3]
        ys += [s.rank, s.rank]
        what = f"instance {s.instance_id}" if s.kind == "collective" else "work"
        text += [f"critical path: {what} on rank {s.rank}, {duration_us(s.end_us - s.start_us)}"] * 2
    fig.add_scatter(
        name="critical path",
        x=xs,
        y=ys,
        mode="lines+markers",
        line={"color": PATH_COLOR, "width": 3},
        marker={"size": 5, "color": PATH_COLOR},
        text=text,
        hovertemplate="%{text}<extra></extra>",
    )
    fig.add_vline(x=(path.end_us - t0) / 1e3, line_dash="dot", line_color="#666", annotation_text="step end")


def _draw_selected(fig: Any, chosen: Instance, drawn: Callable[[int], bool], t0: float) -> None:
    """The chosen instance's members' arrivals linked across the drawn ranks, and its last arrival."""
    members = sorted((m for m in chosen.members if m.arrival_us is not None and drawn(m.rank)), key=lambda m: m.rank)
    fig.add_scatter(
        name=f"instance {chosen.instance_id} ({chosen.op})",
        x=[((m.arrival_us or 0.0) - t0) / 1e3 for m in members],
        y=[m.rank for m in members],
        mode="lines+markers",
        line={"color": SELECTED_COLOR, "width": 1.5, "dash": "dash"},
        marker={"symbol": "diamond", "size": 9, "color": SELECTED_COLOR},
        customdata=[[chosen.instance_id, duration_us(m.wait_us)] for m in members],
        hovertemplate="rank %{y} arrives at %{x:.3f} ms, waits %{customdata[1]}<extra>instance %{customdata[0]}</extra>",
    )
    if chosen.last_arrival_us is not None:
        fig.add_vline(x=(chosen.last_arrival_us - t0) / 1e3, line_color=SELECTED_COLOR, line_width=1)


def _rank_axis(fig: Any, ranks: list[int]) -> None:
    """A tick per rank while they fit; beyond SCALE_RANKS they would overlap, so Plotly spaces numeric ticks."""
    if len(ranks) > SCALE_RANKS:
        fig.update_yaxes(autorange="reversed", tickmode="auto", nticks=20, zeroline=False)
    else:
        fig.update_yaxes(
            autorange="reversed", tickmode="array", tickvals=ranks, ticktext=[str(r) for r in ranks], zeroline=False
        )


def _unmatched(step: int, total: int, status: TimeStatus) -> Any:
    """Why a step's timeline holds the critical path alone: none of its collectives was matched across ranks."""
    if total:
        return None
    why = _why(status, "matching")
    return message(
        f"No collective of step {step} was matched across ranks, so only the critical path is drawn"
        + (f": {why}" if why else "."),
        "warn",
    )


def timeline_view(
    run: str,
    step: int,
    instances: list[Instance],
    total: int,
    path: CriticalPath | None,
    selected: int | None,
    status: TimeStatus,
    shown: tuple[int, int] | None = None,
) -> Any:
    """`shown`: the first and last rank drawn (a band of a large run); the table keeps every instance."""
    t0 = _origin(instances, path)
    if t0 is None:
        why = _why(status, "matching", "clocks", "waits", "critical_path")
        return empty(
            f"No collective with measured times in step {step}" + (f": {why}" if why else " (NCCL logs carry no time).")
        )

    def drawn(rank: int) -> bool:
        return shown is None or shown[0] <= rank <= shown[1]

    ranks = sorted(
        r
        for r in {m.rank for i in instances for m in i.members} | ({s.rank for s in path.segments} if path else set())
        if drawn(r)
    )
    fig = figure(
        f"Step {step}: collectives per rank" + ("" if shown is None else f", ranks {shown[0]}-{shown[1]}"),
        "time since the step's start (ms)",
        "rank",
        height=min(760, 170 + 34 * len(ranks)),
    )
    chosen = next((i for i in instances if i.instance_id == selected), None)

    def hover(i: Instance, rank: int) -> list[Any]:
        m = next(x for x in i.members if x.rank == rank)
        return [
            i.instance_id,
            i.op,
            i.group,
            exact_bytes(i.msg_bytes),
            duration_us(i.skew_us),
            "-" if i.last_rank is None else i.last_rank,
            duration_us(m.wait_us),
            duration_us(i.real_us),
            num(i.busbw_gbps),
        ]

    template = (
        "<b>instance %{customdata[0]}</b>: %{customdata[1]} in %{customdata[2]}, S %{customdata[3]}<br>"
        "rank %{y}: waited %{customdata[6]}; skew %{customdata[4]}, last rank %{customdata[5]}<br>"
        "real duration %{customdata[7]}, busbw %{customdata[8]} GB/s<extra>%{fullData.name}</extra>"
    )

    def opacity(i: Instance) -> float:
        return 1.0 if chosen is None or i.instance_id == selected else 0.3

    waits: dict[str, list[Any]] = {"y": [], "x": [], "base": [], "customdata": [], "opacity": []}
    by_op: dict[str, dict[str, list[Any]]] = {}
    for i in instances:
        for rank, arrival, last, end in _segments(i):
            if not drawn(rank):
                continue
            start = arrival
            if last is not None:
                waits["y"].append(rank)
                waits["base"].append((arrival - t0) / 1e3)
                waits["x"].append((last - arrival) / 1e3)
                waits["customdata"].append(hover(i, rank))
                waits["opacity"].append(opacity(i))
                start = last
            d = by_op.setdefault(i.op, {"y": [], "x": [], "base": [], "customdata": [], "opacity": []})
            d["y"].append(rank)
            d["base"].append((start - t0) / 1e3)
            d["x"].append((end - start) / 1e3)
            d["customdata"].append(hover(i, rank))
            d["opacity"].append(opacity(i))
    for name, d, color in [
        ("wait for the last member", waits, CATEGORY_COLORS["wait"]),
        *[(op, d, OP_COLORS.get(op, "#777")) for op, d in by_op.items()],
    ]:
        if not d["y"]:
            continue
        fig.add_bar(
            name=name,
            orientation="h",
            y=d["y"],
            x=d["x"],
            base=d["base"],
            width=0.6,
            marker={"color": color, "opacity": d["opacity"], "line": {"width": 0}},
            customdata=d["customdata"],
            hovertemplate=template,
        )
    if path is not None:
        _draw_path(fig, path, [s for s in path.segments if drawn(s.rank)], t0)
    if chosen is not None:
        _draw_selected(fig, chosen, drawn, t0)
    fig.update_layout(barmode="overlay", clickmode="event")
    if path is not None:
        fig.update_xaxes(range=[0, (path.end_us - t0) / 1e3 * 1.02])
    _rank_axis(fig, ranks)
    cols = [
        "instance",
        "group",
        "scheme",
        "op",
        "S",
        "skew",
        "last rank",
        "real duration",
        "algbw (GB/s)",
        "busbw (GB/s)",
        "members",
    ]
    display = [
        [
            td_num(i.instance_id),
            i.group,
            i.scheme,
            i.op,
            td_num(i.msg_bytes, exact_bytes(i.msg_bytes)),
            td_num(i.skew_us, duration_us(i.skew_us)),
            td_num(i.last_rank),
            td_num(i.real_us, duration_us(i.real_us)),
            td_num(i.algbw_gbps),
            td_num(i.busbw_gbps),
            td_num(len(i.members)),
        ]
        for i in instances
    ]
    raw = [
        [
            i.instance_id,
            i.group,
            i.scheme,
            i.op,
            i.msg_bytes,
            i.skew_us,
            i.last_rank,
            i.real_us,
            i.algbw_gbps,
            i.busbw_gbps,
            len(i.members),
        ]
        for i in instances
    ]
    counted = f"{len(instances)} of {total} instances" if total > len(instances) else f"{total} instances"
    note = (
        f"{counted}; times on the reference clock from the start of step {step}"
        + (" (the critical path's start)" if path else "")
        + ". Click a bar to link its instance's members across ranks; bandwidth uses the real duration "
        "(end - arrival on the last member)."
        + ("" if shown is None else f" Ranks {shown[0]}-{shown[1]} drawn; the table lists every instance.")
    )
    selected_info = (
        html.P(
            [
                html.Strong(f"Instance {chosen.instance_id}: "),
                f"{chosen.op} in {chosen.group} ({chosen.scheme}), "
                + _member_waits(chosen)
                + f"; last rank {chosen.last_rank}, skew {duration_us(chosen.skew_us)}.",
            ],
            id="tm-selected",
            className="hint",
        )
        if chosen
        else None
    )
    parts: list[Any] = [
        _unmatched(step, total, status),
        chart_block("tm-timeline-graph", fig, cols, display, raw, f"{run}-step{step}-instances.csv", note=note),
        selected_info,
    ]
    if path is not None:
        parts.append(path_view(path))
    return html.Div(parts)


MAX_NAMED_MEMBERS = 16  # an instance's members named one by one at most; beyond, the longest waits


def _member_waits(inst: Instance) -> str:
    members = sorted(inst.members, key=lambda m: m.rank)
    if len(members) <= MAX_NAMED_MEMBERS:
        return "members " + ", ".join(f"{m.rank} waits {duration_us(m.wait_us)}" for m in members)
    longest = sorted(members, key=lambda m: (-(m.wait_us or 0.0), m.rank))[: MAX_NAMED_MEMBERS // 2]
    return f"{len(members):,} members, the longest waits: " + ", ".join(
        f"{m.rank} waits {duration_us(m.wait_us)}" for m in longest
    )


def path_ranks(path: CriticalPath) -> str:
    """The ranks the path runs through, last segment first, a rank held by consecutive segments said once with
    their count (a path of 1,000 segments stays one line)."""
    runs: list[list[int]] = []
    for s in reversed(path.segments):
        if runs and runs[-1][0] == s.rank:
            runs[-1][1] += 1
        else:
            runs.append([s.rank, 1])
    return " → ".join(str(rank) if n == 1 else f"{rank} ({n} segments)" for rank, n in runs)


def path_view(path: CriticalPath) -> html.Div:
    step_us = path.end_us - path.start_us
    cats = [(c, path.categories.get(c)) for c in TIME_CATEGORIES if path.categories.get(c)]
    shares = ", ".join(f"{s} {pct(v)}" for s, v in sorted(path.exposed_share_by_scheme.items())) or "none"
    # the path starts where its first rank began the step; ranks that began earlier make the step longer
    before = step_us - sum(v or 0.0 for _, v in cats)
    first = path.segments[-1].rank if path.segments else None
    gap = (
        f"{duration_us(before)}: rank {first}, where the path begins, started the step that long after the "
        "first rank to start it"
        if first is not None and before > max(1.0, 1e-3 * step_us)
        else None
    )
    return html.Div(
        [
            html.H3("Critical path"),
            kv(
                [
                    ("step time", duration_us(step_us)),
                    (
                        "segments",
                        f"{len(path.segments)} on ranks " + path_ranks(path),
                    ),
                    ("on the path", ", ".join(f"{c} {duration_us(v)}" for c, v in cats) or "-"),
                    *([("before the path", gap)] if gap else []),
                    ("wait + exposed on the path, of the step, per scheme", shares),
                    ("note", path.note),
                ]
            ),
        ],
        id="tm-path",
        className="card",
    )


# ------------------------------------------------------------------------------------ waits


MAX_WAIT_ROWS = 128  # ranks drawn as heatmap rows at most; more are binned in blocks of consecutive ranks


def _wait_blocks(ranks: list[int]) -> list[list[int]]:
    """Blocks of consecutive ranks, at most MAX_WAIT_ROWS of them (one rank each when that many fit)."""
    k = -(-len(ranks) // MAX_WAIT_ROWS)
    return [ranks[i : i + k] for i in range(0, len(ranks), k)]


def waits_view(run: str, step: int, instances: list[Instance], status: TimeStatus) -> Any:
    measured = [i for i in instances if any(m.wait_us is not None for m in i.members)]
    if not measured:
        why = _why(status, "waits", "clocks", "matching")
        return empty(f"No waits in step {step}" + (f": {why}" if why else ": no instance has every member's start."))
    ranks = sorted({m.rank for i in measured for m in i.members})
    labels = [f"#{i.instance_id} {i.op}" for i in measured]
    wait = {(i.instance_id, m.rank): m.wait_us for i in measured for m in i.members if m.wait_us is not None}
    # beyond MAX_WAIT_ROWS ranks a row is a block of consecutive ranks holding its longest wait (the one that
    # matters for a bottleneck), so the browser never draws a cell per rank and instance at 1,024 ranks
    blocks = _wait_blocks(ranks)
    names: list[int | str] = [b[0] if len(b) == 1 else f"{b[0]}-{b[-1]}" for b in blocks]
    cell: dict[tuple[int, int | str], float] = {}
    for i in measured:
        for b, name in zip(blocks, names, strict=True):
            vals = [wait[(i.instance_id, r)] for r in b if (i.instance_id, r) in wait]
            if vals:
                cell[(i.instance_id, name)] = max(vals)
    binned = len(blocks) < len(ranks)
    z = [[cell[(i.instance_id, n)] / 1e3 if (i.instance_id, n) in cell else None for i in measured] for n in names]
    top = max((v for row in z for v in row if v is not None), default=0.0)
    what = "longest wait per block of ranks" if binned else "Wait per rank"
    fig = figure(
        f"{what} and instance, step {step}",
        "instance (id, op)",
        f"ranks ({len(blocks[0])} per row)" if binned else "rank",
        height=min(640, 160 + 26 * len(names)),
    )
    fig.add_heatmap(
        x=labels,
        y=names,
        z=z,
        colorscale="YlOrRd",
        zmin=0,
        zmax=top or 1,  # Plotly ignores zmin without zmax: the scale and its ticks start at 0
        hoverongaps=False,
        colorbar=colorbar("wait (ms)", top, "ms"),
        hovertemplate=("ranks" if binned else "rank")
        + " %{y}, instance %{x}<br>"
        + ("longest wait" if binned else "wait")
        + " %{z:.3f} ms<extra></extra>",
    )
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_xaxes(type="category")
    cols = ["ranks" if binned else "rank", "instance", "op", "group", "longest wait" if binned else "wait"]
    rows = [(n, i) for i in measured for n in names if (i.instance_id, n) in cell]
    display = [
        [
            n,
            td_num(i.instance_id),
            i.op,
            i.group,
            td_num(cell[(i.instance_id, n)], duration_us(cell[(i.instance_id, n)])),
        ]
        for n, i in rows
    ]
    raw = [[n, i.instance_id, i.op, i.group, cell[(i.instance_id, n)]] for n, i in rows]
    note = "wait = the last member's arrival - this member's arrival; empty cells: not a member of the instance."
    if binned:
        note += (
            f" {len(ranks):,} ranks drawn as {len(names)} blocks of up to {len(blocks[0])} consecutive ranks, "
            "each cell the longest wait in its block."
        )
    return chart_block("tm-heatmap", fig, cols, display, raw, f"{run}-step{step}-waits.csv", note=note)


# ------------------------------------------------------------------------------- stragglers


def stragglers_view(report: StragglerReport, group: str | None, status: TimeStatus) -> Any:
    verdicts = [v for v in report.groups if group is None or v.group == group]
    named = [s for s in report.stragglers if group is None or s.group == group]
    if not verdicts:
        why = _why(status, "stragglers", "waits", "clocks", "matching")
        return empty("No straggler analysis" + (f": {why}" if why else ": no group has matched instances with waits."))
    if named:
        head = message(
            [
                html.Strong("Straggler" + ("s" if len(named) > 1 else "") + ": "),
                "; ".join(
                    f"rank {s.rank} in {s.group} ({s.scheme}), last in {pct(s.arrived_last_share)} of instances, "
                    f"imposing {s.imposed_ms_per_step:.3g} ms per step"
                    for s in named
                ),
            ],
            "warn",
        )
    else:
        head = message([html.Strong("No straggler: "), " ".join(f"{v.group}: {v.reason}" for v in verdicts)], "ok")
    rows = [_verdict_row(v) for v in verdicts]
    arrivals = [a for a in report.ranks if group is None or a.group == group]
    arrival_rows = [
        [
            a.group,
            a.scheme,
            a.rank,
            td_num(a.instances),
            td_num(a.arrived_last),
            td_num(a.imposed_us, duration_us(a.imposed_us)),
            td_num(a.wait_us, duration_us(a.wait_us)),
            td_num(a.steps),
            td_num(a.steps_mostly_last),
        ]
        for a in arrivals
    ]
    return html.Div(
        [
            head,
            table(
                [
                    "group",
                    "scheme",
                    "verdict",
                    "rank",
                    "arrived last",
                    "steps consistent",
                    "steps",
                    "imposed per step",
                    "instances",
                    "reason",
                ],
                rows,
                id_="tm-stragglers-table",
                row_class=["flag" if v.verdict == "straggler" else None for v in verdicts],
            ),
            html.Details(
                [
                    html.Summary("Arrivals per group and rank"),
                    html.Div(
                        long_table(
                            [
                                "group",
                                "scheme",
                                "rank",
                                "instances",
                                "arrived last",
                                "imposed",
                                "waited",
                                "steps",
                                "steps mostly last",
                            ],
                            arrival_rows,
                            id_="tm-arrivals",
                        ),
                        className="scroll short",
                    ),
                ]
            ),
        ]
    )


def _verdict_row(v: GroupVerdict) -> list[Any]:
    return [
        v.group,
        v.scheme,
        html.Span(v.verdict, className="badge sev-high" if v.verdict == "straggler" else "badge st-ok"),
        "-" if v.candidate_rank is None else str(v.candidate_rank),
        td_num(v.arrived_last_share, pct(v.arrived_last_share)),
        td_num(v.steps_consistent),
        td_num(v.steps),
        td_num(v.imposed_ms_per_step, "-" if v.imposed_ms_per_step is None else f"{v.imposed_ms_per_step:.3g} ms"),
        td_num(v.instances),
        v.reason,
    ]


# ------------------------------------------------------------------------------ clocks, ranks


def clocks_view(clocks: ClockOffsets | None, status: TimeStatus) -> Any:
    if clocks is None:
        why = _why(status, "clocks")
        return empty("No clock alignment" + (f": {why}" if why else ": no matched instances to estimate it from."))
    rows = [
        [
            o.rank,
            o.domain or "-",
            td_num(o.offset_us, duration_us(o.offset_us) if o.offset_us else "0"),
            td_num(o.estimate_us, duration_us(o.estimate_us)),
            td_num(o.spread_us, duration_us(o.spread_us)),
            td_num(o.instances),
        ]
        for o in clocks.offsets
    ]
    return html.Div(
        [
            kv(
                [
                    ("offsets applied", "yes" if clocks.applied else "no"),
                    ("cross-rank times trusted", "yes" if clocks.trusted else "no"),
                    ("why", clocks.reason),
                ]
            ),
            html.Div(
                long_table(
                    ["rank", "clock domain", "offset applied", "estimate", "spread", "instances used"],
                    rows,
                    id_="tm-clocks",
                ),
                className="scroll short",
            ),
        ],
        className="card",
    )


def ranks_view(summary: TimeSummary) -> Any:
    if not summary.ranks:
        return empty("No per-rank totals: " + (_why(summary.status, "matching", "waits") or "no matched instances."))
    rows = [
        [
            r.rank,
            td_num(r.steps),
            td_num(r.instances),
            td_num(r.arrived_last),
            td_num(r.wait_us, duration_us(r.wait_us)),
            td_num(r.imposed_us, duration_us(r.imposed_us)),
            td_num(r.step_us, duration_us(r.step_us)),
            td_num(r.exposed_us, duration_us(r.exposed_us)),
            td_num(r.overlapped_us, duration_us(r.overlapped_us)),
        ]
        for r in summary.ranks
    ]
    cols = [
        "rank",
        "steps",
        "instances",
        "arrived last",
        "waited",
        "imposed",
        "step time (its steps summed)",
        "exposed comm (wait + exposed)",
        "overlapped comm",
    ]
    return html.Div(long_table(cols, rows, id_="tm-ranks"), className="scroll short")


def mismatches_view(client: ApiClient, run: str, summary: TimeSummary) -> Any:
    if not summary.mismatches:
        return html.P(f"{num(summary.instances)} instances matched; no mismatch between ranks.", className="hint")
    report = client.time_mismatches(run)
    rows = [
        [m.group, td_num(m.position), m.reason, m.rank_a, m.side_a or "(none)", m.rank_b, m.side_b or "(none)"]
        for m in report.mismatches
    ]
    left = ", ".join(f"{k}: {num(v)}" for k, v in report.not_matched.items())
    return html.Div(
        [
            html.H2("Mismatches"),
            message(
                f"{num(summary.mismatches)} calls could not be paired across their group; both sides below.", "warn"
            ),
            html.Div(
                table(
                    ["group", "position", "reason", "rank a", "side a", "rank b", "side b"], rows, id_="tm-mismatches"
                ),
                className="scroll short",
            ),
            html.P(f"Calls left out of matching: {left}." if left else "", className="hint"),
        ]
    )


# -------------------------------------------------------------------------------- callbacks


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("tm-step", "value"),
        Input("tm-scheme", "value"),
        Input("tm-group", "value"),
        Input("tm-inst", "data"),
        Input("tm-band", "value"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(
        step: int | None, scheme: str, group: str, inst: int | None, band: str, rendered: dict[str, str] | None
    ) -> Any:
        search = query({"step": step, "scheme": scheme, "group": group, "inst": inst, "band": band})
        return push_state(rendered, search)

    @app.callback(
        Output("url", "pathname", allow_duplicate=True),
        Input("tm-runsel", "value"),
        State("tm-run", "data"),
        prevent_initial_call=True,
    )
    def other_run(value: str | None, run: str) -> Any:
        if not value or value == run:
            raise PreventUpdate
        return run_path(value, "time")

    @app.callback(
        Output("tm-inst", "data"),
        Input("tm-timeline-graph", "clickData"),
        Input("tm-step", "value"),
        Input("tm-group", "value"),
        State("tm-inst", "data"),
        prevent_initial_call=True,
    )
    def select(click: dict[str, Any] | None, _step: int | None, _group: str, current: int | None) -> Any:
        if ctx.triggered_id != "tm-timeline-graph":
            return None if current is not None else no_update
        points = (click or {}).get("points") or []
        data = points[0].get("customdata") if points else None
        if not isinstance(data, list) or not data or not isinstance(data[0], int):
            raise PreventUpdate
        return None if data[0] == current else data[0]

    @app.callback(
        Output("tm-breakdown", "children"),
        Input("tm-scheme", "value"),
        Input("tm-band", "value"),
        State("tm-run", "data"),
        State("tm-status-data", "data"),
        State("token", "data"),
    )
    @guarded()
    def bars(scheme: str, band: str, run: str, status_data: dict[str, Any], token: str | None) -> Any:
        return breakdown_figure(cfg.client(token), run, scheme or None, TimeStatus.model_validate(status_data), band)

    @app.callback(
        Output("tm-timeline", "children"),
        Output("tm-waits", "children"),
        Input("tm-step", "value"),
        Input("tm-group", "value"),
        Input("tm-inst", "data"),
        Input("tm-band", "value"),
        State("tm-bands", "data"),
        State("tm-run", "data"),
        State("tm-status-data", "data"),
        State("token", "data"),
    )
    @guarded(outputs=2)
    def step_views(
        step: int | None,
        group: str,
        inst: int | None,
        band: str,
        bands: list[list[int]],
        run: str,
        status_data: dict[str, Any],
        token: str | None,
    ) -> Any:
        client = cfg.client(token)
        status = TimeStatus.model_validate(status_data)
        if step is None:
            why = _why(status, "breakdown", "matching", "critical_path")
            text = "No profiler step in this run" + (f": {why}" if why else ".")
            return empty(text), empty("No step to show the waits of (see the timeline above).")
        instances, total = _step_instances(client, run, step, group or None)
        paths = client.critical_paths(run, step=step).paths
        path = paths[0] if paths else None
        first = int_or_none(band)
        shown = next(((lo, hi) for lo, hi in bands if lo == first), None)
        in_band = instances
        if shown is not None:  # the waits of the band's ranks only, one heatmap row each
            in_band = [
                i.model_copy(update={"members": [m for m in i.members if shown[0] <= m.rank <= shown[1]]})
                for i in instances
            ]
        return (
            timeline_view(run, step, instances, total, path, inst, status, shown=shown),
            waits_view(run, step, in_band, status),
        )

    @app.callback(
        Output("tm-stragglers", "children"),
        Input("tm-group", "value"),
        State("tm-run", "data"),
        State("tm-status-data", "data"),
        State("token", "data"),
    )
    @guarded()
    def stragglers(group: str, run: str, status: dict[str, Any], token: str | None) -> Any:
        report = cfg.client(token).time_stragglers(run)
        return stragglers_view(report, group or None, TimeStatus.model_validate(status))
