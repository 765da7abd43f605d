"""Which runs carry no time at all (NCCL logs), so the time analysis reads them with less work.

An NCCL log gives no time, so its run gets instances, their members, mismatches and time_status, and
nothing the times would give (waits, breakdown, critical path). A run qualifies only when no counted call
of a known rank has a time and the run has no profiler step, no timeline interval and no profiler trace
(so every rank's timeline is empty, as load_run would make it): `persist.load_untimed` then reads its
calls without the two time columns and reads nothing of a timeline. The CallTable is the one load_run
builds, value for value (tests/test_time_untimed.py)."""

from __future__ import annotations

import duckdb


def untimed_only(con: duckdb.DuckDBPyConnection, run_id: int) -> bool:
    """Whether the run's counted calls of known rank carry no time and nothing else of the run could
    (profiler steps, timeline intervals, profiler traces): the runs `persist.load_untimed` serves."""
    rows = con.execute(
        """
        SELECT NOT EXISTS (SELECT 1 FROM steps WHERE run_id = $run)
           AND NOT EXISTS (SELECT 1 FROM timeline_intervals WHERE run_id = $run)
           AND NOT EXISTS (SELECT 1 FROM sources WHERE run_id = $run AND status = 'ok' AND kind = 'kineto')
           AND NOT EXISTS (SELECT 1 FROM comm_events e JOIN sources s USING (source_id)
                           WHERE e.run_id = $run AND e.counted AND e.rank IS NOT NULL AND e.ts_us IS NOT NULL)
        """,
        {"run": run_id},
    ).fetchall()
    return bool(rows[0][0])
