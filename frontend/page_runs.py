"""`/`: the runs (search, tags, paging) and the upload of trace files into a run, following its ingest job."""

from __future__ import annotations

import base64
import re
from typing import Any

from dash import Dash, Input, Output, State, dcc, html, no_update
from dash.exceptions import PreventUpdate

from commlens.contract.jobs import JobOut
from commlens.contract.runs import RUN_NAME_PATTERN, RunCreate, RunSummary
from commlens.vocab import format_bytes

from .client import ApiProblem
from .components import empty, guarded, loading, message, problem_box, push_state, table, td_id, td_num
from .config import UiConfig
from .fmt import exact_bytes
from .urls import count_or_none, query, run_path

PAGE_SIZE = 50
MAX_UPLOAD_BYTES = 256 << 20  # per file through the browser; larger files go straight to the API
_RUN_NAME = re.compile(RUN_NAME_PATTERN)


def layout(q: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.H1("Runs"),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Search", htmlFor="runs-q"),
                            dcc.Input(
                                id="runs-q",
                                type="search",
                                value=q.get("q", ""),
                                debounce=True,
                                placeholder="name, description or tag",
                            ),
                        ],
                        className="field wide",
                    ),
                    html.Div(
                        [
                            html.Label("Tag", htmlFor="runs-tag"),
                            dcc.Input(
                                id="runs-tag",
                                type="text",
                                value=q.get("tag", ""),
                                debounce=True,
                                placeholder="exact tag",
                            ),
                        ],
                        className="field",
                    ),
                    dcc.Store(id="runs-offset", data=count_or_none(q.get("offset")) or 0),  # ?offset=-5: 0
                ],
                className="controls",
            ),
            loading(html.Div(id="runs-table")),
            html.H2("Upload traces"),
            html.Div(
                [
                    html.P(
                        [
                            "NCCL debug logs, PyTorch profiler traces (.json, .json.gz), a harness run.json, or .tar/.tar.gz/.zip "
                            "archives of them. A new run name creates the run. Files above ",
                            format_bytes(MAX_UPLOAD_BYTES),
                            " go straight to the API: ",
                            html.Code("curl -F files=@trace.json.gz …/api/runs/NAME/files"),
                            ".",
                        ],
                        className="hint",
                    ),
                    html.Div(
                        [
                            html.Div(
                                [
                                    html.Label("Run", htmlFor="up-run"),
                                    dcc.Input(
                                        id="up-run",
                                        type="text",
                                        placeholder="existing or new run name",
                                        value=q.get("upload_run", ""),
                                    ),
                                ],
                                className="field wide",
                            ),
                            html.Div(
                                [
                                    html.Label("Rank (optional)", htmlFor="up-rank"),
                                    dcc.Input(id="up-rank", type="number", min=0, step=1),
                                ],
                                className="field",
                            ),
                        ],
                        className="controls",
                    ),
                    dcc.Upload(
                        id="up-files",
                        multiple=True,
                        max_size=MAX_UPLOAD_BYTES,
                        className="upload",
                        children=html.Div(
                            ["Drop files here or ", html.A("choose files"), " (they are ingested at once)"]
                        ),
                    ),
                    dcc.Store(id="up-job"),
                    dcc.Store(id="up-done"),
                    dcc.Interval(id="up-poll", interval=600, disabled=True),
                    html.Div(id="up-msg"),
                    html.Div(id="up-status"),
                ],
                className="card",
            ),
        ]
    )


