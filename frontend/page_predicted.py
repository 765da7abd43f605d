"""`/runs/{run}/predicted`: predicted against measured per scheme and per (op, dtype, size), unexplained
and missing calls flagged, and a what-if form that predicts any configuration (POST /api/predict)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import Dash, Input, Output, State, dcc, html
from pydantic import ValidationError

from commlens.contract.analysis import UNATTRIBUTED
from commlens.contract.compare import Comparison, OpComparison, PredictionSource, SchemeResult
from commlens.contract.predict import ParallelSpec, PredictInput, Prediction
from commlens.vocab import SCHEMES, format_bytes

from .client import ApiProblem
from .components import (
    OP_COLORS,
    chart_block,
    empty,
    figure,
    guarded,
    loading,
    message,
    problem_box,
    push_state,
    scheme_color,
    table,
    td_num,
)
from .config import UiConfig
from .fmt import byte_axis, exact_bytes, num
from .page_overview import volumes_chart
from .urls import int_or_none, query

FILTERS = {"": "all", "unexplained": "unexplained", "missing": "missing", "mismatch": "more or fewer than predicted"}
STATUS_CLASS = {"unexplained": "flag", "missing": "bad", "more": "flag", "fewer": "flag"}
# A scheme's prediction_source as the page labels it (badge text, badge class); measured only is neutral grey
SOURCE_BADGE: dict[PredictionSource, tuple[str, str]] = {
    "config": ("predicted from the configuration", "st-ok"),
    "inferred": ("inferred from the measurements", "st-open"),
    "none": ("measured only", "sev-info"),
}
SCHEME_OPTIONS = (*SCHEMES, UNATTRIBUTED)  # calls without a process group form a scheme of their own
IMPLEMENTATIONS = ["paper", "megatron", "deepspeed", "fsdp", "harness"]
DTYPES = ["bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"]
# What-if fields: (url key, label, section of PredictInput, field, kind)
NUMBER_FIELDS = [
    ("layers", "layers", "model", "layers"),
    ("hidden", "hidden", "model", "hidden"),
    ("heads", "heads", "model", "heads"),
    ("kv_heads", "KV heads", "model", "kv_heads"),
    ("ffn", "FFN hidden", "model", "ffn_hidden"),
    ("vocab", "vocab", "model", "vocab"),
    ("seq", "sequence length", "model", "seq_len"),
    ("dp", "DP", "parallel", "dp"),
    ("tp", "TP", "parallel", "tp"),
    ("pp", "PP", "parallel", "pp"),
    ("cp", "CP", "parallel", "cp"),
    ("ep", "EP", "parallel", "ep"),
    ("experts", "experts (MoE)", "model", "experts"),
    ("topk", "top-k", "model", "top_k"),
    ("mb", "micro-batches", "parallel", "micro_batches"),
    ("mbs", "micro-batch size", "parallel", "micro_batch_size"),
]
CP_STYLES = ["ring", "attention2d"]
WHATIF_KEYS = [k for k, *_ in NUMBER_FIELDS] + ["zero", "sp", "cpstyle", "impl", "dtype", "act"]


def defaults_from_config(config: dict[str, Any] | None) -> dict[str, Any]:
    """The form's starting values: the run's stored configuration, read field by field."""
    config = config or {}
    out: dict[str, Any] = {}
    for key, _, section, field in NUMBER_FIELDS:
        value = (config.get(section) or {}).get(field)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
        elif section == "parallel":  # the predictor's own default (1 for every degree)
            out[key] = ParallelSpec.model_fields[field].default
    parallel = config.get("parallel") or {}
    out["zero"] = parallel.get("zero", 0) if parallel.get("zero") in (0, 1, 2, 3) else 0
    out["sp"] = bool(parallel.get("sp"))
    out["cpstyle"] = parallel.get("cp_style") if parallel.get("cp_style") in CP_STYLES else "ring"
    out["impl"] = config.get("implementation") if config.get("implementation") in IMPLEMENTATIONS else "paper"
    dtypes = config.get("dtypes") or {}
    out["dtype"] = dtypes.get("grad") if dtypes.get("grad") in DTYPES else "bfloat16"
    out["act"] = dtypes.get("act") if dtypes.get("act") in DTYPES else out["dtype"]
    return out


def from_query(q: dict[str, str], defaults: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The what-if form's values: the address's where they are ones the form takes, else the defaults; and the
    address's values left out, each with why (`w_tp=abc` became the default without a word)."""
    values, ignored = dict(defaults), []
    choices: dict[str, Sequence[Any]] = {"impl": IMPLEMENTATIONS, "dtype": DTYPES, "act": DTYPES, "cpstyle": CP_STYLES}
    for key in WHATIF_KEYS:
        raw = q.get(f"w_{key}")
        if raw is None:
            continue
        if key in choices:
            if raw in choices[key]:
                values[key] = raw
            else:
                ignored.append(f"w_{key}={raw} (one of {', '.join(map(str, choices[key]))})")
        elif key == "sp":
            values[key] = raw == "1"
        else:
            n = int_or_none(raw)
            low = 0 if key in ("zero", "experts") else 1  # experts 0: a dense model
            if n is not None and low <= n and (key != "zero" or n <= 3):
                values[key] = n
            else:
                rule = "0, 1, 2 or 3" if key == "zero" else f"a whole number >= {low}"
                ignored.append(f"w_{key}={raw} ({rule})")
    return values, ignored


