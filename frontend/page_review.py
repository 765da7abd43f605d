"""`/runs/{run}/review`: the run's review items and findings, each linking to its exact view; comment,
reply, resolve and reopen, and promote a finding to a review item. Bodies are the API's safe HTML,
rebuilt as components through an allow-list (safe_html)."""

from __future__ import annotations

from typing import Any

from dash import ALL, Dash, Input, Output, State, ctx, dcc, html
from dash.exceptions import PreventUpdate

from commlens.contract.analysis import Finding, bin_spec
from commlens.contract.review import MAX_BODY, Anchor, ReviewItem, ReviewUpdate

from .client import ApiClient, ApiProblem
from .components import empty, guarded, loading, message, problem_box, push_state, severity_badge
from .config import UiConfig
from .safe_html import to_components
from .urls import anchor_link, query, view_link

STATUSES = {"": "all", "open": "open", "resolved": "resolved"}


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    return html.Div(
        [
            dcc.Store(id="rv-run", data=run),
            dcc.Store(id="rv-item", data=q.get("item")),
            dcc.Store(id="rv-refresh", data=0),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Status", htmlFor="rv-status"),
                            dcc.Dropdown(
                                id="rv-status",
                                options=[{"label": v, "value": k} for k, v in STATUSES.items()],
                                value=q.get("status", "") if q.get("status", "") in STATUSES else "",
                                clearable=False,
                                searchable=False,
                            ),
                        ],
                        className="field",
                    )
                ],
                className="controls",
            ),
            html.Details(
                [
                    html.Summary("New comment on the run"),
                    dcc.Textarea(
                        id="rv-new-text",
                        className="comment-text",
                        placeholder="Markdown is allowed",
                        maxLength=MAX_BODY,
                    ),
                    html.Button("Add comment", id="rv-new-btn", className="btn"),
                    html.P(
                        "To comment on a chart, use “Comment on this view” under it: the comment then links back to "
                        "that exact view.",
                        className="hint",
                    ),
                ],
                className="comment-box",
                id="rv-new",
            ),
            html.Div(id="rv-msg"),
            loading(html.Div(id="rv-content")),
        ]
    )


def anchor_text(a: Anchor | None) -> str:
    if a is None:
        return "the run"
    parts = [a.view or "overview"]
    parts += [x for x in (a.scheme, a.op) if x]
    if a.bin:
        try:
            parts.append(bin_spec(a.bin).label)
        except ValueError:
            parts.append(a.bin)
    if a.rank is not None:
        parts.append(f"rank {a.rank}")
    return " · ".join(parts)


def _meta(item: ReviewItem) -> list[Any]:
    # A deleted user's name may be given to someone else: their old items say so.
    author = f"{item.author} (former user)" if item.author_removed else item.author
    return [html.Span(author, className="author"), html.Span(item.created_at.strftime("%Y-%m-%d %H:%M"))]


def item_view(item: ReviewItem, selected: bool) -> html.Div:
    nxt = "open" if item.status == "resolved" else "resolved"
    data: dict[str, Any] = {"data-status": item.status}
    replies = [
        html.Div(
            [html.Div(_meta(r), className="meta"), to_components(r.body_html)],
            className="reply",
            id=f"review-item-{r.item_id}",
        )
        for r in item.replies
    ]
    return html.Div(
        [
            html.Div(
                [
                    *_meta(item),
                    html.Span(item.status, className=f"badge st-{item.status}"),
                    dcc.Link(f"view: {anchor_text(item.anchor)}", href=anchor_link(item.run, item.anchor)),
                    html.Span(f"finding {item.finding}", className="badge") if item.finding else None,
                    html.Span(f"#{item.item_id}", className="hint"),
                ],
                className="meta",
            ),
            to_components(item.body_html),
            html.Div(replies, className="replies") if replies else None,
            html.P(f"{item.replies_total - len(replies)} later replies not shown.", className="hint")
            if item.replies_total > len(replies)
            else None,
            html.Div(
                [
                    dcc.Textarea(
                        id={"type": "rv-reply-text", "item": item.item_id}, placeholder="Reply…", maxLength=MAX_BODY
                    ),
                    html.Button("Reply", id={"type": "rv-reply-btn", "item": item.item_id}, className="btn small"),
                    html.Button(
                        "Reopen" if nxt == "open" else "Resolve",
                        id={"type": "rv-status-btn", "item": item.item_id, "to": nxt},
                        className="btn small light",
                    ),
                ],
                className="reply-row",
            ),
        ],
        className="review-item selected" if selected else "review-item",
        id=f"review-item-{item.item_id}",
        **data,
    )


