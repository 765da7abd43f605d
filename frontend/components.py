"""Shared pieces of every page: tables with numeric cells, chart blocks with a table and a CSV
alternative, messages for loading, empty and error states, and the guard that turns exceptions into words."""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any, Literal
from urllib.parse import quote

import plotly.graph_objects as go
from dash import dcc, html, no_update
from dash.development.base_component import Component
from dash.exceptions import PreventUpdate
from pydantic import ValidationError

from commlens.vocab import csv_text

from .client import ApiProblem
from .fmt import byte_axis, duration_axis, num

log = logging.getLogger("commlens.frontend")

GRAPH_CONFIG: dcc.Graph.Config = {
    "displaylogo": False,
    "responsive": True,
    "modeBarButtonsToRemove": ["select2d", "lasso2d", "autoScale2d"],
    "toImageButtonOptions": {"format": "png", "scale": 2},
}
OP_COLORS = {
    "all_reduce": "#1f77b4",
    "all_gather": "#ff7f0e",
    "reduce_scatter": "#2ca02c",
    "broadcast": "#d62728",
    "reduce": "#9467bd",
    "all_to_all": "#8c564b",
    "gather": "#e377c2",
    "scatter": "#7f7f7f",
    "send": "#bcbd22",
    "recv": "#17becf",
    "barrier": "#444444",
}
# Bar fills that tell apart series of one colour (dtypes of one op; series of one run on Compare), in order
PATTERNS = ["", "/", "x", ".", "\\", "+", "-", "|"]
MAX_TABLE_ROWS = 1000
STATIC_ABOVE = 100  # rows: a longer table is drawn as one static component (long_table)
# Runs side by side (Compare) get their own colours, apart from the ops' and schemes' above.
RUN_COLORS = ["#393b79", "#ad494a", "#637939", "#8c6d31", "#7b4173", "#3182bd", "#e6550d", "#31a354"]
SCHEME_COLORS = {
    "dp": "#1f77b4",
    "tp": "#ff7f0e",
    "pp": "#2ca02c",
    "cp": "#9467bd",
    "ep": "#8c564b",
    "other": "#7f7f7f",
    None: "#bbbbbb",
}


def scheme_color(scheme: str | None) -> str:
    """A scheme's one colour on every page: calls without a scheme ("unattributed") grey, an unknown name as
    "other"."""
    if scheme in (None, "", "unattributed", "-"):
        return SCHEME_COLORS[None]
    return SCHEME_COLORS.get(scheme, SCHEME_COLORS["other"])


# ------------------------------------------------------------------------------------ messages


def message(text: Any, kind: str = "info") -> html.Div:
    return html.Div(text, className=f"msg msg-{kind}", role="alert" if kind == "error" else "status")


def empty(text: Any) -> html.Div:
    return message(text, "empty")


def problem_box(exc: ApiProblem) -> html.Div:
    if exc.status == 0:
        head = "The API cannot be reached"
    elif exc.status == 401:
        head = "Not signed in for this action (enter a token at the top right)"
    elif exc.status == 403:
        head = "Not allowed"
    elif exc.status == 404:
        head = "Not found"
    elif exc.status == 409:
        head = "Conflict"
    elif exc.status in (413, 415, 422):
        head = "Refused by the API"
    else:
        head = f"The API answered {exc.status}"
    return message([html.Strong(head + ": "), exc.detail], "error")


def guarded(outputs: int = 1) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Callbacks never raise into Dash: API problems and UI bugs become a message in the first output."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except PreventUpdate:
                raise
            except ApiProblem as exc:
                box = problem_box(exc)
            except ValidationError as exc:  # what the user typed, refused by the contract before it is sent
                said = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
                box = message([html.Strong("Not sent: "), said], "error")
            except Exception as exc:
                log.exception("UI callback %s failed", fn.__name__)
                box = message(
                    [html.Strong("The page could not draw this view: "), f"{type(exc).__name__}: {exc}"], "error"
                )
            return box if outputs == 1 else (box, *([no_update] * (outputs - 1)))

        return wrapper

    return deco


def push_state(rendered: dict[str, str] | None, search: str) -> tuple[str, dict[str, str]]:
    """Outputs (url.search, rendered) of a page's state change; nothing when the URL says it already
    (a component settling its value on mount must not add a history entry)."""
    if rendered is not None and rendered.get("search", "") == search:
        raise PreventUpdate
    return search, {"path": (rendered or {}).get("path", "/"), "search": search}


