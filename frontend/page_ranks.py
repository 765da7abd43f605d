"""`/runs/{run}/ranks`: bytes or time per rank and scheme as a heatmap with the imbalance marked, the
bytes each rank's all-to-all calls send to each receiver (sender x receiver, per group, over the run or one
step), and the bus bandwidth by message size per op where the traces have measured durations.

Beyond SCALE_RANKS ranks the page summarises first (the spread and outliers per scheme, one heatmap row per
band of 32 ranks or per host) and draws ranks one by one only for the band the user picks (`?band=FIRST`),
with one rank's rows on request (`?rank=R`); matrices wider than MAX_CELLS ranks are binned to the screen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, State, dcc, html, no_update
from dash.exceptions import PreventUpdate

from commlens.contract.analysis import (
    BandwidthReport,
    Finding,
    RankSchemeTotal,
    RankSummary,
    RankTotals,
)
from commlens.contract.pairs import PairMatrix, PairsReport
from commlens.vocab import format_bytes

from .client import ApiProblem
from .components import (
    MAX_TABLE_ROWS,
    OP_COLORS,
    chart_block,
    colorbar,
    empty,
    figure,
    guarded,
    loading,
    push_state,
    scheme_color,
    table,
    td_num,
)
from .config import UiConfig
from .fmt import byte_axis, duration_axis, duration_us, exact_bytes, num
from .urls import int_or_none, query, run_path

SCALE_RANKS = 64  # more ranks than this: summary first, then one band at a time
BAND = 32
MAX_CELLS = 128  # a heatmap side drawn at most this many cells; wider matrices are binned
ALL_RANKS = "all"
METRICS = {"bytes": "bytes", "time_us": "time in collectives"}  # values µs, labelled in human units
BASES = {"per_iteration": "per iteration", "total": "whole trace"}
UNATTRIBUTED = "unattributed"


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    metric = q.get("metric") if q.get("metric") in METRICS else "bytes"
    basis = q.get("basis") if q.get("basis") in BASES else "per_iteration"
    pairs_step = q.get("pairs_step") or WHOLE_RUN
    if not pairs_step.lstrip("-").isdigit():
        pairs_step = WHOLE_RUN
    # the URL's step is an option from the start: a dropdown drops a value its options lack
    step_options = [{"label": "whole run", "value": WHOLE_RUN}]
    if pairs_step != WHOLE_RUN:
        step_options.append({"label": f"step {pairs_step}", "value": pairs_step})
    rank = q.get("rank") or None
    band = int_or_none(q.get("band"))
    if band is None and rank is not None and rank.isdigit():
        band = int(rank) // BAND * BAND  # a link to one rank opens its band
    band_value = ALL_RANKS if band is None else str(band)
    band_options = [{"label": "all ranks (summary)", "value": ALL_RANKS}]
    if band is not None:
        band_options.append({"label": f"ranks {band}-{band + BAND - 1}", "value": band_value})
    return html.Div(
        [
            dcc.Store(id="rk-run", data=run),
            dcc.Store(id="rk-focus", data={"scheme": q.get("scheme")}),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Metric"),
                            dcc.RadioItems(
                                id="rk-metric",
                                options=[{"label": f" {v}", "value": k} for k, v in METRICS.items()],
                                value=metric,
                                inline=True,
                                inputStyle={"marginLeft": "8px"},
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Basis"),
                            dcc.RadioItems(
                                id="rk-basis",
                                options=[{"label": f" {v}", "value": k} for k, v in BASES.items()],
                                value=basis,
                                inline=True,
                                inputStyle={"marginLeft": "8px"},
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Ranks", htmlFor="rk-band"),
                            dcc.Dropdown(
                                id="rk-band",
                                options=band_options,
                                value=band_value,
                                clearable=False,
                                style={"width": "220px"},
                            ),
                        ],
                        id="rk-band-field",
                        className="field",
                        style={"display": "none"},
                    ),
                    html.Div(
                        [
                            html.Label("Rank", htmlFor="rk-rank"),
                            dcc.Dropdown(
                                id="rk-rank",
                                options=[{"label": rank, "value": rank}] if rank else [],
                                value=rank,
                                placeholder="one rank…",
                                style={"width": "160px"},
                            ),
                        ],
                        id="rk-rank-field",
                        className="field",
                        style={"display": "none"},
                    ),
                ],
                className="controls",
            ),
            loading(html.Div(id="rk-content")),
            html.H2("All-to-all bytes between ranks", id="pairs"),
            html.Div(
                html.Div(
                    [
                        html.Label("Step"),
                        dcc.Dropdown(
                            id="rk-pairs-step",
                            options=step_options,
                            value=pairs_step,
                            clearable=False,
                            style={"width": "220px"},
                        ),
                    ],
                    className="field",
                ),
                className="controls",
            ),
            loading(html.Div(id="rk-pairs")),
            html.H2("Bandwidth by message size", id="bandwidth"),
            loading(html.Div(id="rk-bandwidth")),
        ]
    )


def _value(r: RankSchemeTotal, metric: str, basis: str) -> float | None:
    if metric == "bytes":
        return r.bytes_per_iteration if basis == "per_iteration" else float(r.bytes)
    return r.time_us_per_iteration if basis == "per_iteration" else r.time_us


def _unit(metric: str) -> Any:
    return "bytes" if metric == "bytes" else "us"


def heatmap(
    t: RankTotals, metric: str, basis: str, findings: list[Finding], focus: dict[str, Any], with_imbalance: bool = True
) -> Any:
    if not t.rows:
        if t.first is not None:
            return empty(f"No calls of ranks {t.first}-{t.last} in this run.")
        return empty("No calls with a known rank or process in this run.")
    schemes: list[str] = []
    ranks: list[str] = []
    for r in t.rows:
        s = r.scheme or UNATTRIBUTED
        if s not in schemes:
            schemes.append(s)
        if r.rank not in ranks:
            ranks.append(r.rank)
    cell = {(r.rank, r.scheme or UNATTRIBUTED): r for r in t.rows}
    z = [[_value(cell[(rk, s)], metric, basis) if (rk, s) in cell else None for s in schemes] for rk in ranks]
    no_iterations = basis == "per_iteration" and all(v is None for row in z for v in row)
    if no_iterations:  # an empty chart said nothing: show the whole trace, and say why
        basis = "total"
        z = [[_value(cell[(rk, s)], metric, basis) if (rk, s) in cell else None for s in schemes] for rk in ranks]
    text = [[_fmt(v, metric) if v is not None else "" for v in row] for row in z]
    custom = [
        [[cell[(rk, s)].calls, cell[(rk, s)].iterations] if (rk, s) in cell else [None, None] for s in schemes]
        for rk in ranks
    ]
    unit = "bytes" if metric == "bytes" else "time"  # the colour bar's ticks say the unit (ms, µs)
    label = f"{METRICS[metric]} {BASES[basis]}"
    scope = "" if t.first is None else f", ranks {t.first}-{t.last}"
    fig = figure(
        f"{label.capitalize()} per rank and scheme{scope}",
        "scheme",
        "rank",
        height=min(620, max(300, 120 + 22 * len(ranks))),
    )
    top = max((v for row in z for v in row if v is not None), default=0.0)
    fig.add_trace(
        go.Heatmap(
            x=schemes,
            y=ranks,
            z=z,
            text=text,
            customdata=custom,
            colorscale="Blues",
            zmin=0,
            zmax=top or 1,
            hoverongaps=False,
            colorbar=colorbar(unit, top, _unit(metric)),
            texttemplate="%{text}" if len(ranks) * len(schemes) <= 160 else None,
            hovertemplate="rank %{y}, %{x}<br>" + label + ": %{text}<br>calls %{customdata[0]}, iterations "
            "%{customdata[1]}<extra></extra>",
        )
    )
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_xaxes(type="category")
    other_basis = False
    for imb in t.imbalance:
        if imb.all_schemes or imb.metric != metric:
            continue
        if imb.basis != basis:  # marked only where the heatmap shows what the imbalance measured
            other_basis = True
            continue
        s = imb.scheme or UNATTRIBUTED
        if imb.max_rank not in ranks:  # another band's rank: a marker would add a row
            continue
        fig.add_annotation(  # positions, not names: Plotly reads a name like "700" as the number 700
            x=schemes.index(s),
            y=ranks.index(imb.max_rank),
            text=f"max ×{imb.max_over_mean:.2f}",  # noqa: RUF001 - the multiplication sign is meant
            showarrow=True,
            arrowhead=2,
            ax=40,
            ay=-18,
            font={"color": "#b42318"},
            bgcolor="#fff",
        )
    if focus.get("rank") is not None and str(focus["rank"]) in ranks:
        fig.add_hline(y=ranks.index(str(focus["rank"])), line_color="#d92d20", line_width=2, opacity=0.6)
    cols = ["rank", "scheme", "calls", "bytes", "time", "iterations", "bytes / iteration", "time / iteration"]
    display = [
        [
            r.rank,
            r.scheme or UNATTRIBUTED,
            td_num(r.calls),
            td_num(r.bytes, exact_bytes(r.bytes)),
            td_num(r.time_us, duration_us(r.time_us)),
            td_num(r.iterations),
            td_num(r.bytes_per_iteration, exact_bytes(r.bytes_per_iteration)),
            td_num(r.time_us_per_iteration, duration_us(r.time_us_per_iteration)),
        ]
        for r in t.rows
    ]
    raw = [
        [r.rank, r.scheme, r.calls, r.bytes, r.time_us, r.iterations, r.bytes_per_iteration, r.time_us_per_iteration]
        for r in t.rows
    ]
    missing = any(v is None for row in z for v in row)
    if other_basis:
        hidden = BASES["total" if basis == "per_iteration" else "per_iteration"]
        note_basis = f" Imbalance here is measured {hidden}: switch the basis to see it marked."
    else:
        note_basis = ""
    empty_cells = (
        (
            "Empty cells: the rank does not use the scheme"
            + (", or has no measured time" if metric == "time_us" else "")
            + ("; per-iteration values need iterations" if basis == "per_iteration" else "")
            + "."
        )
        if missing
        else ""
    )
    note = (empty_cells + note_basis).strip() or None
    if no_iterations:
        note = (
            "No rank has per-iteration values (the run has no iterations: no profiler steps, and no repeating "
            "pattern in its communicators), so this is the whole trace. " + (note or "")
        ).strip()
    return html.Div(
        [
            chart_block("rk-heatmap", fig, cols, display, raw, f"{t.run}-ranks.csv", note=note),
            imbalance_table(t, findings) if with_imbalance else None,
            html.Ul([html.Li(n) for n in t.notes], className="note-list"),
        ]
    )


def _fmt(v: float, metric: str) -> str:
    return format_bytes(v) if metric == "bytes" else duration_us(v)


def imbalance_table(t: RankTotals, findings: list[Finding]) -> Any:
    if not t.imbalance:
        return empty("No imbalance to report: fewer than two ranks share a scheme.")
    flagged = {
        (f.evidence.get("metric"), f.evidence.get("max_rank"), f.evidence.get("max_over_mean")): f
        for f in findings
        if f.id.startswith("imbalance:")
    }
    rows, classes = [], []
    for imb in t.imbalance:
        f = flagged.get((imb.metric, imb.max_rank, imb.max_over_mean))
        fmt = (exact_bytes) if imb.metric == "bytes" else duration_us
        rows.append(
            [
                "all schemes" if imb.all_schemes else imb.scheme or UNATTRIBUTED,
                METRICS[imb.metric],
                BASES[imb.basis],
                td_num(imb.ranks),
                td_num(imb.max, fmt(imb.max)),
                imb.max_rank,
                td_num(imb.mean, fmt(imb.mean)),
                imb.min_rank,
                td_num(imb.max_over_mean, f"{imb.max_over_mean:.3f}"),
                html.Span(f.severity, className=f"badge sev-{f.severity}") if f else "-",
            ]
        )
        classes.append("flag" if f else None)
    return html.Div(
        [
            html.H3("Imbalance between ranks"),
            table(
                ["scope", "metric", "basis", "ranks", "max", "max rank", "mean", "min rank", "max / mean", "finding"],
                rows,
                id_="rk-imbalance",
                row_class=classes,
            ),
            html.P("Highlighted rows are imbalances the findings flag.", className="hint"),
        ]
    )


def _fmt_unit(v: float | None, metric: str) -> str:
    return "-" if v is None else (exact_bytes(v) if metric == "bytes" else duration_us(v))


def _value_axis(metric: str, top: float, bottom: float, log: bool) -> dict[str, Any]:
    """A linear axis starts at zero: ranks that all carry the same volume drew a flat box on a range narrower
    than one tick step, so the axis had no label at all."""
    if metric == "bytes":
        if log:
            return {"type": "log", "tickmode": "array", **byte_axis(top, bottom, log=True)}
        return {"type": "linear", "rangemode": "tozero", "tickmode": "array", **byte_axis(top)}
    if log:
        return {"type": "log"}
    return {"rangemode": "tozero", "tickmode": "array", **duration_axis(top)}


def summary_view(s: RankSummary, run: str) -> Any:
    """Many ranks at a glance: the spread per scheme with its outliers named, then one heatmap row per band."""
    if not s.groups:
        return empty("No calls with a known rank or process in this run.")
    if not s.schemes:
        return html.Div([empty("No rank has a value for this metric and basis."), _notes(s.notes)])
    return html.Div(
        [
            html.P(
                f"{num(s.ranks)} ranks: the spread per scheme first, then bands of {s.band} ranks; pick a band "
                "(or click its row) to see its ranks one by one.",
                className="hint",
            ),
            spread_chart(s, run),
            outliers_table(s, run),
            bands_chart(s, run),
            _notes(s.notes),
        ]
    )


def _notes(notes: list[str]) -> Any:
    return html.Ul([html.Li(n) for n in notes], className="note-list")


def spread_chart(s: RankSummary, run: str) -> Any:
    label = f"{METRICS[s.metric]} {BASES[s.basis]}"
    unit = "bytes" if s.metric == "bytes" else "µs"
    fig = figure(f"Spread of {label} across ranks, per scheme", "scheme", unit, height=360)
    for sp in s.schemes:
        name = sp.scheme or UNATTRIBUTED
        iqr = sp.q3 - sp.q1
        color = scheme_color(sp.scheme)
        fig.add_trace(
            go.Box(
                name=name,
                x=[name],
                q1=[sp.q1],
                median=[sp.median],
                q3=[sp.q3],
                lowerfence=[max(sp.min, sp.q1 - 1.5 * iqr)],
                upperfence=[min(sp.max, sp.q3 + 1.5 * iqr)],
                mean=[sp.mean],
                marker_color=color,
                showlegend=False,
            )
        )
        if sp.outliers:
            fig.add_trace(
                go.Scatter(
                    name=f"{name} outliers",
                    x=[name] * len(sp.outliers),
                    y=[o.value for o in sp.outliers],
                    mode="markers",
                    marker={"color": color, "symbol": "circle-open", "size": 9},
                    text=[o.rank for o in sp.outliers],
                    customdata=[_fmt_unit(o.value, s.metric) for o in sp.outliers],
                    hovertemplate="rank %{text}, " + name + ": %{customdata}<extra>outlier</extra>",
                    showlegend=False,
                )
            )
    positive = [v for sp in s.schemes for v in (sp.min, sp.max) if v > 0]
    log = bool(positive) and max(positive) / min(positive) > 100
    fig.update_yaxes(**_value_axis(s.metric, max(sp.max for sp in s.schemes), min(positive, default=1.0), log))
    fig.update_xaxes(type="category")
    cols = ["scheme", "ranks", "min", "min rank", "q1", "median", "q3", "max", "max rank", "mean", "outliers"]
    display = [
        [
            sp.scheme or UNATTRIBUTED,
            td_num(sp.ranks),
            td_num(sp.min, _fmt_unit(sp.min, s.metric)),
            sp.min_rank,
            td_num(sp.q1, _fmt_unit(sp.q1, s.metric)),
            td_num(sp.median, _fmt_unit(sp.median, s.metric)),
            td_num(sp.q3, _fmt_unit(sp.q3, s.metric)),
            td_num(sp.max, _fmt_unit(sp.max, s.metric)),
            sp.max_rank,
            td_num(sp.mean, _fmt_unit(sp.mean, s.metric)),
            td_num(sp.outliers_total),
        ]
        for sp in s.schemes
    ]
    raw = [
        [
            sp.scheme,
            sp.ranks,
            sp.min,
            sp.min_rank,
            sp.q1,
            sp.median,
            sp.q3,
            sp.max,
            sp.max_rank,
            sp.mean,
            sp.outliers_total,
        ]
        for sp in s.schemes
    ]
    note = "Boxes: quartiles and median; whiskers reach 1.5 IQR; circles: ranks beyond (hover for the rank)." + (
        " Log scale: the schemes differ by more than 100x." if log else ""
    )
    return chart_block("rk-spread", fig, cols, display, raw, f"{run}-ranks-spread.csv", note=note)


def _rank_link(run: str, s: RankSummary, rank: str) -> Any:
    params: dict[str, object] = {
        "metric": None if s.metric == "bytes" else s.metric,
        "basis": None if s.basis == "per_iteration" else s.basis,
        "rank": rank,
    }
    return dcc.Link(rank, href=run_path(run, "ranks") + query(params))


def outliers_table(s: RankSummary, run: str) -> Any:
    rows: list[list[Any]] = []
    for sp in s.schemes:
        for o in sp.outliers:
            ratio = o.value / sp.median if sp.median else None
            rows.append(
                [
                    sp.scheme or UNATTRIBUTED,
                    _rank_link(run, s, o.rank),
                    td_num(o.value, _fmt_unit(o.value, s.metric)),
                    td_num(ratio, "-" if ratio is None else f"{ratio:.3g}"),
                ]
            )
    if not rows:
        return html.P("No rank lies beyond 1.5 IQR of its scheme's quartiles.", className="hint", id="rk-no-outliers")
    more = sum(sp.outliers_total - len(sp.outliers) for sp in s.schemes)
    return html.Div(
        [
            html.H3("Outlying ranks"),
            html.Div(
                table(["scheme", "rank", "value", "value / median"], rows, id_="rk-outliers"), className="scroll short"
            ),
            html.P(f"{more} more beyond the {s.outlier_limit} farthest per scheme.", className="hint")
            if more
            else None,
        ]
    )


def bands_chart(s: RankSummary, run: str) -> Any:
    schemes = list(dict.fromkeys(c.scheme or UNATTRIBUTED for g in s.groups for c in g.cells))
    labels = [g.label for g in s.groups]
    cell = {(g.label, c.scheme or UNATTRIBUTED): c for g in s.groups for c in g.cells}
    z = [[cell[(g, x)].mean if (g, x) in cell else None for x in schemes] for g in labels]
    custom = [
        [
            [
                _fmt_unit(cell[(g.label, x)].mean, s.metric),
                _fmt_unit(cell[(g.label, x)].min, s.metric),
                cell[(g.label, x)].min_rank,
                _fmt_unit(cell[(g.label, x)].max, s.metric),
                cell[(g.label, x)].max_rank,
                cell[(g.label, x)].ranks,
                "" if g.first is None else str(g.first),
            ]
            if (g.label, x) in cell
            else [""] * 6 + ["" if g.first is None else str(g.first)]
            for x in schemes
        ]
        for g in s.groups
    ]
    label = f"{METRICS[s.metric]} {BASES[s.basis]}"
    top = max((v for row in z for v in row if v is not None), default=0.0)
    kind = "band" if all(g.kind == "band" for g in s.groups) else "group"
    fig = figure(
        f"Mean {label} per rank, per {kind} and scheme",
        "scheme",
        "ranks" if kind == "band" else "band or host",
        height=min(620, max(300, 120 + 18 * len(labels))),
    )
    fig.add_trace(
        go.Heatmap(
            x=schemes,
            y=labels,
            z=z,
            customdata=custom,
            colorscale="Blues",
            zmin=0,
            zmax=top or 1,
            hoverongaps=False,
            colorbar=colorbar("mean per rank", top, _unit(s.metric)),
            hovertemplate="%{y}, %{x} (%{customdata[5]} ranks)<br>mean %{customdata[0]}<br>min %{customdata[1]} "
            "on rank %{customdata[2]}<br>max %{customdata[3]} on rank %{customdata[4]}<extra></extra>",
        )
    )
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_xaxes(type="category")
    cols = ["ranks", "scheme", "members", "mean", "min", "min rank", "max", "max rank"]
    rows = [(g, c) for g in s.groups for c in g.cells]
    display = [
        [
            g.label,
            c.scheme or UNATTRIBUTED,
            td_num(c.ranks),
            td_num(c.mean, _fmt_unit(c.mean, s.metric)),
            td_num(c.min, _fmt_unit(c.min, s.metric)),
            c.min_rank,
            td_num(c.max, _fmt_unit(c.max, s.metric)),
            c.max_rank,
        ]
        for g, c in rows
    ]
    raw = [[g.label, c.scheme, c.ranks, c.mean, c.min, c.min_rank, c.max, c.max_rank] for g, c in rows]
    hosts = any(g.kind == "host" for g in s.groups)
    note = "Click a band's row to see its ranks." + (
        " Processes without a global rank are grouped by host and cannot be opened as a band." if hosts else ""
    )
    return chart_block("rk-bands", fig, cols, display, raw, f"{run}-ranks-bands.csv", note=note)


def band_view(t: RankTotals, metric: str, basis: str, findings: list[Finding], focus: dict[str, Any], run: str) -> Any:
    back = dcc.Link(
        "← all ranks",
        href=run_path(run, "ranks")
        + query(
            {"metric": None if metric == "bytes" else metric, "basis": None if basis == "per_iteration" else basis}
        ),
        id="rk-back",
    )
    rank = focus.get("rank")
    detail = rank_detail(t, str(rank), metric) if rank is not None else None
    return html.Div(
        [
            html.P([back, f" · ranks {t.first}-{t.last} of {num(t.ranks)}"], className="hint"),
            detail,
            heatmap(t, metric, basis, findings, focus),
        ]
    )


def rank_detail(t: RankTotals, rank: str, metric: str) -> Any:
    rows = [r for r in t.rows if r.rank == rank]
    if not rows:
        return None  # a rank of another band (kept in the URL while the user moves between bands)
    body = [
        [
            r.scheme or UNATTRIBUTED,
            td_num(r.calls),
            td_num(r.bytes, exact_bytes(r.bytes)),
            td_num(r.time_us, duration_us(r.time_us)),
            td_num(r.iterations),
            td_num(r.bytes_per_iteration, exact_bytes(r.bytes_per_iteration)),
            td_num(r.time_us_per_iteration, duration_us(r.time_us_per_iteration)),
        ]
        for r in rows
    ]
    cols = ["scheme", "calls", "bytes", "time", "iterations", "bytes / iteration", "time / iteration"]
    return html.Div([html.H3(f"Rank {rank}"), table(cols, body)], id="rk-rank-detail", className="card")


def bin_matrix(
    ranks: list[int], rows: list[list[int | None]], cells: int = MAX_CELLS
) -> tuple[list[str], list[list[int | None]], int]:
    """Sums of consecutive blocks of at most `cells` per side: (block labels "a-b", block sums (None where no
    cell of the block is known), ranks per block)."""
    n = len(ranks)
    k = -(-n // cells)
    edges = [(i, min(i + k, n)) for i in range(0, n, k)]
    labels = [f"{ranks[a]}-{ranks[b - 1]}" if b - a > 1 else str(ranks[a]) for a, b in edges]
    z: list[list[int | None]] = []
    for a, b in edges:
        block_rows = rows[a:b]
        out: list[int | None] = []
        for c, d in edges:
            vals = [v for row in block_rows for v in row[c:d] if v is not None]
            out.append(sum(vals) if vals else None)
        z.append(out)
    return labels, z, k


WHOLE_RUN = "run"


def pairs_view(p: PairsReport) -> Any:
    """One heatmap per group (sender on y, receiver on x), or the report's reason for none."""
    if not p.matrices:
        return empty(f"No all-to-all matrix: {p.reason}.")
    scope = "the whole run" if p.step is None else f"step {p.step}"
    blocks: list[Any] = [pairs_heatmap(m, scope, p.run, i) for i, m in enumerate(p.matrices)]
    return html.Div([*blocks, html.Ul([html.Li(n) for n in p.notes], className="note-list")])


