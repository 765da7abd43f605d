"""The `commlens` console script."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from commlens import cli_analysis, describe
from commlens.harness import cli as harness_cli  # no torch at import time
from commlens.service.errors import ServiceError

if TYPE_CHECKING:
    from collections.abc import Callable

    import duckdb

    from commlens.contract.runs import RunCreate
    from commlens.ingest.inputs import InputFile
    from commlens.service.ingest import IngestReport, IngestSummary
    from commlens.service.parse_pool import ParsePool
from commlens.vocab import format_bytes

app = typer.Typer(
    help="commlens: where does the communication of distributed training go, and is it what it should be?",
    no_args_is_help=True,
    add_completion=False,
    # Plain click help: one line per option, no boxes or "<bool>" types, readable in a pipe or a file, as wide
    # as the terminal (200 columns when there is none, so commands in the help stay on one line).
    rich_markup_mode=None,
    context_settings={"terminal_width": shutil.get_terminal_size((200, 24)).columns, "max_content_width": 200},
)
# Piped output (CI logs, files) gets wide tables instead of rich's 80-column default.
console = Console(width=None if sys.stdout.isatty() else 1000, emoji=False)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 1000, emoji=False)
app.command("harness", epilog=harness_cli.EPILOG)(harness_cli.harness)
app.command("predict")(cli_analysis.predict)
app.command("describe-model")(describe.describe_model_command)


def _print_version(value: bool) -> None:
    if value:
        from commlens import __version__

        print(f"commlens {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """commlens: where does the communication of distributed training go, and is it what it should be?"""
    if os.environ.get("COMMLENS_TIME_MEMORY"):  # refused here, not after a whole ingest as every analysis' failure
        from commlens.backend.timing.budget import parse_size

        try:
            parse_size(os.environ["COMMLENS_TIME_MEMORY"])
        except ValueError as exc:
            err_console.print(f"[red]error:[/red] {escape(str(exc))}")
            raise typer.Exit(2) from None


DB_OPTION = typer.Option(Path("commlens.duckdb"), "--db", help="DuckDB store file (created if missing).")
STORE_OPTION = typer.Option(Path("commlens.duckdb"), "--db", help="DuckDB store file (never created).")
READ_DB_OPTION = typer.Option(
    Path("commlens.duckdb"),
    "--db",
    help="DuckDB store file (never created; read through `commlens serve` while it holds the file).",
)
READ_API_OPTION = typer.Option(
    None, "--api", help="Read through the commlens server at this URL (default: the one serving --db, if any)."
)
TOKEN_OPTION = typer.Option(None, "--token", envvar="COMMLENS_TOKEN", help="API token (or COMMLENS_TOKEN).")
INGEST_PATHS = typer.Argument(..., metavar="PATH", help="Files, directories, .gz, .tar, .tar.gz or .zip archives.")
UPLOAD_PATHS = typer.Argument(
    ..., metavar="PATH", help="Files or directories (their files but hidden ones, not sub-folders)."
)


@app.command()
def ingest(
    paths: list[Path] = INGEST_PATHS,
    db: Path = DB_OPTION,
    run: str = typer.Option(..., "--run", help="Run name to ingest into (created if missing)."),
    rank: int | None = typer.Option(
        None,
        "--rank",
        min=0,
        help="Global rank of a single-rank file whose trace does not say; an NCCL log of several processes (it "
        "states each one's) or one stating a world size the rank is not below fails.",
    ),
    description: str | None = typer.Option(None, help="Description of a new run."),
    one_run: bool = typer.Option(
        False,
        "--one-run",
        help="Store every file in --run even where they look like several jobs (by default each job gets a run).",
    ),
    cluster: str | None = typer.Option(
        None,
        "--cluster",
        metavar="tcp://SCHEDULER:8786",
        help="Parse on this Dask cluster's workers (extra `cluster`); PATHs may be fsspec URLs (s3://...).",
    ),
    parquet_out: str | None = typer.Option(
        None,
        "--parquet-out",
        metavar="DIR",
        help="With --cluster: where workers write the parsed Parquet dataset (kept); default a temporary folder.",
    ),
    jobs: int | None = typer.Option(
        None, "--jobs", "-j", min=1, help="Parse files in this many worker processes (default: the cores)."
    ),
    max_trace_events: int | None = typer.Option(
        None,
        "--max-trace-events",
        min=1,
        help="Refuse a profiler trace whose parse would hold more communication records (default 24,000,000).",
    ),
) -> None:
    """Ingest NCCL debug logs and PyTorch profiler (Kineto) traces into the store, one run per training job."""
    from commlens.service.parse_pool import default_jobs, start_pool

    jobs = jobs or default_jobs()
    # a mistyped path is said before the store is opened (or made) and a run created for nothing in it
    missing = [p for p in paths if not p.exists()] if cluster is None else []  # a cluster's may be URLs
    if missing:
        for p in missing:
            err_console.print(f"[red]error:[/red] {escape(f'{p}: No such file or directory')}")
        raise typer.Exit(2)
    if cluster is None:  # and a folder with nothing to read (a harness run not started yet) makes no empty run
        from commlens.ingest.walk import nothing_to_read

        empty = [(p, why) for p in paths if p.is_dir() and (why := nothing_to_read(p))]
        for p, why in empty:
            err_console.print(f"[red]error:[/red] {escape(f'{p}: {why}')}")
        if empty:
            raise typer.Exit(2)
    if cluster is not None:  # a scheduler that cannot answer is said before the store is opened (or made)
        _reach_cluster(cluster, parquet_out)
    # the workers start before this process's own imports, which their start-up and imports then overlap
    pool = start_pool(jobs, paths) if cluster is None else None
    try:
        _ingest(paths, db, run, rank, description, one_run, cluster, parquet_out, jobs, max_trace_events, pool)
    finally:
        if pool is not None:
            pool.close()


def _ingest(
    paths: list[Path],
    db: Path,
    run: str,
    rank: int | None,
    description: str | None,
    one_run: bool,
    cluster: str | None,
    parquet_out: str | None,
    jobs: int,
    max_trace_events: int | None,
    pool: ParsePool | None,
) -> None:
    from dataclasses import replace

    from commlens.ingest.inputs import DEFAULT_LIMITS, iter_inputs
    from commlens.ingest.records import RankHint
    from commlens.service.ingest import FileOutcome, ingest_run
    from commlens.service.no_pandas import arrow_without_pandas
    from commlens.store import StoreError

    limits = DEFAULT_LIMITS if max_trace_events is None else replace(DEFAULT_LIMITS, max_trace_events=max_trace_events)

    con = _open_store(db, f"commlens upload {' '.join(map(str, paths))} --run {run} --api {{url}}")
    progress = Progress(
        TextColumn("[bold]ingest[/bold] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=not err_console.is_terminal,
        transient=True,
    )
    try:
        with progress, arrow_without_pandas():
            task = progress.add_task(run, total=None)

            def on_file(_: InputFile, outcome: FileOutcome) -> None:
                progress.advance(task)
                if outcome.status == "failed":
                    err_console.print(f"[red]failed[/red] {escape(str(outcome.error))}")

            if cluster is not None:
                report = _ingest_on_cluster(con, run, paths, cluster, parquet_out, rank, on_file, description, one_run)
            else:
                report = ingest_run(
                    con,
                    run,
                    iter_inputs(paths, limits),
                    RankHint(rank=rank),
                    limits,
                    on_file=on_file,
                    description=description,
                    split_jobs=not one_run,
                    jobs=jobs,
                    pool=pool,
                )
    except StoreError as exc:  # e.g. --run names a former name of a renamed run
        con.close()
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    if report.split:
        _print_jobs(con, report)
    else:
        _print_summary(con, report)
    con.close()
    if report.attribution_error:
        err_console.print(f"[red]error:[/red] {escape(report.attribution_error)}")
    if report.failed or report.attribution_error:
        raise typer.Exit(1)


def _reach_cluster(scheduler: str, parquet_out: str | None) -> None:
    from commlens.service.cluster import check_dataset_folder, reach_scheduler

    try:
        reach_scheduler(scheduler)
        if parquet_out is not None:
            check_dataset_folder(parquet_out)
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] {escape(exc.detail)}")
        raise typer.Exit(2) from None


def _ingest_on_cluster(
    con: duckdb.DuckDBPyConnection,
    run: str,
    paths: list[Path],
    scheduler: str,
    parquet_out: str | None,
    rank: int | None,
    on_file: Callable[..., None],
    description: str | None,
    one_run: bool,
) -> IngestReport:
    """`ingest --cluster`: the parse step on a Dask cluster; a missing extra or an unreachable scheduler is said."""
    from commlens.ingest.records import RankHint
    from commlens.service.cluster import ingest_cluster, path_arg

    try:
        return ingest_cluster(
            con,
            run,
            [path_arg(p) for p in paths],
            scheduler,
            parquet_out,
            RankHint(rank=rank),
            on_file=on_file,
            description=description,
            split=not one_run,
        )
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] {escape(exc.detail)}")
        raise typer.Exit(2) from None


def _print_jobs(con: duckdb.DuckDBPyConnection, report: IngestReport) -> None:
    """What went where when the files were of several jobs, with the evidence, then the files."""
    from commlens.service.jobs_split import describe
    from commlens.service.runs import comms_totals

    if len(report.jobs) == 1:
        console.print(
            f"The files are of another job than the files run {escape(report.run)} holds: they are run "
            f"{escape(report.jobs[0].run)} (--one-run stores them in {escape(report.run)})."
        )
    else:
        console.print(
            f"The files are of {len(report.jobs)} jobs: each is a run of its own "
            f"(--one-run stores them all in {escape(report.run)})."
        )
    table = Table()
    for col in ("run", "files", "calls", "job", "joined by", "apart from the first because"):
        table.add_column(col, overflow="fold")
    for job in report.jobs:
        calls, _, _ = comms_totals(con, job.run)
        table.add_row(
            escape(job.run),
            escape(", ".join(Path(f.path).name for f in job.files)),
            str(sum(calls.values())),
            escape(describe(job)),
            escape("; ".join(job.joined_by) or "-"),
            escape("; ".join(job.apart) or "-"),
        )
    console.print(table)
    _print_summary(con, report, by_run=True)


def _print_summary(con: duckdb.DuckDBPyConnection, summary: IngestSummary, by_run: bool = False) -> None:
    """The files table, then (one run) its calls per op, then the counts."""
    from collections import Counter

    from commlens.service.runs import comms_totals

    console.print(f"{'files' if by_run else f'run {escape(summary.run)}: files'}")
    files = Table(show_lines=False)
    for col in ("file", *(["run"] if by_run else []), "kind", "status", "rank", "calls", "skipped", "error / warnings"):
        files.add_column(col, overflow="fold")
    for f in summary.files:
        skipped = ", ".join(f"{k}: {v}" for k, v in sorted(f.skipped.items()))
        note = f.error or "; ".join(f.warnings)
        if note.startswith(f.path + ":"):
            note = note[len(f.path) + 1 :].lstrip()  # the file is in the first column already
        style = {"failed": "red", "duplicate": "yellow", "skipped": "dim"}.get(f.status)
        files.add_row(
            escape(f.path),
            *([escape(f.run or summary.run)] if by_run else []),
            f.kind or "-",
            "passed over" if f.status == "skipped" else f.status,  # "skipped" is the lines/events column's word
            "-" if f.rank is None else str(f.rank),
            str(f.events),
            escape(skipped),
            escape(note or ""),
            style=style,
        )
    console.print(files)
    if not by_run:
        calls, sizes, ranks = comms_totals(con, summary.run)
        console.print(f"run {escape(summary.run)}: {ranks} ranks with known rank, calls per op")
        ops = Table()
        for col in ("op", "calls", "bytes (sum of S)"):
            ops.add_column(col, justify="right" if col != "op" else "left")
        for op, n in sorted(calls.items()):
            total, unsized = sizes[op]
            said = "unknown" if unsized == n else format_bytes(total)
            ops.add_row(op, str(n), said + (f" ({unsized} of unknown size)" if 0 < unsized < n else ""))
        console.print(ops)
    status = Counter(f.status for f in summary.files)
    skipped_total = sum(sum(f.skipped.values()) for f in summary.files)
    console.print(
        f"{len(summary.files)} files: {status['ok']} ingested, {status['duplicate']} already present, "
        f"{status['failed']} failed, {status['skipped']} passed over; {skipped_total} lines/events skipped (reasons above)."
    )
    for hint in _hints(con, summary):
        console.print(f"hint: {escape(hint)}")


def _hints(con: duckdb.DuckDBPyConnection, summary: IngestSummary) -> list[str]:
    """What to do about each gap the files leave: logs without COLL lines, runs whose calls have no rank."""
    from commlens.service.runs import comms_totals, unranked_processes

    hints = [
        f"{f.path} has no COLL lines, so no calls: NCCL logs each collective only with NCCL_DEBUG=INFO "
        "NCCL_DEBUG_SUBSYS=COLL (add INIT,GRAPH for the topology)"
        for f in summary.files
        if f.status == "ok" and f.kind == "nccl_log" and f.events == 0
    ]
    for run in dict.fromkeys(f.run or summary.run for f in summary.files if f.status == "ok"):
        calls, _, ranks = comms_totals(con, run)
        if not calls or ranks:
            continue
        # --rank is refused for a log of several processes: only its INIT lines can say which rank each is
        unranked = unranked_processes(con, run)
        hints += [
            f"{path}: its {n} processes name no global rank: NCCL logs each process's rank in its INIT lines "
            "(NCCL_DEBUG_SUBSYS=INIT,COLL: `comm 0x... rank R nranks N ...`)"
            for path, n in unranked.items()
            if n > 1
        ]
        if any(n == 1 for n in unranked.values()):
            hints.append(
                f"no call of run {run} has a known global rank: for a single-rank file, ingest it again with "
                f"--rank N (into a new run, or after `commlens delete {run}`)"
            )
    return hints


@app.command()
def serve(
    db: Path = DB_OPTION,
    host: str = typer.Option("127.0.0.1", help="Address to bind. Off loopback the store needs users (or --insecure)."),
    port: int = typer.Option(8050, min=0, max=65535, help="TCP port (0: any free one)."),
    insecure: bool = typer.Option(
        False, "--insecure", help="Off loopback: start without users and accept tokenless writes."
    ),
    max_file_mb: float = typer.Option(4096, help="Largest uploaded file (MiB, as sent)."),
    max_request_mb: float = typer.Option(8192, help="Largest upload request (MiB)."),
    ui: bool = typer.Option(True, "--ui/--no-ui", help="Serve the dashboard at / (the API stays under /api)."),
    admin_token: str | None = typer.Option(
        None,
        "--admin-token",
        envvar="COMMLENS_ADMIN_TOKEN",
        show_default=False,
        help="Before serving, create (or update) the admin --admin-name with this token: a deployment's own "
        "secret, best given as COMMLENS_ADMIN_TOKEN (docker-compose does).",
    ),
    admin_name: str = typer.Option("admin", "--admin-name", help="The admin that --admin-token belongs to."),
    access_log: bool = typer.Option(False, "--access-log/--no-access-log", help="Log every request."),
) -> None:
    """Serve the API under /api (OpenAPI docs at /docs) and the dashboard at /; own the store while running."""
    from commlens import cli_server
    from commlens.backend.api import Settings, StartupRefusedError
    from commlens.backend.api.server import serve as run_server
    from commlens.store import StoreError

    if admin_token is not None:
        _ensure_admin(db, admin_name, admin_token)
    if port == 0:  # any free port, chosen here so that the marker names it
        port = cli_server.free_port(host)
    settings = Settings(
        db=db,
        host=host,
        port=port,
        insecure=insecure,
        max_file_bytes=int(max_file_mb * 2**20),
        max_request_bytes=int(max_request_mb * 2**20),
    )
    held = cli_server.server_for(db)
    if held is not None:
        err_console.print(f"[red]error:[/red] {escape(f'{db} is already served at {held}')}: use it, or stop it first")
        raise typer.Exit(2)
    if cli_server.port_in_use(host, port):
        err_console.print(
            f"[red]error:[/red] port {port} on {escape(host)} is in use (another server?): stop it, or pass "
            f"--port {port + 1} (make demo PORT={port + 1})"
        )
        raise typer.Exit(2)
    dashboard = None
    if ui:
        from commlens.frontend import create_ui

        dashboard = create_ui()
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    # uvicorn re-raises SIGTERM after its graceful shutdown: withdraw the marker, then die of the signal
    signal.signal(signal.SIGTERM, lambda signum, _: _die_of(signum, db))
    cli_server.announce(db, url)
    err_console.print(
        f"serving {escape(str(db))} at {url} ({'dashboard /, ' if ui else 'no dashboard (--no-ui), '}API /api, "
        "docs /docs); "
        f"`commlens report --db {escape(str(db))} --run RUN` reads through it; Ctrl-C stops"
    )
    try:
        run_server(settings, ui=dashboard, access_log=access_log)
    except (StartupRefusedError, StoreError) as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    finally:
        cli_server.withdraw(db)


def _die_of(signum: int, db: Path) -> None:
    from commlens.cli_server import withdraw

    withdraw(db)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ensure_admin(db: Path, name: str, token: str) -> None:
    from commlens.service.users import ensure_admin

    con = _open_store(db)
    try:
        created = ensure_admin(con, name, token)
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] --admin-token / COMMLENS_ADMIN_TOKEN: {escape(str(exc))}")
        raise typer.Exit(2) from None
    finally:
        con.close()
    err_console.print(f"admin {escape(repr(name))} {'created' if created else 'updated'} with the given token")


@app.command("ui")
def ui_command(
    api: str = typer.Option(..., "--api", help="The commlens server's root URL, e.g. http://api:8050."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(8051, min=0, max=65535, help="TCP port (0: any free one)."),
    insecure: bool = typer.Option(False, "--insecure", help="Serve off loopback in front of a loopback-bound API."),
) -> None:
    """Serve the dashboard alone, against a commlens API elsewhere (docker-compose's ui service)."""
    from commlens.frontend.server import UiRefusedError, serve_ui

    try:
        serve_ui(api, host=host, port=port, insecure=insecure)
    except UiRefusedError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


def _upload_contents(paths: list[Path], run: str) -> tuple[RunCreate, list[tuple[str, bytes]]]:
    """The run to create if missing and the files' names and bytes; every mistake is said (exit 2) before the
    server is asked to do anything, so no run is made for an upload refused here."""
    from pydantic import ValidationError

    from commlens.contract.runs import RunCreate
    from commlens.ingest.walk import passed_over, walk

    try:
        new_run = RunCreate(name=run)
        files: list[tuple[str, Path]] = []  # a directory's files as `commlens ingest` walks it, named below it
        for p in paths:
            if not p.is_dir():
                files.append((p.name, p))
                continue
            for f in walk(p):
                if skip := passed_over(f):
                    err_console.print(f"passed over {escape(str(f))}: {escape(skip)}")
                else:
                    files.append((f.relative_to(p).as_posix(), f))
        contents = [(name, f.read_bytes()) for name, f in files]
    except ValidationError:
        why = "a run made through the API is named with letters, digits and . _ + @ = - (at most 128), first a letter or digit"
        err_console.print(f"[red]error:[/red] {escape(f'--run {run!r}: {why}')}")
        raise typer.Exit(2) from None
    except OSError as exc:
        err_console.print(f"[red]error:[/red] {escape(f'{exc.filename}: {exc.strerror or exc}')}")
        raise typer.Exit(2) from None
    if not contents:
        err_console.print("[red]error:[/red] no files to upload")
        raise typer.Exit(2)
    return new_run, contents


@app.command("upload")
def upload_command(
    paths: list[Path] = UPLOAD_PATHS,
    api: str = typer.Option(..., "--api", help="The commlens server's root URL, e.g. http://127.0.0.1:8050."),
    run: str = typer.Option(..., "--run", help="Run to upload into (created if missing)."),
    rank: int | None = typer.Option(None, "--rank", min=0, help="Global rank of single-rank files that do not say."),
    token: str | None = typer.Option(None, "--token", envvar="COMMLENS_TOKEN", help="API token (or COMMLENS_TOKEN)."),
    one_run: bool = typer.Option(
        False, "--one-run", help="Store every file in --run even where they look like several jobs."
    ),
) -> None:
    """Upload files to a running server (the store belongs to `commlens serve` while it runs) and wait for the job."""
    import time

    from commlens.frontend.client import ApiClient, ApiProblem

    new_run, contents = _upload_contents(paths, run)
    client = ApiClient(api, token)
    created = False
    try:
        try:
            client.run(run)
        except ApiProblem as exc:
            if exc.status != 404:
                raise
            client.create_run(new_run)
            created = True
        try:
            job = client.upload(run, contents, rank=rank, one_run=one_run)
        except ApiProblem:
            if created:  # refused before anything was queued: the run made for it goes too
                with contextlib.suppress(ApiProblem):
                    client.delete_run(run)
            raise
        while job.state not in ("done", "failed"):
            time.sleep(0.5)
            job = client.job(job.job_id)
    except ApiProblem as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    table = Table(title=f"run {escape(run)}: job {job.job_id} {job.state}")
    for col in ("file", "status", "kind", "rank", "calls", "error"):
        table.add_column(col, overflow="fold")
    if job.jobs:
        if len(job.jobs) == 1:
            console.print(
                f"The files are of another job than the files run {escape(run)} holds (--one-run stores them there)."
            )
        else:
            console.print(
                f"The files are of {len(job.jobs)} jobs: each is a run of its own (--one-run stores them all)."
            )
        for j in job.jobs:
            why = "; ".join(j.apart) or "the upload's run"
            console.print(f"  {escape(j.run)}: {len(j.files)} file(s), {escape(j.job)} ({escape(why)})")
    for r in job.results:
        table.add_row(
            escape(r.path),
            r.status,
            r.kind or "-",
            "-" if r.rank is None else str(r.rank),
            str(r.events),
            escape(r.error or ""),
            style="red" if r.status == "failed" else None,
        )
    console.print(table)
    if job.state == "failed" or any(r.status == "failed" for r in job.results):
        raise typer.Exit(1)


users_app = typer.Typer(help="Users and their API tokens (tokens are stored hashed; shown once).", no_args_is_help=True)
app.add_typer(users_app, name="users")


CONFIG_FILES = typer.Argument(..., help="Model description, run.json, config.json, DeepSpeed JSON, Megatron args log.")


@app.command("config")
def config_command(
    files: list[Path] = CONFIG_FILES,
    db: Path = STORE_OPTION,
    run: str = typer.Option(..., "--run", help="Run to attach the configuration to."),
    dp: int | None = typer.Option(None, "--dp", help="Data-parallel size (what the files do not say)."),
    tp: int | None = typer.Option(None, "--tp", help="Tensor-parallel size."),
    pp: int | None = typer.Option(None, "--pp", help="Pipeline-parallel size."),
    cp: int | None = typer.Option(None, "--cp", help="Context-parallel size."),
    ep: int | None = typer.Option(None, "--ep", help="Expert-parallel size."),
    zero: int | None = typer.Option(None, "--zero", help="ZeRO stage (0-3)."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Training sequence length."),
    micro_batches: int | None = typer.Option(None, "--micro-batches", help="Micro-batches per iteration."),
    implementation: str | None = typer.Option(None, "--implementation", help="megatron, deepspeed, fsdp or paper."),
) -> None:
    """Attach configuration to a run, each file detected by its content (docs/model-descriptions.md); through
    the server while `commlens serve` holds the store."""
    from pydantic import ValidationError

    from commlens.cli_server import server_for
    from commlens.contract.model_description import ConfigFile, ConfigUpload, ParallelOptions
    from commlens.frontend.client import ApiClient, ApiProblem
    from commlens.service.config import attach_config

    try:
        options = ParallelOptions.model_validate(
            {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "zero": zero, "seq_len": seq_len}
            | {"micro_batches": micro_batches, "implementation": implementation}
        )
    except ValidationError as exc:  # its fields are the options' names
        cli_analysis.print_errors(cli_analysis.validation_lines(exc, lambda loc: f"--{str(loc[-1]).replace('_', '-')}"))
        raise typer.Exit(2) from None
    try:
        upload = ConfigUpload(
            files=[ConfigFile(name=str(f), content=f.read_text(errors="replace")) for f in files], options=options
        )
    except ValidationError as exc:  # too many files, or one too large
        cli_analysis.print_errors(cli_analysis.validation_lines(exc, lambda loc: _config_file_place(files, loc)))
        raise typer.Exit(2) from None
    except OSError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    url = server_for(db)
    if url is None and not db.exists():
        err_console.print(f"[red]error:[/red] {escape(f'no store at {db}; ingest the run first')}")
        raise typer.Exit(2)
    try:
        if url is not None:
            result = ApiClient(url).attach_config(run, upload)
        else:
            con = _open_store(db)
            try:
                result = attach_config(con, run, upload.files, upload.options)
            finally:
                con.close()
    except (ServiceError, LookupError) as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except ApiProblem as exc:
        err_console.print(f"[red]error:[/red] {escape(exc.detail)}")
        raise typer.Exit(2) from None
    for f in result.files:
        console.print(f"{escape(f.name)}: {f.kind}")
    console.print(f"run {escape(run)}: {result.stored}: {escape(result.summary)}")
    for note in result.notes:
        console.print(f"  note: {escape(note)}")


def _config_file_place(files: list[Path], loc: tuple[int | str, ...]) -> str:
    """What a ConfigUpload error is about: one of the files (loc files.N.content), or the files as a whole."""
    if len(loc) >= 2 and loc[0] == "files" and isinstance(loc[1], int) and loc[1] < len(files):
        return str(files[loc[1]])
    return "FILES"


def _open_store(db: Path, through_api: str | None = None) -> duckdb.DuckDBPyConnection:
    """The store for a write command; while `commlens serve` holds it, say what to run instead
    (`through_api` with `{url}` for the server's URL), or that the server must stop first."""
    from commlens.cli_server import server_for
    from commlens.store import StoreError, connect

    url = server_for(db)
    if url is not None:
        how = (
            f"do it through the server: {through_api.format(url=url)}"
            if through_api
            else "stop that server first (Ctrl-C where it runs), then run this again"
        )
        err_console.print(
            f"[red]error:[/red] {escape(f'{db} is held by another process, `commlens serve` at {url}; {how}')}"
        )
        raise typer.Exit(2)
    try:
        return connect(db)
    except StoreError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None


def _open_existing_store(db: Path, through_api: str) -> duckdb.DuckDBPyConnection:
    """_open_store for a command that needs what a store holds: a missing file is an error, not a new store."""
    from commlens.cli_server import server_for

    if server_for(db) is None and not db.is_file():
        err_console.print(f"[red]error:[/red] {escape(f'no store at {db}')}: give --db the store's path")
        raise typer.Exit(2)
    return _open_store(db, through_api)


def _read_through(db: Path, api: str | None) -> str | None:
    """The server to read through (--api, or the `commlens serve` holding `db`), or None to read the file
    itself; a store that does not exist is an error (read commands never create one)."""
    from commlens.cli_server import server_for

    if api:
        return api
    url = server_for(db)
    if url is not None:
        return url
    if not db.is_file():
        err_console.print(
            f"[red]error:[/red] {escape(f'no store at {db}')} (read commands never create one): "
            "ingest into it first, give --db the store's path, or --api a running server's URL"
        )
        raise typer.Exit(2)
    return None


@app.command("report")
def report(
    run: str = typer.Option(..., "--run", help="Run to report on."),
    db: Path = READ_DB_OPTION,
    fmt: str = typer.Option("md", "--format", help="json or md."),
    config: Path | None = cli_analysis.CONFIG_OPTION,
    api: str | None = READ_API_OPTION,
    token: str | None = TOKEN_OPTION,
) -> None:
    """Attribution, histograms, predicted against measured, bandwidth, where the time goes and findings of one run."""
    from commlens.frontend.client import ApiClient, ApiProblem

    if fmt not in ("json", "md"):
        err_console.print("[red]error:[/red] --format must be json or md")
        raise typer.Exit(2)
    url = _read_through(db, api)
    if url is None:
        from commlens.service.no_pandas import arrow_without_pandas

        with arrow_without_pandas():
            cli_analysis.report(run=run, db=db, fmt=fmt, config=config)
        return
    if config is not None:
        err_console.print(
            f"[red]error:[/red] --config needs the store itself; through the server at {escape(url)}, attach the "
            "configuration to the run (the dashboard's predicted page, or the API), or stop the server"
        )
        raise typer.Exit(2)
    try:
        sys.stdout.write(ApiClient(url, token).report(run, fmt))
    except ApiProblem as exc:
        err_console.print(f"[red]error:[/red] {escape(f'{url}: {exc}')}")
        raise typer.Exit(2) from None


EXPORT_PARQUET = typer.Option(..., "--parquet", metavar="DIR", help="New folder for the Parquet dataset.")
EXPORT_DB = typer.Option(
    Path("commlens.duckdb"), "--db", help="DuckDB store file (never created; a server holding it must stop first)."
)


@app.command("export")
def export_command(
    parquet: Path = EXPORT_PARQUET,
    run: str | None = typer.Option(None, "--run", help="Only this run's rows (default: every run)."),
    db: Path = EXPORT_DB,
) -> None:
    """Write every table and view of the store as hive-partitioned Parquet (<name>/run=<run>/rank=<r>/part-0.parquet),
    which DuckDB, Spark or Trino query with the store's documented SQL (docs/store.md)."""
    from commlens.service.export import export_parquet

    if not db.is_file():
        err_console.print(f"[red]error:[/red] {escape(f'no store at {db}')}: give --db the store's path")
        raise typer.Exit(2)
    con = _open_store(db)
    try:
        written = export_parquet(con, parquet, run)
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] {escape(exc.detail)}")
        raise typer.Exit(2) from None
    finally:
        con.close()
    rows = sum(r.rows for r in written)
    console.print(f"{len(written)} tables and views, {rows} rows, written under {escape(str(parquet))}")


@app.command("runs")
def runs_command(
    db: Path = READ_DB_OPTION,
    api: str | None = READ_API_OPTION,
    token: str | None = TOKEN_OPTION,
    fmt: str = typer.Option("table", "--format", help="table or json."),
) -> None:
    """List the runs in the store (newest first): files, calls, world size, strategy."""
    from commlens.contract.runs import RunSummary
    from commlens.frontend.client import ApiClient, ApiProblem

    if fmt not in ("table", "json"):
        err_console.print("[red]error:[/red] --format must be table or json")
        raise typer.Exit(2)
    url = _read_through(db, api)
    runs: list[RunSummary] = []
    if url is None:
        from commlens.service.runs import list_runs
        from commlens.store import StoreError, connect

        try:
            con = connect(db, read_only=True)
        except StoreError as exc:
            err_console.print(f"[red]error:[/red] {escape(str(exc))} (or give --api the server's URL)")
            raise typer.Exit(2) from None
        items, _ = list_runs(con, limit=2**31 - 1, offset=0)
        con.close()
        runs = [RunSummary.model_validate(item) for item in items]
    else:
        client = ApiClient(url, token)
        try:
            while True:
                page = client.runs(limit=1000, offset=len(runs))
                runs.extend(page.items)
                if page.next_offset is None:
                    break
        except ApiProblem as exc:
            err_console.print(f"[red]error:[/red] {escape(f'{url}: {exc}')}")
            raise typer.Exit(2) from None
    if fmt == "json":
        sys.stdout.write(json.dumps([r.model_dump(mode="json") for r in runs], indent=2) + "\n")
        return
    table = Table()
    for col in ("run", "files", "failed", "calls", "world size", "strategy", "created"):
        table.add_column(col, justify="right" if col in ("files", "failed", "calls", "world size") else "left")
    for r in runs:
        table.add_row(
            escape(r.name),
            str(r.sources.ok),
            str(r.sources.failed),
            str(r.events),
            "-" if r.world_size is None else str(r.world_size),
            escape(r.strategy or "-"),
            r.created_at.strftime("%Y-%m-%d %H:%M"),
        )
    console.print(f"{len(runs)} runs in {escape(url or str(db))}")
    console.print(table)


@app.command("delete")
def delete_command(
    run: str = typer.Argument(..., help="The run to delete."),
    db: Path = EXPORT_DB,
    yes: bool = typer.Option(False, "--yes", "-y", help="Delete without asking first."),
) -> None:
    """Delete a run and everything stored of it: its files' rows, review items and jobs (the API's DELETE
    /api/runs/RUN; while `commlens serve` holds the store, it says that request instead)."""
    from commlens.service.runs import comms_totals, delete_run, list_sources, resolve_alias, run_names

    con = _open_existing_store(db, f"DELETE {{url}}/api/runs/{quote(run, safe='')} (an admin's token)")
    try:
        try:
            _, files = list_sources(con, run, limit=0, offset=0)
        except LookupError:
            current = resolve_alias(con, run)
            why = (
                f"{run!r} is a former name of run {current!r}; delete that one by its name"
                if current
                else f"no run {run!r} in {db}; runs: {', '.join(run_names(con)) or 'none'}"
            )
            err_console.print(f"[red]error:[/red] {escape(why)}")
            raise typer.Exit(2) from None
        calls = sum(comms_totals(con, run)[0].values())
        what = f"run {run!r} ({files} files, {calls} calls)"
        if not yes and not typer.confirm(f"delete {what} from {db}?", default=False, err=True):
            err_console.print(f"nothing deleted ({escape('--yes')} deletes without asking)")
            raise typer.Exit(1)
        try:
            delete_run(con, run)
        except ServiceError as exc:  # e.g. ingest jobs of a stopped server still queued for it
            err_console.print(f"[red]error:[/red] {escape(exc.detail)}")
            raise typer.Exit(2) from None
    finally:
        con.close()
    console.print(f"deleted {escape(what)}")


@users_app.command("add")
def users_add(
    name: str = typer.Argument(..., help="User name (letters, digits, . _ -)."),
    admin: bool = typer.Option(False, "--admin", help="May delete runs and manage users."),
    db: Path = DB_OPTION,
) -> None:
    """Create a user and print its token once (while `commlens serve` holds the store, it says the API request
    instead)."""
    from commlens.service.users import add_user

    body = shlex.quote(json.dumps({"name": name, "admin": admin})).replace("{", "{{").replace("}", "}}")  # .format
    con = _open_store(
        db,
        "curl -s -H \"Authorization: Bearer $ADMIN_TOKEN\" -H 'Content-Type: application/json' "
        f"-d {body} {{url}}/api/users (an admin's token; none is needed from loopback)",
    )
    try:
        token = add_user(con, name, admin)
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    finally:
        con.close()
    err_console.print(f"user {escape(repr(name))} created{' (admin)' if admin else ''}; its token, shown only now:")
    print(token)


@users_app.command("token")
def users_token(name: str = typer.Argument(...), db: Path = STORE_OPTION) -> None:
    """Replace a user's token and print the new one once."""
    from commlens.service.users import rotate_token

    con = _open_existing_store(db, f"POST {{url}}/api/users/{quote(name, safe='')}/token (an admin's token)")
    try:
        token, _ = rotate_token(con, name)
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    finally:
        con.close()
    print(token)


@users_app.command("list")
def users_list(db: Path = STORE_OPTION) -> None:
    """List users (never their tokens)."""
    from commlens.service.users import list_users

    con = _open_existing_store(db, "GET {url}/api/users (an admin's token)")
    users = list_users(con)
    con.close()
    table = Table(title="users")
    for col in ("name", "admin", "created"):
        table.add_column(col)
    for user in users:
        table.add_row(escape(user.name), "yes" if user.is_admin else "no", str(user.created_at))
    console.print(table)


@users_app.command("remove")
def users_remove(name: str = typer.Argument(...), db: Path = STORE_OPTION) -> None:
    """Delete a user (its token stops working)."""
    from commlens.service.users import remove_user

    con = _open_existing_store(db, f"DELETE {{url}}/api/users/{quote(name, safe='')} (an admin's token)")
    try:
        remove_user(con, name)
    except ServiceError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    finally:
        con.close()


def main() -> None:  # pragma: no cover - entry point convenience
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
