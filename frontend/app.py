"""The Dash app factory: the frame (header, token, router) and the pages' callbacks.

The router renders a page from the URL; pages write their state back into the URL's query string
(without a reload) and record it in `rendered`, so the router knows the change came from the page and
leaves it alone, while a pasted link, a link click or back/forward renders the view the URL names.
"""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from commlens.contract.review import MAX_BODY, Anchor

from . import (
    page_compare,
    page_histograms,
    page_overview,
    page_predicted,
    page_ranks,
    page_review,
    page_runs,
    page_time,
    page_topology,
)
from .client import ApiProblem
from .components import guarded, message, preload_plotly_imports, problem_box
from .config import UiConfig
from .style import CSS
from .urls import RUN_PAGES, parse, route, run_path

RUN_PAGE_MODULES = {
    "overview": page_overview,
    "histograms": page_histograms,
    "predicted": page_predicted,
    "ranks": page_ranks,
    "topology": page_topology,
    "time": page_time,
    "review": page_review,
}

INDEX = (
    """<!DOCTYPE html>
<html lang="en">
<head>{%metas%}<title>{%title%}</title>{%favicon%}{%css%}<style>"""
    + CSS
    + """</style></head>
<body>{%app_entry%}<footer>{%config%}{%scripts%}{%renderer%}</footer></body>
</html>"""
)


def create_ui(api_url: str | None = None) -> Dash:
    """The dashboard. `api_url`: the API's server root; None when mounted in the API's own server."""
    cfg = UiConfig(api_url=api_url)
    preload_plotly_imports()
    app = Dash(
        __name__,
        title="commlens",
        update_title="",  # no "Updating..." tab title while a callback runs
        suppress_callback_exceptions=True,
        serve_locally=True,
        assets_folder="assets-none",
        index_string=INDEX,
    )
    app.layout = html.Div(
        [
            dcc.Location(id="url", refresh=False),
            dcc.Store(id="token", storage_type="local"),
            dcc.Store(id="rendered"),
            _header(),
            html.Main(id="page", className="page"),
        ]
    )
    _register_frame(app, cfg)
    for module in (page_runs, page_compare, *RUN_PAGE_MODULES.values()):
        module.register(app, cfg)
    app.commlens_config = cfg  # type: ignore[attr-defined]  # tests and the CLI reach the client through it
    return app


def _header() -> html.Header:
    return html.Header(
        [
            dcc.Link("commlens", href="/", className="brand"),
            html.Nav([dcc.Link("Runs", href="/"), dcc.Link("Compare", href="/compare")], className="topnav"),
            html.Div(
                [
                    html.Span(id="whoami", className="whoami"),
                    dcc.Input(
                        id="token-input",
                        type="password",
                        placeholder="API token (optional)",
                        debounce=True,
                        className="token-input",
                        autoComplete="off",
                    ),
                    html.Button("Use token", id="token-save", className="btn small"),
                    html.Button("Forget", id="token-clear", className="btn small ghost"),
                ],
                className="auth",
            ),
        ],
        className="top",
    )


def run_frame(run: str, page: str, body: Any) -> html.Div:
    tabs = [
        dcc.Link(label, href=run_path(run, key), className="cl-tab active" if key == page else "cl-tab")
        for key, label in RUN_PAGES.items()
    ]
    return html.Div(
        [
            html.Div(
                [html.H1(["Run ", html.Span(run, className="run-name")]), html.Nav(tabs, className="cl-tabs")],
                className="run-head",
            ),
            body,
            None
            if page == "review"
            else html.Details(
                [
                    html.Summary("Comment on this view"),
                    html.P(
                        "The comment is anchored to this page and its selection (scheme, op, size bin, rank); "
                        "Markdown is allowed.",
                        className="hint",
                    ),
                    dcc.Textarea(
                        id="comment-body",
                        className="comment-text",
                        placeholder="What do you see here?",
                        maxLength=MAX_BODY,
                    ),
                    html.Button("Add comment", id="comment-add", className="btn"),
                    html.Div(id="comment-result"),
                ],
                className="comment-box",
                id="comment-box",
            ),
        ]
    )


