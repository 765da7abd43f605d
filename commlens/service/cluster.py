"""Ingest on a Dask distributed cluster: the parse step runs as tasks on the cluster's workers, which read
the files through fsspec (local or shared paths, `file://`, `s3://`... URLs) and write what they parsed as a
hive-partitioned Parquet dataset (`<table>/run=<name>/rank=<r>/part-<file>-<i>.parquet`, the layout of
`commlens export --parquet`). The store then attaches each file's part of the dataset (DuckDB's
`read_parquet(hive_partitioning=1)`) in the order a single-process ingest reads the files, through the ingest
service's own per-file checks and writer, and finishes each run once (linking, aggregates, attribution, time
analysis): the result equals a single-process ingest. Dask schedules; commlens holds no scheduler or RPC.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import duckdb
import pyarrow as pa

from commlens import store
from commlens.ingest.inputs import (
    DEFAULT_LIMITS,
    InputFile,
    Limits,
    gzip_content_sha256,
    iter_inputs,
)
from commlens.ingest.parse_file import ParsedFile, first_line, parse_tables
from commlens.ingest.records import ParseResult, RankHint
from commlens.ingest.walk import NOT_TRACES
from commlens.service.errors import InvalidError
from commlens.service.ingest import FileOutcome, IngestReport, PendingRun, complete_run, ingest_file
from commlens.service.jobs_split import FileEvidence, evidence, split_jobs

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
# The dataset holds a parsed file's rows per store table, its process groups and its `sources` row (the
# file's own facts). Back from it, these tables' rows become the dicts the parse step leaves them as (the
# ingest service reads them), by ParseResult field; comm_events, timeline_intervals and a2a_pairs stay Arrow.
ROW_TABLES = {
    "steps": "steps",
    "groups": "process_groups",
    "nccl_comms": "nccl_comms",
    "topology": "nccl_topology",
    "tuning": "nccl_tuning",
    "fr_entries": "fr_entries",
}
TCP_SCHEMES = ("tcp", "tls", "ws", "wss")  # scheduler addresses a TCP connection reaches
ORDER_COLUMN = "file_row"  # a row's place in its file: the store gets rows in file order across rank partitions


@dataclass(frozen=True)
class Task:
    """One input path (a file or an archive) parsed on a worker; an archive's members are dealt out over
    `shards` tasks (member i goes to shard i % shards), each reading the archive once."""

    entry: int  # the input's place in the ingest's order
    name: str  # as a single-process ingest names it (a path as given, or the URL)
    url: str  # what fsspec opens
    shard: int = 0
    shards: int = 1


@dataclass
class FileDone:
    """One file's parse on a worker: where its rows went in the dataset, or why there are none."""

    entry: int
    member: int  # the file's place among its input's files (archive members)
    name: str
    size: int
    skip: str | None = None  # passed over (documentation next to traces)
    error: str | None = None  # the container could not be read: nothing was parsed
    kind: str | None = None
    sha256: str = ""  # the content's identity: sha256 of the decompressed content for gzip, else of the bytes
    parse_error: str | None = None  # the parser's or the worker's error, naming the file
    parts: dict[str, list[str]] = field(default_factory=dict)  # table -> Parquet files written
    evidence: FileEvidence | None = None  # what splitting files into jobs reads
    parse_s: float = 0.0  # the worker's seconds parsing the file, then writing its part of the dataset
    write_s: float = 0.0

    @property
    def order(self) -> tuple[int, int]:
        return self.entry, self.member


# ------------------------------------------------------------------------------------ the tasks