def _num_field(key: str, label: str, value: Any) -> html.Div:
    return html.Div(
        [html.Label(label, htmlFor=f"wi-{key}"), dcc.Input(id=f"wi-{key}", type="number", min=1, step=1, value=value)],
        className="field",
    )


def _drop(key: str, label: str, options: list[Any], value: Any) -> html.Div:
    return html.Div(
        [
            html.Label(label, htmlFor=f"wi-{key}"),
            dcc.Dropdown(
                id=f"wi-{key}",
                options=[{"label": str(o), "value": o} for o in options],
                value=value,
                clearable=False,
                searchable=False,
            ),
        ],
        className="field",
    )


def layout(cfg: UiConfig, token: str | None, run: str, q: dict[str, str]) -> html.Div:
    try:
        config = cfg.client(token).run(run).config
        head = None
    except ApiProblem as exc:
        config, head = None, problem_box(exc)
    values, ignored = from_query(q, defaults_from_config(config))
    form = html.Div(
        [
            *[_num_field(k, label, values.get(k)) for k, label, *_ in NUMBER_FIELDS],
            _drop("zero", "ZeRO stage", [0, 1, 2, 3], values["zero"]),
            html.Div(
                [
                    html.Label("Sequence parallel"),
                    dcc.Checklist(
                        id="wi-sp", options=[{"label": " SP", "value": "1"}], value=["1"] if values["sp"] else []
                    ),
                ],
                className="field",
            ),
            _drop("cpstyle", "CP style", CP_STYLES, values["cpstyle"]),
            _drop("impl", "implementation", IMPLEMENTATIONS, values["impl"]),
            _drop("dtype", "param/grad dtype", DTYPES, values["dtype"]),
            _drop("act", "activation dtype", DTYPES, values["act"]),
            html.Div(html.Button("Predict", id="wi-go", className="btn"), className="field"),
        ],
        className="whatif",
    )
    auto = any(k.startswith("w_") for k in q)
    return html.Div(
        [
            head,
            dcc.Store(id="pv-run", data=run),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Scheme", htmlFor="pv-scheme"),
                            dcc.Dropdown(
                                id="pv-scheme",
                                options=[{"label": "all", "value": ""}]
                                + [{"label": s, "value": s} for s in SCHEME_OPTIONS],
                                value=q.get("scheme") if q.get("scheme") in SCHEME_OPTIONS else "",
                                clearable=False,
                                searchable=False,
                            ),
                        ],
                        className="field",
                    ),
                    html.Div(
                        [
                            html.Label("Calls", htmlFor="pv-filter"),
                            dcc.Dropdown(
                                id="pv-filter",
                                options=[{"label": v, "value": k} for k, v in FILTERS.items()],
                                value=q.get("filter", "") if q.get("filter", "") in FILTERS else "",
                                clearable=False,
                                searchable=False,
                            ),
                        ],
                        className="field wide",
                    ),
                ],
                className="controls",
            ),
            loading(html.Div(id="pv-content")),
            html.H2("What if: predict any configuration"),
            html.Div(
                [
                    html.P(
                        "Starts from the run's configuration when it has one. Predict shows the volumes per scheme "
                        "and the calls by message size for this configuration at any scale, and compares it with "
                        "this run's measurements.",
                        className="hint",
                    ),
                    message("Left out of the address, as values the form does not take: " + "; ".join(ignored), "warn")
                    if ignored
                    else None,
                    form,
                ],
                className="card",
            ),
            dcc.Store(id="wi-auto", data=auto),
            loading(html.Div(id="wi-result")),
        ]
    )