def _page(cfg: UiConfig, token: str | None, pathname: str | None, search: str | None) -> Any:
    """The page the URL names, or a 'not found' that links back to the runs."""
    r, q = route(pathname), parse(search)
    if r.page == "runs":
        return page_runs.layout(q)
    if r.page == "compare":
        return page_compare.layout(cfg, token, q)
    if r.run is not None and r.page in RUN_PAGE_MODULES:
        return run_frame(r.run, r.page, RUN_PAGE_MODULES[r.page].layout(cfg, token, r.run, q))
    found = ["There is no page at ", html.Code(pathname or "/"), ". ", dcc.Link("See the runs", href="/"), "."]
    return html.Div([html.H1("Page not found"), message(found, "error")])


def _register_frame(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("page", "children"),
        Output("rendered", "data"),
        Input("url", "pathname"),
        Input("url", "search"),
        State("rendered", "data"),
        State("token", "data"),
    )
    def render(pathname: str | None, search: str | None, rendered: dict | None, token: str | None) -> Any:
        here = {"path": pathname or "/", "search": search or ""}
        if rendered == here:
            raise PreventUpdate  # the page itself wrote this URL
        try:
            body = _page(cfg, token, pathname, search)
        except ApiProblem as exc:
            body = problem_box(exc)
        return body, here

    @app.callback(
        Output("token", "data"),
        Output("token-input", "value"),
        Input("token-save", "n_clicks"),
        Input("token-input", "n_submit"),
        Input("token-clear", "n_clicks"),
        State("token-input", "value"),
        prevent_initial_call=True,
    )
    def save_token(_save: int | None, _submit: int | None, _clear: int | None, value: str | None) -> Any:
        if ctx.triggered_id == "token-clear":
            return None, ""
        if not value or not value.strip():
            raise PreventUpdate
        return value.strip(), ""

    @app.callback(Output("whoami", "children"), Input("token", "data"))
    def whoami(token: str | None) -> Any:
        try:
            me = cfg.client(token).me()
        except ApiProblem as exc:
            if exc.status == 401:
                return html.Span("token refused: enter another or Forget", className="bad")
            return html.Span(
                "API unreachable" if exc.status == 0 else f"API error {exc.status}", className="bad", title=exc.detail
            )
        rights = "admin" if me.is_admin else ("can write" if me.can_write else "read only")
        return [html.Span(me.name, id="whoami-name", className="who"), f" ({me.via}, {rights})"]

    @app.callback(
        Output("comment-result", "children"),
        Output("comment-body", "value"),
        Input("comment-add", "n_clicks"),
        State("comment-body", "value"),
        State("url", "pathname"),
        State("url", "search"),
        State("token", "data"),
        prevent_initial_call=True,
    )
    @guarded(outputs=2)
    def add_comment(n: int | None, body: str | None, pathname: str, search: str, token: str | None) -> Any:
        if not n:
            raise PreventUpdate
        if not body or not body.strip():
            return message("Write something first.", "error"), no_update
        r = route(pathname)
        if r.run is None:
            raise PreventUpdate
        item = cfg.client(token).add_review(r.run, body, anchor_for(r.page, parse(search), search))
        return message(
            [
                "Comment #",
                str(item.item_id),
                f" added by {item.author}. ",
                dcc.Link("Open the review", href=run_path(r.run, "review") + f"?item={item.item_id}"),
            ],
            "ok",
        ), ""


def anchor_for(page: str, q: dict[str, str], search: str | None) -> Anchor:
    """The anchor of the current view: its page, the selected scheme/op/bin/rank, and the full query."""
    fields: dict[str, Any] = {"view": page, "free": (search or "")[:500] or None}
    sel = q.get("sel", "").split(":") if q.get("sel") else []
    candidates = {
        "scheme": (sel[0] if sel and sel[0] != "-" else None) or q.get("scheme"),
        "op": (sel[1] if len(sel) > 1 else None) or q.get("op"),
        "bin": sel[3] if len(sel) > 3 else q.get("bin"),
        "rank": q.get("rank"),
    }
    for key, value in candidates.items():
        if value in (None, ""):
            continue
        try:
            Anchor.model_validate({key: value})
        except ValueError:
            continue  # a value the anchor cannot hold stays in `free`
        fields[key] = value
    return Anchor(**fields)