def loading(child: Any, id_: str | None = None) -> dcc.Loading:
    kwargs: dict[str, Any] = {"id": id_} if id_ else {}
    return dcc.Loading(child, type="default", delay_show=150, **kwargs)


# -------------------------------------------------------------------------------------- tables


def td_num(value: float | int | None, text: str | None = None, **props: Any) -> html.Td:
    """A numeric cell: the readable text shown, the exact value in data-value."""
    data: dict[str, Any] = {"data-value": "" if value is None else repr(value)}
    return html.Td(num(value) if text is None else text, className="num", **data, **props)


def td_id(value: int | None, **props: Any) -> html.Td:
    """A numeric identifier (rank, step, iteration): sorted as a number, shown without thousands separators."""
    return td_num(value, "-" if value is None else str(value), **props)


def table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    id_: Any = None,
    caption: str | None = None,
    row_class: Sequence[str | None] | None = None,
) -> html.Table:
    head = html.Thead(html.Tr([html.Th(c, scope="col") for c in columns]))
    body = []
    for i, row in enumerate(rows):
        cells = [c if isinstance(c, (html.Td, html.Th)) else html.Td(c) for c in row]
        cls = row_class[i] if row_class is not None else None
        body.append(html.Tr(cells, className=cls) if cls else html.Tr(cells))
    parts: list[Any] = [html.Caption(caption)] if caption else []
    kwargs = {"id": id_} if id_ is not None else {}
    return html.Table([*parts, head, html.Tbody(body)], className="data", **kwargs)


_MD_PUNCT = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~&])")


def _md_cell(value: Any) -> str:
    text = "" if value is None else " ".join(str(value).split())
    return _MD_PUNCT.sub(r"\\\1", text)


def _text(cell: Any) -> str:
    """What a cell shows, as plain text: the children of its components, joined."""
    if cell is None:
        return ""
    if isinstance(cell, (list, tuple)):
        return "".join(_text(c) for c in cell)
    if isinstance(cell, Component):
        return _text(getattr(cell, "children", None))
    return str(cell)


def long_table(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    id_: str | None = None,
    row_class: Sequence[str | None] | None = None,
) -> Component:
    """table() while it is short; beyond STATIC_ABOVE rows the same text as one static_table, since a component
    per cell took minutes to draw at 1,024 ranks. Columns of td_num cells stay right-aligned; row classes go."""
    if len(rows) <= STATIC_ABOVE:
        return table(columns, rows, id_=id_, row_class=row_class)
    numeric = [
        c
        for i, c in enumerate(columns)
        if isinstance(rows[0][i], html.Td) and "num" in str(getattr(rows[0][i], "className", "")).split()
    ]
    return static_table(columns, [[_text(c) for c in row] for row in rows], id_, numeric)


def static_table(
    columns: Sequence[str], rows: Sequence[Sequence[Any]], id_: str | None, numeric: Sequence[str] = ()
) -> dcc.Markdown:
    """A long table of plain text as ONE component: the dashboard's renderer pays per component, so a table
    of hundreds of cells built from html.Td components takes seconds to appear, while this Markdown table
    (every cell escaped, raw HTML off) is drawn as one piece. It is still a <table> with thead and tbody;
    numeric columns are right-aligned."""
    right = set(numeric)
    lines = [
        "| " + " | ".join(_md_cell(c) for c in columns) + " |",
        "| " + " | ".join("---:" if c in right else "---" for c in columns) + " |",
    ]
    lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in rows]
    kwargs: dict[str, Any] = {"id": id_} if id_ is not None else {}
    return dcc.Markdown("\n".join(lines), className="md-table", dangerously_allow_html=False, **kwargs)


