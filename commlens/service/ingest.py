"""Ingesting a run: every adapter's one sequence (the CLI's `ingest`, the harness launcher, the API's
upload queue): the run made if missing, each file parsed (`commlens.ingest.parse_file`) and written on
its own (all rows or none), the run's sources linked and its aggregates refreshed, then its process
groups attributed to schemes.

A file that fails is recorded with its error and rolled back alone; files with bytes already in the run
are skipped as duplicates; a second profiler trace of a rank whose calls overlap the first is refused.
With `split_jobs`, every file is parsed first and the files of different training jobs are stored as one
run each (`commlens.service.jobs_split`), the table of what went where in `IngestReport.jobs`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TypeVar

import duckdb
import pyarrow.compute as pc

from commlens import store
from commlens.backend.attribution import attribute_run
from commlens.backend.findings_time import store_timing_inputs
from commlens.backend.timing.persist import persist_run
from commlens.ingest import formats
from commlens.ingest.formats import Trait
from commlens.ingest.inputs import DEFAULT_LIMITS, InputFile, Limits, gzip_content_sha256, iter_inputs
from commlens.ingest.nccl_link import link_run
from commlens.ingest.nccl_prelink import Prelinked, Prelinks
from commlens.ingest.parse_file import ParsedFile, first_line, parse_file
from commlens.ingest.records import ParseResult, RankHint
from commlens.service.held_parses import HeldParses
from commlens.service.jobs_split import FileEvidence, Job, evidence, split_jobs, stored_job
from commlens.service.parallel import ParsePool, parsed_inputs
from commlens.store import aggregates
from commlens.store.errors import StoreError
from commlens.store.overlap import same_nccl_process

log = logging.getLogger("commlens.service.ingest")

CONFLICT_RETRIES = 3
T = TypeVar("T")


@dataclass
class FileOutcome:
    path: str
    status: str  # ok | failed | duplicate | skipped
    kind: str | None = None
    rank: int | None = None
    events: int = 0
    error: str | None = None
    skipped: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    size: int = 0
    run: str | None = None  # the run it went to, where a split sent files of one ingest to several


@dataclass
class PendingRun:
    """A run made by the first file stored into it, in that file's transaction: an ingest killed before
    any file commits leaves no empty run behind."""

    name: str
    description: str | None = None
    run_id: int | None = None  # once made (or found)
    owner_id: int | None = None  # the user who owns it if this ingest makes it

    def write(self, con: duckdb.DuckDBPyConnection, fn: Callable[[duckdb.DuckDBPyConnection, int], T]) -> T:
        """fn(con, run_id) in one transaction with the run's creation, if it is not made yet."""
        if self.run_id is not None:
            return fn(con, self.run_id)

        def body(c: duckdb.DuckDBPyConnection) -> tuple[int, T]:
            run_id = store.ensure_run(c, self.name, description=self.description, owner_id=self.owner_id)
            return run_id, fn(c, run_id)

        self.run_id, out = store.transaction(con, body)
        return out

    def made(self, con: duckdb.DuckDBPyConnection) -> int:
        """The run's id, made now if no file made it (an ingest whose every file was skipped)."""
        if self.run_id is None:
            self.run_id = store.ensure_run(con, self.name, description=self.description, owner_id=self.owner_id)
        return self.run_id


def _as_pending(run: int | PendingRun) -> PendingRun:
    return run if isinstance(run, PendingRun) else PendingRun("", run_id=run)