def findings_view(run: str, findings: list[Finding], promoted: dict[str, int]) -> Any:
    if not findings:
        return empty("No findings for this run.")
    out = []
    for f in findings:
        action: Any
        if f.id in promoted:
            action = html.Span(f"review item #{promoted[f.id]}", className="hint")
        else:
            action = html.Button(
                "Make a review item", id={"type": "rv-promote", "finding": f.id}, className="btn small light"
            )
        out.append(
            html.Div(
                [
                    html.Div([severity_badge(f.severity), html.Span(f.title, className="title")]),
                    html.Div(f.suggestion, className="hint"),
                    html.Div([dcc.Link("open the view →", href=view_link(run, f.view)), " ", action]),
                ],
                className=f"finding {f.severity}",
            )
        )
    return html.Div(out)


def review_view(client: ApiClient, run: str, status: str, selected: str | None) -> Any:
    page = client.review(run, status=status or None)
    for i in page.items:
        if i.replies_total > len(i.replies):  # the rest of a long thread
            i.replies += client.replies(i.item_id, offset=len(i.replies)).items
    items = [item_view(i, str(i.item_id) == str(selected)) for i in page.items]
    everything = client.review(run, limit=1000).items if status else page.items
    promoted = {i.finding: i.item_id for i in everything if i.finding}
    try:
        found: Any = findings_view(run, client.findings(run, limit=200).items, promoted)
    except ApiProblem as exc:
        found = problem_box(exc)
    head = f"Review items ({page.total} {STATUSES[status] if status else 'in all'})"
    return html.Div(
        [
            html.H2(head),
            html.Div(items, id="rv-items") if items else empty("No review items yet."),
            html.P(f"{page.total - len(items)} older items not shown.", className="hint") if page.next_offset else None,
            html.H2("Findings"),
            found,
        ]
    )


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("rv-status", "value"),
        State("rv-item", "data"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(status: str, item: str | None, rendered: dict | None) -> Any:
        search = query({"status": status, "item": item})
        return push_state(rendered, search)

    @app.callback(
        Output("rv-content", "children"),
        Input("rv-status", "value"),
        Input("rv-refresh", "data"),
        State("rv-item", "data"),
        State("rv-run", "data"),
        State("token", "data"),
    )
    @guarded()
    def show(status: str, _refresh: int, selected: str | None, run: str, token: str | None) -> Any:
        return review_view(cfg.client(token), run, status or "", selected)

    @app.callback(
        Output("rv-msg", "children"),
        Output("rv-refresh", "data"),
        Output("rv-new-text", "value"),
        Input("rv-new-btn", "n_clicks"),
        Input({"type": "rv-reply-btn", "item": ALL}, "n_clicks"),
        Input({"type": "rv-status-btn", "item": ALL, "to": ALL}, "n_clicks"),
        Input({"type": "rv-promote", "finding": ALL}, "n_clicks"),
        State("rv-new-text", "value"),
        State({"type": "rv-reply-text", "item": ALL}, "value"),
        State("rv-refresh", "data"),
        State("rv-run", "data"),
        State("token", "data"),
        prevent_initial_call=True,
    )
    @guarded(outputs=3)
    def act(
        _new: int | None,
        _replies: list,
        _statuses: list,
        _promotes: list,
        new_text: str | None,
        reply_texts: list[str | None],
        refresh: int,
        run: str,
        token: str | None,
    ) -> Any:
        trig = ctx.triggered_id
        if trig is None or not ctx.triggered or not ctx.triggered[0]["value"]:
            raise PreventUpdate  # buttons appearing, not clicked
        client = cfg.client(token)
        keep = new_text
        if trig == "rv-new-btn":
            if not new_text or not new_text.strip():
                return message("Write the comment first.", "error"), refresh, new_text
            item = client.add_review(run, new_text, Anchor(view="review"))
            text, keep = f"Comment #{item.item_id} added by {item.author}.", ""
        elif trig["type"] == "rv-reply-btn":
            ids = [s["id"]["item"] for s in ctx.states_list[1]]
            body = dict(zip(ids, reply_texts, strict=True)).get(trig["item"])
            if not body or not body.strip():
                return message("Write the reply first.", "error"), refresh, keep
            item = client.add_review(run, body, parent_id=trig["item"])
            text = f"Reply #{item.item_id} added by {item.author}."
        elif trig["type"] == "rv-status-btn":
            item = client.update_review(trig["item"], ReviewUpdate(status=trig["to"]))
            text = f"Item #{item.item_id} is {item.status} now."
        else:
            item = client.promote_finding(run, trig["finding"])
            text = f"Finding is review item #{item.item_id} now."
        return message(text, "ok"), (refresh or 0) + 1, keep