def plan_tasks(paths: list[str], archive_shards: int) -> tuple[list[Task], list[FileDone]]:
    """The tasks for `paths` (directories walked as a single-process ingest walks them, sorted), and the
    files decided without reading them: passed over, or missing."""
    import fsspec

    tasks: list[Task] = []
    decided: list[FileDone] = []
    entries = itertools.count()
    for path in paths:
        fs, root = fsspec.core.url_to_fs(path)
        url = "://" in path
        if fs.isfile(root):
            files, walked = [root], False
        elif fs.isdir(root):
            found = (f for f in fs.find(root) if not os.path.basename(f).startswith("."))
            files, walked = sorted(found, key=PurePosixPath), True
        else:
            decided.append(FileDone(next(entries), 0, path, 0, error="no such file or directory"))
            continue
        for f in files:
            entry = next(entries)
            below = os.path.relpath(f, root)
            name = path if not walked else f"{path.rstrip('/')}/{below}" if url else str(Path(path) / below)
            suffix = os.path.splitext(f)[1].lower()
            if walked and suffix in NOT_TRACES:
                skip = f"not a trace ({suffix} files are passed over in directories)"
                decided.append(FileDone(entry, 0, name, int(fs.size(f)), skip=skip))
                continue
            shards = archive_shards if f.lower().endswith(ARCHIVE_SUFFIXES) else 1
            url_of = fs.unstrip_protocol(f) if url else os.path.abspath(f)
            tasks.extend(Task(entry, name, url_of, shard, shards) for shard in range(shards))
    return tasks, decided


