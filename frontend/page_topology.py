"""`/runs/{run}/topology`: what the NCCL logs say about communicators, rings, trees, connections and
their transports, and the tuner's choices (GET /api/runs/{run}/topology/{comms,topology,tuning})."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from dash import Dash, Input, Output, State, ctx, dcc, html

from commlens.contract.analysis import TopologyRows

from .client import ApiClient, ApiProblem
from .components import chart_block, empty, figure, guarded, loading, problem_box, push_state, table, td_num
from .config import UiConfig
from .fmt import exact_bytes
from .urls import int_or_none, query, run_path

PAGE = 500
TRANSPORT_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    try:
        groups = cfg.client(token).groups(run).items
        head = None
    except ApiProblem as exc:
        groups, head = [], problem_box(exc)
    options = [{"label": "all communicators", "value": ""}] + [
        {"label": f"{g.group_key} ({g.scheme}{', ' + str(g.size) + ' ranks' if g.size else ''})", "value": g.group_key}
        for g in groups
    ]
    return html.Div(
        [
            head,
            dcc.Store(id="tp-run", data=run),
            dcc.Store(id="tp-offset", data=int_or_none(q.get("offset")) or 0),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Communicator / group", htmlFor="tp-group"),
                            dcc.Dropdown(id="tp-group", options=options, value=q.get("group", ""), clearable=False),
                        ],
                        className="field wide",
                    )
                ],
                className="controls",
            ),
            loading(html.Div(id="tp-content")),
        ]
    )


def records(t: TopologyRows) -> list[dict[str, Any]]:
    return [dict(zip(t.columns, row, strict=True)) for row in t.rows]


def _cell(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, (int, float)):  # ids, ranks and pids: digits as they are
        return td_num(v, str(v))
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return str(v)


def generic_table(t: TopologyRows, rows: list[dict[str, Any]], cols: list[str], table_id: str) -> Any:
    body = [
        [html.Td(r.get(c), className="mono") if c == "file" and r.get(c) else _cell(r.get(c)) for c in cols]
        for r in rows
    ]
    return html.Div(table(cols, body, id_=table_id), className="scroll short")


def connections_chart(rows: list[dict[str, Any]], run: str) -> Any:
    conns = [r for r in rows if r["kind"] == "connection" and r["src_rank"] is not None and r["dst_rank"] is not None]
    if not conns:
        return empty('The logs list no connection lines ("Channel NN : a -> b via …").')
    transports: list[str] = []
    for r in conns:
        if (r["transport"] or "unknown") not in transports:
            transports.append(r["transport"] or "unknown")
    fig = figure(
        "Connections: sending rank → receiving rank, by transport", "receiving rank", "sending rank", height=380
    )
    for i, tr in enumerate(transports):
        pts = [r for r in conns if (r["transport"] or "unknown") == tr]
        fig.add_trace(
            go.Scatter(
                name=tr,
                x=[r["dst_rank"] for r in pts],
                y=[r["src_rank"] for r in pts],
                mode="markers",
                marker={"symbol": "square", "size": 13, "color": TRANSPORT_COLORS[i % len(TRANSPORT_COLORS)]},
                customdata=[[r["channel"], r["host"], r["detail"]] for r in pts],
                hovertemplate="%{y} → %{x} via " + tr + "<br>channel %{customdata[0]} on %{customdata[1]}"
                "<br>%{customdata[2]}<extra></extra>",
            )
        )
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(dtick=1, autorange="reversed")
    cols = ["channel", "from", "to", "transport", "host", "pid", "line"]
    display = [
        [
            td_num(r["channel"]),
            td_num(r["src_rank"]),
            td_num(r["dst_rank"]),
            r["transport"] or "-",
            r["host"],
            td_num(r["pid"], str(r["pid"])),
            html.Td(r["detail"], className="mono"),
        ]
        for r in conns
    ]
    raw = [
        [r["channel"], r["src_rank"], r["dst_rank"], r["transport"], r["host"], r["pid"], r["detail"]] for r in conns
    ]
    return chart_block("tp-connections", fig, cols, display, raw, f"{run}-connections.csv")


def rings_table(rows: list[dict[str, Any]]) -> Any:
    rings = [r for r in rows if r["kind"] == "ring"]
    if not rings:
        return empty("No ring lines in the logs.")
    body = [
        [
            html.Td(r["group_key"] or "-", className="mono"),
            td_num(r["channel"]),
            " → ".join(map(str, r["ranks"] or [])),
            r["host"] or "-",
            _cell(r["pid"]),
        ]
        for r in rings
    ]
    return html.Div(
        table(["communicator", "channel", "ring order", "host", "pid"], body, id_="tp-rings"), className="scroll"
    )


def trees_table(rows: list[dict[str, Any]]) -> Any:
    """One row per tree position, its channels together: NCCL prints the same tree on every channel, and a
    row per line made this table most of the page's components (the dashboard slows with their number)."""
    trees = [r for r in rows if r["kind"] in ("tree", "nvls_tree")]
    if not trees:
        return empty("No tree lines in the logs.")
    positions: dict[tuple[Any, ...], list[Any]] = {}
    for r in trees:
        ranks = r["ranks"] or []
        down = ", ".join(str(x) for x in ranks[:3] if x is not None and x >= 0) or "-"
        me = ranks[3] if len(ranks) > 3 else None
        up = ranks[4] if len(ranks) > 4 and ranks[4] is not None and ranks[4] >= 0 else None
        key = (r["group_key"] or "-", r["kind"], me, "-" if up is None else str(up), down, r["host"] or "-", r["pid"])
        positions.setdefault(key, []).append(r["channel"])
    body = [
        [
            html.Td(comm, className="mono"),
            kind,
            ", ".join("-" if c is None else str(c) for c in channels),
            td_num(me),
            up,
            down,
            host,
        ]
        for (comm, kind, me, up, down, host, _), channels in positions.items()
    ]
    return html.Div(
        table(["communicator", "kind", "channels", "rank", "parent", "children", "host"], body, id_="tp-trees"),
        className="scroll",
    )