def op_table(ops: list[OpComparison], table_id: str, predicted: bool = True) -> Any:
    """The scheme's calls against the prediction; a scheme nothing predicts lists them as measured, unflagged,
    with no predicted count or difference (measured only is a neutral state: nothing was expected, so nothing is
    unexplained)."""
    cols = ["op", "dtype", "S", "predicted calls / iter", "measured calls / iter", "difference", "status"]
    rows = [
        [
            o.op,
            o.dtype or "-",
            td_num(o.msg_bytes, exact_bytes(o.msg_bytes)),
            td_num(o.predicted_calls_per_iter) if predicted else td_num(None),
            td_num(o.measured_calls_per_iter),
            td_num(o.difference, f"{o.difference:+,.4g}") if predicted else td_num(None),
            html.Span(o.status, className=f"badge st-{o.status}")
            if predicted
            else html.Span("measured", className="badge sev-info"),
        ]
        for o in ops
    ]
    flags = [STATUS_CLASS.get(o.status) if predicted else None for o in ops]
    return table(cols, rows, id_=table_id, row_class=flags)


def scheme_head(s: SchemeResult, configured: bool) -> html.H3:
    """The scheme's volumes and where its prediction comes from; only a configuration's prediction can leave
    calls unexplained, so only it raises the red count."""
    text, badge = SOURCE_BADGE[s.prediction_source]
    if s.prediction_source == "none" and configured:
        text = "measured only: the configuration predicts nothing for this scheme"
    flagged = sum(1 for o in s.ops if o.status == "unexplained") if s.prediction_source == "config" else 0
    volumes = (
        f"predicted {format_bytes(s.predicted_bytes_per_iter)}, measured "
        if s.prediction_source == "config"
        else "measured "
    )
    return html.H3(
        [
            f"{s.scheme}: {volumes}{format_bytes(s.measured_bytes_per_iter)} per iteration per rank ",
            html.Span(text, className=f"badge {badge}", id=f"pv-source-{s.scheme}"),
            html.Span(f" {flagged} unexplained", className="badge st-failed") if flagged else None,
        ]
    )


def _keep(o: OpComparison, filt: str) -> bool:
    if filt == "mismatch":
        return o.status in ("more", "fewer")
    return not filt or o.status == filt


def comparison_view(c: Comparison, scheme: str, filt: str) -> Any:
    parts: list[Any] = [volumes_chart(c, "pv-volumes", on_predicted=True)]
    if c.config_source == "none":
        parts.append(
            message(
                "This run has no configuration: measured volumes, with what the measurements support labelled "
                f"inferred. Attach one (commlens config, or PUT /api/runs/{c.run}/config) for predictions, or use "
                "the what-if form below.",
                "info",
            )
        )
    elif c.exact:
        parts.append(
            message(
                "Exact: every (op, dtype, size) count equals the prediction"
                + (
                    f", on the ranks the files hold ({c.ranks_absent} of the job's ranks are missing)."
                    if c.ranks_absent
                    else "."
                ),
                "ok",
            )
        )
    for s in c.schemes:
        if scheme and s.scheme != scheme:
            continue
        predicted = s.prediction_source == "config"
        ops = [o for o in s.ops if _keep(o, filt)] if predicted or not filt else []
        body = (
            op_table(ops, f"pv-ops-{s.scheme}", predicted)
            if ops
            else empty("No calls of this scheme match the filter.")
        )
        parts.append(
            html.Div([scheme_head(s, c.config_source != "none"), html.Div(body, className="scroll")], className="card")
        )
    if c.inferences:
        parts.append(
            html.Div(
                [
                    html.H3("Inferred from the measurements (not a prediction: what the calls imply)"),
                    table(
                        ["quantity", "value", "evidence"],
                        [[i.quantity, td_num(i.value), i.evidence] for i in c.inferences],
                    ),
                ],
                className="card",
            )
        )
    if c.notes:
        parts.append(html.Ul([html.Li(n) for n in c.notes], className="note-list"))
    return html.Div(parts)


