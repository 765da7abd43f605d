"""`/compare?runs=a,b`: runs side by side: volumes per scheme, histograms overlaid, and a sweep chart of
volume against any configuration value that differs between the runs, with the predicted lines."""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, dcc, html

from commlens.contract.analysis import BinSpec, Histogram
from commlens.contract.compare import RunsComparison
from commlens.vocab import OPS, SCHEMES

from .client import ApiClient, ApiProblem
from .components import (
    PATTERNS,
    RUN_COLORS,
    chart_block,
    empty,
    figure,
    guarded,
    loading,
    problem_box,
    push_state,
    td_num,
)
from .config import UiConfig
from .fmt import byte_axis, exact_bytes, num
from .urls import query

MAX_RUNS = 8
PALETTE = RUN_COLORS  # runs are told apart by colour; ops and schemes keep theirs on every page


def _runs(value: str | None) -> list[str]:
    return [r for r in (value or "").split(",") if r][:MAX_RUNS]


def layout(cfg: UiConfig, token: str | None, q: dict[str, str]) -> html.Div:
    selected = _runs(q.get("runs"))
    try:
        names = [r.name for r in cfg.client(token).runs(limit=500).items]
        head = None
    except ApiProblem as exc:
        names, head = [], problem_box(exc)
    options = [{"label": n, "value": n} for n in dict.fromkeys(names + selected)]
    return html.Div(
        [
            html.H1("Compare runs"),
            head,
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Runs (up to 8)", htmlFor="cmp-runs"),
                            dcc.Dropdown(
                                id="cmp-runs", options=options, value=selected, multi=True, placeholder="choose runs"
                            ),
                        ],
                        className="field",
                        style={"minWidth": "420px"},
                    ),
                    html.Div(
                        [
                            html.Label("Scheme", htmlFor="cmp-scheme"),
                            dcc.Dropdown(
                                id="cmp-scheme",
                                options=[{"label": "all", "value": ""}] + [{"label": s, "value": s} for s in SCHEMES],
                                value=q.get("scheme", ""),
                                clearable=False,
                                searchable=False,
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Op", htmlFor="cmp-op"),
                            dcc.Dropdown(
                                id="cmp-op",
                                options=[{"label": "all", "value": ""}] + [{"label": o, "value": o} for o in OPS],
                                value=q.get("op", ""),
                                clearable=False,
                                searchable=False,
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Weight"),
                            dcc.RadioItems(
                                id="cmp-weight",
                                options=[{"label": " calls", "value": "calls"}, {"label": " bytes", "value": "bytes"}],
                                value=q.get("weight") if q.get("weight") in ("calls", "bytes") else "calls",
                                inline=True,
                                inputStyle={"marginLeft": "8px"},
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Histograms"),
                            dcc.RadioItems(
                                id="cmp-mode",
                                options=[
                                    {"label": " overlaid", "value": "overlay"},
                                    {"label": " side by side", "value": "group"},
                                ],
                                value=q.get("mode") if q.get("mode") in ("overlay", "group") else "overlay",
                                inline=True,
                                inputStyle={"marginLeft": "8px"},
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Sweep over", htmlFor="cmp-sweep"),
                            dcc.Dropdown(
                                id="cmp-sweep",
                                options=[],
                                value=q.get("sweep"),
                                clearable=False,
                                placeholder="a configuration value",
                            ),
                        ],
                        className="field wide",
                    ),
                ],
                className="controls",
            ),
            loading(html.Div(id="cmp-content")),
            html.H2("Sweep"),
            loading(html.Div(id="cmp-sweep-chart")),
        ]
    )


