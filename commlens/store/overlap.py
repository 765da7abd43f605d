"""Whether a rank's profiler trace, or an NCCL process's log, is already in a run: the ingest service refuses a
second file whose calls would count twice."""

from __future__ import annotations

import duckdb


def same_rank_trace(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    kinds: list[str],
    rank: int,
    steps: list[int],
    span: tuple[float, float] | None,
) -> str | None:
    """The path of a source of one of `kinds` of this rank in the run that has any of `steps` (when the new
    trace has steps) or whose calls' time span overlaps `span` (first, last call start); None if there is none."""
    if steps:
        row = con.execute(
            """SELECT s.path FROM steps t JOIN sources s ON s.source_id = t.source_id
            WHERE t.run_id = ? AND list_contains(?, s.kind) AND t.rank = ? AND list_contains(?, t.step) LIMIT 1""",
            [run_id, kinds, rank, steps],
        ).fetchone()
    elif span is not None:
        row = con.execute(
            """SELECT s.path FROM comm_events e JOIN sources s ON s.source_id = e.source_id
            WHERE e.run_id = ? AND list_contains(?, s.kind) AND e.rank = ?
            GROUP BY s.path HAVING min(e.ts_us) <= ? AND max(e.ts_us) >= ? LIMIT 1""",
            [run_id, kinds, rank, span[1], span[0]],
        ).fetchone()
    else:
        return None
    return str(row[0]) if row else None


def same_nccl_process(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    kinds: list[str],
    process: str,
    comm_ptr: str,
    calls: set[tuple[int, str, int | None]],
) -> str | None:
    """The path of a source of one of `kinds` in the run with any of `calls` (opCount, op, msg_bytes) of this
    NCCL process ("host:pid") on this communicator pointer; None if there is none."""
    counts = [c[0] for c in calls]
    rows = con.execute(
        """SELECT DISTINCT e.op_count, e.op, e.msg_bytes, s.path FROM comm_events e
        JOIN sources s ON s.source_id = e.source_id
        WHERE e.run_id = ? AND list_contains(?, s.kind) AND e.process = ? AND e.comm_ptr = ?
        AND e.op_count BETWEEN ? AND ?""",
        [run_id, kinds, process, comm_ptr, min(counts), max(counts)],
    ).fetchall()
    return next((str(r[3]) for r in rows if (r[0], r[1], r[2]) in calls), None)


def same_calls_trace(
    con: duckdb.DuckDBPyConnection,
    run_id: int,
    kinds: list[str],
    step_starts: list[float],
    cpu_starts: list[float],
) -> tuple[str, int | None] | None:
    """(path, rank) of a source of one of `kinds` in the run whose profiler steps start at the very instants of
    `step_starts` (any of them), or, for a trace without steps, whose calls start on the CPU at these instants
    (at least two, and half of those given): the same recording under another rank (an excerpt of one rank's
    trace relabelled), whose calls would count twice. None if there is none. Steps are a small table; calls are
    read only for a trace without steps."""
    if step_starts:
        row = con.execute(
            """SELECT s.path, s.rank FROM steps t JOIN sources s ON s.source_id = t.source_id
            WHERE t.run_id = ? AND list_contains(?, s.kind) AND list_contains(?, t.ts_us) LIMIT 1""",
            [run_id, kinds, step_starts],
        ).fetchone()
        return None if row is None else (str(row[0]), row[1])
    if len(cpu_starts) < 2:
        return None
    row = con.execute(
        """SELECT s.path, s.rank, count(DISTINCT e.cpu_start_us) AS n FROM comm_events e
        JOIN sources s ON s.source_id = e.source_id
        WHERE e.run_id = ? AND list_contains(?, s.kind) AND e.cpu_start_us BETWEEN ? AND ?
        AND list_contains(?, e.cpu_start_us)
        GROUP BY s.path, s.rank ORDER BY n DESC LIMIT 1""",
        [run_id, kinds, min(cpu_starts), max(cpu_starts), cpu_starts],
    ).fetchone()
    if row is None or row[2] < max(2, len(set(cpu_starts)) // 2):
        return None
    return str(row[0]), row[1]