def runs_table(page: Any, q: str | None, tag: str | None, offset: int) -> Any:
    if not page.items:
        if page.total:  # a link past the last page
            first = dcc.Link("the first page", href="/" + query({"q": q, "tag": tag}))
            return empty([f"No runs this far down the list: it has {page.total}; go to ", first, "."])
        if q or tag:
            return empty("No run matches this search.")
        return empty("No runs yet: upload files below or ingest them with `commlens ingest PATH --run NAME`.")
    rows = [_row(r) for r in page.items]
    cols = ["run", "strategy", "world size", "created", "sources", "calls", "tags", "description"]
    pager: list[Any] = [html.Span(f"runs {page.offset + 1}-{page.offset + len(page.items)} of {page.total}")]
    if page.offset > 0:
        pager.append(
            dcc.Link("← previous", href="/" + query({"q": q, "tag": tag, "offset": max(0, offset - PAGE_SIZE) or None}))
        )
    if page.next_offset is not None:
        pager.append(dcc.Link("next →", href="/" + query({"q": q, "tag": tag, "offset": page.next_offset})))
    return html.Div([html.Div(pager, className="pager"), table(cols, rows, id_="runs")])


def _row(r: RunSummary) -> list[Any]:
    kinds = ", ".join(f"{n} {k}" for k, n in r.sources.by_kind.items())
    status: list[Any] = [f"{r.sources.ok}/{r.sources.total} ok"]
    if r.sources.failed:
        status.append(html.Span(f" {r.sources.failed} failed", className="badge st-failed"))
    if r.jobs_active:
        status.append(html.Span(" ingesting", className="badge st-open"))
    return [
        dcc.Link(r.name, href=run_path(r.name), className="run-link"),
        r.strategy or "-",
        td_num(r.world_size),
        r.created_at.strftime("%Y-%m-%d %H:%M"),
        html.Span(status + ([html.Br(), html.Span(kinds, className="hint")] if kinds else [])),
        td_num(r.events),
        html.Span([dcc.Link(t, href="/" + query({"tag": t}), className="tag") for t in r.tags]),
        r.description or "",
    ]


def job_view(job: JobOut) -> html.Div:
    done = job.state in ("done", "failed")
    head = {"queued": "Queued", "running": "Ingesting", "done": "Done", "failed": "Failed"}[job.state]
    progress = html.Progress(value=str(job.bytes_done), max=str(max(job.bytes_total, 1)), id="up-progress")
    summary = (
        f"{head}: {job.files_done}/{job.files_total} files, {format_bytes(job.bytes_done)} of "
        f"{format_bytes(job.bytes_total)}" + (f"; now {job.current}" if job.current and not done else "")
    )
    counts = [f"{n} {what}" for n, what in ((job.files_failed, "failed"), (job.files_duplicate, "already stored")) if n]
    if done and job.results and not job.files_stored:
        summary += "; nothing new was stored (" + ", ".join(counts) + ")"
    elif job.files_failed:
        summary += f"; {job.files_failed} of {len(job.results)} failed"

    rows, classes = [], []
    for f in job.results:
        note = f.error or "; ".join(f.warnings)
        if f.skipped:
            note = (note + "; " if note else "") + "skipped " + ", ".join(f"{k}: {v}" for k, v in f.skipped.items())
        rows.append(
            [
                f.upload,
                html.Span(f.path, className="mono"),
                html.Span(f.status, className=f"badge st-{f.status}"),
                f.kind or "-",
                td_id(f.rank),
                td_num(f.events),
                td_num(f.size, exact_bytes(f.size)),
                note,
            ]
        )
        classes.append("bad" if f.status == "failed" else None)
    parts: list[Any] = [html.Div(summary, id="up-summary", className="hint"), progress]
    if job.error:
        parts.append(message(job.error, "error"))
    if rows:
        parts.append(
            table(
                ["upload", "file", "status", "kind", "rank", "calls", "size", "error / notes"],
                rows,
                id_="up-results",
                row_class=classes,
            )
        )
    if job.jobs:
        parts.append(html.P(f"The files are of {len(job.jobs)} jobs: each went to a run of its own.", className="hint"))
        parts.append(
            table(
                ["run", "files", "calls", "job", "joined by", "apart from the first because"],
                [
                    [
                        dcc.Link(j.run, href=run_path(j.run), className="run-link"),
                        ", ".join(j.files),
                        td_num(j.calls),
                        j.job,
                        "; ".join(j.joined_by) or "-",
                        "; ".join(j.apart) or "-",
                    ]
                    for j in job.jobs
                ],
                id_="up-jobs",
            )
        )
    if done and job.run:
        failed = job.state == "failed" or any(f.status == "failed" for f in job.results)
        where = f"in the {len(job.jobs)} runs above" if job.jobs else "in the run"
        text = (
            f"Files marked failed were not ingested (see why above); the others are {where}. "
            if failed
            else f"Every file is {where}. "
        )
        parts.append(
            message([text, dcc.Link(f"Open run {job.run}", href=run_path(job.run))], "warn" if failed else "ok")
        )
    data: dict[str, Any] = {"data-state": job.state}
    return html.Div(parts, id="up-job-view", **data)