def volumes(rc: RunsComparison) -> Any:
    if not any(r.comparison.schemes for r in rc.runs):  # an empty chart with a numeric axis said nothing
        return empty(f"No calls to compare: {', '.join(r.run for r in rc.runs)} hold no collective calls.")
    fig = figure(
        "Bytes per iteration per rank by scheme: measured (solid) and predicted (hatched)",
        "scheme",
        "bytes per iteration per rank",
    )
    top = 0.0
    rows, raw = [], []
    for i, r in enumerate(rc.runs):
        color = PALETTE[i % len(PALETTE)]
        s = r.comparison.schemes
        labels = [sr.scheme for sr in s]
        fig.add_bar(
            name=f"{r.run} measured",
            x=labels,
            y=[x.measured_bytes_per_iter for x in s],
            marker_color=color,
            legendgroup=r.run,
            offsetgroup=f"{i}m",
            customdata=[exact_bytes(x.measured_bytes_per_iter) for x in s],
            hovertemplate=f"{r.run} " + "%{x} measured: %{customdata}<extra></extra>",
        )
        if r.comparison.config_source != "none":
            fig.add_bar(
                name=f"{r.run} predicted",
                x=labels,
                y=[x.predicted_bytes_per_iter for x in s],
                marker_color=color,
                marker_pattern_shape="/",
                opacity=0.55,
                legendgroup=r.run,
                offsetgroup=f"{i}p",
                customdata=[exact_bytes(x.predicted_bytes_per_iter) for x in s],
                hovertemplate=f"{r.run} " + "%{x} predicted: %{customdata}<extra></extra>",
            )
        for x in s:
            top = max(top, x.measured_bytes_per_iter, x.predicted_bytes_per_iter)
            rows.append(
                [
                    r.run,
                    r.strategy or "-",
                    td_num(r.world_size),
                    x.scheme,
                    td_num(x.predicted_bytes_per_iter, exact_bytes(x.predicted_bytes_per_iter)),
                    td_num(x.measured_bytes_per_iter, exact_bytes(x.measured_bytes_per_iter)),
                    td_num(x.unexplained_bytes_per_iter, exact_bytes(x.unexplained_bytes_per_iter)),
                    td_num(x.ratio, "-" if x.ratio is None else f"{x.ratio:.4g}"),
                ]
            )
            raw.append(
                [
                    r.run,
                    r.strategy,
                    r.world_size,
                    x.scheme,
                    x.predicted_bytes_per_iter,
                    x.measured_bytes_per_iter,
                    x.unexplained_bytes_per_iter,
                    x.ratio,
                ]
            )
    fig.update_layout(barmode="group", yaxis=byte_axis(top))
    cols = ["run", "strategy", "world size", "scheme", "predicted", "measured", "unexplained", "ratio"]
    return chart_block("cmp-volumes", fig, cols, rows, raw, "compare-volumes.csv")


def _bin_order(b: BinSpec) -> tuple[int, int]:
    return (0, 0) if b.key == "zero" else ((2, 0) if b.key == "unknown" else (1, b.k or 0))


OVERLAY_WIDTH = 0.8  # the widest overlaid bar, as a share of its bin


def identical_runs(hists: list[Histogram]) -> list[list[str]]:
    """Runs whose histograms are equal bar for bar, in groups of two or more: overlaid, one would hide the other."""
    groups: dict[Any, list[str]] = {}
    for h in hists:
        key = tuple(
            sorted(
                (s.scheme or "", s.op, s.dtype or "", b.key, s.values[k])
                for s in h.series
                for k, b in enumerate(h.bins)
                if s.values[k]
            )
        )
        groups.setdefault(key, []).append(h.run)
    return [runs for key, runs in groups.items() if key and len(runs) > 1]


def overlaid(hists: list[Histogram], mode: str) -> Any:
    """The runs' histograms on one axis: side by side, or overlaid with each run's bars narrower than the run's
    before it (nested, centred on the bin), so a run equal to another still shows around and inside it."""
    bins: dict[str, BinSpec] = {}
    for h in hists:
        for b in h.bins:
            bins[b.key] = b
    if not bins:
        filtered = any(h.filters.get("scheme") or h.filters.get("op") for h in hists)
        return empty(
            "None of these runs has calls matching the scheme and op." if filtered else "None of these runs has calls."
        )
    axis = [b.label for b in sorted(bins.values(), key=_bin_order)]
    weight = hists[0].weight
    norms = {h.normalization for h in hists}
    norm = "per rank per iteration" if norms == {"per_rank_per_iteration"} else "normalised as each run allows"
    fig = figure(f"Message sizes, {weight} {norm}", "message size S (power-of-two bin)", f"{weight} {norm}")
    rows, raw, top = [], [], 0.0
    for i, h in enumerate(hists):
        for j, s in enumerate(h.series):
            name = f"{h.run} · {s.scheme or 'unattributed'} {s.op} {s.dtype or ''}".strip()
            nested = mode == "overlay"
            fig.add_bar(
                name=name,
                x=[b.label for b in h.bins],
                y=s.values,
                width=OVERLAY_WIDTH * (len(hists) - i) / len(hists) if nested else None,
                marker_color=PALETTE[i % len(PALETTE)],
                marker_line={"width": 1, "color": "white"} if nested else None,
                marker_pattern_shape=PATTERNS[j % len(PATTERNS)],
                opacity=0.9 if nested else 1,
                customdata=[[num(s.calls[k]), exact_bytes(s.bytes[k])] for k in range(len(h.bins))],
                hovertemplate="<b>" + name + "</b><br>%{x}<br>calls %{customdata[0]}<br>bytes "
                "%{customdata[1]}<extra></extra>",
            )
            top += max(s.values, default=0.0)  # bound of the bars' height, for the tick labels only
            for k, b in enumerate(h.bins):
                if s.calls[k] or s.bytes[k]:
                    rows.append(
                        [
                            h.run,
                            s.scheme or "-",
                            s.op,
                            s.dtype or "-",
                            b.label,
                            td_num(s.calls[k]),
                            td_num(s.bytes[k], exact_bytes(s.bytes[k])),
                        ]
                    )
                    raw.append([h.run, s.scheme, s.op, s.dtype, b.label, s.calls[k], s.bytes[k]])
    fig.update_layout(
        barmode=mode, xaxis={"type": "category", "categoryorder": "array", "categoryarray": axis, "tickangle": -35}
    )
    if weight == "bytes":
        fig.update_layout(yaxis=byte_axis(top))
    same = identical_runs(hists)
    note = [
        (", ".join(runs[:-1]) + f" and {runs[-1]}: identical distributions, every bar equal")
        + (
            "; overlaid, each run's bars are drawn narrower than the one before, so all show."
            if mode == "overlay"
            else "."
        )
        for runs in same
    ]
    return chart_block(
        "cmp-hist",
        fig,
        ["run", "scheme", "op", "dtype", "size bin", "calls", "bytes"],
        rows,
        raw,
        "compare-histograms.csv",
        note=html.Span(" ".join(note), id="cmp-hist-same") if note else None,
    )