def pairs_heatmap(m: PairMatrix, scope: str, run: str, index: int) -> Any:
    """Sender x receiver bytes; groups wider than MAX_CELLS ranks are drawn as blocks of consecutive ranks
    (their sums: binned by the server when asked with `bins`, else here), so the browser never draws a cell
    per pair of 1,024 ranks."""
    binned = m.per_block > 1 or len(m.ranks) > MAX_CELLS
    if m.per_block > 1:
        labels, z, per = m.labels, m.bytes, m.per_block
    elif binned:
        labels, z, per = bin_matrix(m.ranks, m.bytes)
    else:
        labels, z, per = [str(r) for r in m.ranks], m.bytes, 1
    text = [[exact_bytes(v) if v is not None else "" for v in row] for row in z]
    scheme = m.scheme or UNATTRIBUTED
    fig = figure(
        f"All-to-all bytes sent, {m.group_key} ({scheme}), {scope}",
        "receiver (global rank)" + (f", {per} ranks per cell" if binned else ""),
        "sender (global rank)" + (f", {per} ranks per cell" if binned else ""),
        height=min(620, max(320, 140 + 40 * len(labels))),
    )
    top = max((v for row in z for v in row if v is not None), default=0)
    who = "ranks" if binned else "rank"
    fig.add_trace(
        go.Heatmap(
            x=labels,
            y=labels,
            z=z,
            text=text,
            colorscale="Blues",
            zmin=0,
            zmax=top or 1,  # Plotly ignores zmin without zmax: the scale starts at 0 B
            hoverongaps=False,
            colorbar=colorbar("bytes", top, "bytes"),
            texttemplate="%{text}" if len(labels) <= 16 else None,
            hovertemplate=f"{who} %{{y}} sent {who} %{{x}}: %{{text}}<extra></extra>",
        )
    )
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_xaxes(type="category", side="top")
    cols = ["sender", "receiver", "bytes"]
    cells = [(s, r, v) for s, row in zip(labels, z, strict=True) for r, v in zip(labels, row, strict=True)]
    display = [[s, r, td_num(v, exact_bytes(v) if v is not None else "no trace")] for s, r, v in cells[:MAX_TABLE_ROWS]]
    raw = [[s, r, v] for s, r, v in cells]
    senders = m.labels if m.per_block > 1 else [str(r) for r in m.ranks]
    missing = [s for s, row in zip(senders, m.bytes, strict=True) if row[0] is None]
    note = (
        f"{num(m.calls)} all_to_all calls, {exact_bytes(m.total_bytes)} in all; the diagonal is what a rank keeps."
        + (f" {len(m.ranks)} ranks binned {per} per cell (sums)." if binned else "")
        + (f" No split-recorded call from rank {_few(missing)} (empty rows)." if missing else "")
    )
    return chart_block(
        f"rk-pairs-{index}", fig, cols, display, raw, f"{run}-a2a-{m.group_key}.csv", note=note, total_rows=len(cells)
    )