def prediction_view(p: Prediction, run: str) -> Any:
    totals = p.totals
    fig = figure(
        f"Predicted bytes per iteration per rank ({p.implementation}, world size {num(p.world_size)})",
        "scheme",
        "bytes per iteration per rank",
    )
    x = [t.scheme for t in totals]
    for name, values, color in (
        ("sum of S (sent)", [t.s_sum for t in totals], None),
        ("ring wire bytes", [t.wire_bytes for t in totals], "#9db4e0"),
        ("paper convention", [t.paper_bytes for t in totals], "#c7c7c7"),
    ):
        fig.add_bar(
            name=name,
            x=x,
            y=values,
            marker_color=color or [scheme_color(s) for s in x],
            customdata=[exact_bytes(v) for v in values],
            hovertemplate="%{x}: %{customdata}<extra>" + name + "</extra>",
        )
    top = max([0.0] + [t.s_sum for t in totals] + [t.wire_bytes for t in totals] + [t.paper_bytes for t in totals])
    fig.update_layout(barmode="group", yaxis=byte_axis(top))
    cols = ["scheme", "sum of S", "ring wire bytes", "paper convention", "received (p2p)"]
    display = [
        [
            t.scheme,
            td_num(t.s_sum, exact_bytes(t.s_sum)),
            td_num(t.wire_bytes, exact_bytes(t.wire_bytes)),
            td_num(t.paper_bytes, exact_bytes(t.paper_bytes)),
            td_num(t.recv_bytes, exact_bytes(t.recv_bytes)),
        ]
        for t in totals
    ]
    raw = [[t.scheme, t.s_sum, t.wire_bytes, t.paper_bytes, t.recv_bytes] for t in totals]
    parts: list[Any] = [
        html.P(f"{num(p.param_count)} parameters; {len(p.stages)} pipeline stage(s).", className="hint"),
        chart_block("wi-totals", fig, cols, display, raw, "whatif-totals.csv", open_table=True),
        *(stage_chart(stage, p) for stage in p.stages[:4]),
    ]
    if len(p.stages) > 4:
        parts.append(
            html.P(
                f"{len(p.stages) - 4} more stages behave like the ones shown or are in the CSV of the API.",
                className="hint",
            )
        )
    if p.notes:
        parts.append(html.Ul([html.Li(n) for n in p.notes], className="note-list"))
    return html.Div(parts)


def stage_chart(stage: Any, p: Prediction) -> Any:
    """Predicted calls per iteration by exact message size, one bar per (op, size) entry of the stage."""
    ops = sorted(stage.ops, key=lambda o: (o.msg_bytes, o.op))
    labels: dict[int, str] = {}  # a readable label per exact size; exact digits where two sizes read alike
    for o in ops:
        label = format_bytes(o.msg_bytes)
        if o.msg_bytes not in labels:
            labels[o.msg_bytes] = label if label not in labels.values() else f"{o.msg_bytes:,} B"
    sizes = list(labels.values())
    fig = figure(
        f"Stage {stage.stage} (ranks {_ranks_text(stage.ranks)}): predicted calls per iteration by message size",
        "message size S",
        "calls per iteration per rank",
    )
    seen: set[str] = set()
    for o in ops:
        name = f"{o.scheme} {o.op}"
        fig.add_bar(
            name=name,
            x=[labels[o.msg_bytes]],
            y=[o.calls_per_iter],
            legendgroup=name,
            showlegend=name not in seen,
            marker_color=OP_COLORS.get(o.op, "#777"),
            marker_pattern_shape={"dp": "", "tp": "/", "pp": "x", "cp": ".", "ep": "+"}.get(o.scheme, ""),
            customdata=[[o.group, o.dtype, exact_bytes(o.msg_bytes), o.what]],
            hovertemplate=(
                "<b>" + name + "</b> %{customdata[1]}<br>S = %{customdata[2]}<br>group "
                "%{customdata[0]}<br>calls/iter: %{y}<br>%{customdata[3]}<extra></extra>"
            ),
        )
        seen.add(name)
    fig.update_layout(barmode="stack", xaxis={"type": "category", "categoryorder": "array", "categoryarray": sizes})
    cols = ["scheme", "group", "group size", "op", "dtype", "S", "calls / iter", "per micro-step", "what"]
    display = [
        [
            o.scheme,
            o.group,
            td_num(o.group_size),
            o.op,
            o.dtype,
            td_num(o.msg_bytes, exact_bytes(o.msg_bytes)),
            td_num(o.calls_per_iter),
            "yes" if o.per_micro_step else "no",
            o.what,
        ]
        for o in ops
    ]
    raw = [
        [o.scheme, o.group, o.group_size, o.op, o.dtype, o.msg_bytes, o.calls_per_iter, o.per_micro_step, o.what]
        for o in ops
    ]
    return chart_block(f"wi-stage-{stage.stage}", fig, cols, display, raw, f"whatif-stage{stage.stage}.csv")


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}, {ranks[1]}, … {ranks[-1]} ({len(ranks)})"


