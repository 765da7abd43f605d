"""Whether the API's ingest jobs are writing a run: readers of derived rows must know (see aggregates.py)."""

from __future__ import annotations

import duckdb

ACTIVE_STATES = ("queued", "running")


def active_jobs(con: duckdb.DuckDBPyConnection, run_id: int) -> list[str]:
    """Ids of the run's queued or running ingest jobs, oldest first."""
    rows = con.execute(
        "SELECT job_id FROM jobs WHERE run_id = ? AND list_contains(?, state) ORDER BY created_at",
        [run_id, list(ACTIVE_STATES)],
    ).fetchall()
    return [str(r[0]) for r in rows]