@dataclass
class IngestSummary:
    run: str
    files: list[FileOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[FileOutcome]:
        return [f for f in self.files if f.status == "failed"]


@dataclass
class IngestReport(IngestSummary):
    attribution_error: str | None = None  # the files are stored; their schemes are not
    jobs: list[Job] = field(default_factory=list)  # with split_jobs: the runs the files went to, with evidence

    @property
    def split(self) -> bool:
        """Whether the files went elsewhere than the run named: several jobs, or one the named run's
        stored files say is another job (what went where is then worth a table)."""
        return len(self.jobs) > 1 or any(job.run != self.run for job in self.jobs)


def ingest_run(
    con: duckdb.DuckDBPyConnection,
    run: str,
    inputs: Iterable[InputFile],
    hint: RankHint | None = None,
    limits: Limits = DEFAULT_LIMITS,
    on_file: Callable[[InputFile, FileOutcome], None] | None = None,
    description: str | None = None,
    replace: bool = False,
    attribute_schemes: bool = True,
    split_jobs: bool = False,
    jobs: int = 1,
    pool: ParsePool | None = None,
    owner_id: int | None = None,
    on_split: Callable[[IngestReport], None] | None = None,
) -> IngestReport:
    """Ingest the files into the run (created by its first stored file if missing; `replace` first removes
    what earlier files of it stored, its review and overrides kept), link and refresh it, and attribute its
    groups to schemes. A file that fails is recorded with its error; an exception of `inputs` itself stops
    before the linking. With `split_jobs` the files are parsed first (held as Arrow tables) and each job's go
    to a run of its own. With `jobs` > 1 files are parsed in that many processes (same rows): this one and
    jobs-1 workers (`pool`, if the caller started them early). `owner_id`: the user on whose behalf it runs,
    who owns the runs it makes (None: the store's operator, the CLI). `on_split(report)`: once a split has
    decided where the files go, before any is stored (`report.jobs` is then final)."""
    hint = hint or RankHint()
    if store.get_run_id(con, run) is None:
        store.check_new_run_name(run)  # up front, not after every file is parsed
    if split_jobs:
        return _ingest_split(
            con, run, inputs, hint, limits, on_file, description, replace, jobs, pool, owner_id, on_split
        )
    pending = PendingRun(run, description, store.get_run_id(con, run), owner_id)
    if replace and pending.run_id is not None:
        store.replace_run_data(con, pending.run_id)
    report = IngestReport(run)
    for item, parsed in parsed_inputs(inputs, hint, limits, jobs, pool):
        outcome = ingest_file(con, pending, item, hint, limits, parsed)
        del parsed  # stored: not held while the next file is parsed or the run is finished
        report.files.append(outcome)
        if on_file is not None:
            on_file(item, outcome)
    _finish(con, pending.made(con), run, report, attribute_schemes)
    return report


def _finish(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    run: str,
    report: IngestReport,
    attribute_schemes: bool,
    prelinked: Prelinked | None = None,
) -> None:
    report.attribution_error = report.attribution_error or complete_run(con, run_id, run, attribute_schemes, prelinked)


def complete_run(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    run: str,
    attribute_schemes: bool = True,
    prelinked: Prelinked | None = None,
) -> str | None:
    """Link and refresh the run, attribute its groups, then its time analysis (with the schemes just set):
    what follows its files' ingest, also redone for a run whose ingest a stopped server left unfinished.
    `prelinked`: the NCCL calls this command wrote already linked (finalize_run). The attribution's error, if any."""
    finalize_run(con, run_id, prelinked)
    error = attribute(con, run) if attribute_schemes else None
    store.release_memory(con)  # what the writes and the linking left cached is not held through the analysis
    persist_run(con, run_id)
    store_timing_inputs(con, run_id)
    store.release_memory(con)
    return error


def _ingest_split(
    con: duckdb.DuckDBPyConnection,
    run: str,
    inputs: Iterable[InputFile],
    hint: RankHint,
    limits: Limits,
    on_file: Callable[[InputFile, FileOutcome], None] | None,
    description: str | None,
    replace: bool,
    jobs: int = 1,
    pool: ParsePool | None = None,
    owner_id: int | None = None,
    on_split: Callable[[IngestReport], None] | None = None,
) -> IngestReport:
    """Parse every file, group the parsed ones by job, then store each job as its own run (a run split off
    takes no name of another owner's run nor any run's former name). Files that could
    not be parsed (and skipped ones) are recorded in the first job's run. The parses wait in HeldParses
    (on disk past its memory budget) and each input's bytes are released once parsed (archive members are
    spooled in memory up to 64 MiB each), so memory does not grow with the number of files."""
    first_of: dict[str, str] = {}  # content identity -> the first file with it
    twin: dict[str, str] = {}  # a file -> the earlier file with its content: it goes where that one goes
    kept: dict[str, str] = {}  # a file whose content a run of this ingest's family holds -> that run
    found = []
    held_here: list[FileEvidence] = []  # files the named run holds already: their job keeps its name
    items: list[InputFile] = []  # every input in order, its bytes released once parsed
    links = Prelinks()  # NCCL calls of a run without NCCL rows yet are written already linked
    with HeldParses() as held:
        for item, p in parsed_inputs(inputs, hint, limits, jobs, pool):
            items.append(item)
            if p is None:
                continue
            if p.result is not None:
                identity = p.content_sha256 = _identity(item, p, limits)  # not read again when stored
                holder = None if replace else _family_run_holding(con, run, (identity, p.sha256), owner_id)
                if identity in first_of:
                    twin[item.name] = first_of[identity]
                elif holder is not None:  # stored by an earlier ingest: it stays there, whatever this split says
                    first_of[identity] = item.name
                    kept[item.name] = holder
                    if holder == run:  # the run's job is the one these files are in, as in one ingest of them all
                        held_here.append(evidence(item.name, p.result))
                else:
                    first_of[identity] = item.name
                    found.append(evidence(item.name, p.result))
                    links.saw(id(item), p.result)
            item.open_raw = _ReleasedBytes(item.name)  # an archive member's spool goes now, not with the run
            held.put(id(item), p)
            del p  # held only by `held`, which lets it go once stored
        split = split_jobs(
            run,
            held_here + found,
            _names_not_ours(con, owner_id),
            None if replace else _stored_job(con, run),
            held={f.path for f in held_here},
        )
        where = {f.path: job.run for job in split for f in job.files} | kept
        where.update({name: where[first] for name, first in twin.items() if first in where})
        report = IngestReport(run, jobs=split)
        if on_split is not None:
            on_split(report)
        runs: dict[str, PendingRun] = {}
        for job in split:
            pending = runs[job.run] = PendingRun(job.run, description, store.get_run_id(con, job.run), owner_id)
            if replace and pending.run_id is not None:
                store.replace_run_data(con, pending.run_id)
            links.plan(con, job.run, pending.run_id, [id(i) for i in items if where.get(i.name, run) == job.run])
        for name in set(kept.values()) - set(runs):  # runs that only see their files again: nothing is written
            runs[name] = PendingRun(name, description, store.get_run_id(con, name), owner_id)
        for item in items:
            target = where.get(item.name, run)
            parsed = held.pop(id(item))
            links.apply(target, item.name, parsed)
            outcome = ingest_file(con, runs[target], item, hint, limits, parsed)
            del parsed
            outcome.run = target
            report.files.append(outcome)
            if on_file is not None:
                on_file(item, outcome)
    for job in split:
        _finish(con, runs[job.run].made(con), job.run, report, True, links.written(job.run))
    return report


def _family_run_holding(
    con: duckdb.DuckDBPyConnection, run: str, hashes: tuple[str, str], owner_id: int | None
) -> str | None:
    """The run of this ingest's family (`run`, or a run of the same owner split off from it earlier:
    `run-...`) that holds a stored file of this content (or these bytes), if any. A second ingest of the same
    files in another order, or of a folder or archive holding files stored before, splits its jobs
    differently; without this a file stored in one run of the family would be stored again in another and its
    calls would count twice. Another owner's `run-...` is no part of the family: splits never write there,
    and a colleague's `baseline-old` must not swallow the files of one's own `baseline`."""
    row = con.execute(
        "SELECT r.name FROM sources s JOIN runs r USING (run_id) WHERE s.status = 'ok' AND s.sha256 IN (?, ?) "
        "AND (r.name = ? OR (starts_with(r.name, ? || '-') AND r.owner_id IS NOT DISTINCT FROM ?)) "
        "ORDER BY r.name = ? DESC, r.run_id LIMIT 1",
        [*hashes, run, run, owner_id, run],
    ).fetchone()
    return None if row is None else str(row[0])


def _stored_job(con: duckdb.DuckDBPyConnection, run: str) -> Job | None:
    """The job evidence the run's stored files give (jobs_split.stored_job), or None for a new or empty run."""
    sizes = con.execute(
        "SELECT DISTINCT s.world_size FROM sources s JOIN runs r USING (run_id) "
        "WHERE r.name = ? AND s.status = 'ok' AND s.world_size IS NOT NULL",
        [run],
    ).fetchall()
    ids = con.execute(
        "SELECT DISTINCT c.comm_id FROM nccl_comms c JOIN runs r USING (run_id) WHERE r.name = ? AND c.comm_id <> ''",
        [run],
    ).fetchall()
    return stored_job(run, [int(r[0]) for r in sizes], [str(r[0]) for r in ids])


def _names_not_ours(con: duckdb.DuckDBPyConnection, owner_id: int | None) -> set[str]:
    """Names a run split off for `owner_id` must not take: another owner's runs (where the uploader may not
    write unasked) and every run's former names (links holding them lead to that run)."""
    rows = con.execute(
        "SELECT name FROM runs WHERE owner_id IS DISTINCT FROM ? UNION ALL SELECT alias FROM run_aliases", [owner_id]
    ).fetchall()
    return {r[0] for r in rows}


class _ReleasedBytes:
    """The opener of an input whose bytes were released after its parse: a split stores from the parse."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> BinaryIO:
        raise RuntimeError(f"{self.name}: its bytes were released once parsed")


def ingest_paths(
    con: duckdb.DuckDBPyConnection,
    paths: list[Path],
    run: str,
    hint: RankHint | None = None,
    limits: Limits = DEFAULT_LIMITS,
    description: str | None = None,
) -> IngestSummary:
    """The files, directories and archives at `paths` into the run, linked and refreshed but not attributed
    (what ingest alone stores: the tests and benches of the parsers and the store look at it)."""
    return ingest_run(
        con, run, iter_inputs(paths, limits), hint, limits, description=description, attribute_schemes=False
    )


def finalize_run(con: duckdb.DuckDBPyConnection, run_id: int, prelinked: Prelinked | None = None) -> None:
    """Run-level linking after files land (NCCL communicators across processes, harness groups) in one
    transaction, told which calls were written already linked (`nccl_prelink`); then the run's aggregates
    are recomputed (in their own). The run's updated_at says when its data last changed."""

    def link(c: duckdb.DuckDBPyConnection) -> None:
        link_run(c, run_id, prelinked)
        c.execute("UPDATE runs SET updated_at = current_timestamp WHERE run_id = ?", [run_id])

    store.transaction(con, link)
    aggregates.refresh_run(con, run_id)


def ingest_file(
    con: duckdb.DuckDBPyConnection,
    run: int | PendingRun,
    item: InputFile,
    hint: RankHint,
    limits: Limits = DEFAULT_LIMITS,
    parsed: ParsedFile | None = None,
) -> FileOutcome:
    """One file (parsed here unless `parsed` is its parse already) into the run (its id, or a PendingRun the
    file's transaction makes), written again when a concurrent transaction conflicted; a parser's bug fails
    the file (recorded with its error), not the run."""
    pending = _as_pending(run)
    for attempt in range(CONFLICT_RETRIES):
        try:
            return _ingest_file(con, pending, item, hint, limits, parsed)
        except StoreError:  # the run cannot be made under this name (a renamed run's former name)
            raise
        except duckdb.TransactionException:
            if attempt == CONFLICT_RETRIES - 1:
                error = f"{item.name}: could not be written: concurrent changes conflicted {CONFLICT_RETRIES} times"
                break
        except Exception as exc:  # a parser bug must not stop the other files
            log.exception("ingesting %s", item.name)
            error = f"{item.name}: internal error while ingesting ({type(exc).__name__}: {exc})"
            break
    _record_failure(con, pending, item.name, "unknown", "", item.size, error)
    return FileOutcome(item.name, "failed", error=error, size=item.size)


def _record_failure(
    con: duckdb.DuckDBPyConnection, run: PendingRun, path: str, kind: str, sha256: str, size: int, error: str
) -> None:
    run.write(con, lambda c, run_id: store.record_failure(c, run_id, path, kind, sha256, size, error))


def _ingest_file(
    con: duckdb.DuckDBPyConnection,
    run: PendingRun,
    item: InputFile,
    hint: RankHint,
    limits: Limits,
    parsed: ParsedFile | None = None,
) -> FileOutcome:
    """Parse one file and store it (one transaction), or record why not; never raises for a bad file."""
    if item.skip:
        return FileOutcome(item.name, "skipped", error=item.skip, size=item.size)
    if item.error:
        _record_failure(con, run, item.name, "unknown", "", item.size, f"{item.name}: {item.error}")
        return FileOutcome(item.name, "failed", error=f"{item.name}: {item.error}", size=item.size)
    parsed = parsed or parse_file(item, hint, limits)
    kind, sha, size, result = parsed.kind or "unknown", parsed.sha256, parsed.size, parsed.result
    if result is None:
        error = parsed.error or f"{item.name}: not parsed"
        _record_failure(con, run, item.name, kind, sha, size, error)
        return FileOutcome(item.name, "failed", kind=parsed.kind, error=error, size=size)
    identity = _identity(item, parsed, limits)
    existing = None if run.run_id is None else store.find_source(con, run.run_id, identity)
    if existing is None and identity != sha and run.run_id is not None:
        existing = store.find_source(con, run.run_id, sha)  # stored before identity was the content
    if existing is not None:
        error = f"{_same_what(con, existing[0], size)} as {existing[1]}, already ingested"
        return FileOutcome(item.name, "duplicate", kind=kind, error=error, size=size)
    sha = identity
    if not result.n_events and formats.get(result.kind).has(Trait.PER_RANK_TIMED_TRACE):
        result.warn(
            f"{item.name}: no communication: the trace holds no collective or point-to-point call "
            "(profiled steps without communication, or a single-process job)"
        )
    process = None if run.run_id is None else _same_nccl_process(con, run.run_id, result)
    if process is not None:
        error = (
            f"{item.name}: NCCL process {process[0]} is already in this run from {process[1]}: the same host, pid, "
            "communicator, op counts and calls, so they would count twice. "
            "Ingest it into another run, or delete the run and ingest the files you mean"
        )
        _record_failure(con, run, item.name, kind, sha, size, error)
        return FileOutcome(item.name, "failed", kind=kind, rank=result.rank, error=error, size=size)
    other = None if run.run_id is None else _same_rank_trace(con, run.run_id, result)
    if other is not None:
        error = (
            f"{item.name}: rank {result.rank} already has a profiler trace in this run ({other}) whose "
            f"{'steps' if result.steps else 'time span'} overlap this one's; its calls would count twice. "
            "Ingest it into another run, or delete the run and ingest the files you mean"
        )
        _record_failure(con, run, item.name, kind, sha, size, error)
        return FileOutcome(item.name, "failed", kind=kind, rank=result.rank, error=error, size=size)
    twin = None if run.run_id is None else _same_calls_trace(con, run.run_id, result)
    if twin is not None:  # said, not refused: a copy relabelled on purpose (a scaled benchmark) is still stored
        result.warn(
            f"its calls start at the very instants of calls of {twin[0]} (rank {twin[1]}; this file says rank "
            f"{result.rank}): the same recording under another rank? Then its calls count twice in this run"
        )
    try:
        run.write(con, lambda c, run_id: store.write_result(c, run_id, item.name, sha, size, result))  # all or none
    except (duckdb.DataError, duckdb.IntegrityError, OverflowError, ValueError, TypeError) as exc:
        # the file's values (pyarrow's errors are ValueError/TypeError); a store problem (I/O) still raises
        error = f"{item.name}: a value does not fit the store ({type(exc).__name__}: {first_line(exc)})"
        _record_failure(con, run, item.name, kind, sha, size, error)
        return FileOutcome(item.name, "failed", kind=kind, error=error, size=size)
    return FileOutcome(
        item.name,
        "ok",
        kind=kind,
        rank=result.rank,
        events=result.n_events,
        skipped=dict(result.skipped),
        warnings=list(result.warnings),
        size=size,
    )


def _same_rank_trace(con: duckdb.DuckDBPyConnection, run_id: int, result: ParseResult) -> str | None:
    """A per-rank timed trace of the same rank already in the run that describes some of the same calls: one
    with any of this trace's profiler steps, or (without steps) whose calls' time span overlaps this one's.
    Traces of other step windows of a rank (a profiler schedule with repeat) are welcome."""
    if not formats.get(result.kind).has(Trait.PER_RANK_TIMED_TRACE) or result.rank is None or not result.n_events:
        return None
    times = [e["ts_us"] for e in result.events if e.get("ts_us") is not None]
    for table in result.event_tables:  # rows already moved into Arrow: their span
        if "ts_us" in table.column_names and table.column("ts_us").null_count < table.num_rows:
            span = pc.min_max(table.column("ts_us")).as_py()
            times += [span["min"], span["max"]]
    return store.same_rank_trace(
        con,
        run_id,
        formats.kinds_with(Trait.PER_RANK_TIMED_TRACE),
        result.rank,
        sorted({st["step"] for st in result.steps}),
        (min(times), max(times)) if times else None,
    )


def _same_calls_trace(
    con: duckdb.DuckDBPyConnection, run_id: int, result: ParseResult
) -> tuple[str, int | None] | None:
    """A per-rank trace already in the run whose profiler steps (without steps: calls, up to 64 of them) start at
    the same instants as this one's: one process's recording stored under two ranks."""
    if not formats.get(result.kind).has(Trait.PER_RANK_TIMED_TRACE) or not result.n_events:
        return None
    kinds = formats.kinds_with(Trait.PER_RANK_TIMED_TRACE)
    step_starts = [float(st["ts_us"]) for st in result.steps if st.get("ts_us") is not None]
    if step_starts:
        return store.same_calls_trace(con, run_id, kinds, step_starts, [])
    starts = [float(e["cpu_start_us"]) for e in result.events[:64] if e.get("cpu_start_us") is not None]
    for table in result.event_tables:
        if len(starts) >= 64:
            break
        if "cpu_start_us" in table.column_names:
            column = table.column("cpu_start_us").slice(0, 64 - len(starts)).drop_null()
            starts += [float(v) for v in column.to_pylist()]
    return store.same_calls_trace(con, run_id, kinds, [], starts)


def _identity(item: InputFile, parsed: ParsedFile, limits: Limits) -> str:
    """The file's identity: the sha256 of its content, decompressed (the parse hashed it as it read, else it
    is read again here)."""
    return parsed.content_sha256 or gzip_content_sha256(item.open_raw, item.name, limits) or parsed.sha256


def _same_what(con: duckdb.DuckDBPyConnection, source_id: int, size: int) -> str:
    """'same bytes' for a file as stored before, 'same content' for its content in another compression."""
    row = con.execute("SELECT size_bytes FROM sources WHERE source_id = ?", [source_id]).fetchone()
    return "same bytes" if row is not None and row[0] == size else "same content (decompressed)"


def _same_nccl_process(con: duckdb.DuckDBPyConnection, run_id: int, result: ParseResult) -> tuple[str, str] | None:
    """(process, path) of an NCCL log already in the run with calls of one of this log's processes: the same
    "host:pid", communicator pointer, opCount, op and size. One process writes one log, so a second file
    with its calls is a copy or an overlapping excerpt of it."""
    logs = [k for k in formats.kinds_with(Trait.NCCL_COMMUNICATORS) if not formats.get(k).has(Trait.SUPERSEDED_BY_LOG)]
    if result.kind not in logs:
        return None
    calls: dict[tuple[str, str], set[tuple[int, str, int | None]]] = {}
    for e in result.event_rows(["process", "comm_ptr", "op_count", "op", "msg_bytes"]):
        process, comm, count = e.get("process"), e.get("comm_ptr"), e.get("op_count")
        if not process or process.startswith("unknown") or not comm or count is None:
            continue  # a paste without host and pid names no process
        calls.setdefault((process, comm), set()).add((count, e["op"], e["msg_bytes"]))
    for (process, comm), keys in calls.items():
        path = same_nccl_process(con, run_id, logs, process, comm, keys)
        if path is not None:
            return process, path
    return None


def attribute(con: duckdb.DuckDBPyConnection, run: str) -> str | None:
    """Scheme attribution after new files; a failure leaves the files stored and says so."""
    try:
        attribute_run(con, run)
    except Exception as exc:  # the files are stored whatever attribution makes of them
        log.exception("attribution of %s", run)
        return f"files stored, but scheme attribution failed: {type(exc).__name__}: {exc}"
    return None


def attribute_pending(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    """Attribute the runs that have groups without a scheme (ingested while no server held the store, by
    a tool that did not attribute); the runs whose attribution failed, with why."""
    pending = [
        str(r[0])
        for r in con.execute(
            "SELECT DISTINCT r.name FROM runs r JOIN process_groups g USING (run_id) WHERE g.scheme IS NULL ORDER BY 1"
        ).fetchall()
    ]
    return {run: error for run in pending if (error := attribute(con, run)) is not None}
