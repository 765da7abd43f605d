"""Whether a rank's profiler trace is already in a run: the ingest service refuses a second trace of a rank
whose calls would count twice."""

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
