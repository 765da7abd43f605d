"""`/runs/{run}/histograms`: message sizes per scheme in power-of-two bins, bars coloured by op, calls or
bytes, normalised per rank per iteration; a click on a bar lists its calls."""

from __future__ import annotations

import math
from typing import Any

from dash import ALL, Dash, Input, Output, State, ctx, dcc, html
from dash.exceptions import PreventUpdate

from commlens.contract.analysis import NO_DTYPE, BarCall, Histogram, HistogramSeries
from commlens.contract.analysis import UNATTRIBUTED as NO_SCHEME
from commlens.vocab import OPS, SCHEMES

from .components import (
    OP_COLORS,
    PATTERNS,
    chart_block,
    csv_link,
    empty,
    figure,
    guarded,
    loading,
    push_state,
    table,
    td_id,
    td_num,
)
from .config import UiConfig
from .fmt import byte_axis, duration_us, exact_bytes, num
from .urls import count_or_none, int_or_none, one_of, query

UNATTRIBUTED = "-"  # the selection's scheme for calls without a group
MAX_LISTED = 300
NORM_TEXT = {"per_rank_per_iteration": "per rank per iteration", "per_rank": "per rank", "none": "in the whole run"}


def _select(id_: str, label: str, options: list[str], value: str | None, all_label: str = "all") -> html.Div:
    return html.Div(
        [
            html.Label(label, htmlFor=id_),
            dcc.Dropdown(
                id=id_,
                options=[{"label": all_label, "value": ""}] + [{"label": o, "value": o} for o in options],
                value=value or "",
                clearable=False,
                searchable=False,
            ),
        ],
        className="field",
    )


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    return html.Div(
        [
            dcc.Store(id="hg-run", data=run),
            html.Div(
                [
                    _select("hg-scheme", "Scheme", list(SCHEMES), one_of(q.get("scheme"), SCHEMES)),
                    _select("hg-op", "Op", list(OPS), one_of(q.get("op"), OPS)),
                    html.Div(
                        [
                            html.Label("Dtype", htmlFor="hg-dtype"),
                            dcc.Input(
                                id="hg-dtype",
                                type="text",
                                value=q.get("dtype", ""),
                                debounce=True,
                                placeholder="all",
                                size="9",
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Rank", htmlFor="hg-rank"),
                            dcc.Input(
                                id="hg-rank",
                                type="number",
                                min=0,
                                step=1,
                                value=count_or_none(q.get("rank")),  # ?rank=-1: as if not given
                                debounce=True,
                                placeholder="all",
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Step / iteration", htmlFor="hg-step"),
                            dcc.Input(
                                id="hg-step",
                                type="number",
                                step=1,
                                value=int_or_none(q.get("step")),
                                debounce=True,
                                placeholder="all",
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Weight"),
                            dcc.RadioItems(
                                id="hg-weight",
                                options=[{"label": " calls", "value": "calls"}, {"label": " bytes", "value": "bytes"}],
                                value=q.get("weight", "calls") if q.get("weight") in ("calls", "bytes") else "calls",
                                inline=True,
                                inputStyle={"marginLeft": "8px"},
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Normalise"),
                            dcc.Checklist(
                                id="hg-norm",
                                options=[{"label": " per rank per iteration", "value": "1"}],
                                value=[] if q.get("norm") == "0" else ["1"],
                            ),
                        ],
                        className="field",
                    ),
                ],
                className="controls",
            ),
            dcc.Store(id="hg-sel", data=q.get("sel")),
            loading(html.Div(id="hg-content")),
            html.H2("Calls of the selected bar"),
            loading(html.Div(id="hg-calls")),
        ]
    )


def _series_name(s: HistogramSeries) -> str:
    return f"{s.op} {s.dtype}" if s.dtype else s.op


def panel(h: Histogram, scheme: str | None, series: list[HistogramSeries]) -> html.Div:
    labels = [b.label for b in h.bins]
    title_scheme = scheme if scheme is not None else "unattributed (no group)"
    unit = "bytes" if h.weight == "bytes" else "calls"
    norm = NORM_TEXT[h.normalization]
    fig = figure(
        f"{title_scheme}: {unit} {norm} by message size",
        "message size S (power-of-two bin)",
        f"{unit} {norm} (log scale)",
    )
    top = 0.0
    for s in series:
        key = scheme if scheme is not None else UNATTRIBUTED
        custom = [
            [key, s.op, s.dtype or "", b.key, num(s.calls[i]), exact_bytes(s.bytes[i])] for i, b in enumerate(h.bins)
        ]
        fig.add_bar(
            name=_series_name(s),
            x=labels,
            y=s.values,
            customdata=custom,
            marker_color=OP_COLORS.get(s.op, "#777"),
            marker_pattern_shape=PATTERNS[[x for x in series if x.op == s.op].index(s) % len(PATTERNS)],
            hovertemplate=(
                "<b>%{x}</b><br>" + _series_name(s) + "<br>calls: %{customdata[4]}"
                "<br>bytes: %{customdata[5]}<extra></extra>"
            ),
        )
        top = max([top, *s.values])  # the highest bar, for the axis range and tick labels
    # side by side, not stacked: on a log axis a stacked part's height is no measure of its value (two equal
    # halves drew one as the whole bar and the other as a thin cap)
    fig.update_layout(
        barmode="group",
        xaxis={"type": "category", "categoryorder": "array", "categoryarray": labels, "tickangle": -35},
        clickmode="event",
    )
    # Log scale: message counts and volumes span orders of magnitude; a few huge buckets must not flatten
    # the many small calls that matter for latency.
    low = min((v for s in series for v in s.values if v > 0), default=1.0)
    # the axis starts a half decade below the smallest bar: autorange started at it, so a bin of one call was a
    # sliver of a bar too thin to see or click
    span = [math.log10(low) - 0.5, math.log10(max(top, low)) + 0.2]
    fig.update_layout(
        yaxis={"type": "log", "range": span, **(byte_axis(top, low, log=True) if h.weight == "bytes" else {})}
    )
    cols = ["op", "dtype", "size bin", "bin from (B)", "bin to (B)", f"calls {norm}", f"bytes {norm}"]
    display, raw = [], []
    for s in series:
        for i, b in enumerate(h.bins):
            if s.calls[i] == 0 and s.bytes[i] == 0:
                continue
            display.append(
                [
                    s.op,
                    s.dtype or "-",
                    b.label,
                    td_num(b.lo),
                    td_num(b.hi),
                    td_num(s.calls[i]),
                    td_num(s.bytes[i], exact_bytes(s.bytes[i])),
                ]
            )
            raw.append([s.op, s.dtype, b.label, b.lo, b.hi, s.calls[i], s.bytes[i]])
    graph_id = {"type": "hg-graph", "scheme": scheme if scheme is not None else UNATTRIBUTED}
    return chart_block(graph_id, fig, cols, display, raw, f"{h.run}-{scheme or 'unattributed'}-histogram.csv")


def histogram_view(h: Histogram) -> Any:
    notes: list[Any] = []
    # per rank for want of iterations: the note below says so with the reason, so the message would repeat it
    if h.iterations is not None and not (h.iterations.mode == "none" and h.normalization == "per_rank"):
        notes.append(h.iterations.message)
    notes += h.notes
    if h.excluded:
        notes.append(
            "left out of the normalised histogram: " + ", ".join(f"{k}: {num(v)} calls" for k, v in h.excluded.items())
        )
    head = html.Ul([html.Li(n) for n in notes], className="note-list") if notes else None
    if not h.series:
        chosen = {k: v for k, v in h.filters.items() if v is not None}
        if chosen:
            why = "No calls match these filters (" + ", ".join(f"{k} {v}" for k, v in chosen.items()) + ")."
        else:
            why = (
                "No collective calls in this run: an NCCL log lists calls only with NCCL_DEBUG=INFO "
                "NCCL_DEBUG_SUBSYS=COLL; a profiler trace needs its collectives' ops or kernels "
                "(the run's files and what was skipped are on the Runs page)."
            )
        return html.Div([head, empty(why)])
    order: list[str | None] = []
    for s in h.series:
        if s.scheme not in order:
            order.append(s.scheme)
    panels = [panel(h, sc, [s for s in h.series if s.scheme == sc]) for sc in order]
    hint = html.P("Click a bar to list its calls below. Hover shows the exact numbers.", className="hint")
    return html.Div([head, hint, html.Div(panels, className="grid2" if len(panels) > 1 else "")])


def parse_sel(sel: str | None) -> tuple[str, str, str, str] | None:
    parts = (sel or "").split(":")
    return (parts[0], parts[1], parts[2], parts[3]) if len(parts) == 4 else None


def register(app: Dash, cfg: UiConfig) -> None:
    controls = [
        Input("hg-scheme", "value"),
        Input("hg-op", "value"),
        Input("hg-dtype", "value"),
        Input("hg-rank", "value"),
        Input("hg-step", "value"),
        Input("hg-weight", "value"),
        Input("hg-norm", "value"),
    ]

    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        *controls,
        Input("hg-sel", "data"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(
        scheme: str,
        op: str,
        dtype: str,
        rank: int | None,
        step: int | None,
        weight: str,
        norm: list[str],
        sel: str | None,
        rendered: dict | None,
    ) -> Any:
        search = query(
            {
                "scheme": scheme,
                "op": op,
                "dtype": dtype,
                "rank": rank,
                "step": step,
                "weight": None if weight == "calls" else weight,
                "norm": None if norm else "0",
                "sel": sel,
            }
        )
        return push_state(rendered, search)

    @app.callback(Output("hg-content", "children"), *controls, State("hg-run", "data"), State("token", "data"))
    @guarded()
    def show(
        scheme: str,
        op: str,
        dtype: str,
        rank: int | None,
        step: int | None,
        weight: str,
        norm: list[str],
        run: str,
        token: str | None,
    ) -> Any:
        h = cfg.client(token).histogram(
            run,
            scheme=scheme or None,
            op=op or None,
            dtype=dtype or None,
            rank=rank,
            step=step,
            weight=weight or "calls",
            normalize=bool(norm),
        )
        return histogram_view(h)

    @app.callback(
        Output("hg-sel", "data"), Input({"type": "hg-graph", "scheme": ALL}, "clickData"), prevent_initial_call=True
    )
    def select(clicks: list[dict | None]) -> Any:
        trig = ctx.triggered[0]["value"] if ctx.triggered else None
        if not trig or not trig.get("points"):
            raise PreventUpdate
        scheme, op, dtype, key = trig["points"][0]["customdata"][:4]
        return f"{scheme}:{op}:{dtype}:{key}"

    @app.callback(
        Output("hg-calls", "children"),
        Input("hg-sel", "data"),
        Input("hg-rank", "value"),
        Input("hg-step", "value"),
        Input("hg-norm", "value"),
        State("hg-run", "data"),
        State("token", "data"),
    )
    @guarded()
    def calls(sel: str | None, rank: int | None, step: int | None, norm: list[str], run: str, token: str | None) -> Any:
        parsed = parse_sel(sel)
        if parsed is None:
            return empty("Click a bar of a histogram to list the calls in it.")
        scheme, op, dtype, key = parsed
        # The API lists the bar's calls with the histogram's own filters; the page passes the selection through.
        page = cfg.client(token).bar_calls(
            run,
            bin=key,
            scheme=NO_SCHEME if scheme == UNATTRIBUTED else scheme,
            op=op,
            dtype=dtype or NO_DTYPE,
            rank=rank,
            step=step,
            normalize=bool(norm),
            limit=MAX_LISTED,
        )
        rows = page.items
        label = page.bin.label if page.bin is not None else "every size"
        title = f"{'unattributed' if scheme == UNATTRIBUTED else scheme} · {op} {dtype} · {label}"
        if not rows:
            return html.Div([html.H3(title), empty("No calls of the trace fall in this bar with these filters.")])
        cols = [
            "rank",
            "op",
            "dtype",
            "S",
            "group",
            "group size",
            "step / iteration",
            "start (ms after the step's first call)",
            "duration",
            "source",
            "file",
        ]
        # Wall-clock microseconds since 1970 say nothing at a glance: a call's start is shown from the first
        # call of its file, rank and step (the CSV keeps ts_us as recorded).
        first: dict[tuple[str, int | None, int | None], float] = {}
        for r in rows:
            if r.ts_us is not None:
                at = (r.file, r.rank, r.iteration)
                first[at] = min(first.get(at, r.ts_us), r.ts_us)

        def since_step(r: BarCall) -> Any:
            if r.ts_us is None:
                return td_num(None, "-")
            ms = (r.ts_us - first[(r.file, r.rank, r.iteration)]) / 1e3
            return td_num(ms, f"{ms:,.3f}")

        display = [
            [
                td_id(r.rank),
                r.op,
                r.dtype or "-",
                td_num(r.msg_bytes, exact_bytes(r.msg_bytes)),
                html.Span(r.group_key or "-", className="mono"),
                td_num(r.group_size),
                td_id(r.iteration),
                since_step(r),
                td_num(r.dur_us, duration_us(r.dur_us)),
                r.source_kind,
                html.Span(r.file, className="mono"),
            ]
            for r in rows
        ]
        raw_cols = [
            "rank",
            "op",
            "dtype",
            "msg_bytes",
            "group_key",
            "group_size",
            "step",
            "iteration",
            "ts_us",
            "dur_us",
            "source_kind",
            "file",
        ]
        raw = [[getattr(r, c) for c in raw_cols] for r in rows]
        scope = (
            "calls inside complete iterations, as the normalised bar counts"
            if page.iterations_only
            else "every call of the bar, not normalised"
        )
        note = (
            f"The first {len(rows)} of {page.total} calls ({scope}), in file, rank and time order."
            if page.next_offset is not None
            else f"{page.total} calls ({scope})."
        )
        return html.Div(
            [
                html.H3(title, id="hg-calls-title"),
                html.P(note, className="hint"),
                html.Div(table(cols, display, id_="hg-calls-table"), className="scroll"),
                csv_link(raw_cols, raw, f"{run}-calls.csv"),
            ]
        )
