"""`/runs/{run}/ranks`: bytes or time per rank and scheme as a heatmap with the imbalance marked, the
bytes each rank's all-to-all calls send to each receiver (sender x receiver, per group, over the run or one
step), and the bus bandwidth by message size per op where the traces have measured durations."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, State, dcc, html

from commlens.contract.analysis import BandwidthReport, Finding, RankSchemeTotal, RankTotals
from commlens.contract.pairs import PairMatrix, PairsReport
from commlens.vocab import format_bytes

from .client import ApiProblem
from .components import (
    OP_COLORS,
    chart_block,
    empty,
    figure,
    guarded,
    loading,
    push_state,
    table,
    td_num,
)
from .config import UiConfig
from .fmt import byte_axis, duration_us, exact_bytes, num
from .urls import query

METRICS = {"bytes": "bytes", "time_us": "time (µs)"}
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
    return html.Div(
        [
            dcc.Store(id="rk-run", data=run),
            dcc.Store(id="rk-focus", data={"scheme": q.get("scheme"), "rank": q.get("rank")}),
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


def heatmap(t: RankTotals, metric: str, basis: str, findings: list[Finding], focus: dict[str, Any]) -> Any:
    if not t.rows:
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
    text = [[_fmt(v, metric) if v is not None else "" for v in row] for row in z]
    custom = [
        [[cell[(rk, s)].calls, cell[(rk, s)].iterations] if (rk, s) in cell else [None, None] for s in schemes]
        for rk in ranks
    ]
    unit = "bytes" if metric == "bytes" else "µs"
    label = f"{METRICS[metric]} {BASES[basis]}"
    fig = figure(
        f"{label.capitalize()} per rank and scheme", "scheme", "rank", height=min(620, max(300, 120 + 22 * len(ranks)))
    )
    values = [v for row in z for v in row if v is not None]
    colorbar: dict[str, Any] = {"title": {"text": unit}}
    if metric == "bytes" and values:
        colorbar.update(tickmode="array", **byte_axis(max(values)))
    fig.add_trace(
        go.Heatmap(
            x=schemes,
            y=ranks,
            z=z,
            text=text,
            customdata=custom,
            colorscale="Blues",
            hoverongaps=False,
            colorbar=colorbar,
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
        fig.add_annotation(
            x=s,
            y=imb.max_rank,
            text=f"max ×{imb.max_over_mean:.2f}",  # noqa: RUF001 - the multiplication sign is meant
            showarrow=True,
            arrowhead=2,
            ax=40,
            ay=-18,
            font={"color": "#b42318"},
            bgcolor="#fff",
        )
    if focus.get("rank") is not None and str(focus["rank"]) in ranks:
        fig.add_hline(y=str(focus["rank"]), line_color="#d92d20", line_width=2, opacity=0.6)
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
    return html.Div(
        [
            chart_block("rk-heatmap", fig, cols, display, raw, f"{t.run}-ranks.csv", note=note),
            imbalance_table(t, findings),
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


WHOLE_RUN = "run"


def pairs_view(p: PairsReport) -> Any:
    """One heatmap per group (sender on y, receiver on x), or the report's reason for none."""
    if not p.matrices:
        return empty(f"No all-to-all matrix: {p.reason}.")
    scope = "the whole run" if p.step is None else f"step {p.step}"
    blocks: list[Any] = [pairs_heatmap(m, scope, p.run, i) for i, m in enumerate(p.matrices)]
    return html.Div([*blocks, html.Ul([html.Li(n) for n in p.notes], className="note-list")])