def register(app: Dash, cfg: UiConfig) -> None:
    @app.callback(
        Output("url", "search", allow_duplicate=True),
        Output("rendered", "data", allow_duplicate=True),
        Input("runs-q", "value"),
        Input("runs-tag", "value"),
        State("rendered", "data"),
        prevent_initial_call=True,
    )
    def sync(q: str | None, tag: str | None, rendered: dict | None) -> Any:
        search = query({"q": q, "tag": tag})
        return push_state(rendered, search)

    @app.callback(
        Output("runs-table", "children"),
        Input("runs-q", "value"),
        Input("runs-tag", "value"),
        Input("runs-offset", "data"),
        Input("up-done", "data"),
        State("token", "data"),
    )
    @guarded()
    def show(q: str | None, tag: str | None, offset: int | None, _done: Any, token: str | None) -> Any:
        page = cfg.client(token).runs(q=q or None, tag=tag or None, limit=PAGE_SIZE, offset=offset or 0)
        return runs_table(page, q, tag, offset or 0)

    @app.callback(
        Output("up-job", "data"),
        Output("up-msg", "children"),
        Output("up-poll", "disabled", allow_duplicate=True),
        Input("up-files", "contents"),
        State("up-files", "filename"),
        State("up-run", "value"),
        State("up-rank", "value"),
        State("token", "data"),
        prevent_initial_call=True,
    )
    def upload(
        contents: list[str] | None, names: list[str] | None, run: str | None, rank: int | None, token: str | None
    ) -> Any:
        if not contents:
            raise PreventUpdate
        run = (run or "").strip()
        if not _RUN_NAME.fullmatch(run):
            return (
                no_update,
                message(
                    f"The run needs a name of letters, digits and . _ + @ = - (at most 128, first a letter or digit); "
                    f"{run!r} is not one."
                    if run
                    else "Name the run first: letters, digits and . _ + @ = -, at most 128.",
                    "error",
                ),
                True,
            )
        files = []
        for name, data in zip(names or [], contents, strict=True):
            _, _, b64 = data.partition(",")
            files.append((name, base64.b64decode(b64)))
        client = cfg.client(token)
        try:
            try:
                client.run(run)
                created = ""
            except ApiProblem as exc:
                if exc.status != 404:
                    raise
                client.create_run(RunCreate(name=run))
                created = f"Created run {run}. "
            job = client.upload(run, files, rank=rank)
        except ApiProblem as exc:
            return no_update, problem_box(exc), True
        return job.job_id, message(f"{created}Uploaded {len(files)} file(s) as job {job.job_id}.", "info"), False

    @app.callback(
        Output("up-status", "children"),
        Output("up-poll", "disabled"),
        Output("up-done", "data"),
        Input("up-poll", "n_intervals"),
        Input("up-job", "data"),
        State("token", "data"),
        prevent_initial_call=True,
    )
    def poll(_n: int | None, job_id: str | None, token: str | None) -> Any:
        if not job_id:
            raise PreventUpdate
        try:
            job = cfg.client(token).job(job_id)
        except ApiProblem as exc:
            return problem_box(exc), True, no_update
        finished = job.state in ("done", "failed")
        return job_view(job), finished, (job.job_id if finished else no_update)