def build_input(v: dict[str, Any]) -> PredictInput:
    model = {field: v.get(key) for key, _, section, field in NUMBER_FIELDS if section == "model" and v.get(key)}
    parallel = {field: v.get(key) for key, _, section, field in NUMBER_FIELDS if section == "parallel" and v.get(key)}
    parallel.update(zero=v.get("zero") or 0, sp=bool(v.get("sp")), cp_style=v.get("cpstyle") or "ring")
    return PredictInput.model_validate(
        {
            "model": model,
            "parallel": parallel,
            "implementation": v.get("impl") or "paper",
            "dtypes": {"grad": v.get("dtype"), "param": v.get("dtype"), "act": v.get("act") or v.get("dtype")},
        }
    )


def _validation_text(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}".lstrip(": ") for e in exc.errors()[:4])


def register(app: Dash, cfg: UiConfig) -> None:
    form_states = [State(f"wi-{k}", "value") for k in WHATIF_KEYS]

    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("pv-scheme", "value"),
        Input("pv-filter", "value"),
        Input("wi-go", "n_clicks"),
        *form_states,
        State("wi-auto", "data"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(scheme: str, filt: str, go: int | None, *rest: Any) -> Any:
        *values, auto, rendered = rest
        state: dict[str, Any] = {"scheme": scheme, "filter": filt}
        if go or auto:  # the what-if joins the URL once predicted
            for key, value in zip(WHATIF_KEYS, values, strict=True):
                state[f"w_{key}"] = ("1" if value else "0") if key == "sp" else value
        return push_state(rendered, query(state))

    @app.callback(
        Output("pv-content", "children"),
        Input("pv-scheme", "value"),
        Input("pv-filter", "value"),
        State("pv-run", "data"),
        State("token", "data"),
    )
    @guarded()
    def show(scheme: str, filt: str, run: str, token: str | None) -> Any:
        return comparison_view(cfg.client(token).predicted_vs_measured(run), scheme or "", filt or "")

    @app.callback(
        Output("wi-result", "children"),
        Input("wi-go", "n_clicks"),
        Input("wi-auto", "data"),
        *form_states,
        State("pv-run", "data"),
        State("token", "data"),
    )
    @guarded()
    def what_if(n: int | None, auto: bool, *rest: Any) -> Any:
        *values, run, token = rest
        if not n and not auto:
            return empty("Set the configuration above and press Predict.")
        v = dict(zip(WHATIF_KEYS, values, strict=True))
        v["sp"] = bool(v.get("sp"))
        try:
            inp = build_input(v)
        except ValidationError as exc:
            return message(f"The configuration is not valid: {_validation_text(exc)}", "error")
        client = cfg.client(token)
        prediction = client.predict(inp)
        try:
            against: Any = html.Div(
                [
                    html.H3(f"This configuration against run {run}'s measurements"),
                    volumes_chart(client.predicted_vs_measured(run, inp), "wi-against", on_predicted=True),
                ]
            )
        except ApiProblem as exc:
            against = problem_box(exc)
        return html.Div([prediction_view(prediction, run), against])
