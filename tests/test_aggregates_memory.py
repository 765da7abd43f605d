"""The bandwidth aggregates' exact medians within a DuckDB memory limit: an exact median holds every value of its
group in memory (DuckDB does not spill it), so the refresh computes one median per query. Four in one query needed
four columns of the run's measured calls at once: a 100 M-call store (bench/scale.py) failed its refresh within
6 GB (and its OutOfMemoryException was hidden behind the refusal to unregister a table: tests/test_arrow_views.py)."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from commlens import store
from commlens.store import aggregates

CALLS = 1_000_000  # one (op, size bin): every value of every median in one group


def _store(path: Path) -> tuple[duckdb.DuckDBPyConnection, int]:
    con = store.connect(path)
    con.execute("INSERT INTO runs (name) VALUES ('big')")
    (run_id,) = con.execute("SELECT run_id FROM runs WHERE name = 'big'").fetchone()
    con.execute(
        "INSERT INTO sources (run_id, path, kind, sha256, size_bytes, status) VALUES (?, 'x.json', 'kineto', 'x', 1, 'ok')",
        [run_id],
    )
    (source_id,) = con.execute("SELECT max(source_id) FROM sources").fetchone()
    con.execute(
        "INSERT INTO process_groups (run_id, group_key, size, backend, origin, scheme) "
        "VALUES (?, 'g', 8, 'nccl', 'pg_config', 'dp')",
        [run_id],
    )
    con.execute(
        """INSERT INTO comm_events (run_id, source_id, rank, seq, op, dtype, msg_bytes, group_size, group_key,
                                    dur_us, dur_source)
           SELECT ?, ?, i % 8, i, 'all_reduce', 'float32', 1048576 + i % 1000, 8, 'g', 100.0 + (i * 7919) % 10007,
                  'kernel'
           FROM range(?) t(i)""",
        [run_id, source_id, CALLS],
    )
    return con, run_id


def _medians(con: duckdb.DuckDBPyConnection, run_id: int) -> dict[str, list[tuple]]:
    return {
        "bw_bins": con.execute(
            "SELECT op, k, calls, median_bytes, median_dur_us, median_algbw_gbps, median_busbw_gbps, group_sizes "
            "FROM bw_bins WHERE run_id = ? ORDER BY op, k",
            [run_id],
        ).fetchall(),
        "bw_schemes": con.execute(
            "SELECT scheme, op, calls, median_busbw_gbps, large_calls, large_median_busbw_gbps FROM bw_schemes "
            "WHERE run_id = ? ORDER BY op",
            [run_id],
        ).fetchall(),
    }


def test_the_medians_refresh_within_a_memory_limit_their_single_query_exceeded(tmp_path: Path) -> None:
    con, run_id = _store(tmp_path / "s.duckdb")
    try:
        aggregates.refresh_run(con, run_id)  # no limit: the reference
        expected = _medians(con, run_id)
        assert expected["bw_bins"][0][2] == CALLS and expected["bw_schemes"][0][4] > 0
        con.execute("SET memory_limit = '75MB'")  # the four need about 110 MB here, the refresh about 50
        # the four medians in one query, as the refresh had them, do not fit ...
        with aggregates.measured_calls(con, run_id) as (sql, _), pytest.raises(duckdb.OutOfMemoryException):
            con.execute(
                f"SELECT median(msg_bytes), median(dur_us), median(algbw), median(busbw) FROM ({sql}) m GROUP BY op, k",
                [run_id],
            ).fetchall()
        # ... one at a time they do, and give the same numbers
        con.execute("DELETE FROM agg_runs WHERE run_id = ?", [run_id])
        aggregates.refresh_run(con, run_id)
        assert _medians(con, run_id) == expected
    finally:
        con.close()