def csv_href(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(columns)
    writer.writerows(["" if v is None else csv_text(v) if isinstance(v, str) else v for v in r] for r in rows)
    return "data:text/csv;charset=utf-8," + quote(buf.getvalue())


def csv_link(columns: Sequence[str], rows: Sequence[Sequence[Any]], filename: str) -> html.A:
    return html.A("Download CSV", href=csv_href(columns, rows), download=filename, className="csv")


def chart_block(
    graph_id: Any,
    fig: go.Figure,
    columns: Sequence[str],
    display_rows: Sequence[Sequence[Any]],
    raw_rows: Sequence[Sequence[Any]],
    filename: str,
    note: Any = None,
    open_table: bool = False,
    total_rows: int | None = None,
) -> html.Div:
    """A chart with its table view and CSV: the same numbers three ways (the table shows the first
    MAX_TABLE_ROWS rows; the CSV has them all). A caller with very many rows may build only the first
    MAX_TABLE_ROWS display rows and say how many there are in `total_rows`."""
    tidy_legend(fig)
    shown = display_rows[:MAX_TABLE_ROWS]
    total = len(display_rows) if total_rows is None else total_rows
    more = (
        html.P(f"The table shows the first {MAX_TABLE_ROWS} of {total} rows; the CSV has them all.", className="hint")
        if total > MAX_TABLE_ROWS
        else None
    )
    return html.Div(
        [
            # responsive graphs take their parent's height: a graph whose box has none yet when it is drawn
            # (side by side in a grid) collapsed to a strip with its legend over the axis titles
            dcc.Graph(
                id=graph_id,
                figure=fig,
                config=GRAPH_CONFIG,
                className="graph",
                style={"height": f"{fig.layout.height or 340}px"},
            ),
            html.Div(note, className="chart-note") if note else None,
            html.Details(
                [html.Summary("Table view"), more, html.Div(long_table(columns, shown), className="scroll")],
                open=open_table,
            ),
            csv_link(columns, raw_rows, filename),
        ],
        className="chart",
    )


def preload_plotly_imports() -> None:
    """Plotly imports pandas and numpy lazily on the first figure and elsewhere reads them from sys.modules
    without waiting for an import in progress: two callbacks building the first figures of a fresh server at
    once met a half-imported pandas ("partially initialized module 'pandas'", a 500 for both). The dashboard
    calls this once before it serves; `import commlens.frontend` stays light."""
    from _plotly_utils.optional_imports import get_module

    for name in ("numpy", "pandas"):
        get_module(name)
    go.Figure(layout={"template": "plotly_white"}).to_plotly_json()


def figure(title: str, x_title: str, y_title: str, height: int = 340) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        xaxis_title=x_title,
        yaxis_title=y_title,
        height=height,
        template="plotly_white",
        margin={"l": 70, "r": 20, "t": 60, "b": 60},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        hoverlabel={"namelength": -1},
        font={"size": 12},
    )
    return fig


ColorUnit = Literal["bytes", "us", "ms"]


def colorbar(title: str, zmax: float, unit: ColorUnit) -> dict[str, Any]:
    """Every heatmap's colour bar: tick marks drawn outside the bar at 1-2-5 steps (binary multiples for
    bytes), each labelled in human units, so a colour reads as a number without hovering."""
    if unit == "bytes":
        ticks = byte_axis(zmax)
    elif unit == "us":
        ticks = duration_axis(zmax)
    else:  # z in milliseconds, labelled so (a bar titled in ms keeps one unit along its length)
        us = duration_axis(zmax * 1e3)
        vals = [round(v / 1e3, 9) for v in us["tickvals"]]
        ticks = {"tickvals": vals, "ticktext": [f"{v:g} ms" for v in vals]}
    return {
        "title": {"text": title},
        "ticks": "outside",
        "ticklen": 6,
        "tickwidth": 1,
        "tickcolor": "#5b6475",
        "showticklabels": True,
        "tickmode": "array",
        **ticks,
    }


def tidy_legend(fig: go.Figure) -> None:
    """Many legend entries go below the plot, where they cannot cover the title: anchored to the bottom of
    the figure itself (yref container) under a margin that holds the tick labels and the x-axis title first,
    so the legend never lies over an axis title however the ticks are tilted."""
    entries = sum(1 for t in fig.data if t.showlegend is not False and t.type != "heatmap")
    if entries <= 4:
        return
    rows = -(-entries // 4)
    legend_px = 22 * rows + 8
    tilted = fig.layout.xaxis.tickangle not in (None, 0)
    axis_px = 70 + (45 if tilted else 0)  # tick labels and the axis title
    fig.update_layout(
        height=(fig.layout.height or 340) + legend_px,
        margin={"b": axis_px + legend_px},
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0, "xanchor": "left"},
    )


def kv(pairs: Sequence[tuple[str, Any]]) -> html.Dl:
    items: list[Any] = []
    for k, v in pairs:
        items += [html.Dt(k), html.Dd(v if v not in (None, "") else "-")]
    return html.Dl(items, className="kv")


def severity_badge(severity: str) -> html.Span:
    return html.Span(severity, className=f"badge sev-{severity}")
