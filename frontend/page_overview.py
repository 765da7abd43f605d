"""`/runs/{run}`: the run at a glance: facts, a hang when Flight Recorder dumps show one, schemes and how
they were attributed, bytes per iteration per rank per scheme (predicted and measured), the top findings,
the ingested sources and, per rank, which of them describe it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dash import Dash, Input, Output, State, dcc, html

from commlens.contract.compare import Comparison
from commlens.contract.runs import RunUpdate
from commlens.vocab import evidence_key, format_bytes

from .client import ApiClient, ApiProblem
from .components import (
    chart_block,
    empty,
    figure,
    guarded,
    kv,
    loading,
    message,
    problem_box,
    scheme_color,
    severity_badge,
    static_table,
    table,
    td_id,
    td_num,
)
from .config import UiConfig
from .fmt import byte_axis, exact_bytes, num
from .urls import run_path, view_link

TOP_FINDINGS = 5


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    return html.Div([dcc.Store(id="ov-run", data=run), loading(html.Div(id="ov-content"))])


def _section(title: str, build: Callable[[], Any]) -> html.Section:
    """One section; an API problem in it is said there and the others still show."""
    try:
        body = build()
    except ApiProblem as exc:
        body = problem_box(exc)
    return html.Section([html.H2(title), body])


def facts(client: ApiClient, run: str) -> Any:
    d = client.run(run)
    ops = ", ".join(f"{op} {num(n)}" for op, n in d.ops.items()) or "none"
    left = kv(
        [
            ("strategy", d.strategy),
            ("world size", num(d.world_size) if d.world_size else None),
            (
                "ranks with calls",
                num(d.ranks)
                + (f" (and {num(d.n_processes)} processes without a global rank)" if d.n_processes else ""),
            ),
            ("calls", num(d.events)),
            ("calls per op", ops),
            (
                "configuration",
                {
                    "run_config": "harness run.json",
                    "predict_input": "predictor input",
                    "model_description": "model description (commlens describe-model)",
                    "other": "other (not usable for predictions)",
                }.get(d.config_kind or "", "none"),
            ),
            ("created", d.created_at.strftime("%Y-%m-%d %H:%M:%S")),
            ("description", d.description),
        ]
    )
    tags = html.Div(
        [
            html.Label("Tags (comma-separated)", htmlFor="ov-tags"),
            dcc.Input(id="ov-tags", type="text", value=", ".join(d.tags), className="tags-input"),
            html.Button("Save tags", id="ov-tags-save", className="btn small light"),
            html.Div(id="ov-tags-msg"),
        ],
        className="field",
    )
    return html.Div([left, tags], className="grid2")


def schemes(client: ApiClient, run: str) -> Any:
    g = client.groups(run)
    if not g.items:
        if not g.unattributed_events:
            return empty("No process groups or communicators: nothing to attribute.")
        # a call's scheme is its group's (backend/attribution.py): every view lists groupless calls as unattributed
        return empty(
            f"No process group or communicator in the files: none of the {num(g.unattributed_events)} calls has a "
            "group to attribute, so every view lists them as unattributed."
        )
    rows = [
        [
            html.Span(x.group_key, className="mono"),
            x.description or x.name or "-",
            ", ".join(map(str, x.ranks)) if x.ranks else "-",
            td_num(x.size),
            html.Strong(x.scheme),
            x.source,
            x.reason,
            td_num(x.confidence, f"{x.confidence:.2f}"),
            td_num(x.calls),
        ]
        for x in g.items
    ]
    by_scheme = ", ".join(f"{k}: {num(v)}" for k, v in g.events_by_scheme.items())
    notes = [
        html.P(
            f"Calls by scheme: {by_scheme or 'none'}. Calls without a group (not attributable): "
            f"{num(g.unattributed_events)}.",
            className="hint",
        )
    ]
    if g.next_offset is not None:
        notes.append(html.P(f"The first {num(len(g.items))} of {num(g.total)} groups.", className="hint"))
    return html.Div(
        [
            *notes,
            html.Div(
                table(
                    [
                        "group",
                        "description",
                        "ranks",
                        "size",
                        "scheme",
                        "attributed by",
                        "reason",
                        "confidence",
                        "calls",
                    ],
                    rows,
                    id_="ov-groups",
                ),
                className="scroll",
            ),
        ]
    )


def volumes_chart(c: Comparison, graph_id: Any = "ov-volumes", *, on_predicted: bool = False) -> Any:
    if not c.schemes:
        return empty("No calls inside complete iterations and no prediction: nothing to compare.")
    names = [s.scheme for s in c.schemes]
    fig = figure("Bytes per iteration per rank, by scheme", "scheme", "bytes per iteration per rank (sum of S)")
    predicted = [s.predicted_bytes_per_iter for s in c.schemes]
    measured = [s.measured_bytes_per_iter for s in c.schemes]
    # only a scheme the configuration predicts can leave bytes unexplained; measured only is neutral
    unexplained = [s.unexplained_bytes_per_iter if s.prediction_source == "config" else 0.0 for s in c.schemes]
    if c.config_source != "none":
        fig.add_bar(
            name="predicted",
            x=names,
            y=predicted,
            marker_color="#9db4e0",
            customdata=[exact_bytes(v) for v in predicted],
            hovertemplate="%{x} predicted: %{customdata}<extra></extra>",
        )
    fig.add_bar(
        name="measured",
        x=names,
        y=measured,
        marker_color=[scheme_color(n) for n in names],
        customdata=[exact_bytes(v) for v in measured],
        hovertemplate="%{x} measured: %{customdata}<extra></extra>",
    )
    if any(s.prediction_source == "config" for s in c.schemes):
        fig.add_bar(
            name="of which unexplained",
            x=names,
            y=unexplained,
            marker_color="#f0a35e",
            customdata=[exact_bytes(v) for v in unexplained],
            hovertemplate="%{x} unexplained: %{customdata}<extra></extra>",
        )
    top = max(predicted + measured + [0.0])
    fig.update_layout(barmode="group", yaxis=byte_axis(top), bargap=0.35 if len(names) > 1 else 0.6)
    cols = ["scheme", "predicted", "measured", "unexplained", "explained / predicted"]
    display, raw = [], []
    for s in c.schemes:
        # a scheme nothing predicts has no predicted, unexplained or ratio: "-", not 0 B and all of it unexplained
        said = s.prediction_source == "config"
        pred = s.predicted_bytes_per_iter if said else None
        unex = s.unexplained_bytes_per_iter if said else None
        ratio = s.ratio if said else None
        display.append(
            [
                s.scheme,
                td_num(pred, exact_bytes(pred)),
                td_num(s.measured_bytes_per_iter, exact_bytes(s.measured_bytes_per_iter)),
                td_num(unex, exact_bytes(unex)),
                td_num(ratio, "-" if ratio is None else f"{ratio:.4g}"),
            ]
        )
        raw.append([s.scheme, pred, s.measured_bytes_per_iter, unex, ratio])
    source = {
        "run": "the run's own configuration",
        "supplied": "a supplied configuration",
        "none": "no configuration (measured only)"
        if on_predicted
        else "no configuration (measured only; add one or use the what-if on Predicted)",
    }[c.config_source]
    note = (
        f"Prediction from {source}{f' ({c.implementation})' if c.implementation else ''}. "
        f"{c.iterations_message}. Ratio = (measured - unexplained) / predicted. Bytes sent: receives are not "
        "added (a send and its receive move one message), unlike the histograms and the rank totals."
    )
    return chart_block(graph_id, fig, cols, display, raw, f"{c.run}-volumes.csv", note=note, open_table=True)


def findings_list(client: ApiClient, run: str, limit: int = TOP_FINDINGS) -> Any:
    page = client.findings(run, limit=limit)
    if not page.items:
        return empty("No findings: nothing stands out in this run.")
    items = [
        html.Div(
            [
                html.Div([severity_badge(f.severity), html.Span(f.title, className="title")]),
                html.Div(
                    " · ".join(f"{evidence_key(k).replace('_', ' ')} {v}" for k, v in f.evidence_text.items())
                    + (f" ({f.stability})" if f.stability else ""),
                    className="hint finding-evidence",
                ),
                html.Div(f.suggestion, className="hint"),
                dcc.Link("open the view →", href=view_link(run, f.view)),
            ],
            className=f"finding {f.severity}",
        )
        for f in page.items
    ]
    more = (
        html.P(dcc.Link(f"all {page.total} findings on the review page", href=run_path(run, "review")))
        if page.total > len(page.items)
        else None
    )
    return html.Div([*items, more])


def sources(client: ApiClient, run: str) -> Any:
    """The run's files as one static table (a component per cell took minutes to draw at 1,024 ranks);
    failed files are counted above it, since a static table cannot colour their rows."""
    page = client.sources(run)
    if not page.items:
        return empty("No files ingested into this run yet.")
    rows = []
    for s in page.items:
        note = s.error or "; ".join(s.warnings or [])
        if s.skipped:
            note = (note + "; " if note else "") + "skipped " + ", ".join(f"{k}: {v}" for k, v in s.skipped.items())
        rows.append(
            [
                s.path,
                s.kind,
                s.status,
                "-" if s.rank is None else str(s.rank),
                num(s.n_events),
                format_bytes(s.size_bytes),
                note,
            ]
        )
    failed = sum(1 for s in page.items if s.status == "failed")
    return html.Div(
        [
            message(f"{failed} of these {len(rows)} files failed: see error / notes.", "error") if failed else None,
            html.Div(
                static_table(
                    ["file", "kind", "status", "rank", "calls", "size", "error / notes"],
                    rows,
                    "ov-sources",
                    ("rank", "calls", "size"),
                ),
                className="scroll",
            ),
            html.P(
                f"The first {num(len(rows))} of {num(page.total)} files; GET /api/runs/<run>/sources?offset="
                f"{page.next_offset} pages through the rest. Sources per rank below names every rank's files.",
                className="hint",
            )
            if page.next_offset
            else None,
        ]
    )


def hang(client: ApiClient, run: str) -> Any:
    """Groups whose latest collective did not complete: arrived and missing ranks, what the missing did."""
    h = client.hang(run)
    if not h.dumped_ranks:
        return empty("No Flight Recorder dump in this run.")
    if not h.groups:
        return empty(f"Every collective completed in the dumps of ranks {', '.join(map(str, h.dumped_ranks))}.")
    rows, classes = [], []
    for g in h.groups:
        for x in g.ranks:
            missing = x.rank in g.missing_ranks
            rows.append(
                [
                    g.group,
                    f"{g.op} #{g.seq}",
                    td_id(x.rank),
                    html.Strong("never arrived") if missing else "arrived",
                    x.doing,
                ]
            )
            classes.append("bad" if missing else None)
    missing_all = sorted({r for g in h.groups for r in g.missing_ranks})
    return html.Div(
        [
            message(f"Hung: ranks {', '.join(map(str, missing_all)) or 'none'} never arrived.", "error"),
            html.Div(
                table(["group", "collective", "rank", "state", "doing"], rows, id_="ov-hang", row_class=classes),
                className="scroll",
            ),
        ]
    )


def rank_sources(client: ApiClient, run: str) -> Any:
    """Per rank, the files that describe it and how many of their calls count (each call counts once); one
    static table, a row per rank at any scale."""
    r = client.rank_sources(run)
    if not r.ranks:
        return empty("No file names a rank yet.")
    rows = [
        [
            str(x.rank),
            ", ".join(sorted({s.kind for s in x.sources})),
            "; ".join(s.path for s in x.sources),
            num(sum(s.counted for s in x.sources)),
            ", ".join(f"{s.kind}: {num(s.calls)}" for s in x.sources if s.calls and not s.counted) or "-",
        ]
        for x in r.ranks
    ]
    cols = ["rank", "kinds", "files", "calls counted", "calls superseded"]
    return html.Div(static_table(cols, rows, "ov-rank-sources", ("rank", "calls counted")), className="scroll")


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(Output("ov-content", "children"), Input("ov-run", "data"), State("token", "data"))
    @guarded()
    def show(run: str, token: str | None) -> Any:
        client = cfg.client(token)
        client.run(run)  # a missing run is said once, not per section
        return html.Div(
            [
                _section("Run", lambda: facts(client, run)),
                _section("Hang (Flight Recorder)", lambda: hang(client, run)),
                _section(
                    "Bytes per iteration per rank, predicted and measured",
                    lambda: volumes_chart(client.predicted_vs_measured(run)),
                ),
                _section("Top findings", lambda: findings_list(client, run)),
                _section("Schemes and how they were attributed", lambda: schemes(client, run)),
                _section("Sources", lambda: sources(client, run)),
                _section("Sources per rank", lambda: rank_sources(client, run)),
            ]
        )

    @app.callback(
        Output("ov-tags-msg", "children"),
        Input("ov-tags-save", "n_clicks"),
        State("ov-tags", "value"),
        State("ov-run", "data"),
        State("token", "data"),
        prevent_initial_call=True,
    )
    @guarded()
    def save_tags(n: int | None, value: str | None, run: str, token: str | None) -> Any:
        tags = [t.strip() for t in (value or "").split(",") if t.strip()]
        d = cfg.client(token).update_run(run, RunUpdate(tags=tags))
        return message(f"Tags saved: {', '.join(d.tags) or 'none'}.", "ok")