def pairs_heatmap(m: PairMatrix, scope: str, run: str, index: int) -> Any:
    labels = [str(r) for r in m.ranks]
    text = [[exact_bytes(v) if v is not None else "" for v in row] for row in m.bytes]
    scheme = m.scheme or UNATTRIBUTED
    fig = figure(
        f"All-to-all bytes sent, {m.group_key} ({scheme}), {scope}",
        "receiver (global rank)",
        "sender (global rank)",
        height=min(620, max(320, 140 + 40 * len(labels))),
    )
    values = [v for row in m.bytes for v in row if v is not None]
    colorbar: dict[str, Any] = {"title": {"text": "bytes"}, "tickmode": "array", **byte_axis(max(values, default=0))}
    fig.add_trace(
        go.Heatmap(
            x=labels,
            y=labels,
            z=m.bytes,
            text=text,
            colorscale="Blues",
            zmin=0,
            zmax=max(values, default=0) or 1,  # Plotly ignores zmin without zmax: the scale starts at 0 B
            hoverongaps=False,
            colorbar=colorbar,
            texttemplate="%{text}" if len(labels) <= 16 else None,
            hovertemplate="rank %{y} sent rank %{x}: %{text}<extra></extra>",
        )
    )
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_xaxes(type="category", side="top")
    cols = ["sender", "receiver", "bytes"]
    cells = [(s, r, v) for s, row in zip(m.ranks, m.bytes, strict=True) for r, v in zip(m.ranks, row, strict=True)]
    display = [[s, r, td_num(v, exact_bytes(v) if v is not None else "no trace")] for s, r, v in cells]
    raw = [[s, r, v] for s, r, v in cells]
    missing = [s for s, row in zip(m.ranks, m.bytes, strict=True) if row[0] is None]
    note = (
        f"{num(m.calls)} all_to_all calls, {exact_bytes(m.total_bytes)} in all; the diagonal is what a rank keeps."
        + (f" No split-recorded call from rank {', '.join(map(str, missing))} (empty rows)." if missing else "")
    )
    return chart_block(f"rk-pairs-{index}", fig, cols, display, raw, f"{run}-a2a-{m.group_key}.csv", note=note)


def bandwidth_view(b: BandwidthReport) -> Any:
    if not b.bins:
        why = ", ".join(f"{k}: {num(v)}" for k, v in b.excluded.items())
        return empty(
            "No measured durations in this run (NCCL logs carry no time)" + (f"; left out: {why}" if why else "") + "."
        )
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
                    "latency-bound calls",
                    "latency-bound time",
                ],
                ops_rows,
                id_="rk-bw-ops",
            ),
            html.Ul([html.Li(n) for n in b.notes], className="note-list"),
        ]
    )


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("rk-metric", "value"),
        Input("rk-basis", "value"),
        Input("rk-pairs-step", "value"),
        State("rk-focus", "data"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(metric: str, basis: str, pairs_step: str, focus: dict[str, Any], rendered: dict[str, str] | None) -> Any:
        search = query(
            {
                "metric": None if metric == "bytes" else metric,
                "basis": None if basis == "per_iteration" else basis,
                "pairs_step": None if pairs_step == WHOLE_RUN else pairs_step,
                **(focus or {}),
            }
        )
        return push_state(rendered, search)

    @app.callback(
        Output("rk-content", "children"),
        Input("rk-metric", "value"),
        Input("rk-basis", "value"),
        State("rk-focus", "data"),
        State("rk-run", "data"),
        State("token", "data"),
    )
    @guarded()
    def show(metric: str, basis: str, focus: dict[str, Any], run: str, token: str | None) -> Any:
        client = cfg.client(token)
        totals = client.ranks(run)
        try:
            findings = client.findings(run, limit=200).items
        except ApiProblem:
            findings = []  # the heatmap stands without the flags
        return heatmap(totals, metric, basis, findings, focus or {})

    @app.callback(
        Output("rk-pairs", "children"),
        Output("rk-pairs-step", "options"),
        Input("rk-pairs-step", "value"),
        State("rk-run", "data"),
        State("token", "data"),
    )
    @guarded(outputs=2)
    def pairs(step: str, run: str, token: str | None) -> Any:
        report = cfg.client(token).pairs(run, step=None if step == WHOLE_RUN else int(step))
        options = [{"label": "whole run", "value": WHOLE_RUN}]
        options += [{"label": f"step {s}", "value": str(s)} for s in report.steps]
        return pairs_view(report), options

    @app.callback(Output("rk-bandwidth", "children"), Input("rk-run", "data"), State("token", "data"))
    @guarded()
    def bandwidth(run: str, token: str | None) -> Any:
        return bandwidth_view(cfg.client(token).bandwidth(run))
