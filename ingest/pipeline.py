"""Ingest files into a run: detect, parse, write each file atomically, then link the run's sources.

A file that fails is recorded with its error and rolled back alone; files with bytes already in
the run are skipped as duplicates."""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from commlens import store
from commlens.store import aggregates

from . import formats
from .formats import Trait
from .inputs import DEFAULT_LIMITS, InputFile, Limits, TapReader, file_rank_hint, iter_inputs, open_content
from .records import ParseError, ParseResult, RankHint


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


@dataclass
class IngestSummary:
    run: str
    files: list[FileOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[FileOutcome]:
        return [f for f in self.files if f.status == "failed"]


class _Hash:
    """sha256 and size of the bytes a TapReader passes through."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.size = 0

    def __call__(self, data: bytes) -> None:
        self.sha.update(data)
        self.size += len(data)


def ingest_file(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    item: InputFile,
    hint: RankHint,
    limits: Limits = DEFAULT_LIMITS,
) -> FileOutcome:
    """Parse and store one input file; never raises for a bad file."""
    if item.skip:
        return FileOutcome(item.name, "skipped", error=item.skip, size=item.size)
    if item.error:
        store.record_failure(con, run_id, item.name, "unknown", "", item.size, f"{item.name}: {item.error}")
        return FileOutcome(item.name, "failed", error=f"{item.name}: {item.error}", size=item.size)
    kind = None
    digest = _Hash()
    hashing = TapReader(item.open_raw(), digest)
    try:
        stream = open_content(io.BufferedReader(hashing, 1 << 20), item.name, limits)
        fmt = formats.detect(stream)
        kind = fmt.kind
        file_hint = RankHint(
            rank=hint.rank if hint.rank is not None else file_rank_hint(item.name), world_size=hint.world_size
        )
        result = fmt.parse(stream, item.name, file_hint, limits)
        hashing.drain()
    except Exception as exc:  # one bad file never stops the others
        with contextlib.suppress(Exception):  # the hash of a broken file is best effort
            hashing.drain()
        error = _error_text(item.name, exc, kind)
        store.record_failure(con, run_id, item.name, kind or "unknown", digest.sha.hexdigest(), digest.size, error)
        return FileOutcome(item.name, "failed", kind=kind, error=error, size=digest.size)
    finally:
        hashing.close()
    sha = digest.sha.hexdigest()
    existing = store.find_source(con, run_id, sha)
    if existing is not None:
        return FileOutcome(
            item.name, "duplicate", kind=kind, error=f"same bytes as {existing[1]}, already ingested", size=digest.size
        )
    other = _same_rank_trace(con, run_id, result)
    if other is not None:
        error = (
            f"{item.name}: rank {result.rank} already has a profiler trace in this run ({other}) whose "
            f"{'steps' if result.steps else 'time span'} overlap this one's; its calls would count twice. "
            "Ingest it into another run, or delete the run and ingest the files you mean"
        )
        store.record_failure(con, run_id, item.name, kind, sha, digest.size, error)
        return FileOutcome(item.name, "failed", kind=kind, rank=result.rank, error=error, size=digest.size)
    try:
        store.write_result(con, run_id, item.name, sha, digest.size, result)  # rolled back whole on failure
    except (duckdb.DataError, duckdb.IntegrityError, OverflowError, ValueError, TypeError) as exc:
        # the file's values (pyarrow's errors are ValueError/TypeError); a store problem (I/O) still raises
        error = f"{item.name}: a value does not fit the store ({type(exc).__name__}: {_first_line(exc)})"
        store.record_failure(con, run_id, item.name, kind, sha, digest.size, error)
        return FileOutcome(item.name, "failed", kind=kind, error=error, size=digest.size)
    return FileOutcome(
        item.name,
        "ok",
        kind=kind,
        rank=result.rank,
        events=result.n_events,
        skipped=dict(result.skipped),
        warnings=list(result.warnings),
        size=digest.size,
    )


def _same_rank_trace(con: duckdb.DuckDBPyConnection, run_id: int, result: ParseResult) -> str | None:
    """A per-rank timed trace of the same rank already in the run that describes some of the same calls: one with
    any of this trace's profiler steps, or (without steps) whose calls' time span overlaps this one's.
    Traces of other step windows of a rank (a profiler schedule with repeat) are welcome."""
    if not formats.get(result.kind).has(Trait.PER_RANK_TIMED_TRACE) or result.rank is None or not result.events:
        return None
    traces = formats.kinds_with(Trait.PER_RANK_TIMED_TRACE)
    if result.steps:
        row = con.execute(
            """SELECT s.path FROM steps t JOIN sources s ON s.source_id = t.source_id
            WHERE t.run_id = ? AND list_contains(?, s.kind) AND t.rank = ? AND list_contains(?, t.step) LIMIT 1""",
            [run_id, traces, result.rank, sorted({st["step"] for st in result.steps})],
        ).fetchone()
    else:
        times = [e["ts_us"] for e in result.events if e.get("ts_us") is not None]
        if not times:
            return None
        row = con.execute(
            """SELECT s.path FROM comm_events e JOIN sources s ON s.source_id = e.source_id
            WHERE e.run_id = ? AND list_contains(?, s.kind) AND e.rank = ?
            GROUP BY s.path HAVING min(e.ts_us) <= ? AND max(e.ts_us) >= ? LIMIT 1""",
            [run_id, traces, result.rank, max(times), min(times)],
        ).fetchone()
    return row[0] if row else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else "no message"


def _error_text(name: str, exc: Exception, kind: str | None) -> str:
    """`name:where: reason` for a ParseError; for anything else, what failed and that it is not the user's to fix."""
    if isinstance(exc, ParseError):
        return f"{name}:{exc.where}: {exc.reason}" if exc.where else f"{name}: {exc.reason}"
    what = f"{kind} parser" if kind else "reading the file"
    return (
        f"{name}: unexpected {type(exc).__name__} in the {what}: {_first_line(exc)} "
        f"(the file is probably malformed; please report it with the file)"
    )


def ingest_paths(
    con: duckdb.DuckDBPyConnection,
    paths: list[Path],
    run: str,
    hint: RankHint | None = None,
    limits: Limits = DEFAULT_LIMITS,
    on_file: Callable[[FileOutcome], None] | None = None,
    description: str | None = None,
) -> IngestSummary:
    run_id = store.ensure_run(con, run, description=description)
    summary = IngestSummary(run)
    for item in iter_inputs(paths, limits):
        outcome = ingest_file(con, run_id, item, hint or RankHint(), limits)
        summary.files.append(outcome)
        if on_file:
            on_file(outcome)
    finalize_run(con, run_id)
    return summary


def finalize_run(con: duckdb.DuckDBPyConnection, run_id: int) -> None:
    """Run-level linking after files land: NCCL communicators across processes, harness groups; then
    the run's aggregates are recomputed."""
    from .nccl_link import link_run

    con.execute("BEGIN TRANSACTION")
    try:
        link_run(con, run_id)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    aggregates.refresh_run(con, run_id)  # the run's precomputed aggregates (own transaction)


def run_totals(con: duckdb.DuckDBPyConnection, run: str) -> dict[str, Counter]:
    """Calls and bytes per op of a run (the summary table)."""
    rows = con.execute(
        "SELECT op, count(*), coalesce(sum(msg_bytes), 0), count(DISTINCT rank) FROM comms WHERE run = ? GROUP BY op ORDER BY op",
        [run],
    ).fetchall()
    return {"calls": Counter({r[0]: r[1] for r in rows}), "bytes": Counter({r[0]: r[2] for r in rows})}
