"""`/runs/{run}/topology`: what the NCCL logs say about communicators, rings, trees, connections and
their transports, and the tuner's choices (GET /api/runs/{run}/topology/{comms,topology,tuning})."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dash import Dash, Input, Output, State, ctx, dcc, html

from commlens.contract.analysis import GroupAttribution, TopologyRows

from .client import ApiClient
from .components import csv_link, empty, guarded, loading, push_state, static_table
from .config import UiConfig
from .fmt import exact_bytes
from .urls import count_or_none, query, run_path

PAGE = 500


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    """The frame only: the groups and every table come in one callback whose API calls run side by side."""
    group = q.get("group", "")
    options = [{"label": "all communicators", "value": ""}] + ([{"label": group, "value": group}] if group else [])
    return html.Div(
        [
            dcc.Store(id="tp-run", data=run),
            dcc.Store(id="tp-offset", data=count_or_none(q.get("offset")) or 0),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Communicator / group", htmlFor="tp-group"),
                            dcc.Dropdown(id="tp-group", options=options, value=group, clearable=False),
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


def _text(v: Any) -> str:
    """A cell as text: ids, ranks and pids as their digits, lists joined, nothing as '-'."""
    if v is None:
        return "-"
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return str(v)


NUMERIC = (
    "pid",
    "cuda_dev",
    "comm_rank",
    "nranks",
    "global_rank",
    "channel",
    "rank",
    "bytes",
    "time (µs)",
    "from",
    "to",
)


def generic_table(rows: list[dict[str, Any]], cols: list[str], table_id: str) -> Any:
    body = [[_text(r.get(c)) for c in cols] for r in rows]
    return html.Div(static_table(cols, body, table_id, NUMERIC), className="scroll short")


MATRIX_RANKS = 32  # up to this many ranks the connections are a sender x receiver grid, else a list


def connections_view(rows: list[dict[str, Any]], run: str) -> Any:
    """Who connects to whom and over what, as tables (one component each): a sender x receiver grid naming
    the transport and its channel count in each cell, or beyond MATRIX_RANKS ranks one row per (sender,
    receiver, transport). No chart: plotly.js alone takes seconds to start in a fresh tab, and this page
    is tables; the CSV keeps every line."""
    conns = [r for r in rows if r["kind"] == "connection" and r["src_rank"] is not None and r["dst_rank"] is not None]
    if not conns:
        return empty('The logs list no connection lines ("Channel NN : a -> b via …").')
    links: dict[tuple[int, int, str], set[Any]] = {}
    hosts: dict[tuple[int, int, str], set[str]] = {}
    for r in conns:
        key = (r["src_rank"], r["dst_rank"], r["transport"] or "unknown")
        links.setdefault(key, set()).add(r["channel"])
        hosts.setdefault(key, set()).add(r["host"] or "-")

    def label(key: tuple[int, int, str]) -> str:
        n = len(links[key])
        return f"{key[2]} ({n} channel{'s' if n != 1 else ''})"

    senders = sorted({k[0] for k in links})
    receivers = sorted({k[1] for k in links})
    if len(set(senders) | set(receivers)) <= MATRIX_RANKS:
        cells = {
            (a, b): "; ".join(label(k) for k in sorted(links) if k[:2] == (a, b)) for a in senders for b in receivers
        }
        body = [[str(a), *[cells[(a, b)] or "" for b in receivers]] for a in senders]
        grid = static_table(["from \\ to", *map(str, receivers)], body, "tp-connections", ())
        caption = "Sending rank (rows) to receiving rank (columns): the transport and how many channels use it."
    else:
        body = [[str(k[0]), str(k[1]), k[2], str(len(links[k])), ", ".join(sorted(hosts[k]))] for k in sorted(links)]
        grid = static_table(
            ["from", "to", "transport", "channels", "hosts"], body, "tp-connections", ("from", "to", "channels")
        )
        caption = "One row per sending rank, receiving rank and transport."
    cols = ["channel", "from", "to", "transport", "host", "pid", "line"]
    raw = [
        [r["channel"], r["src_rank"], r["dst_rank"], r["transport"], r["host"], r["pid"], r["detail"]] for r in conns
    ]
    return html.Div(
        [
            html.P(f"{caption} {len(conns)} connection lines.", className="hint"),
            html.Div(grid, className="scroll short"),
            csv_link(cols, raw, f"{run}-connections.csv"),
        ],
        className="chart",
    )


def rings_table(rows: list[dict[str, Any]]) -> Any:
    rings = [r for r in rows if r["kind"] == "ring"]
    if not rings:
        return empty("No ring lines in the logs.")
    body = [
        [
            r["group_key"] or "-",
            _text(r["channel"]),
            " → ".join(map(str, r["ranks"] or [])),
            r["host"] or "-",
            _text(r["pid"]),
        ]
        for r in rings
    ]
    cols = ["communicator", "channel", "ring order", "host", "pid"]
    return html.Div(static_table(cols, body, "tp-rings", NUMERIC), className="scroll")


def trees_table(rows: list[dict[str, Any]]) -> Any:
    """One row per tree position, its channels together: NCCL prints the same tree on every channel."""
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
        [comm, kind, ", ".join("-" if c is None else str(c) for c in channels), _text(me), up, down, host]
        for (comm, kind, me, up, down, host, _), channels in positions.items()
    ]
    cols = ["communicator", "kind", "channels", "rank", "parent", "children", "host"]
    return html.Div(static_table(cols, body, "tp-trees", NUMERIC), className="scroll")


def other_lines(rows: list[dict[str, Any]]) -> Any:
    rest = [r for r in rows if r["kind"] not in ("ring", "tree", "nvls_tree", "connection")]
    if not rest:
        return None
    body = [[r["kind"], r["group_key"] or "-", r["host"] or "-", _text(r["pid"]), r["detail"] or ""] for r in rest]
    return html.Div(
        [
            html.H3("Channels, nodes and other lines"),
            html.Div(
                static_table(["kind", "communicator", "host", "pid", "line"], body, "tp-other", NUMERIC),
                className="scroll",
            ),
        ]
    )


def tuning_table(t: TopologyRows) -> Any:
    rows = records(t)
    if not rows:
        return empty("No TUNING lines (NCCL_DEBUG_SUBSYS=TUNING writes them).")
    body = [
        [
            r["op"],
            exact_bytes(r["bytes"]),
            r["algo"],
            r["proto"],
            _text(r["time_us"]),
            _text(r["channels"]),
            r["host"] or "-",
            _text(r["pid"]),
        ]
        for r in rows
    ]
    cols = ["op", "bytes", "algorithm", "protocol", "time (µs)", "channels", "host", "pid"]
    return html.Div(static_table(cols, body, "tp-tuning", (*NUMERIC, "channels")), className="scroll")


def _pager(t: TopologyRows, run: str, group: str | None, what: str) -> Any:
    if t.total <= len(t.rows) and t.offset == 0:
        return None
    parts: list[Any] = [f"{what} {t.offset + 1}-{t.offset + len(t.rows)} of {t.total}"]
    if t.next_offset is not None:
        parts.append(
            dcc.Link(" next page →", href=run_path(run, "topology") + query({"group": group, "offset": t.next_offset}))
        )
    return html.Div(parts, className="pager")


def group_options(groups: list[GroupAttribution]) -> list[dict[str, str]]:
    return [{"label": "all communicators", "value": ""}] + [
        {"label": f"{g.group_key} ({g.scheme}{', ' + str(g.size) + ' ranks' if g.size else ''})", "value": g.group_key}
        for g in groups
    ]


def fetch(client: ApiClient, run: str, group: str | None, offset: int) -> tuple[Any, list[dict[str, str]]]:
    """(the view, the group options): the four API calls at once, so the page waits for the slowest, not
    their sum (the server answers them in parallel)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        groups = pool.submit(lambda: client.groups(run).items)
        comms = pool.submit(client.topology, run, "comms", limit=PAGE, group_key=group)
        topo = pool.submit(client.topology, run, "topology", limit=PAGE, offset=offset, group_key=group)
        tuning = pool.submit(client.topology, run, "tuning", limit=PAGE)
        return topology_view(run, group, comms.result(), topo.result(), tuning.result()), group_options(groups.result())