def _few(ranks: Sequence[str], most: int = 12) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")


def bandwidth_view(b: BandwidthReport) -> Any:
    if not b.bins:  # the report's notes say this run's own reason (no duration, no group size...)
        if b.notes:
            return empty("; ".join(n[0].upper() + n[1:] for n in b.notes) + ".")
        why = ", ".join(f"{k}: {num(v)}" for k, v in b.excluded.items())
        return empty("No call of this run has a measured duration" + (f"; left out: {why}" if why else "") + ".")
    fig = figure("Median bus bandwidth by message size", "median message size S (log)", "median busbw (GB/s)")
    ops: list[str] = []
    for x in b.bins:
        if x.op not in ops:
            ops.append(x.op)
    for op in ops:
        pts = [x for x in b.bins if x.op == op]
        fig.add_scatter(
            name=op,
            x=[p.median_bytes for p in pts],
            y=[p.median_busbw_gbps for p in pts],
            mode="lines+markers",
            marker_color=OP_COLORS.get(op, "#777"),
            customdata=[
                [
                    p.bin.label,
                    p.calls,
                    duration_us(p.median_dur_us),
                    f"{p.median_algbw_gbps:.4g}",
                    ", ".join(map(str, p.group_sizes)),
                    exact_bytes(p.median_bytes),
                ]
                for p in pts
            ],
            hovertemplate=(
                "<b>" + op + "</b> %{customdata[0]}<br>median S %{customdata[5]}<br>busbw "
                "%{y:.4g} GB/s, algbw %{customdata[3]} GB/s<br>median duration %{customdata[2]}"
                "<br>%{customdata[1]} calls, group sizes %{customdata[4]}<extra></extra>"
            ),
        )
    xs = [x.median_bytes for x in b.bins]
    fig.update_xaxes(type="log", **byte_axis(max(xs), min(xs), log=True))
    cols = [
        "op",
        "size bin",
        "calls",
        "median S",
        "median duration",
        "median algbw (GB/s)",
        "median busbw (GB/s)",
        "group sizes",
    ]
    display = [
        [
            x.op,
            x.bin.label,
            td_num(x.calls),
            td_num(x.median_bytes, exact_bytes(x.median_bytes)),
            td_num(x.median_dur_us, duration_us(x.median_dur_us)),
            td_num(x.median_algbw_gbps),
            td_num(x.median_busbw_gbps),
            ", ".join(map(str, x.group_sizes)),
        ]
        for x in b.bins
    ]
    raw = [
        [
            x.op,
            x.bin.label,
            x.calls,
            x.median_bytes,
            x.median_dur_us,
            x.median_algbw_gbps,
            x.median_busbw_gbps,
            " ".join(map(str, x.group_sizes)),
        ]
        for x in b.bins
    ]
    ops_rows = [
        [
            o.op,
            td_num(o.calls),
            td_num(o.best_busbw_gbps),
            o.best_bin,
            o.half_bw_label or "-",
            td_num(o.latency_bound_calls),
            td_num(o.latency_bound_time_us, duration_us(o.latency_bound_time_us)),
        ]
        for o in b.ops
    ]
    excluded = ", ".join(f"{k}: {num(v)}" for k, v in b.excluded.items())
    note = f"{num(b.calls_with_duration)} calls with a measured duration" + (
        f"; left out: {excluded}" if excluded else ""
    )
    return html.Div(
        [
            chart_block("rk-busbw", fig, cols, display, raw, f"{b.run}-bandwidth.csv", note=note),
            html.H3("Per op"),
            table(
                [
                    "op",
                    "calls",
                    "best busbw (GB/s)",
                    "best bin",
                    "half-bandwidth size",
                    "calls below it",
                    "their time",
                ],
                ops_rows,
                id_="rk-bw-ops",
            ),
            html.Ul([html.Li(n) for n in b.notes], className="note-list"),
        ]
    )