def _inputs_of(task: Task, limits: Limits) -> Iterator[InputFile]:
    """The task's input files, named as a single-process ingest names them: a file on a local or mounted path
    (`file://` too) read by the ingest's own walker (archives expanded); a remote file opened through fsspec, a
    remote archive copied to a local cache first."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(task.url)
    if _is_local(fs):
        yield from _named_inputs(task.name, os.path.abspath(root), limits)
    elif not task.url.lower().endswith(ARCHIVE_SUFFIXES):
        yield InputFile(task.name, int(fs.size(root)), lambda: fs.open(root, "rb"))
    else:  # a copy of its own per task: tasks of one archive's shards may run side by side in one process
        with tempfile.TemporaryDirectory(prefix="commlens-cluster-") as tmp:
            local = os.path.join(tmp, os.path.basename(root))
            fs.get(root, local)
            yield from _named_inputs(task.name, local, limits)


def _named_inputs(name: str, local: str, limits: Limits) -> Iterator[InputFile]:
    for item in iter_inputs([Path(local)], limits):
        item.name = name + item.name[len(local) :]
        yield item


def _is_local(fs: Any) -> bool:
    """Whether an fsspec filesystem is this machine's (a path or a `file://` URL)."""
    return "file" in ((fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol)


def run_task(task: Task, out: str, run: str, hint: RankHint, limits: Limits) -> list[FileDone]:
    """On a worker: parse the task's files and write each one's rows under `out`; never raises for a bad file
    (its error, naming it, is in the answer)."""
    done = []
    for member, item in enumerate(_inputs_of(task, limits)):
        if member % task.shards != task.shard:
            continue
        if item.skip or item.error:
            done.append(FileDone(task.entry, member, item.name, item.size, skip=item.skip, error=item.error))
            continue
        try:
            done.append(_parse_and_write(task, member, item, out, run, hint, limits))
        except Exception as exc:  # the worker's own failure (writing the dataset): the file fails, not the run
            error = f"{item.name}: failed on a cluster worker ({type(exc).__name__}: {first_line(exc)})"
            done.append(FileDone(task.entry, member, item.name, item.size, parse_error=error))
    return done


def _parse_and_write(
    task: Task, member: int, item: InputFile, out: str, run: str, hint: RankHint, limits: Limits
) -> FileDone:
    start = time.perf_counter()
    parsed = parse_tables(item, hint, limits)
    done = FileDone(task.entry, member, item.name, parsed.size, kind=parsed.kind, sha256=parsed.sha256)
    done.parse_s = time.perf_counter() - start
    if parsed.result is None:
        done.parse_error = parsed.error or f"{item.name}: not parsed"
        return done
    done.sha256 = parsed.content_sha256 or gzip_content_sha256(item.open_raw, item.name, limits) or parsed.sha256
    done.evidence = evidence(item.name, parsed.result)
    key = f"{task.entry:06d}-{member:06d}"
    for table, rows in parsed_tables(item.name, done.sha256, parsed.size, parsed.result).items():
        done.parts[table] = write_part(rows, out, table, run, key)
    done.write_s = time.perf_counter() - start - done.parse_s
    return done


def parsed_tables(name: str, sha256: str, size: int, result: ParseResult) -> dict[str, pa.Table]:
    """A parsed file as Arrow tables named for the store's tables (the parse step's own, plus its process
    groups and its `sources` row: the file's facts, JSON fields as the writer stores them, and the run config
    it carries), each row numbered in file order."""
    tables = result.tables()
    if result.groups:
        tables["process_groups"] = pa.Table.from_struct_array(pa.array(result.groups))
    source = {
        "path": name,
        "kind": result.kind,
        "sha256": sha256,
        "size_bytes": size,
        "rank": result.rank,
        "world_size": result.world_size,
        "n_events": result.n_events,
        "skipped": json.dumps(dict(result.skipped)),
        "warnings": json.dumps(result.warnings),
        "meta": json.dumps(result.meta, default=str),
        "run_config": None if result.run_config is None else json.dumps(result.run_config),
    }
    tables["sources"] = pa.Table.from_pylist([source])
    return {
        t: rows.append_column(ORDER_COLUMN, pa.array(range(rows.num_rows), pa.int64())) for t, rows in tables.items()
    }


def write_part(rows: pa.Table, out: str, table: str, run: str, key: str) -> list[str]:
    """Write one file's rows of a table under `out/<table>/run=<run>[/rank=<r>]/part-<key>-<i>.parquet`
    (hive partitions; a rank partition where the rows have a rank); the files written, as URLs for a remote
    `out`."""
    import fsspec
    import pyarrow.dataset as ds

    fs, root = fsspec.core.url_to_fs(out)
    keys = [("run", pa.string())]
    if "rank" in rows.column_names:
        rows = rows.set_column(rows.column_names.index("rank"), "rank", rows["rank"].cast(pa.int32()))
        keys.append(("rank", pa.int32()))
    rows = rows.append_column("run", pa.array([run] * rows.num_rows, pa.string()))
    written: list[str] = []
    ds.write_dataset(
        rows,
        f"{root.rstrip('/')}/{table}",
        format="parquet",
        partitioning=ds.partitioning(pa.schema(keys), flavor="hive"),
        basename_template=f"part-{key}-{{i}}.parquet",
        existing_data_behavior="overwrite_or_ignore",
        filesystem=fs,
        file_visitor=lambda f: written.append(f.path),
    )
    return [fs.unstrip_protocol(p) if "://" in out else p for p in written]


# ------------------------------------------------------------------------------------ attaching


def read_part(con: duckdb.DuckDBPyConnection, files: list[str]) -> pa.Table:
    """One file's rows of a table from the dataset, in file order, with the partition columns typed as in
    the store (`rank` INTEGER) and the run and order columns dropped."""
    has_rank = any("/rank=" in f for f in files)
    types = "{'run': VARCHAR, 'rank': INTEGER}" if has_rank else "{'run': VARCHAR}"
    return con.sql(
        f"SELECT * EXCLUDE (run, {ORDER_COLUMN}) FROM read_parquet(?, hive_partitioning = true, "
        f"hive_types = {types}, union_by_name = true) ORDER BY {ORDER_COLUMN}",
        params=[files],
    ).to_arrow_table()


def attach(con: duckdb.DuckDBPyConnection, done: FileDone) -> ParsedFile:
    """A file's parse as the ingest service takes it, read back from the dataset the worker wrote."""
    parsed = ParsedFile(
        done.name, done.kind, done.sha256, done.size, error=done.parse_error, content_sha256=done.sha256
    )
    if done.parse_error is not None:
        return parsed
    parts = {table: read_part(con, files) for table, files in done.parts.items()}
    source = parts.pop("sources").to_pylist()[0]
    result = ParseResult(
        kind=source["kind"],
        rank=source["rank"],
        world_size=source["world_size"],
        warnings=json.loads(source["warnings"]),
        meta=json.loads(source["meta"]),
        run_config=None if source["run_config"] is None else json.loads(source["run_config"]),
    )
    result.skipped.update(json.loads(source["skipped"]))
    if "comm_events" in parts:
        result.event_tables.append(parts["comm_events"])
    if "a2a_pairs" in parts:
        result.arrow_rows["a2a_pairs"] = parts["a2a_pairs"]
    result.intervals = parts.get("timeline_intervals")
    for attr, table in ROW_TABLES.items():
        if table in parts:  # keys a row did not have stay absent: the writer leaves them to their default
            setattr(result, attr, [{k: v for k, v in r.items() if v is not None} for r in parts[table].to_pylist()])
    parsed.result = result
    return parsed


def _stub(done: FileDone) -> InputFile:
    """The input as the ingest service sees it here: the bytes stay on the workers' side (the content's
    identity came with the parse)."""
    import io

    return InputFile(done.name, done.size, lambda: io.BytesIO(b""), error=done.error, skip=done.skip)


# ------------------------------------------------------------------------------------ the ingest


def ingest_cluster(
    con: duckdb.DuckDBPyConnection,
    run: str,
    paths: list[str],
    scheduler: str,
    parquet_out: str | None = None,
    hint: RankHint | None = None,
    limits: Limits = DEFAULT_LIMITS,
    on_file: Callable[[InputFile, FileOutcome], None] | None = None,
    description: str | None = None,
    split: bool = True,
) -> IngestReport:
    """Ingest `paths` with the parse step on the Dask cluster at `scheduler` (tcp://host:8786). The dataset
    goes to `parquet_out` (a folder or URL every worker and this process can reach; a temporary folder,
    removed after, when None: right for a cluster on this machine). With `split`, files of several jobs go
    to a run each, as a single-process ingest does."""
    reach_scheduler(scheduler)
    if parquet_out is not None:
        check_dataset_folder(parquet_out)
    import fsspec
    from distributed import Client

    try:
        client = Client(scheduler, timeout="30s")  # type: ignore[no-untyped-call]  # distributed is untyped
    except (OSError, ValueError) as exc:
        raise InvalidError(f"--cluster {scheduler}: cannot reach the Dask scheduler ({exc})", "cluster") from None
    out = parquet_out or tempfile.mkdtemp(prefix="commlens-cluster-")
    fs, _ = fsspec.core.url_to_fs(out)
    if not _is_local(fs):
        con.register_filesystem(fs)  # DuckDB reads the dataset through the same fsspec filesystem
    try:
        with client:
            done = parse_on(client, paths, out, run, hint or RankHint(), limits)
        return store_files(con, run, done, hint or RankHint(), limits, on_file, description, split)
    finally:
        if parquet_out is None:
            shutil.rmtree(out, ignore_errors=True)


def reach_scheduler(address: str, timeout: float = 10.0) -> None:
    """Refuse at once, in those words, an address Dask cannot use and a TCP scheduler whose host does not resolve
    or that refuses the connection: Dask's own connect retries those for its whole timeout, then says only that
    it timed out. Called before the store is opened, so a bad address leaves no store file behind."""
    try:
        from distributed.comm import get_address_host_port, parse_address
        from distributed.comm.registry import get_backend
    except ImportError as exc:
        raise InvalidError(f"--cluster needs Dask: pip install 'commlens[cluster]' ({exc})", "cluster") from None
    try:
        scheme, _ = parse_address(address)
        get_backend(scheme)
        host, port = get_address_host_port(address) if scheme in TCP_SCHEMES else (None, 0)
    except ValueError as exc:
        raise InvalidError(
            f"--cluster {address}: not a Dask scheduler address ({first_line(exc)}); give tcp://HOST:PORT", "cluster"
        ) from None
    if host is None:  # inproc://, ucx://: Dask's connect says what is wrong
        return
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise InvalidError(f"--cluster {address}: cannot reach the Dask scheduler ({reason})", "cluster") from None


def check_dataset_folder(parquet_out: str) -> None:
    """Refuse a `--parquet-out` folder that holds files already: the parts written would mix with them, and
    whoever reads the dataset after would read both."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(parquet_out)
    if fs.isdir(root) and fs.ls(root, detail=False):
        raise InvalidError(
            f"--parquet-out {parquet_out}: a folder that is not empty; give a new or empty folder for the dataset",
            "cluster",
        )


def parse_on(client: Any, paths: list[str], out: str, run: str, hint: RankHint, limits: Limits) -> list[FileDone]:
    """Every file's FileDone in ingest order; a task that failed as a whole (its worker died) fails its input,
    named."""
    workers = max(1, len(client.scheduler_info(n_workers=-1)["workers"]))
    tasks, done = plan_tasks(paths, workers)
    futures = client.map(run_task, tasks, out=out, run=run, hint=hint, limits=limits, pure=False)
    failed: set[int] = set()
    for task, future in zip(tasks, futures, strict=True):
        try:
            done.extend(future.result())
        except Exception as exc:
            if task.entry not in failed:
                failed.add(task.entry)
                error = f"{task.name}: the cluster task failed ({type(exc).__name__}: {first_line(exc)})"
                done.append(FileDone(task.entry, -1, task.name, 0, parse_error=error))
    return sorted(done, key=lambda d: d.order)


def store_files(
    con: duckdb.DuckDBPyConnection,
    run: str,
    done: list[FileDone],
    hint: RankHint,
    limits: Limits,
    on_file: Callable[[InputFile, FileOutcome], None] | None,
    description: str | None,
    split: bool,
) -> IngestReport:
    """Attach the files in order through the ingest service, then finish each run once."""
    where, report = _split(run, done) if split else ({}, IngestReport(run))
    runs = {
        target: PendingRun(target, description, store.get_run_id(con, target))
        for target in [job.run for job in report.jobs] or [run]
    }
    for d in done:
        item = _stub(d)
        target = where.get(d.name, run)
        parsed = None if d.skip or d.error else attach(con, d)
        outcome = ingest_file(con, runs[target], item, hint, limits, parsed)
        if split:
            outcome.run = target
        report.files.append(outcome)
        if on_file is not None:
            on_file(item, outcome)
    for target, pending in runs.items():
        report.attribution_error = report.attribution_error or complete_run(con, pending.made(con), target)
    return report


def _split(run: str, done: list[FileDone]) -> tuple[dict[str, str], IngestReport]:
    """Which run each file goes to when the files are of several jobs (the split a single-process ingest
    makes, from the evidence the workers sent); a file with the content of an earlier one goes with it."""
    first_of: dict[str, str] = {}
    twin: dict[str, str] = {}
    found = []
    for d in done:
        if d.evidence is None:
            continue
        if d.sha256 in first_of:
            twin[d.name] = first_of[d.sha256]
            continue
        first_of[d.sha256] = d.name
        found.append(d.evidence)
    jobs = split_jobs(run, found)
    where = {f.path: job.run for job in jobs for f in job.files}
    where.update({name: where[first] for name, first in twin.items() if first in where})
    return where, IngestReport(run, jobs=jobs)


def path_arg(path: Path) -> str:
    """A command-line PATH as fsspec takes it: a URL that pathlib folded (`s3:/b/k`, `file:/x`) restored."""
    text = str(path)
    scheme, sep, rest = text.partition(":/")
    if not sep or not scheme.isalnum() or len(scheme) < 2 or rest.startswith("/"):
        return text
    return f"{scheme}:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