def topology_view(run: str, group: str | None, comms: TopologyRows, topo: TopologyRows, tuning: TopologyRows) -> Any:
    if not (comms.total or topo.total or tuning.total):
        return empty(
            "No NCCL topology in this run: it comes from the Init, ring, tree and channel lines of NCCL debug logs "
            "(NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS including INIT and GRAPH: a log of COLL lines only has none); "
            "profiler traces do not carry it."
        )
    rows = records(topo)
    comm_cols = [c for c in comms.columns if any(r.get(c) is not None for r in records(comms))]
    return html.Div(
        [
            html.H2("Connections and transports"),
            _pager(topo, run, group, "topology lines"),
            connections_view(rows, run),
            html.H2("Communicators"),
            generic_table(records(comms), comm_cols, "tp-comms") if comms.rows else empty("No Init lines."),
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
        Output("tp-group", "options"),
        Input("tp-group", "value"),
        State("tp-offset", "data"),
        State("tp-run", "data"),
        State("token", "data"),
    )
    @guarded(outputs=2)
    def show(group: str, offset: int, run: str, token: str | None) -> Any:
        first = ctx.triggered_id is None  # the offset in the URL holds for the first view, not a new group
        return fetch(cfg.client(token), run, group or None, (offset or 0) if first else 0)