def other_lines(rows: list[dict[str, Any]]) -> Any:
    rest = [r for r in rows if r["kind"] not in ("ring", "tree", "nvls_tree", "connection")]
    if not rest:
        return None
    body = [
        [
            r["kind"],
            html.Td(r["group_key"] or "-", className="mono"),
            r["host"] or "-",
            _cell(r["pid"]),
            html.Td(r["detail"] or "", className="mono"),
        ]
        for r in rest
    ]
    return html.Div(
        [
            html.H3("Channels, nodes and other lines"),
            html.Div(table(["kind", "communicator", "host", "pid", "line"], body, id_="tp-other"), className="scroll"),
        ]
    )


def tuning_table(t: TopologyRows) -> Any:
    rows = records(t)
    if not rows:
        return empty("No TUNING lines (NCCL_DEBUG_SUBSYS=TUNING writes them).")
    body = [
        [
            r["op"],
            td_num(r["bytes"], exact_bytes(r["bytes"])),
            r["algo"],
            r["proto"],
            td_num(r["time_us"]),
            td_num(r["channels"]),
            r["host"] or "-",
            _cell(r["pid"]),
        ]
        for r in rows
    ]
    return html.Div(
        table(["op", "bytes", "algorithm", "protocol", "time (µs)", "channels", "host", "pid"], body, id_="tp-tuning"),
        className="scroll",
    )


def _pager(t: TopologyRows, run: str, group: str | None, what: str) -> Any:
    if t.total <= len(t.rows) and t.offset == 0:
        return None
    parts: list[Any] = [f"{what} {t.offset + 1}-{t.offset + len(t.rows)} of {t.total}"]
    if t.next_offset is not None:
        parts.append(
            dcc.Link(" next page →", href=run_path(run, "topology") + query({"group": group, "offset": t.next_offset}))
        )
    return html.Div(parts, className="pager")


def topology_view(client: ApiClient, run: str, group: str | None, offset: int) -> Any:
    comms = client.topology(run, "comms", limit=PAGE, group_key=group)
    topo = client.topology(run, "topology", limit=PAGE, offset=offset, group_key=group)
    tuning = client.topology(run, "tuning", limit=PAGE)
    if not (comms.total or topo.total or tuning.total):
        return empty(
            "No NCCL topology in this run: it comes from NCCL debug logs (NCCL_DEBUG=INFO) with their Init, "
            "ring, tree and channel lines; profiler traces do not carry it."
        )
    rows = records(topo)
    comm_cols = [c for c in comms.columns if any(r.get(c) is not None for r in records(comms))]
    return html.Div(
        [
            html.H2("Connections and transports"),
            _pager(topo, run, group, "topology lines"),
            connections_chart(rows, run),
            html.H2("Communicators"),
            generic_table(comms, records(comms), comm_cols, "tp-comms") if comms.rows else empty("No Init lines."),
            _pager(comms, run, group, "communicator ranks"),
            html.H2("Rings"),
            rings_table(rows),
            html.H2("Trees"),
            trees_table(rows),
            other_lines(rows),
            html.H2("Tuning"),
            tuning_table(tuning),
        ]
    )


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("tp-group", "value"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(group: str, rendered: dict | None) -> Any:
        search = query({"group": group})
        return push_state(rendered, search)

    @app.callback(
        Output("tp-content", "children"),
        Input("tp-group", "value"),
        State("tp-offset", "data"),
        State("tp-run", "data"),
        State("token", "data"),
    )
    @guarded()
    def show(group: str, offset: int, run: str, token: str | None) -> Any:
        first = ctx.triggered_id is None  # the offset in the URL holds for the first view, not a new group
        return topology_view(cfg.client(token), run, group or None, (offset or 0) if first else 0)