def flat_config(config: dict[str, Any] | None, prefix: str = "") -> dict[str, float]:
    """The numeric scalars of a run's configuration by dotted key (model.seq_len, parallel.dp, ...)."""
    out: dict[str, float] = {}
    for k, v in (config or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k not in ("results",):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = v
    return out


def varied_keys(configs: dict[str, dict[str, float]]) -> list[str]:
    """The configuration keys a sweep may follow: the runs differ in exactly one parameter (keys that vary
    together, such as parallel.dp and world_size, are one parameter under several names); none when a run
    has no configuration or the runs differ in more than one parameter (its effect would be mixed with the
    others'). Sequence length first."""
    if len(configs) < 2 or not all(configs.values()):
        return []
    keys: list[str] = []
    for cfg in configs.values():
        for k in cfg:
            if k not in keys:
                keys.append(k)
    runs = list(configs.values())
    varied = [k for k in keys if len({c.get(k) for c in runs}) > 1]
    partitions = {tuple(_groups([c.get(k) for c in runs])) for k in varied}
    if len(partitions) != 1 or any(k not in c for k in varied for c in runs):
        return []
    # Keys that vary together are one parameter only when one follows from the other (two runs put any two
    # differing keys in the same partition): a derived key rides along with its source, nothing else does.
    independent = [k for k in varied if not any(_derived_from(k, src) for src in varied if src != k)]
    if len(independent) != 1:
        return []
    return sorted(varied, key=lambda k: (k != "model.seq_len", not k.startswith(("model.", "parallel.")), k))


def _derived_from(key: str, source: str) -> bool:
    """The world size is the product of the parallel sizes; the FFN width follows the hidden size."""
    if key.rsplit(".", 1)[-1] == "world_size":
        return source.startswith("parallel.") and source.rsplit(".", 1)[-1] in ("dp", "tp", "pp", "cp", "ep")
    return key == "model.ffn_hidden" and source == "model.hidden"


def _groups(values: list[float | None]) -> list[int]:
    """Which runs share a value: each run's index of the first run with its value."""
    return [values.index(v) for v in values]


def sweep_chart(rc: RunsComparison, configs: dict[str, dict[str, float]], key: str) -> Any:
    points = sorted(((configs[r.run][key], r) for r in rc.runs if key in configs.get(r.run, {})), key=lambda p: p[0])
    if len(points) < 2:
        return empty(f"Fewer than two runs have {key}.")
    schemes: list[str] = []
    for _, r in points:
        for s in r.comparison.schemes:
            if s.scheme not in schemes:
                schemes.append(s.scheme)
    fig = figure(f"Bytes per iteration per rank against {key}", key, "bytes per iteration per rank")
    rows, raw, top = [], [], 0.0
    for i, scheme in enumerate(schemes):
        color = PALETTE[i % len(PALETTE)]
        xs, meas, pred, names = [], [], [], []
        for x, r in points:
            found = next((s for s in r.comparison.schemes if s.scheme == scheme), None)
            if found is None:
                continue
            xs.append(x)
            names.append(r.run)
            meas.append(found.measured_bytes_per_iter)
            pred.append(found.predicted_bytes_per_iter if r.comparison.config_source != "none" else None)
            rows.append(
                [
                    r.run,
                    td_num(x),
                    scheme,
                    td_num(found.predicted_bytes_per_iter, exact_bytes(found.predicted_bytes_per_iter)),
                    td_num(found.measured_bytes_per_iter, exact_bytes(found.measured_bytes_per_iter)),
                ]
            )
            raw.append([r.run, x, scheme, found.predicted_bytes_per_iter, found.measured_bytes_per_iter])
            top = max(top, found.measured_bytes_per_iter, found.predicted_bytes_per_iter)
        fig.add_scatter(
            name=f"{scheme} measured",
            x=xs,
            y=meas,
            mode="lines+markers",
            line={"color": color},
            customdata=[[n, exact_bytes(v)] for n, v in zip(names, meas, strict=True)],
            hovertemplate="%{customdata[0]}: " + scheme + " measured %{customdata[1]}<extra></extra>",
        )
        fig.add_scatter(
            name=f"{scheme} predicted",
            x=xs,
            y=pred,
            mode="lines+markers",
            line={"color": color, "dash": "dash"},
            marker={"symbol": "diamond-open"},
            customdata=[[n, exact_bytes(v) if v is not None else "-"] for n, v in zip(names, pred, strict=True)],
            hovertemplate="%{customdata[0]}: " + scheme + " predicted %{customdata[1]}<extra></extra>",
        )
    xs_all = sorted({x for x, _ in points})
    fig.update_layout(
        yaxis=byte_axis(top), xaxis={"tickmode": "array", "tickvals": xs_all, "ticktext": [num(x) for x in xs_all]}
    )
    return chart_block(
        "cmp-sweep-graph", fig, ["run", key, "scheme", "predicted", "measured"], rows, raw, "compare-sweep.csv"
    )


def _configs(client: ApiClient, runs: list[str]) -> dict[str, dict[str, float]]:
    return {r: flat_config(client.run(r).config) for r in runs}


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("cmp-runs", "value"),
        Input("cmp-scheme", "value"),
        Input("cmp-op", "value"),
        Input("cmp-weight", "value"),
        Input("cmp-mode", "value"),
        Input("cmp-sweep", "value"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(
        runs: list[str], scheme: str, op: str, weight: str, mode: str, sweep: str | None, rendered: dict | None
    ) -> Any:
        search = query(
            {
                "runs": ",".join(runs or []),
                "scheme": scheme,
                "op": op,
                "weight": None if weight == "calls" else weight,
                "mode": None if mode == "overlay" else mode,
                "sweep": sweep,
            }
        )
        return push_state(rendered, search)

    @app.callback(
        Output("cmp-content", "children"),
        Input("cmp-runs", "value"),
        Input("cmp-scheme", "value"),
        Input("cmp-op", "value"),
        Input("cmp-weight", "value"),
        Input("cmp-mode", "value"),
        State("token", "data"),
    )
    @guarded()
    def show(runs: list[str], scheme: str, op: str, weight: str, mode: str, token: str | None) -> Any:
        runs = (runs or [])[:MAX_RUNS]
        if not runs:
            return empty("Choose one or more runs to compare.")
        client = cfg.client(token)
        rc = client.compare_runs(runs)
        hists = [client.histogram(r, scheme=scheme or None, op=op or None, weight=weight or "calls") for r in runs]
        return html.Div(
            [html.H2("Volumes per scheme"), volumes(rc), html.H2("Message sizes"), overlaid(hists, mode or "overlay")]
        )

    @app.callback(
        Output("cmp-sweep", "options"),
        Output("cmp-sweep", "value"),
        Input("cmp-runs", "value"),
        State("cmp-sweep", "value"),
        State("token", "data"),
    )
    def sweep_options(runs: list[str], current: str | None, token: str | None) -> Any:
        try:
            keys = varied_keys(_configs(cfg.client(token), (runs or [])[:MAX_RUNS]))
        except ApiProblem:
            return [], None
        value = current if current in keys else (keys[0] if keys else None)
        return [{"label": k, "value": k} for k in keys], value

    @app.callback(
        Output("cmp-sweep-chart", "children"),
        Input("cmp-sweep", "value"),
        Input("cmp-runs", "value"),
        State("token", "data"),
    )
    @guarded()
    def sweep(key: str | None, runs: list[str], token: str | None) -> Any:
        runs = (runs or [])[:MAX_RUNS]
        if len(runs) < 2:
            return empty("Choose at least two runs for a sweep.")
        if not key:
            return empty(
                "A sweep needs runs whose configurations differ in exactly one parameter: these runs have none, "
                "or do not differ, or differ in several at once (their effects would be mixed)."
            )
        client = cfg.client(token)
        return sweep_chart(client.compare_runs(runs), _configs(client, runs), key)