HIDDEN = {"display": "none"}


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("rk-metric", "value"),
        Input("rk-basis", "value"),
        Input("rk-pairs-step", "value"),
        Input("rk-band", "value"),
        Input("rk-rank", "value"),
        State("rk-focus", "data"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(
        metric: str,
        basis: str,
        pairs_step: str,
        band: str | None,
        rank: str | None,
        focus: dict[str, Any],
        rendered: dict[str, str] | None,
    ) -> Any:
        search = query(
            {
                "metric": None if metric == "bytes" else metric,
                "basis": None if basis == "per_iteration" else basis,
                "pairs_step": None if pairs_step == WHOLE_RUN else pairs_step,
                "band": None if band in (None, ALL_RANKS) else band,
                "rank": rank,
                **(focus or {}),
            }
        )
        return push_state(rendered, search)

    @app.callback(
        Output("rk-content", "children"),
        Output("rk-band", "options"),
        Output("rk-band-field", "style"),
        Output("rk-rank", "options"),
        Output("rk-rank-field", "style"),
        Input("rk-metric", "value"),
        Input("rk-basis", "value"),
        Input("rk-band", "value"),
        Input("rk-rank", "value"),
        State("rk-focus", "data"),
        State("rk-run", "data"),
        State("token", "data"),
    )
    @guarded(outputs=5)
    def show(
        metric: str, basis: str, band: str | None, rank: str | None, focus: dict[str, Any], run: str, token: str | None
    ) -> Any:
        client = cfg.client(token)
        summary = client.ranks_summary(run, metric, basis, BAND)
        try:
            findings = client.findings(run, limit=200).items
        except ApiProblem:
            findings = []  # the heatmap stands without the flags
        view_focus = {**(focus or {}), "rank": rank}
        if summary.ranks <= SCALE_RANKS:
            totals = client.ranks(run)
            ranks = list(dict.fromkeys(r.rank for r in totals.rows))
            options = [{"label": r, "value": r} for r in ranks]
            return heatmap(totals, metric, basis, findings, view_focus), no_update, HIDDEN, options, HIDDEN
        band_options = [{"label": "all ranks (summary)", "value": ALL_RANKS}] + [
            {"label": g.label, "value": str(g.first)} for g in summary.groups if g.kind == "band"
        ]
        first = int_or_none(band) if band != ALL_RANKS else None
        if first is None:
            return summary_view(summary, run), band_options, {}, [], HIDDEN
        totals = client.ranks(run, first=first, last=first + BAND - 1)
        options = [{"label": r, "value": r} for r in dict.fromkeys(r.rank for r in totals.rows)]
        return band_view(totals, metric, basis, findings, view_focus, run), band_options, {}, options, {}

    @app.callback(
        Output("rk-band", "value"),
        Input("rk-bands", "clickData"),
        prevent_initial_call=True,
    )
    def open_band(click: dict[str, Any] | None) -> Any:
        first = ((click or {}).get("points") or [{}])[0].get("customdata", [""] * 7)[6]
        if not first:
            raise PreventUpdate  # a host's row: no band to open
        return first

    @app.callback(
        Output("rk-rank", "value"),
        Input("rk-heatmap", "clickData"),
        prevent_initial_call=True,
    )
    def pick_rank(click: dict[str, Any] | None) -> Any:
        point = ((click or {}).get("points") or [{}])[0]
        if point.get("y") is None:
            raise PreventUpdate
        return str(point["y"])

    @app.callback(
        Output("rk-pairs", "children"),
        Output("rk-pairs-step", "options"),
        Input("rk-pairs-step", "value"),
        State("rk-run", "data"),
        State("token", "data"),
    )
    @guarded(outputs=2)
    def pairs(step: str, run: str, token: str | None) -> Any:
        report = cfg.client(token).pairs(run, step=None if step == WHOLE_RUN else int(step), bins=MAX_CELLS)
        options = [{"label": "whole run", "value": WHOLE_RUN}]
        options += [{"label": f"step {s}", "value": str(s)} for s in report.steps]
        return pairs_view(report), options

    @app.callback(Output("rk-bandwidth", "children"), Input("rk-run", "data"), State("token", "data"))
    @guarded()
    def bandwidth(run: str, token: str | None) -> Any:
        return bandwidth_view(cfg.client(token).bandwidth(run))
